"""The import graph of ``pie_ctx`` and ``runtime``: one-way arrows, no circles.

Every import statement counts: at module level, inside functions, and under
``TYPE_CHECKING``. An edge goes to the module named (``from a.b import c`` names ``a.b.c``
when that is a module, else ``a.b``), as import linters count them. That ``import a.b.c``
first runs the package ``a``'s ``__init__`` is checked separately: ``pie_ctx/__init__``
imports nothing when it runs, so importing the contract never loads the SDK's client
classes. Circles are looked for twice: between modules, and between the packages of
``LAYERS`` with every module counted as its package's. See docs/design.md for the layers
these rules keep apart.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pie_ctx", "runtime")

# The only place the SDK reaches into the runtime package (documented):
ALLOWED_SDK_TO_RUNTIME = {
    "pie_ctx.runtime": {"runtime.boot"},  # Runtime.local boots an engine lazily
}

# The package order, lowest first (docs/design.md, "The layers"): a module may import its
# own layer and the layers below it, never one above. The SDK needs nothing of the runtime
# but ``Runtime.local``'s lazy import of the boot, so it ranks just above the boot; the
# hosting, the server and the command line use the SDK, so they rank above it.
LAYERS = (
    ("pie_ctx.proto",),           # the contract
    ("runtime.kv",),              # pages: pool, trie, page states, snapshots, disk tier
    ("runtime.model",),           # weights, the forward math, runner failures
    ("runtime.sampling",),        # draws from logits (the executor and decoding use it)
    ("runtime.engine",),          # the step loop, its jobs, rows and request tables
    ("runtime.distributed",),     # tensor parallelism: a runner over many ranks
    ("runtime.boot",),            # builds a store, a runner and an engine
    ("pie_ctx",),                 # the SDK
    ("runtime.hosted",),          # inferlets launched inside the engine's process
    ("runtime.server",),          # connections, HTTP, ``serve``
    ("runtime.fleet",),           # engine replicas on Ray Serve, routed (``fleet``)
    ("runtime.cli", "runtime.__main__"),  # the program (``pie-ctx``, ``python -m runtime``)
)
# The bare package modules import nothing and rank below everything.
ROOTS = ("runtime", "pie_ctx")


def _layer(module: str) -> int:
    best, rank = "", -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    return rank


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in modules else node.module)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    """The package of ``LAYERS`` a module belongs to (the longest prefix naming it), or the
    module itself for the bare package roots."""
    names = [prefix for prefixes in LAYERS for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    return max(names, key=len) if names else module


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with every module replaced by its package."""
    out: dict[str, set[str]] = {_package(m): set() for m in graph}
    for name, targets in graph.items():
        out[_package(name)].update(_package(t) for t in targets if _package(t) != _package(name))
    return out


def test_imports_inside_functions_are_counted():
    """The graph sees the lazy imports too: ``Runtime.local`` imports the boot inside the
    method, and the command line imports the hosting inside its commands."""
    graph = _graph()
    assert "runtime.boot" in graph["pie_ctx.runtime"]
    assert "runtime.hosted.host" in graph["runtime.cli"]


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_no_package_circles():
    """No circle between the packages of ``LAYERS`` either, counting every import: a
    module of the SDK that imported the command line (which imports the SDK) would be one,
    even though no two modules import each other."""
    assert _cycles(_package_graph(_graph())) == []


def test_the_package_check_finds_a_circle():
    graph = _graph()
    graph["pie_ctx.context"] = graph["pie_ctx.context"] | {"runtime.cli"}
    assert any({"pie_ctx", "runtime.cli"} <= set(c) for c in _cycles(_package_graph(graph)))


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if m not in ROOTS and _layer(m) < 0]
    assert unplaced == [], "add these to LAYERS: " + ", ".join(sorted(unplaced))


def test_no_package_imports_a_package_above_it():
    upward = sorted((name, target) for name, targets in _graph().items() for target in targets
                    if target not in ROOTS and name not in ROOTS
                    and _layer(target) > _layer(name))
    assert upward == [], upward


def test_the_roots_import_nothing_and_nothing_imports_the_program():
    graph = _graph()
    assert all(not graph[root] for root in ROOTS), {r: graph[r] for r in ROOTS}
    assert not [name for name, targets in graph.items() if "runtime.__main__" in targets]


def test_the_sdk_reaches_the_runtime_only_through_its_entry_point():
    for name, targets in _graph().items():
        if not name.startswith("pie_ctx"):
            continue
        into_runtime = {t for t in targets if t.split(".")[0] == "runtime"}
        assert into_runtime <= ALLOWED_SDK_TO_RUNTIME.get(name, set()), (name, into_runtime)


# The one place the runtime uses the SDK itself: the HTTP server hosts an inferlet, the
# chat-shaped APIs over one conversation pipeline, written over the public SDK
# (docs/http.md): it may use the SDK's constraint and tool modules.
ALLOWED_RUNTIME_TO_SDK = {"runtime.server.http.conversation.turns": {"pie_ctx.tools"},
                          "runtime.server.http.conversation.decoding": {"pie_ctx.constrain",
                                                                        "pie_ctx.tools"},
                          "runtime.server.http.openai.api": {"pie_ctx.tools"},
                          "runtime.server.http.openai.chat": {"pie_ctx.tools"},
                          "runtime.server.http.openai.decoding": {"pie_ctx.constrain",
                                                                  "pie_ctx.tools"},
                          "runtime.server.http.anthropic.api": {"pie_ctx.tools"},
                          "runtime.server.http.anthropic.schema": {"pie_ctx.tools"},
                          "runtime.server.http.responses.api": {"pie_ctx.tools"},
                          "runtime.server.http.responses.run": {"pie_ctx.tools"},
                          "runtime.server.http.responses.compact": {"pie_ctx.policies"},
                          "runtime.server.http.responses.mcp": {"pie_ctx.tools",
                                                                "pie_ctx.tools.mcp"},
                          # a runtime per API key, each in its own snapshot namespace
                          "runtime.server.http.responses.store": {"pie_ctx.transport"},
                          # a hosted inferlet is loaded and run as ``pie-ctx run`` does
                          "runtime.hosted.host": {"pie_ctx.loading", "pie_ctx.runtime"},
                          # one in-process transport: the bridge is a LocalTransport whose
                          # engine calls hop to the engine's loop
                          "runtime.hosted.bridge": {"pie_ctx.transport"},
                          # the fleet's front renders a chat prompt as the SDK's fillers do
                          "runtime.fleet.prompt": {"pie_ctx.chat"},
                          # the program: ``run`` runs an inferlet file on a Runtime, ``stats``
                          # and ``launch`` are clients of a server
                          "runtime.cli": {"pie_ctx.loading", "pie_ctx.runtime",
                                          "pie_ctx.socket_transport"}}


def test_the_runtime_depends_only_on_the_contract():
    for name, targets in _graph().items():
        if not name.startswith("runtime"):
            continue
        sdk = {t for t in targets if t.split(".")[0] == "pie_ctx" and t != "pie_ctx"}
        outside = {t for t in sdk if not t.startswith("pie_ctx.proto")}
        assert outside <= ALLOWED_RUNTIME_TO_SDK.get(name, set()), (name, outside)


def test_importing_the_contract_loads_no_client_class_and_no_torch():
    code = ("import sys, pie_ctx.proto.messages, pie_ctx.proto.checks, pie_ctx.proto.wire, "
            "pie_ctx.proto.framing, pie_ctx.proto.address\n"
            "print(sorted(m for m in sys.modules if m.startswith('pie_ctx') and "
            "not m.startswith('pie_ctx.proto') or m in ('torch', 'runtime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['pie_ctx']"


def test_every_benchmark_script_starts():
    """Run from its folder, a benchmark has that folder first on sys.path: no file there
    may shadow a module it imports (benchmarks/http.py once hid the standard library's)."""
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True) for p in scripts}
    failed = {name: proc.communicate(timeout=300)[1].strip().splitlines()[-1:]
              for name, proc in procs.items() if proc.wait(timeout=300) != 0}
    assert not failed, failed

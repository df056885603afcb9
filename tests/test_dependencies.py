"""Every third-party import of ``pie_ctx`` and ``runtime`` is a declared dependency.

Every import counts (module level and inside functions): the module's distribution must be
listed in pyproject.toml's ``dependencies`` or in one of its optional extras other than
``dev`` (the test tools). A package another dependency happens to pull in is not enough:
its version may stop pulling it in (anyio 4.16 dropped ``sniffio``), and a plain install
then cannot start an engine. ``make test-install`` checks a real plain install end to end.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pie_ctx", "runtime")
# import name -> distribution where they differ, for extras a machine may not have
# installed (CI installs no `ray` extra, so pyzmq's metadata is absent there)
DISTRIBUTION_OF = {"zmq": "pyzmq", "llama_cpp": "llama-cpp-python", "yaml": "pyyaml"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, str]:
    """Declared distribution -> where (``dependencies`` or ``extra NAME``), dev left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    groups = {"dependencies": project["dependencies"],
              **{f"extra {k}": v for k, v in project["optional-dependencies"].items()
                 if k != "dev"}}
    for where, requirements in groups.items():
        for req in requirements:
            name = re.match(r"[A-Za-z0-9_.-]+", req)
            assert name is not None, req
            out.setdefault(_normal(name.group(0)), where)
    return out


def _imports() -> dict[str, set[str]]:
    """Top-level module imported -> the files importing it (every import statement)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in sorted(_imports().items()):
        # an installed module's distribution; one not installed here (an extra's, like
        # flash_attn or zmq) is looked up by its known distribution or its own name
        candidates = ({_normal(d) for d in distributions.get(module, [])}
                      or {_normal(DISTRIBUTION_OF.get(module, module))})
        if not candidates & declared.keys():
            missing[module] = sorted(files)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_core_imports_need_no_extra() -> None:
    """What ``import runtime.boot`` (``pie-ctx run``/``serve``) loads at module level comes
    from ``dependencies``, not an extra."""
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    extra_only = {m for m, _ in _imports().items()
                  if all(declared.get(_normal(d), "").startswith("extra")
                         for d in distributions.get(m, []) or [m])}
    core = ["runtime/boot.py", "runtime/engine/engine.py", "runtime/server/http/app.py",
            "runtime/cli.py", "pie_ctx/runtime.py"]
    for rel in core:
        tree = ast.parse((ROOT / rel).read_text())
        for node in tree.body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in extra_only, (rel, name)

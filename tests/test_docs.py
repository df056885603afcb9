"""Docs that are generated or quoted stay true."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_current():
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api.py"), "--check"], check=True)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "scripts" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A prose paragraph ends like a sentence (or introduces what follows it).
_ENDS = (".", ":", "?", "!", ")")
# ``name(...)``, ``a.b.name(...)``: a call the docstring tells the reader to make.
_CALL = re.compile(r"``([A-Za-z_][\w.]*)\([^`]*\)``", re.S)
# Modules and variables a docstring may call through, and what they stand for.
_ALIASES = {"rt": "Runtime", "ctx": "Context", "base": "Context", "child": "Context",
            "gen": "Generator", "raw": "RawContext", "sub": "Subscription"}


def _paragraphs(doc: str) -> list[str]:
    """The prose paragraphs of a docstring (not an indented block, not a code example)."""
    out = []
    for paragraph in doc.split("\n\n"):
        lines = paragraph.splitlines()
        if not lines or lines[0].startswith((" ", ">>>")) or paragraph.rstrip().endswith("::"):
            continue
        if re.match(r"^(Args|Returns|Raises|Yields|Usage|Example)s?:", lines[0]):
            continue
        out.append(" ".join(line.strip() for line in lines))
    return out


def test_api_docstrings_are_whole_sentences():
    """Every docstring the API reference shows is there, and none stops mid-sentence."""
    gen = _gen_api()
    cut = []
    for where, doc, _ in gen.documented():
        if not doc:
            if where.split(".")[-1] in _PROPERTIES:  # a method may go without one
                cut.append(f"{where}: a property without a docstring")
            continue
        summary = doc.split("\n\n")[0]
        if not summary.rstrip().endswith((".", "?", "!", ":")):
            cut.append(f"{where}: the summary does not end with a period: {summary[-60:]!r}")
        for paragraph in _paragraphs(doc):
            if not paragraph.rstrip().endswith(_ENDS):
                cut.append(f"{where}: a paragraph ends mid-sentence: {paragraph[-60:]!r}")
    assert not cut, "\n".join(cut)


_PROPERTIES = {name for _, cls in _gen_api().SECTIONS for name in dir(cls)
               if isinstance(getattr(cls, name, None), property)}


def test_api_reference_shows_whole_docstrings():
    """The generator cuts nothing: a property's or an error's list item ends a sentence."""
    text = (ROOT / "docs" / "api.md").read_text()
    items = re.findall(r"^- `\w+`(?: \(property\))?: (.*)$", text, re.M)
    assert len(items) > 30
    cut = [item for item in items if not item.rstrip().endswith(_ENDS)]
    assert not cut, "\n".join(cut)


def test_api_docstrings_name_only_calls_that_exist():
    gen = _gen_api()
    classes = {title.rsplit(".", 1)[-1]: cls for title, cls in gen.SECTIONS}
    classes["Sampler"] = gen.pie_ctx.Sampler
    public = {name for cls in classes.values() for name in dir(cls) if not name.startswith("_")}
    modules = {"pie_ctx": gen.pie_ctx, "constrain": gen.constrain, "tools": gen.tools,
               "speculate": gen.speculate, "errors": gen.errors, "loading": gen.loading}
    public |= {name for m in modules.values() for name in dir(m) if not name.startswith("_")}
    wrong = []
    for where, doc, params in gen.documented():
        for call in _CALL.findall(doc):
            *owner, name = call.split(".")
            owner_cls = classes.get(_ALIASES.get(owner[-1], owner[-1])) if owner else None
            if owner_cls is not None:
                ok = hasattr(owner_cls, name)
            elif owner and owner[0] in modules:
                ok = hasattr(modules[owner[0]], name) or name in public
            elif owner:
                ok = True  # through another library or a variable of the example's own
            else:
                ok = name in public or name in params
            if not ok:
                wrong.append(f"{where}: ``{call}()`` is not in the public API")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ the docs' programs
#
# Every ```python block of docs/*.md and README.md says what it is in its info string
# (docs/examples.md, "Code in the docs"):
#   ```python                an inferlet (``async def main(rt, args)``): run on the tiny model
#   ```python script         a script: run with ``python FILE`` against a tiny-model server
#   ```python file           a file the others use (named by its first line): written, not run
#   ```python fragment       a piece of a program: compiled (top-level await allowed), not run
# A block whose first line is ``# NAME.py ...`` is written under that name, so the others
# can use it; the words after ``pie-ctx run NAME.py --`` on that line are its args.

_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.M | re.S)
_ROLES = ("", "script", "file", "fragment")
_PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_SERVER_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class _Block:
    page: str
    line: int
    role: str
    code: str

    @property
    def name(self) -> str:
        m = re.match(r"# (\w+\.py)\b", self.code)
        return m.group(1) if m else f"{Path(self.page).stem}_{self.line}.py"

    @property
    def argv(self) -> list[str]:
        first = self.code.splitlines()[0]
        words = shlex.split(first.partition(f"pie-ctx run {self.name}")[2])
        return words[words.index("--") + 1:] if "--" in words else []


def _blocks() -> list[_Block]:
    out = []
    for page in _PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            out.append(_Block(page.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 1,
                              m.group(1).strip(), m.group(2)))
    return out


def test_every_python_block_says_what_it_is_and_compiles():
    wrong = []
    for b in _blocks():
        where = f"{b.page}:{b.line}"
        if b.role not in _ROLES:
            wrong.append(f"{where}: unknown role {b.role!r} (one of {_ROLES})")
            continue
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT if b.role == "fragment" else 0
        try:
            compile(b.code, where, "exec", flags=flags)
        except SyntaxError as err:
            wrong.append(f"{where}: {err}")
        if b.role == "" and "async def main(rt, args)" not in b.code:
            wrong.append(f"{where}: a plain ```python block is an inferlet: it defines "
                         "`async def main(rt, args)` (or mark it script, file or fragment)")
        if "rt.stats()" in b.code.replace("await rt.stats()", ""):
            wrong.append(f"{where}: rt.stats() is a coroutine: await it")
    assert not wrong, "\n".join(wrong)


# Pages whose code is an interface sketch of the engine's internals, not an SDK program.
_SKETCHES = {"docs/forward.md"}  # ModelRunner's signature and shapes


def test_the_first_example_of_each_page_is_a_whole_program():
    first: dict[str, _Block] = {}
    for b in _blocks():
        first.setdefault(b.page, b)
    fragments = [f"{b.page}:{b.line}" for b in first.values()
                 if b.role == "fragment" and b.page not in _SKETCHES]
    assert not fragments, f"the first example of these pages is a fragment: {fragments}"


def test_prose_awaits_stats():
    """``rt.stats()`` is a coroutine: prose that names it says ``await rt.stats()``."""
    bare = [f"{p.name}: {line.strip()[:80]}" for p in _PAGES
            for line in p.read_text().splitlines()
            if re.search(r"(?<!await )rt\.stats\(\)", line)]
    assert not bare, "\n".join(bare)


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory) -> Path:
    """Every named block written as a file: the inferlet folder and the scripts' cwd."""
    folder = tmp_path_factory.mktemp("docs-programs")
    for b in _blocks():
        if b.role != "fragment":
            (folder / b.name).write_text(b.code)
    return folder


def _tiny_adapter(tmp_path_factory, model: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from tests.model.lora_fixtures import make_adapter

    hf = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    path = tmp_path_factory.mktemp("adapters") / "terse"
    make_adapter(hf, path, rank=4, seed=1)
    return path


async def test_the_docs_inferlets_run(docs_folder, tmp_path_factory, monkeypatch):
    """Each page's inferlets run together (a boss and its worker meet), on the tiny model,
    in an engine that hosts them all (``rt.spawn`` finds a page's children)."""
    import anyio

    from pie_ctx import Runtime
    from pie_ctx.loading import inferlet_args, load_inferlet
    from runtime.hosted.host import host_inferlets
    from tests.sdk.harness import tiny_engine, tiny_model_folder

    model = tiny_model_folder(tmp_path_factory.mktemp("model"))
    pages: dict[str, list[_Block]] = {}
    for b in _blocks():
        if b.role == "":
            pages.setdefault(b.page, []).append(b)
    # the docs' placeholder paths, and what they stand for here
    if importlib.util.find_spec("peft") is None:  # it makes the adapter (the dev extra)
        places = {}
        pages.pop("docs/adapters.md")
    else:
        places = {"/adapters/terse": str(_tiny_adapter(tmp_path_factory, model))}
    monkeypatch.chdir(docs_folder)  # "python server.py" is the venv's, in the docs' folder
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    failed = []
    async with tiny_engine(model, num_pages=2048) as engine:
        host_inferlets(engine, docs_folder)

        async def run(b: _Block) -> None:
            module = load_inferlet(docs_folder / b.name)
            argv = [places.get(w, w) for w in b.argv]
            args = inferlet_args(module, argv, prog=f"pie-ctx run {b.name} --")
            try:
                with anyio.fail_after(120):
                    async with Runtime.local(engine=engine) as rt:
                        await module.main(rt, args)
            except Exception as err:  # noqa: BLE001 - every block's failure is reported
                failed.append(f"{b.page}:{b.line}: {type(err).__name__}: {err}")

        for blocks in pages.values():
            async with anyio.create_task_group() as tg:
                for b in blocks:
                    tg.start_soon(run, b)
    assert not failed, "\n".join(failed)


@pytest.mark.real_model  # models.md's scripts load the default model
def test_the_docs_scripts_run(docs_folder, tmp_path_factory):
    """Scripts run as written against a tiny-model ``pie-ctx serve --http`` (its URL in place
    of http://127.0.0.1:8000; its socket is the default one)."""
    from tests.http.test_openai import LiveServer
    from tests.sdk.harness import tiny_model_folder

    scripts = [b for b in _blocks() if b.role == "script"]
    model = tiny_model_folder(tmp_path_factory.mktemp("model"))
    run_dir = tmp_path_factory.mktemp("run")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run_dir),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(run_dir)  # LiveServer passes os.environ on
    try:
        srv = LiveServer(str(model), str(tmp_path_factory.mktemp("srv")), "--socket",
                         str(run_dir / "pie-ctx" / "engine.sock"))
    finally:
        if old is None:
            del os.environ["XDG_RUNTIME_DIR"]
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
    def run(b: _Block) -> str | None:
        file = docs_folder / b.name
        file.write_text(b.code.replace(_SERVER_URL, srv.url))
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, str(file)], cwd=docs_folder, env=env,
                              capture_output=True, text=True, timeout=300)
        print(f"{b.page}:{b.line}: {time.monotonic() - t0:.1f} s")
        if done.returncode != 0:
            return f"{b.page}:{b.line}: exit {done.returncode}\n{done.stderr[-2000:]}"
        return None

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:  # each mostly starts Python
            failed = [f for f in pool.map(run, scripts) if f]
    finally:
        srv.stop()
    assert not failed, "\n".join(failed)

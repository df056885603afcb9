"""Docs that are generated or quoted stay true."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

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

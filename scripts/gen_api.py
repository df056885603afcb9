"""Write docs/api.md from the SDK's docstrings and signatures.

    python scripts/gen_api.py          # rewrite docs/api.md
    python scripts/gen_api.py --check  # exit 1 if docs/api.md is stale (run by the tests)
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pie_ctx  # noqa: E402
from pie_ctx import constrain, errors, loading, speculate, tools  # noqa: E402
from pie_ctx.tools.mcp import MCPClient  # noqa: E402  (imports no mcp until used)

SECTIONS = [
    ("Runtime", pie_ctx.Runtime),
    ("Context", pie_ctx.Context),
    ("Generator", pie_ctx.Generator),
    ("Delta", pie_ctx.Delta),
    ("Forward", pie_ctx.Forward),
    ("ForwardOutput", pie_ctx.ForwardOutput),
    ("RawContext", pie_ctx.RawContext),
    ("Sampler", pie_ctx.Sampler),
    ("Receiver", pie_ctx.Receiver),
    ("Subscription", pie_ctx.Subscription),
    ("InferletHandle", pie_ctx.InferletHandle),
    ("Session", pie_ctx.Session),
    ("Store", pie_ctx.Store),
    ("constrain.Regex", constrain.Regex),
    ("constrain.JsonSchema", constrain.JsonSchema),
    ("constrain.AnyJson", constrain.AnyJson),
    ("constrain.Grammar", constrain.Grammar),
    ("constrain.Choice", constrain.Choice),
    ("constrain.Constraint", constrain.Constraint),
    ("tools.Tool", tools.Tool),
    ("tools.ToolCall", tools.ToolCall),
    ("tools.mcp.MCPClient", MCPClient),
    ("speculate.Speculator", speculate.Speculator),
    ("speculate.PromptLookup", speculate.PromptLookup),
    ("SamplerSpec", pie_ctx.SamplerSpec),
    ("PassReport", pie_ctx.PassReport),
    ("ContextState", pie_ctx.ContextState),
]


FUNCTIONS = [pie_ctx.gather]
INFERLET_FUNCTIONS = [loading.load_inferlet, loading.inferlet_args]  # ``pie-ctx run``'s entry points


def _doc(obj: object) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "").strip()


def _signature(name: str, fn: object) -> str:
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        sig = "(...)"
    sig = sig.replace("'", "").replace("(self, ", "(").replace("(self)", "()")
    sig = sig.replace(", *, _core: ContextCore | None = None", "")  # internal constructor form
    return f"{name}{sig}"


def awaiting(fn: object) -> str:
    """How a caller waits on ``fn``: ``"async "`` for a coroutine function (``await`` it),
    ``"async for "`` for an async generator, ``"async with "`` for an async context manager
    (``contextlib.asynccontextmanager``), ``""`` for a plain call."""
    fn = getattr(fn, "__func__", fn)  # a bound method or a class/static method's function
    if inspect.iscoroutinefunction(fn):
        return "async "
    if inspect.isasyncgenfunction(fn):
        return "async for "
    inner = inspect.unwrap(fn)  # type: ignore[arg-type]
    if inner is not fn and inspect.isasyncgenfunction(inner):
        return "async with "
    return ""


def _bullet(label: str, doc: str) -> list[str]:
    """A list item: the first paragraph on its line, the rest indented under it."""
    first, _, rest = doc.partition("\n\n")
    lines = [f"- {label}: {' '.join(first.split())}".rstrip()]
    for paragraph in rest.split("\n\n") if rest else ():
        lines += [""] + ["  " + line if line else "" for line in paragraph.splitlines()]
    return lines


_FIELD = re.compile(r"^    (\w+): ([^#=]+?)(?:\s*=\s*([^#]+?))?\s*(?:#\s*(.*))?$")


def struct_fields(cls: type) -> list[tuple[str, str, str]]:
    """A msgspec Struct's fields as ``(name, "type = default", comment)``, in order, read
    from its source (the comment is the meaning; a field without one has "")."""
    comments: dict[str, tuple[str, str]] = {}
    for line in inspect.getsource(cls).splitlines():
        m = _FIELD.match(line)
        if m:
            kind, default = m.group(2).strip(), (m.group(3) or "").strip()
            comments[m.group(1)] = (kind + (f" = {default}" if default else ""), m.group(4) or "")
    return [(f.name, *comments.get(f.name, ("", ""))) for f in msgspec.structs.fields(cls)]


def members(cls: type) -> Iterator[tuple[str, object, object]]:
    """The public members the reference lists: ``(name, member, raw)`` (``raw`` as
    stored on the class, telling properties and class/static methods apart)."""
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name not in ("__init__",):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, property):
            yield name, member, raw
            continue
        if not callable(member) or name == "__init__" and cls.__init__ is object.__init__:
            continue
        if getattr(member, "__module__", "") and not str(member.__module__).startswith("pie_ctx"):
            continue
        yield name, member, raw


def error_classes() -> list[tuple[str, type]]:
    return [(name, obj) for name, obj in vars(errors).items()
            if not name.startswith("_") and inspect.isclass(obj)]


def documented() -> Iterator[tuple[str, str, set[str]]]:
    """Every docstring the reference shows: ``(where, docstring, parameter names)``."""
    def params(fn: object) -> set[str]:
        try:
            return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return set()

    for fn in FUNCTIONS + INFERLET_FUNCTIONS:
        yield fn.__qualname__, _doc(fn), params(fn)
    for title, cls in SECTIONS:
        yield title, _doc(cls), params(cls)
        for name, member, raw in members(cls):
            if name != "__init__":
                yield f"{title}.{name}", _doc(raw if isinstance(raw, property) else member), \
                    params(member)
    for name, cls in error_classes():
        yield f"errors.{name}", _doc(cls), set()


def render() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python scripts/gen_api.py`; concepts are in "
           "`docs/sdk.md`.", "",
           "`async` before a name marks a coroutine: `await` it (`await ctx.flush()`). "
           "`async with` marks an async context manager (`async with Runtime.local() as "
           "rt:`), `async for` an async generator. Every other call returns at once.", ""]
    out += ["## Functions", ""]
    for fn in FUNCTIONS:
        out += [f"### `{awaiting(fn)}{_signature(fn.__name__, fn)}`", "", _doc(fn), ""]
    out += ["## Inferlets (`pie-ctx run`, `pie_ctx.loading`)", ""]
    for fn in INFERLET_FUNCTIONS:
        out += [f"### `{awaiting(fn)}{_signature(fn.__name__, fn)}`", "", _doc(fn), ""]
    for title, cls in SECTIONS:
        out += [f"## {title}", "", _doc(cls), ""]
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
            out += ["Fields:", ""]
            for name, kind, comment in struct_fields(cls):
                out.append(f"- `{name}: {kind}`" + (f": {comment}" if comment else ""))
        for name, member, raw in members(cls):
            if isinstance(raw, property):
                out += [""] + _bullet(f"`{name}` (property)", _doc(raw))
                continue
            label = cls.__name__ if name == "__init__" else name
            kind = "classmethod " if isinstance(raw, classmethod) else (
                "staticmethod " if isinstance(raw, staticmethod) else "")
            out += ["", f"### `{kind}{awaiting(raw)}{_signature(label, member)}`", ""]
            doc = _doc(member)
            if doc and name != "__init__":
                out += [doc]
        out.append("")
    out += ["## Errors (`pie_ctx.errors`)", ""]
    for name, obj in error_classes():
        out += _bullet(f"`{name}`", _doc(obj))
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    target = ROOT / "docs" / "api.md"
    text = render()
    if "--check" in sys.argv:
        if not target.exists() or target.read_text() != text:
            print("docs/api.md is stale: run python scripts/gen_api.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write docs/api.md from the SDK's docstrings and signatures.

    python scripts/gen_api.py          # rewrite docs/api.md
    python scripts/gen_api.py --check  # exit 1 if docs/api.md is stale (run by the tests)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pie_ctx  # noqa: E402
from pie_ctx import constrain, errors, speculate, tools  # noqa: E402
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


def render() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python scripts/gen_api.py`; concepts are in "
           "`docs/sdk.md`.", ""]
    out += ["## Functions", "", f"### `{_signature('gather', pie_ctx.gather)}`", "",
            _doc(pie_ctx.gather), ""]
    for title, cls in SECTIONS:
        out += [f"## {title}", "", _doc(cls), ""]
        for name, member in inspect.getmembers(cls):
            if name.startswith("_") and name not in ("__init__",):
                continue
            raw = inspect.getattr_static(cls, name)
            if isinstance(raw, property):
                out += ["", f"- `{name}` (property): {_doc(raw).splitlines()[0] if _doc(raw) else ''}"]
                continue
            if not callable(member) or name == "__init__" and cls.__init__ is object.__init__:
                continue
            if getattr(member, "__module__", "") and not str(member.__module__).startswith("pie_ctx"):
                continue
            label = cls.__name__ if name == "__init__" else name
            kind = "classmethod " if isinstance(raw, classmethod) else (
                "staticmethod " if isinstance(raw, staticmethod) else "")
            out += ["", f"### `{kind}{_signature(label, member)}`", ""]
            doc = _doc(member)
            if doc and name != "__init__":
                out += [doc]
        out.append("")
    out += ["## Errors (`pie_ctx.errors`)", ""]
    for name in (n for n in vars(errors) if not n.startswith("_")):
        obj = getattr(errors, name)
        if inspect.isclass(obj):
            out.append(f"- `{name}`: {_doc(obj)}")
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

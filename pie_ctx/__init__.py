"""pie-ctx: write inferlets, async programs that steer an LLM's KV cache directly.

Importing this package never imports torch: the SDK talks to the runtime through one
narrow transport interface (``pie_ctx.transport``) and the torch-free contract package
``pie_ctx.proto``. The names below load on first use, so ``import pie_ctx.proto`` (what the
runtime does) never loads the SDK's client classes.

Usage::

    from pie_ctx import Context, Sampler

    async def main(rt, args):
        ctx = Context(rt).system("You are terse.").user("Name a colour.").cue()
        return await ctx.generate(Sampler.greedy(), max_tokens=16).text()
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Context",
    "ContextState",
    "Delta",
    "Forward",
    "ForwardOutput",
    "Generator",
    "InferletHandle",
    "PassReport",
    "RawContext",
    "Receiver",
    "Runtime",
    "Sampler",
    "SamplerSpec",
    "ScoresSpec",
    "Session",
    "Store",
    "Subscription",
    "errors",
    "gather",
]
__version__ = "0.1.0"

# name -> module that defines it (loaded on first attribute access, PEP 562)
_WHERE = {
    "Context": "pie_ctx.context",
    "ContextState": "pie_ctx.proto.messages",
    "Delta": "pie_ctx.generator",
    "Forward": "pie_ctx.forward",
    "ForwardOutput": "pie_ctx.forward",
    "Generator": "pie_ctx.generator",
    "InferletHandle": "pie_ctx.inferlets",
    "PassReport": "pie_ctx.proto.messages",
    "RawContext": "pie_ctx.raw",
    "Receiver": "pie_ctx.channels",
    "Runtime": "pie_ctx.runtime",
    "Sampler": "pie_ctx.sampler",
    "SamplerSpec": "pie_ctx.proto.messages",
    "ScoresSpec": "pie_ctx.proto.messages",
    "Session": "pie_ctx.inferlets",
    "Store": "pie_ctx.inferlets",
    "Subscription": "pie_ctx.channels",
    "gather": "pie_ctx.concurrency",
}


def __getattr__(name: str) -> Any:
    if name == "errors":
        value: Any = importlib.import_module("pie_ctx.errors")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'pie_ctx' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

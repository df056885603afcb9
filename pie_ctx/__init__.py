"""pie-ctx: write inferlets, async programs that steer an LLM's KV cache directly.

Importing this package never imports torch: the SDK talks to the runtime through one
narrow transport interface (``pie_ctx.transport``).

Usage::

    from pie_ctx import Context, Sampler

    async def main(rt, args):
        ctx = Context(rt).system("You are terse.").user("Name a colour.").cue()
        return await ctx.generate(Sampler.greedy(), max_tokens=16).text()
"""

from __future__ import annotations

from pie_ctx import errors
from pie_ctx.concurrency import gather
from pie_ctx.context import Context
from pie_ctx.forward import Forward, ForwardOutput
from pie_ctx.generator import Delta, Generator
from pie_ctx.protocol import ContextState, PassReport, SamplerSpec
from pie_ctx.raw import RawContext
from pie_ctx.runtime import Runtime
from pie_ctx.sampler import Sampler

__all__ = [
    "Context",
    "ContextState",
    "Delta",
    "Forward",
    "ForwardOutput",
    "Generator",
    "PassReport",
    "RawContext",
    "Runtime",
    "Sampler",
    "SamplerSpec",
    "errors",
    "gather",
]
__version__ = "0.1.0"

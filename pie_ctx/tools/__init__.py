"""Tools for inferlets: declare them, let the model call them, run them, answer them.

Usage::

    from pie_ctx import Context, Sampler
    from pie_ctx.tools import Tool

    async def get_weather(city: str) -> str:
        \"\"\"Current weather in a city.\"\"\"
        return f"{city}: 18 C, clear"

    weather = Tool.from_function(get_weather)
    ctx = Context(rt).system("You help with travel.", tools=[weather]).user("Paris?")
    gen = ctx.generate(Sampler.greedy(), tool_choice="required", max_tokens=64)
    for call in await gen.calls():            # valid JSON for the tool's schema
        ctx.tool_result(call.id, await weather.run(call.arguments))
    print(await ctx.generate(Sampler.greedy(), tool_choice="none").text())

Tools from MCP servers: ``pie_ctx.tools.mcp`` (needs the ``mcp`` package).
"""

from __future__ import annotations

from pie_ctx.tools.formats import ToolOffer, tool_format
from pie_ctx.tools.tool import Tool, ToolCall

__all__ = ["Tool", "ToolCall", "ToolOffer", "tool_format"]

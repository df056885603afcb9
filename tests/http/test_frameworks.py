"""Agent frameworks' default paths against ``pie-ctx serve --http``'s ``/v1/responses``:
the OpenAI Agents SDK (its default model is the Responses one), LangChain's
``ChatOpenAI(use_responses_api=True)`` and pydantic-ai's ``OpenAIResponsesModel``, each
installed from the ``dev`` extra.

The tiny random model would call tools forever, so each test forces the first call
(``tool_choice="required"``) and stops the loop by the framework's own rule (stop at the
first tool, a request limit): the tests check the protocol, not the model.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from tests.http.conftest import Served

MODEL = "tiny-llama"


def test_openai_agents_sdk_default_model_with_a_function_tool(served: Served) -> None:
    server = served.server
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Bergen"]) -> str:
        """Weather in a city."""
        ran.append(city)
        return "sunny"

    class Report(BaseModel):
        sky: str

    async def main() -> None:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_tracing_disabled(True)
        settings = agents.ModelSettings(tool_choice="required", temperature=0,
                                        max_tokens=200, parallel_tool_calls=False)
        plain = agents.Agent(name="w", instructions="You report the weather.", model=MODEL,
                             tools=[get_weather], model_settings=settings,
                             tool_use_behavior="stop_on_first_tool")
        result = await agents.Runner.run(plain, "Weather in Oslo?")
        assert result.final_output == "sunny" and len(ran) == 1
        # the model is the Responses one, and its response was stored: chain on it
        assert result.last_response_id and result.last_response_id.startswith("resp_")
        # output_type together with tools: the request carries text.format and tools
        typed = agents.Agent(name="t", instructions="You report the weather.", model=MODEL,
                             tools=[get_weather], model_settings=settings,
                             output_type=Report, tool_use_behavior="stop_on_first_tool")
        again = await agents.Runner.run(typed, "Weather in Bergen?",
                                        previous_response_id=result.last_response_id)
        assert again.final_output == "sunny" and len(ran) == 2
        await client.close()

    asyncio.run(main())


def test_langchain_chat_openai_responses_bind_tools(served: Served) -> None:
    server = served.server
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    # Its schema closed by hand: LangChain leaves other keys allowed, and the generic tool
    # format lets the tiny model write undeclared keys until its budget ends (the chat
    # API's fix for undeclared keys makes this unnecessary).
    get_weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                       "properties": {"city": {"enum": ["Oslo", "Bergen"]}}}}}

    llm = lc.ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none",
                        use_responses_api=True, temperature=0, max_tokens=200,
                        max_retries=0)
    bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    ask = HumanMessage("Weather in Oslo?")
    ai = bound.invoke([ask])
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    # the whole history back (LangChain's default): function_call + function_call_output
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(
        [ask, ai, ToolMessage("sunny", tool_call_id=call["id"])])
    assert not answer.tool_calls and answer.usage_metadata["input_tokens"] > 0
    assert answer.response_metadata["id"].startswith("resp_")


def test_pydantic_ai_openai_responses_model_with_a_tool(served: Served) -> None:
    server = served.server
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.direct import model_request
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.messages import ModelRequest, ToolCallPart
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.usage import UsageLimits

    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(
        base_url=server.url + "/v1", api_key="none"))
    weather = ToolDefinition(name="get_weather", description="Weather in a city.",
                             parameters_json_schema={
                                 "type": "object", "required": ["city"],
                                 "additionalProperties": False,
                                 "properties": {"city": {"type": "string", "maxLength": 8}}})

    async def main() -> None:
        # one request, the call forced: it comes back as pydantic-ai's ToolCallPart
        reply = await model_request(
            model, [ModelRequest.user_text_prompt("Weather in Oslo?")],
            model_settings={"temperature": 0, "max_tokens": 200, "tool_choice": "required",
                            "parallel_tool_calls": False},
            model_request_parameters=ModelRequestParameters(function_tools=[weather]))
        (part,) = [p for p in reply.parts if isinstance(p, ToolCallPart)]
        assert part.tool_name == "get_weather" and "city" in part.args_as_dict()
        # the agent loop on the default path: its tool runs, results go back
        ran: list[str] = []
        agent = Agent(model, model_settings={"temperature": 0, "max_tokens": 200})

        @agent.tool_plain
        def get_weather(city: Literal["Oslo", "Bergen"]) -> str:
            """Weather in a city."""
            ran.append(city)
            return "sunny"

        try:
            result = await agent.run("Weather in Oslo?",
                                     usage_limits=UsageLimits(request_limit=3))
            assert isinstance(result.output, str)
        except UsageLimitExceeded:  # the tiny model kept calling: the tool ran each time
            assert len(ran) >= 2

    asyncio.run(main())

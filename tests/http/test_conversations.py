"""OpenAI's Conversations API (``/v1/conversations``) and ``conversation`` on
``/v1/responses``, through the official ``openai`` client and the OpenAI Agents SDK's
``OpenAIConversationsSession``, against a live ``pie-ctx serve --http`` (the tiny model:
the tests check the protocol and the cache, not the text)."""

from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest

from tests.http.conftest import Served

MODEL = "tiny-llama"


def test_conversations_and_their_items(served: Served) -> None:
    client = served.client("conv-a")
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello there."}],
        metadata={"topic": "greeting"})
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "greeting"}
    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == \
        {"topic": "x"}
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "assistant", "id": "msg_kept",
         "content": [{"type": "output_text", "text": "Hi."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}])
    assert [i.type for i in added.data] == ["message", "function_call",
                                            "function_call_output"]
    assert added.data[0].id == "msg_kept"  # a client's id is kept
    listed = [i.id for i in client.conversations.items.list(conv.id, order="asc")]
    assert len(listed) == 4 and listed[1] == "msg_kept"
    newest = client.conversations.items.list(conv.id, limit=2)  # desc by default
    assert [i.id for i in newest.data] == listed[::-1][:2] and newest.has_more
    after = client.conversations.items.list(conv.id, order="asc", after=listed[1])
    assert [i.id for i in after.data] == listed[2:]
    assert client.conversations.items.retrieve("msg_kept", conversation_id=conv.id).type == \
        "message"
    client.conversations.items.delete("msg_kept", conversation_id=conv.id)
    assert len(list(client.conversations.items.list(conv.id))) == 3
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("msg_kept", conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):  # another key's conversation
        served.client("conv-b").conversations.retrieve(conv.id)
    with pytest.raises(openai.BadRequestError):  # an item this server cannot read
        client.conversations.items.create(conv.id, items=[{"type": "reasoning"}])
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_responses_in_a_conversation_reuse_its_context(served: Served) -> None:
    client = served.client("conv-c")
    conv = client.conversations.create()
    first = served.create("conv-c", input="Tell me about the sea.", conversation=conv.id,
                          max_output_tokens=6)
    assert first.conversation is not None and first.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in items] == ["message", "message"]  # the input, the answer
    assert items[1].id == first.output[0].id
    second = served.create("conv-c", input="And the sky?", conversation={"id": conv.id},
                           max_output_tokens=6)
    context = first.usage.input_tokens + first.usage.output_tokens
    # the conversation's snapshot: only the new turn is computed
    assert second.usage.input_tokens_details.cached_tokens >= context - 4
    assert len(list(client.conversations.items.list(conv.id))) == 4
    # an item added from outside changes the history: the next response builds it again
    client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "One more thing."}])
    third = served.create("conv-c", input="Go on.", conversation=conv.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="cannot be used together"):
        served.create("conv-c", input="x", conversation=conv.id,
                      previous_response_id=first.id)
    with pytest.raises(openai.NotFoundError):
        served.create("conv-c", input="x", conversation="conv_" + "0" * 32)


def test_openai_agents_sdk_conversations_session(served: Served) -> None:
    agents = pytest.importorskip("agents")
    from agents.memory import OpenAIConversationsSession
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    async def main() -> None:
        client = AsyncOpenAI(base_url=served.server.url + "/v1", api_key="conv-d",
                             max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_tracing_disabled(True)
        class Answer(BaseModel):  # a constrained answer ends (the tiny model's would not)
            ok: Literal["yes"]

        agent = agents.Agent(name="a", instructions="Answer briefly.", model=MODEL,
                             output_type=Answer,
                             model_settings=agents.ModelSettings(temperature=0,
                                                                 max_tokens=60))
        session = OpenAIConversationsSession(openai_client=client)
        await agents.Runner.run(agent, "Hi.", session=session)
        history = await session.get_items()
        assert [i.get("role") for i in history] == ["user", "assistant"]
        await agents.Runner.run(agent, "Again.", session=session)
        assert len(await session.get_items()) == 4
        popped = await session.pop_item()
        assert popped is not None and popped.get("role") == "assistant"
        assert len(await session.get_items()) == 3
        # the same conversation, run server-side through conversation_id
        cid = await session._get_session_id()
        result = await agents.Runner.run(agent, "Once more.", conversation_id=cid)
        assert result.last_response_id
        assert len(await session.get_items()) == 5
        await session.clear_session()
        await client.close()

    asyncio.run(main())

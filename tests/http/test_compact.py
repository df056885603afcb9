"""``POST /v1/responses/compact`` through the official ``openai`` client against a live
``pie-ctx serve --http``: a long conversation compacted by KV compaction, then continued
from its ``compaction`` item or its id with no prefill of what it holds (the tiny model:
the test checks the protocol and the token counts, not the text)."""

from __future__ import annotations

import openai
import pytest

from tests.http.conftest import Served

MODEL = "tiny-llama"
LONG = "The keeper's cat is called Moss. " + "The sea was grey and the wind was cold. " * 14


@pytest.mark.parametrize("policy", ["snapkv", "streaming"])
def test_a_compacted_conversation_continues_without_prefill(served: Served, policy) -> None:
    client = served.client("compact")
    first = served.create("compact", input=LONG, max_output_tokens=4)
    context = first.usage.input_tokens + first.usage.output_tokens
    assert context > 500
    compacted = client.responses.compact(
        model=MODEL, previous_response_id=first.id,
        extra_body={"compaction": {"budget": 64, "policy": policy}})
    assert compacted.object == "response.compaction"
    *users, item = compacted.output
    assert item.type == "compaction" and item.encrypted_content
    assert [u.role for u in users] == ["user"] and users[0].content[0].text == LONG
    assert compacted.usage.input_tokens >= context - 8  # the context it compacted
    # the client's next turn: the compacted output as input, then its new message
    again = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0,
        input=[*(o.model_dump(exclude_none=True) for o in compacted.output),
               {"role": "user", "content": "What is the cat called?"}])
    u = again.usage
    assert u.input_tokens <= 64 + 48  # the budget and the new turn, not the whole context
    assert u.input_tokens_details.cached_tokens >= 60  # the compacted context: not computed
    # or by id, as any stored response
    by_id = served.create("compact", input="And the sea?", previous_response_id=compacted.id,
                          max_output_tokens=4)
    assert by_id.usage.input_tokens <= 64 + 48
    assert by_id.usage.input_tokens_details.cached_tokens >= 60


def test_bad_compactions_are_400s(served: Served) -> None:
    client = served.client("compact")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.compact(model=MODEL)
    with pytest.raises(openai.BadRequestError, match="budget"):
        client.responses.compact(model=MODEL, input="Hi.",
                                 extra_body={"compaction": {"budget": 8}})
    with pytest.raises(openai.NotFoundError):  # a compaction of another key
        first = served.create("compact", input="Hello.", max_output_tokens=2)
        other = client.responses.compact(model=MODEL, previous_response_id=first.id)
        served.client("compact-other").responses.create(
            model=MODEL, input=[o.model_dump(exclude_none=True) for o in other.output])

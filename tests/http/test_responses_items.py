"""The Responses API's typed objects (``responses.items``, ``responses.store``): a record as
an earlier server wrote it (plain JSON, before the items were typed) decodes into them, and
their JSON is OpenAI's shapes. Unit tests: no server."""

from __future__ import annotations

import json

import msgspec

from runtime.server.http.responses.api import turns_of_items
from runtime.server.http.responses.items import (
    FunctionCall,
    FunctionCallOutput,
    McpCall,
    McpListTools,
    Message,
    OutputText,
    encode,
)
from runtime.server.http.responses.store import Record, _decode_record

# A record as the store wrote it before the items were typed (json.dumps of dicts).
OLD = {
    "response": {
        "id": "resp_" + "0" * 32, "object": "response", "created_at": 1764300000,
        "status": "completed", "model": "tiny-llama",
        "output": [
            {"id": "mcpl_1", "type": "mcp_list_tools", "server_label": "count",
             "tools": [{"name": "tally", "description": "Count.", "annotations": None,
                        "input_schema": {"type": "object"}}], "error": None},
            {"id": "mcp_1", "type": "mcp_call", "server_label": "count", "name": "tally",
             "arguments": "{\"code\": \"ab\"}", "output": "tally 1: ab", "error": None,
             "status": "completed"},
            {"id": "fc_1", "type": "function_call", "status": "completed",
             "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
            {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Sunny.", "annotations": [],
                          "logprobs": []}]}],
        "instructions": None, "previous_response_id": None, "tools": [],
        "tool_choice": "auto", "parallel_tool_calls": True, "max_output_tokens": None,
        "max_tool_calls": None, "temperature": 1.0, "top_p": 1.0,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
        "store": True, "background": False,
        "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0,
                                                              "cache_write_tokens": 9},
                  "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": 13},
        "error": None, "incomplete_details": None,
        "reasoning": {"effort": None, "summary": None}, "user": None,
        "service_tier": "default", "completed_at": 1764300001},
    "input_items": [
        {"id": "msg_1", "type": "message", "role": "developer", "status": "completed",
         "content": [{"type": "input_text", "text": "Be brief."}]},
        {"id": "msg_0", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Earlier.", "annotations": []}]},
        {"id": "fco_1", "type": "function_call_output", "status": "completed",
         "call_id": "call_0", "output": "12 C"}],
    "previous": None,
    "header": {"model": "tiny-llama", "instructions": None, "tools": []},
    "created": 1764300000.5,
}


def test_an_old_record_decodes_into_typed_items() -> None:
    record = _decode_record(json.dumps(OLD))
    assert isinstance(record, Record) and record.id == ""  # the key names it
    kinds = [type(i) for i in record.conversation_items()]
    assert kinds == [Message, Message, FunctionCallOutput, McpListTools, McpCall,
                     FunctionCall, Message]
    assert record.input_items[1].content == [OutputText(text="Earlier.")]
    assert record.response.usage is not None and record.response.usage.total_tokens == 13
    # re-encoded, it is the same JSON (fields added since are filled in: an id, logprobs,
    # the conversation a response ran in)
    again = json.loads(encode(record))
    assert again.pop("id") == "" and again["response"].pop("conversation") is None
    assert again["input_items"][1]["content"][0].pop("logprobs") == []
    assert again == OLD


def test_turns_of_typed_items() -> None:
    record = _decode_record(json.dumps(OLD))
    turns = turns_of_items(record.conversation_items())
    assert [(t.role, t.text, [c.name for c in t.calls]) for t in turns] == [
        ("system", "Be brief.", []), ("assistant", "Earlier.", []), ("tool", "12 C", []),
        ("assistant", "", ["tally", "get_weather"]), ("tool", "tally 1: ab", []),
        ("assistant", "Sunny.", [])]


def test_a_response_in_progress_leaves_out_completed_at() -> None:
    record = _decode_record(json.dumps(OLD))
    record.response.completed_at = msgspec.UNSET
    assert "completed_at" not in json.loads(encode(record.response))

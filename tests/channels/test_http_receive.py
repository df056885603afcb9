"""``GET /v1/pie/channels/{name}`` (a long poll) and ``GET /v1/pie/topics/{name}`` (server-sent
events) on a live HTTP server: an outside client collects what an inferlet sends."""

from __future__ import annotations

import base64
import json

import anyio
import httpx
import pytest

from pie_ctx import Runtime
from runtime.server.testing import serve_http_in_background
from tests.sdk.harness import tiny_engine

pytestmark = pytest.mark.fp32_only("channels carry bytes; no dtype changes them")

KEY = {"Authorization": "Bearer sekrit"}


async def test_a_long_poll_takes_what_an_inferlet_sends(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine, api_key="sekrit") as url, \
            httpx.AsyncClient(base_url=url, headers=KEY, timeout=30) as http, \
            Runtime.local(engine=engine) as rt:
        # nothing there: 204 after the timeout, and the poll created nothing that stays
        empty = await http.get("/v1/pie/channels/answers", params={"timeout": 0.1})
        assert empty.status_code == 204 and empty.content == b""

        got: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:

            async def poll() -> None:
                got.append(await http.get("/v1/pie/channels/answers", params={"timeout": 20}))

            tg.start_soon(poll)
            await anyio.sleep(0.2)
            assert got == []                       # waiting for the inferlet
            await rt.send("answers", "42")          # the inferlet replies
        assert got[0].status_code == 200
        assert got[0].json() == {"object": "pie.channel.message", "channel": "answers",
                                 "bytes": 2, "type": "text", "data": "42"}

        await rt.send("team/out", b"\x00\xff")
        r = await http.get("/v1/pie/channels/team/out")
        assert r.json()["type"] == "bytes" and base64.b64decode(r.json()["data"]) == b"\x00\xff"

        # a client that leaves while it waits takes nothing: the message stays for the next
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/v1/pie/channels/late", params={"timeout": 20}, timeout=0.3)
        await anyio.sleep(0.2)
        await rt.send("late", "kept")
        assert await rt.receive("late") == "kept"

        bad = await http.get("/v1/pie/channels/x", params={"timeout": 301})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
        no_key = await http.get("/v1/pie/channels/x", headers={"Authorization": ""})
        assert no_key.status_code == 401
        assert engine.stats().num_channel_messages == 0


async def test_a_topic_streams_as_server_sent_events(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine, api_key="sekrit") as url, \
            httpx.AsyncClient(base_url=url, headers=KEY, timeout=30) as http, \
            Runtime.local(engine=engine) as rt:
        async with http.stream("GET", "/v1/pie/topics/news") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = (json.loads(line[5:]) async for line in r.aiter_lines()
                      if line.startswith("data:"))
            assert await anext(events) == {"object": "pie.topic.subscribed", "topic": "news"}
            assert await rt.broadcast("news", "hello") == 1    # subscribed before the event
            assert await rt.broadcast("news", b"\x01") == 1
            first, second = await anext(events), await anext(events)
        assert first == {"object": "pie.topic.message", "topic": "news", "bytes": 5,
                         "type": "text", "data": "hello"}
        assert second["type"] == "bytes" and base64.b64decode(second["data"]) == b"\x01"
        with anyio.fail_after(10):                  # the client left: its subscription goes
            while engine.stats().num_subscriptions:
                await anyio.sleep(0.05)
        assert await rt.broadcast("news", "nobody") == 0

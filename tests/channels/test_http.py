"""``POST /v1/pie/channels/{name}`` and ``/v1/pie/topics/{name}`` on a live HTTP server
(uvicorn on a free port, the tiny model's engine), with the API key required."""

from __future__ import annotations

import anyio
import httpx
import pytest

from pie_ctx import Runtime
from runtime.engine.channels import ChannelLimits
from runtime.server.testing import serve_http_in_background
from tests.sdk.harness import tiny_engine

pytestmark = pytest.mark.fp32_only("channels carry bytes; no dtype changes them")

KEY = {"Authorization": "Bearer sekrit"}


async def test_an_http_post_reaches_an_inferlets_receive(tiny_folder) -> None:
    limits = ChannelLimits(max_message_bytes=64, max_queue_messages=1)
    async with tiny_engine(tiny_folder, channel_limits=limits) as engine, \
            serve_http_in_background(engine, api_key="sekrit") as url, \
            httpx.AsyncClient(base_url=url, headers=KEY, timeout=30) as http, \
            Runtime.local(engine=engine) as rt:
        r = await http.post("/v1/pie/channels/jobs", content="resize cat.png",
                            headers={"Content-Type": "text/plain"})
        assert r.status_code == 200
        assert r.json() == {"object": "pie.channel.message", "channel": "jobs", "bytes": 14,
                            "type": "text"}
        assert await rt.receive("jobs") == "resize cat.png"
        r = await http.post("/v1/pie/channels/team/jobs%20b", content=b"\x00\xff",
                            headers={"Content-Type": "application/octet-stream"})
        assert r.json()["channel"] == "team/jobs b" and r.json()["type"] == "bytes"
        assert await rt.receive("team/jobs b") == b"\x00\xff"

        # back-pressure: a full queue holds the POST until a receiver takes one
        await http.post("/v1/pie/channels/jobs", content="first")
        full = await http.post("/v1/pie/channels/jobs", content="x", params={"timeout": 0})
        assert full.status_code == 503 and full.json()["error"]["code"] == "channel_full"
        async with anyio.create_task_group() as tg:
            answers: list[int] = []

            async def post_second() -> None:
                answers.append((await http.post("/v1/pie/channels/jobs", content="second",
                                                params={"timeout": 20})).status_code)

            tg.start_soon(post_second)
            await anyio.sleep(0.2)
            assert answers == []
            assert await rt.receive("jobs") == "first"
        assert answers == [200] and await rt.receive("jobs") == "second"

        # the topic route reaches every present subscriber
        async with rt.subscribe("news") as sub:
            r = await http.post("/v1/pie/topics/news", content='{"headline": "hi"}',
                                headers={"Content-Type": "application/json"})
            assert r.json()["subscribers"] == 1 and r.json()["object"] == "pie.topic.message"
            assert await sub.receive() == '{"headline": "hi"}'

        # refusals, in OpenAI's error body; none changes anything
        big = await http.post("/v1/pie/channels/jobs", content="x" * 65)
        assert big.status_code == 413 and big.json()["error"]["code"] == "message_too_large"
        binary = await http.post("/v1/pie/channels/jobs", content=b"\xff")
        assert binary.status_code == 400 and "octet-stream" in binary.json()["error"]["message"]
        bad = await http.post("/v1/pie/channels/jobs", content="x", params={"timeout": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
        name = await http.post("/v1/pie/channels/" + "n" * 300, content="x")
        assert name.status_code == 400 and "channel names" in name.json()["error"]["message"]
        no_key = await http.post("/v1/pie/channels/jobs", content="x", headers={"Authorization": ""})
        assert no_key.status_code == 401
        assert engine.stats().num_channel_messages == 0
        metrics = (await http.get("/metrics")).text
        assert 'endpoint="/v1/pie/channels/{name}",status="200"' in metrics

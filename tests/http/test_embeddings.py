"""``POST /v1/embeddings`` through the official ``openai`` client: mean-pooled (or last-token)
final-norm hidden states, L2-normalized, equal to what the SDK's forward pass returns."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from pie_ctx import Context, Runtime
from runtime.server.testing import serve_http_in_background
from tests.sdk.harness import tiny_engine

pytestmark = pytest.mark.fp32_only("the oracle is the same engine's fp32 forward")


async def _oracle(rt: Runtime, tokens: list[int], pooling: str) -> np.ndarray:
    async with Context(rt) as ctx:
        out = await ctx.forward().input(tokens).hidden_states(range(len(tokens))).execute()
    rows = np.stack(out.hidden_states)
    vec = rows.mean(axis=0) if pooling == "mean" else rows[-1]
    return vec / np.linalg.norm(vec)


async def test_embeddings_are_pooled_normalized_hidden_states(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine) as url, \
            Runtime.local(engine=engine) as rt:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = engine.model_name
        long = [(7 * i) % 200 + 3 for i in range(300)]        # over one 256-token pass
        texts = ["a grey cat", "a grey cat sat on the mat", "a grey cat"]

        r = await client.embeddings.create(model=model, input=texts)  # base64 on the wire
        assert [d.index for d in r.data] == [0, 1, 2] and r.model == model
        vecs = [np.array(d.embedding) for d in r.data]
        assert all(v.shape == (rt.info.hidden_size,) for v in vecs)
        assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vecs)
        assert np.array_equal(vecs[0], vecs[2])                # the same text, the same vector
        for text, vec in zip(texts, vecs, strict=True):
            want = await _oracle(rt, rt.tokenizer.encode(text), "mean")
            assert np.abs(vec - want).max() < 1e-5
        tokens = sum(len(rt.tokenizer.encode(t)) for t in texts)
        assert r.usage.prompt_tokens == r.usage.total_tokens == tokens

        r = await client.embeddings.create(model=model, input=long, encoding_format="float")
        assert np.abs(np.array(r.data[0].embedding) - await _oracle(rt, long, "mean")).max() \
            < 1e-5
        r = await client.embeddings.create(model=model, input=[long[:40]],
                                           extra_body={"pooling": "last"})
        assert np.abs(np.array(r.data[0].embedding)
                      - await _oracle(rt, long[:40], "last")).max() < 1e-5

        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="nope", input="x")
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            await client.embeddings.create(model=model, input="x", dimensions=8)
        with pytest.raises(openai.BadRequestError, match="empty"):
            await client.embeddings.create(model=model, input=[])
        assert engine.stats().num_contexts == 0                # every context released
        await client.close()

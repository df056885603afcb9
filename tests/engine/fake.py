"""A fake model runner and tokenizer that exercise the engine's KV bookkeeping.

The fake runner writes each token's id and position into its KV slot, and its logits for a
row depend on every KV entry the row can see (through the page table and the mask). So any
mistake in page tables, forks, dedup, prefix reuse or preemption changes the tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from runtime.engine.engine import Engine
from runtime.kv.store import PageStore

VOCAB = 64
STOP = 63


class FakeRunner:
    backend = SimpleNamespace(name="fake")
    weight_format = "fp32"
    kind = "native"
    deterministic = False

    def __init__(self, pool_kv: torch.Tensor, page_size: int) -> None:
        self.pool_kv = pool_kv  # [P, ps, 1, 2, 1, 2]
        self.page_size = page_size
        self.calls: list[list[int]] = []  # tokens per sequence, per call

    def forward(self, batch, return_hidden: bool = False) -> torch.Tensor:
        self.calls.append([len(s.tokens) for s in batch])
        rows = []
        ps = self.page_size
        for seq in batch:
            for j, (tok, pos) in enumerate(zip(seq.tokens, seq.positions, strict=True)):
                idx = seq.num_cached + j
                page, slot = seq.page_table[idx // ps], idx % ps
                self.pool_kv[page, slot, 0, 0, 0, 0] = float(tok)
                self.pool_kv[page, slot, 0, 0, 0, 1] = float(pos)
            for j in seq.logit_indices:
                kv_len = seq.num_cached + j + 1
                visible = np.ones(kv_len, dtype=bool)
                if seq.mask is not None:
                    visible = np.asarray(seq.mask[j, :kv_len], dtype=bool)
                acc = 0
                for i in np.nonzero(visible)[0]:
                    page, slot = seq.page_table[i // ps], i % ps
                    t = int(self.pool_kv[page, slot, 0, 0, 0, 0])
                    p = int(self.pool_kv[page, slot, 0, 0, 0, 1])
                    acc = (acc * 31 + t * 7 + p) % 1_000_003
                target = acc % (VOCAB - 1)  # never STOP by itself
                logits = -torch.abs(torch.arange(VOCAB, dtype=torch.float32) - target) * 0.5
                logits[STOP] = -1e9 if (acc % 17) else 10.0  # sometimes the model "stops"
                rows.append(logits)
        logits = torch.stack(rows) if rows else torch.empty((0, VOCAB))
        if return_hidden:  # a stand-in: the logits' first two values
            return logits, logits[:, :2].clone()
        return logits


class FakeTokenizer:
    stop_token_ids = (STOP,)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join("" if (i == STOP and skip_special_tokens) else chr(ord("a") + i % 26)
                       if i < 52 else chr(ord("0") + i % 10) for i in ids)

    def incremental_decoder(self, skip_special_tokens: bool = False):
        return _Decoder(self, skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]


def make_engine(num_pages: int = 64, page_size: int = 4, **kw) -> Engine:
    store = PageStore(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=2)
    runner = FakeRunner(store.pool.kv, page_size)
    return Engine(store, runner, FakeTokenizer(), vocab_size=VOCAB, max_seq_len=4096, **kw)


class _Decoder:
    def __init__(self, tok: FakeTokenizer, skip: bool) -> None:
        self.tok, self.skip = tok, skip

    def feed(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def flush(self) -> str:
        return ""

"""TP=2 against TP=1 on a tiny random Llama with 4 KV heads, at the runner: prefill, decode,
forked and cascade (shared-prefix) batches, and the disk tier's page bytes.

Tolerance: fp32 logits agree within 1e-4 absolute (the two ranks' partial sums are added
in another order than one rank's matmul adds them; measured ~2e-6 on these logits of
magnitude ~5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pie_ctx.proto.errors import InvalidArgument
from runtime.boot import boot_engine
from runtime.distributed.pool import ShardedPagePool
from runtime.distributed.runner import ShardedRunner
from runtime.model.batch import SeqInput
from runtime.model.runner import ModelRunner
from tests.parallel.tiny import tp_model_folder

TOL = 1e-4
PAGE = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tp_model_folder(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def engines(folder):
    """(TP=2 engine, TP=1 engine), not started: the tests drive their runners directly."""
    tp2 = boot_engine(str(folder), page_size=PAGE, num_pages=64, progress=False, tp=2)
    tp1 = boot_engine(str(folder), page_size=PAGE, num_pages=64, progress=False)
    yield tp2, tp1
    tp2.executor.runner.close()
    assert not dist.is_initialized()


def both(engines, batch):
    tp2, tp1 = engines
    a = tp2.executor.runner.forward(batch)
    b = tp1.executor.runner.forward(batch)
    assert a.shape == b.shape
    return a, b


def seq(tokens, start, table, rows=None):
    n = len(tokens)
    return SeqInput(tokens=tokens, positions=list(range(start, start + n)), page_table=table,
                    num_cached=start, logit_indices=list(range(n)) if rows is None else rows)


def test_shapes_and_processes(engines):
    tp2, tp1 = engines
    runner = tp2.executor.runner
    assert isinstance(runner, ShardedRunner) and isinstance(tp2.store.pool, ShardedPagePool)
    assert type(tp1.executor.runner) is ModelRunner  # TP=1: the plain runner, no ranks
    assert tp2.store.pool.kv.shape[-2] == 2 and tp1.store.pool.kv.shape[-2] == 4
    assert [p.poll() for p in runner.comm.processes] == [None]


def test_prefill_decode_fork_cascade(engines):
    tp2, tp1 = engines
    # prefill two contexts in one batch: A (10 tokens, pages 0-2), B (5 tokens, pages 5-6)
    a, b = both(engines, [seq(list(range(20, 30)), 0, [0, 1, 2]),
                          seq([40, 41, 42, 43, 44], 0, [5, 6], rows=[4])])
    assert a.shape == (11, 266)
    assert (a - b).abs().max() <= TOL
    # decode both
    a, b = both(engines, [seq([7], 10, [0, 1, 2]), seq([8], 5, [5, 6])])
    assert (a - b).abs().max() <= TOL
    # fork A twice: its working tail (page 2, 3 tokens) copied into pages 3 and 4
    for engine in (tp2, tp1):
        engine.store.pool.copy_pages([3, 4], [2, 2])
    # cascade: three decodes sharing pages 0-1 (read once for all), each with its own tail
    a, b = both(engines, [seq([11], 11, [0, 1, 2]), seq([12], 11, [0, 1, 3]),
                          seq([13], 11, [0, 1, 4])])
    assert (a - b).abs().max() <= TOL
    assert (a[0] - a[1]).abs().max() > 1e-3  # different tokens, different logits
    # the forks go on with chunks and a custom mask
    mask = np.tril(np.ones((3, 14), dtype=bool), k=11)
    a, b = both(engines, [SeqInput(tokens=[1, 2, 3], positions=[12, 13, 14],
                                   page_table=[0, 1, 3, 7], num_cached=11,
                                   logit_indices=[0, 2], mask=mask),
                          seq([14], 12, [0, 1, 4, 8])])
    assert (a - b).abs().max() <= TOL
    stats = tp2.executor.runner.comm.stats
    assert stats.calls["broadcast"] >= 4 and stats.calls["all_reduce"] >= 4 * 2 * 2


def test_disk_tier_bytes_gathered_and_scattered(engines):
    tp2, tp1 = engines
    sharded, plain = tp2.store.pool, tp1.store.pool
    both(engines, [seq(list(range(50, 58)), 0, [10, 11])])
    assert sharded.page_bytes == plain.page_bytes
    for page in (10, 11):
        got = np.frombuffer(bytes(sharded.read_page(page)), dtype=np.float32)
        want = np.frombuffer(bytes(plain.read_page(page)), dtype=np.float32)
        np.testing.assert_allclose(got, want, atol=TOL)
    # a page loaded from disk (the single-device engine's bytes) lands on every rank
    payload = bytes(plain.read_page(11))
    sharded.write_page(30, payload)
    plain.write_page(30, payload)
    assert bytes(sharded.read_page(30)) == payload
    # ... and attention reads it there like a computed page
    a, b = both(engines, [seq([9], 8, [10, 30, 31])])
    assert (a - b).abs().max() <= TOL


def test_rejected_batch_keeps_the_ranks_in_step(engines):
    tp2, _ = engines
    with pytest.raises(InvalidArgument, match="page id out of range"):
        tp2.executor.runner.forward([seq([1], 0, [999])])
    assert tp2.executor.runner.comm.lost is None
    a, b = both(engines, [seq([3, 4], 0, [40])])
    assert (a - b).abs().max() <= TOL


def test_sizes_the_model_cannot_split_into(folder):
    with pytest.raises(InvalidArgument, match=r"4 KV heads .* --tensor-parallel 1, 2, 4"):
        boot_engine(str(folder), page_size=PAGE, num_pages=8, progress=False, tp=3)
    with pytest.raises(InvalidArgument, match="tensor_parallel must be a positive int"):
        boot_engine(str(folder), page_size=PAGE, num_pages=8, progress=False, tp=0)


def test_return_hidden(engines):
    tp2, tp1 = engines
    batch = [seq([5, 6, 7], 0, [50])]
    la, ha = tp2.executor.runner.forward(batch, return_hidden=True)
    lb, hb = tp1.executor.runner.forward(batch, return_hidden=True)
    assert (la - lb).abs().max() <= TOL and (ha - hb).abs().max() <= TOL
    assert torch.isfinite(la).all()

"""The attention-scores probe of a job: which rows of each chunk ask, and the sums so far.

Owns a job's ``ScoresSpec``s and what the steps returned for them. The scheduler asks it
for the ``ScoreQuery``s of each chunk it puts in a step (``queries``), and hands it the
filled queries when the step completes (``absorb``); a chunked prompt or a generation's
steps each see a longer context, so earlier results are padded with zeros (the KV entries
that did not exist yet received nothing) before they are summed or maxed. A preempted job
starts over (``reset``). The weights themselves: ``runtime.model.scores``.
"""

from __future__ import annotations

import numpy as np
import torch

from pie_ctx.proto.messages import AttentionScores, ScoresSpec
from runtime.model.batch import ScoreQuery

__all__ = ["ScoreProbe", "as_array"]


class ScoreProbe:
    """Attention scores asked by one job.

    Args:
        specs: what is asked (checked by ``pie_ctx.proto.checks.scores``).
        num_layers: the model's layers (``layers=None`` means all of them).
        generation: the specs name no queries: the rows that sample tokens are the queries.
    """

    def __init__(self, specs: list[ScoresSpec], num_layers: int, generation: bool) -> None:
        self.specs = specs
        self.generation = generation
        self._layers = [list(range(num_layers)) if s.layers is None else list(s.layers)
                        for s in specs]
        self._sums: list[torch.Tensor | None] = [None] * len(specs)
        self._pending: list[tuple[int, ScoreQuery]] = []

    def reset(self) -> None:
        """Forget every result (the job starts over)."""
        self._sums = [None] * len(self.specs)
        self._pending = []

    def queries(self, start: int, length: int, rows: list[int]) -> list[ScoreQuery] | None:
        """The queries of a chunk whose ``length`` new tokens are job indices ``start + j``;
        ``rows`` are the chunk's sampling rows (a generation's queries). None: none."""
        out = []
        for k, spec in enumerate(self.specs):
            if self.generation:
                asked = rows
            else:
                asked = [i - start for i in spec.queries if start <= i < start + length]
            if asked:
                q = ScoreQuery(rows=asked, layers=self._layers[k], reduce=spec.reduce,
                               heads=spec.heads, by_layer=spec.by_layer)
                self._pending.append((k, q))
                out.append(q)
        return out or None

    def absorb(self) -> None:
        """Fold the results of the step that just completed into the sums."""
        for k, q in self._pending:
            if q.out is None:
                continue
            have = self._sums[k]
            if have is None:
                self._sums[k] = q.out
                continue
            width = max(have.shape[-1], q.out.shape[-1])
            a, b = _pad(have, width), _pad(q.out, width)
            self._sums[k] = a + b if self.specs[k].reduce == "sum" else torch.maximum(a, b)
        self._pending = []

    def results(self, kv_len: int) -> list[AttentionScores]:
        """One answer per spec, over ``kv_len`` KV entries (zeros where nothing asked)."""
        out = []
        for k, spec in enumerate(self.specs):
            have = self._sums[k]
            if have is None:
                lead = ([len(self._layers[k])] if spec.by_layer else [])
                have = torch.zeros((*lead, kv_len))  # heads="all" with no row: no head axis
            arr = _pad(have, kv_len)[..., :kv_len].numpy().astype("<f4")
            out.append(AttentionScores(shape=list(arr.shape), data=arr.tobytes()))
        return out


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[-1] >= width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def as_array(scores: AttentionScores) -> np.ndarray:
    """An answer as a float32 array of its shape."""
    return np.frombuffer(scores.data, dtype="<f4").reshape(scores.shape)

"""``Forward``: one explicit forward pass with chosen inputs, positions, mask and outputs.

Owns: the description of one pass until ``execute()`` sends it. Pending tokens of the
context are flushed first, so the pass sees everything filled before it. Every argument is
checked as it is given, and the whole pass again (with the context's length) just before
it is sent, by the same contract checks the engine applies.

Mask convention: ``attention_mask(rows)`` takes one row per input token; row ``i`` has one
boolean per KV entry the token could see: the ``seq_len`` entries already in the context
followed by this pass's inputs, ``True`` = attend. A causal pass of 2 tokens on a context
of 3 is::

    [[T, T, T, T, F],
     [T, T, T, T, T]]

and an "attention sink" pass that lets the new token see only entry 0 and itself is
``[[T, F, F, T]]``. Without a mask a pass is causal. Pages written under a custom mask
are never shared with pages written causally (the mask is part of their page hash).

Usage::

    out = await (ctx.forward()
                 .input([t1, t2, t3])
                 .sample([2], Sampler.greedy())
                 .logprobs(2, [42, 7])
                 .defer_commit()
                 .execute())
    out.tokens, out.logprobs[0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pie_ctx.core import ContextCore
from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Forward", "ForwardOutput"]


@dataclass(slots=True)
class ForwardOutput:
    """Results of a pass, each list in the order it was requested."""

    tokens: list[int] = field(default_factory=list)  # one per sample() index
    logits: list[np.ndarray] = field(default_factory=list)  # float32 [vocab] per index
    distributions: list[tuple[list[int], list[float]]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # one per entropy() index, nats
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    hidden_states: list[np.ndarray] = field(default_factory=list)  # float32 [hidden] each
    # one float32 array per attention_scores() call: [layers]? [heads]? [seq_len + inputs]
    attention_scores: list[np.ndarray] = field(default_factory=list)
    report: P.PassReport | None = None
    state: P.ContextState | None = None


class Forward:
    """Builder of one pass; every method returns the builder."""

    def __init__(self, core: ContextCore) -> None:
        self._core = core
        self._tokens: list[int] | None = None
        self._positions: list[int] | None = None
        self._mask: list[list[bool]] | None = None
        self._sample: list[P.SampleSpec] = []
        self._logits: list[int] = []
        self._dists: list[P.DistributionSpec] = []
        self._logprobs: list[P.LogprobSpec] = []
        self._entropy: list[int] = []
        self._top_logprobs: list[P.TopLogprobSpec] = []
        self._hidden: list[int] = []
        self._scores: list[P.ScoresSpec] = []
        self._commit = True
        self._done = False

    def input(self, tokens: Sequence[int]) -> Forward:
        """Input tokens at consecutive positions from the context's ``next_position``."""
        return self._set_input(tokens, None)

    def input_at(self, tokens: Sequence[int], positions: Sequence[int]) -> Forward:
        """Input tokens at explicit positions (one per token; any order, repeats allowed)."""
        return self._set_input(tokens, positions)

    def _set_input(self, tokens: Sequence[int], positions: Sequence[int] | None) -> Forward:
        if self._tokens is not None:
            raise InvalidArgument("a pass has one input; build another pass for more tokens")
        info = self._core.rt.info
        toks = checks.token_ids(tokens, info.vocab_size, "input")
        if not toks:
            raise InvalidArgument("input needs at least one token")
        if positions is not None:
            positions = checks.positions(positions, len(toks), info.max_seq_len)
        self._tokens, self._positions = toks, positions
        return self

    def attention_mask(self, rows: Sequence[Sequence[bool]]) -> Forward:
        """Custom mask, one row per input token (see the module docstring); ``rows`` is a
        list of lists of bools, or a bool numpy array."""
        import numpy as np

        try:
            arr = np.asarray(rows)
        except ValueError:  # ragged rows: the shape check at execute() names the problem
            arr = None
        if arr is not None and arr.dtype != np.bool_:
            raise InvalidArgument(f"attention_mask takes booleans (True = attend), got "
                                  f"{arr.dtype} values")
        self._mask = arr.tolist() if arr is not None else [
            list(r) if isinstance(r, Sequence) else r for r in rows]
        return self

    def sample(self, indices: Sequence[int], sampler: P.SamplerSpec, *,
               logit_bias: dict[int, float] | None = None,
               allowed_tokens: Sequence[int] | None = None) -> Forward:
        """Sample a token after each of these input indices (with ``logit_bias`` added and
        the draw restricted to ``allowed_tokens``, when given)."""
        vocab = self._core.rt.info.vocab_size
        spec = dict(sampler=checks.sampler(sampler),
                    logit_bias=checks.logit_bias(logit_bias, vocab),
                    allowed_tokens=checks.allowed_tokens(
                        None if allowed_tokens is None else list(allowed_tokens), vocab))
        self._sample.extend(P.SampleSpec(index=_index(i), **spec) for i in indices)
        return self

    def entropy(self, indices: Sequence[int]) -> Forward:
        """The entropy (nats) of the next-token distribution after each of these indices."""
        self._entropy.extend(_index(i) for i in indices)
        return self

    def top_logprobs(self, indices: Sequence[int], k: int) -> Forward:
        """The ``k`` most likely next tokens and their log-probabilities after each index."""
        checks.positive(k, "k")
        self._top_logprobs.extend(P.TopLogprobSpec(index=_index(i), k=k) for i in indices)
        return self

    def hidden_states(self, indices: Sequence[int]) -> Forward:
        """The model's final-norm hidden state (the lm_head's input) at each index: for
        value heads or reward models of your own."""
        self._hidden.extend(_index(i) for i in indices)
        return self

    def attention_scores(self, queries: Sequence[int], *, layers: Sequence[int] | None = None,
                         reduce: str = "sum", heads: str = "mean",
                         by_layer: bool = False) -> Forward:
        """The attention weight each KV entry received from the input rows ``queries``:
        what H2O, SnapKV and your own memory policies rank tokens by (docs/compaction.md).

        One float32 array comes back in ``ForwardOutput.attention_scores`` per call, one
        value per KV entry the pass could see (the context's ``seq_len`` entries, then
        this pass's inputs), computed from the softmax the pass itself uses.

        Args:
            queries: indices into this pass's input.
            layers: which layers (default: all).
            reduce: ``"sum"`` or ``"max"`` over the query rows, and over the layers
                unless ``by_layer``.
            heads: ``"mean"`` over the query heads, or ``"all"`` (a leading ``[heads]``
                axis).
            by_layer: a leading ``[len(layers)]`` axis instead of combining the layers.
        """
        spec = P.ScoresSpec(queries=[_index(i) for i in queries],
                            layers=None if layers is None else list(layers), reduce=reduce,
                            heads=heads, by_layer=by_layer)
        checks.scores(spec, self._core.rt.info, 1 << 62)  # the indices again at execute()
        self._scores.append(spec)
        return self

    def logits(self, indices: Sequence[int]) -> Forward:
        """Return the raw logits after each of these input indices."""
        self._logits.extend(_index(i) for i in indices)
        return self

    def distribution(self, index: int, top_k: int = 20) -> Forward:
        """Return the ``top_k`` most likely next tokens and their probabilities."""
        checks.positive(top_k, "top_k")
        self._dists.append(P.DistributionSpec(index=_index(index), top_k=top_k))
        return self

    def logprobs(self, index: int, token_ids: Sequence[int]) -> Forward:
        """Return the log-probabilities of ``token_ids`` as the token after ``index``."""
        ids = checks.token_ids(token_ids, self._core.rt.info.vocab_size, "logprobs")
        self._logprobs.append(P.LogprobSpec(index=_index(index), token_ids=ids))
        return self

    def defer_commit(self) -> Forward:
        """Keep the written tokens in working pages (so they can be truncated losslessly)."""
        self._commit = False
        return self

    async def execute(self) -> ForwardOutput:
        """Flush pending tokens, run the pass, and return its outputs.

        Raises:
            InvalidArgument: no input, an index out of range, a mask of the wrong shape.
            OutOfPages / ContextTooLong: the pass cannot fit.
        """
        if self._done:
            raise InvalidArgument("this pass already ran; build a new one with ctx.forward()")
        if self._tokens is None:
            raise InvalidArgument("call input() or input_at() before execute()")
        self._done = True
        core = self._core

        async def body() -> ForwardOutput:
            fields: dict[str, Any] = {
                "tokens": self._tokens, "positions": self._positions, "mask": self._mask,
                "commit": self._commit, "sample": self._sample, "logits": self._logits,
                "distributions": self._dists, "logprobs": self._logprobs,
                "entropy": self._entropy, "top_logprobs": self._top_logprobs,
                "hidden": self._hidden, "attention_scores": self._scores,
            }
            # The engine's own check, here too and before anything is written (the pending
            # tokens included): the same error on every transport, and nothing changed.
            seq_len = core.state.seq_len + len(core.pending)
            checks.forward(P.Forward(ctx=0, **fields), core.rt.info, seq_len)
            await core.write_pending()
            reply = await core.request(P.Forward, **fields)
            core.set_state(reply.state)
            core.chat.synced = False  # the KV now holds tokens the conversation does not
            core.chat.note_raw()
            return ForwardOutput(
                tokens=list(reply.sampled),
                logits=[_floats(b) for b in reply.logits],
                distributions=[(d.token_ids, d.probs) for d in reply.distributions],
                logprobs=list(reply.logprobs), entropies=list(reply.entropy),
                top_logprobs=[list(zip(t.token_ids, t.logprobs, strict=True))
                              for t in reply.top_logprobs],
                hidden_states=[_floats(b) for b in reply.hidden],
                attention_scores=[scores_array(a) for a in reply.attention_scores],
                report=reply.report, state=reply.state,
            )

        try:
            return await core.run(body)
        except BaseException:
            self._done = False  # a failed pass changed nothing and may be retried
            raise


def _index(i: Any) -> int:
    if not checks.is_int(i) or i < 0:
        raise InvalidArgument(f"indices are non-negative ints into the pass's input, got {i!r}")
    return i


def scores_array(scores: P.AttentionScores) -> np.ndarray:
    """An ``AttentionScores`` reply as a float32 array of its shape."""
    return _floats(scores.data).reshape(scores.shape)


def _floats(raw: bytes) -> np.ndarray:
    import numpy as np

    return np.frombuffer(raw, dtype="<f4")

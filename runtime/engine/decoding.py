"""Programmable decoding in the engine: constraints, logit bias, allowed tokens, probes and
speculative verification, applied to the rows of a step.

Owns: the compiled-grammar cache (``Grammars``: llguidance, one template matcher per
``(kind, source)``, deep-copied per generation). The functions below run on the model
thread, inside ``StepExecutor.run``, over the logits of one step: every transformation is
vectorised over the rows that ask for it, so constrained, biased and plain rows share one
batch. Why llguidance: docs/decoding.md (measured with ``benchmarks/grammar_libs.py``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import ConstraintSpec, SamplerSpec, TopLogprobs
from runtime.engine.regex_classes import ascii_classes
from runtime.sampling import draw, sample_rows, top_k

__all__ = ["Grammars", "adjust", "probes", "verify", "JSON_STYLE"]

# Generated JSON is written on one line, like json.dumps: no free whitespace for a model to
# wander into, and the separators most models write after ',' and ':'.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Constraint compilation for one engine's tokenizer, cached.

    Args:
        tokenizer: the engine's ``Tokenizer`` (its ``backend.to_str()`` is what llguidance
            reads); anything else means constraints are unavailable.
        vocab_size: the model's vocabulary (masks have one bit per id).
        stop_token_ids: the ids that end a generation (allowed once a grammar is complete).
        capacity: how many compiled grammars to keep.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 capacity: int = 64) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stops = list(stop_token_ids)
        self._capacity = capacity
        self._lltok: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """True when constraints can be compiled for this tokenizer."""
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return hasattr(getattr(self._tokenizer, "backend", None), "to_str")

    def matcher(self, spec: ConstraintSpec) -> Any:
        """A fresh matcher for ``spec`` (blocking: compiles on a cache miss, which can take
        up to a second for a large grammar; call it from a worker thread).

        Raises:
            InvalidArgument: the constraint does not compile; the message says why.
        """
        key = (spec.kind, spec.source)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._compile(spec)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def _compile(self, spec: ConstraintSpec) -> Any:
        import llguidance

        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                    eos_token=self._stops)
        grammar = _grammar(spec)
        matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"the {spec.kind} constraint does not compile: "
                                  f"{matcher.get_error()}")
        return matcher


def _grammar(spec: ConstraintSpec) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.kind == "regex":  # \d \w \s as vLLM's backends read them (regex_classes)
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.source))
    if spec.kind == "json_schema":
        try:  # one line, with json.dumps's separators; a schema's "x-guidance" overrides it
            schema = _ascii_patterns(json.loads(spec.source))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except ValueError as err:
            raise InvalidArgument(f"the JSON schema is not valid: {err}") from None
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "gbnf":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.source))
        except Exception as err:  # the converter raises its own error types
            raise InvalidArgument(f"the EBNF grammar does not parse: {err}") from None
    options = json.loads(spec.source)  # "choice": one literal per option
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))


def _ascii_patterns(schema: Any) -> Any:
    """``schema`` with every ``pattern`` and ``patternProperties`` regex read through
    :func:`ascii_classes`, as a ``Regex`` constraint's is."""
    if isinstance(schema, list):
        return [_ascii_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _ascii_patterns(v) for k, v in schema.items()}
    if isinstance(schema.get("pattern"), str):
        out["pattern"] = ascii_classes(schema["pattern"])
    props = schema.get("patternProperties")
    if isinstance(props, dict):
        out["patternProperties"] = {ascii_classes(k): _ascii_patterns(v)
                                    for k, v in props.items()}
    return out


def adjust(logits: torch.Tensor, rows: Sequence[Any]) -> tuple[torch.Tensor, list[int]]:
    """The logits each row is sampled from: bias added, then everything not allowed (by
    ``allowed`` ids and by a constraint's matcher) set to ``-inf``.

    Args:
        logits: Tensor[n, V] fp32, the rows' raw logits (not modified).
        rows: n row requests (``logit_bias``, ``allowed``, ``matcher``; all optional).

    Returns:
        ``(adjusted, empty)``: Tensor[n, V], and the rows with no token left.
    """
    touched = [i for i, r in enumerate(rows) if r.logit_bias or r.allowed or r.matcher]
    if not touched:
        return logits, []
    out = logits.clone()
    vocab = logits.shape[1]
    for i in touched:
        r = rows[i]
        if r.logit_bias:
            ids = torch.tensor(list(r.logit_bias), dtype=torch.int64)
            out[i].index_add_(0, ids, torch.tensor(list(r.logit_bias.values()),
                                                   dtype=out.dtype))
        if r.allowed:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[torch.tensor(r.allowed, dtype=torch.int64)] = True
            out[i].masked_fill_(~keep, float("-inf"))
    # A constrained row masks itself; the first row of a speculative group also masks the
    # rows after it, each with the matcher advanced over the draft tokens before it.
    constrained = [i + j for i in touched if rows[i].matcher is not None
                   for j in range(len(rows[i].verify or ()) + 1)]
    if constrained:
        import llguidance.numpy

        words = llguidance.numpy.allocate_token_bitmask(len(constrained), vocab)  # [m, V/32]
        w = 0
        for i in touched:
            if rows[i].matcher is not None:
                w = _fill_masks(rows[i].matcher, rows[i].verify or [], words, w)
        # bit t of the mask (little-endian words) allows token t
        allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        index = torch.tensor(constrained, dtype=torch.int64)
        out[index] = out[index].masked_fill(torch.from_numpy(allowed == 0), float("-inf"))
        touched = sorted(set(touched) | set(constrained))
    empty = [i for i in touched if bool(torch.isneginf(out[i]).all())]
    return out, empty


def _fill_masks(matcher: Any, draft: Sequence[int], words: np.ndarray, w: int) -> int:
    """Fill ``len(draft) + 1`` mask rows from ``words[w]`` on: the matcher's mask now, then
    after each draft token. The matcher ends where it started. Returns the next free row.

    A draft token the matcher refuses ends the walk: the rows after it copy its mask (the
    verification rejects that token at its own row, so later rows are never read).
    """
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask(matcher, words, w)
    consumed = 0
    for j, token in enumerate(draft, start=1):
        if consumed == j - 1 and matcher.try_consume_tokens([token]) == 1:
            consumed += 1
            llguidance.numpy.fill_next_token_bitmask(matcher, words, w + j)
        else:
            words[w + j] = words[w + j - 1]
    if consumed:
        matcher.rollback(consumed)
    return w + len(draft) + 1


def probes(raw: torch.Tensor, k: int) -> tuple[list[TopLogprobs], list[float]]:
    """Per row of raw logits [n, V]: the k most likely tokens with their log-probabilities
    and the entropy (nats), both of the model's distribution at temperature 1."""
    lp = torch.log_softmax(raw.float(), dim=-1)  # [n, V]
    entropy = -(lp.exp() * lp.nan_to_num(neginf=0.0)).sum(dim=-1)  # [n]
    values, ids = top_k(lp, k)
    tops = [TopLogprobs(token_ids=i, logprobs=v) for i, v in zip(ids.tolist(), values.tolist(),
                                                                strict=True)]
    return tops, entropy.tolist()


def verify(adjusted: torch.Tensor, draft: Sequence[int], params: SamplerSpec,
           gen: torch.Generator | None, stops: frozenset[int]) -> tuple[int, int | None]:
    """Speculative verification of one group of rows: each row decoded as plain decoding
    decodes it, the draft kept up to the first token that differs.

    Row ``j`` of ``adjusted`` [k + 1, V] is the distribution after draft token ``j - 1``
    (row 0: after the prompt). Row ``j``'s token is what a plain decode step picks from it:
    greedy, its argmax; sampled, one filtered draw (``sample_rows``) at the generation's
    next uniform number. Draft token ``j`` is kept if it is that token, so it is kept with
    probability ``p_j(d_j)``, and the first one that is not is replaced by the row's own
    token, a draw from ``p_j`` without ``d_j``: speculative rejection sampling (Leviathan et
    al. 2023) for a draft that is one token (q = 1), the same distribution. If every draft
    token is kept, row ``k``'s token follows. A kept stop token ends the group there.

    One uniform number is used per token produced, as a plain step uses them, so the tokens
    are exactly plain decoding's for the same seed whatever the draft: speculation (and its
    length, whatever decides it) never changes a seeded generation's output.

    Returns:
        ``(accepted, token)``: how many draft tokens were kept, and the token produced after
        them (None if a kept stop token ended the group).
    """
    if params.is_greedy:
        tokens = adjusted.argmax(dim=-1).tolist()  # [k + 1]
    else:  # a draw a row, then the generator rewound to one number a token produced
        state = gen.get_state() if gen is not None else torch.get_rng_state()
        tokens = sample_rows(adjusted, [params] * adjusted.shape[0], [gen] * adjusted.shape[0])
    accepted, token = len(draft), tokens[len(draft)]
    for j, d in enumerate(draft):
        if d != tokens[j]:
            accepted, token = j, tokens[j]
            break
        if d in stops:
            accepted, token = j + 1, None
            break
    if not params.is_greedy:
        if gen is not None:
            gen.set_state(state)
        else:
            torch.set_rng_state(state)
        for _ in range(accepted + (token is not None)):
            draw(gen)
    return accepted, token

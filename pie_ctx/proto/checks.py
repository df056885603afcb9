"""One check per input kind, shared by the SDK (early) and the engine (authoritative).

The SDK calls these before a request leaves the process, so bad input fails the same way
on every transport (a socket would otherwise turn some of it into encoding or decoding
errors). The engine calls them once, at its boundary, for everything a request carries,
because a client may speak the protocol without the SDK. Layers below the engine trust
what they are given. Every function raises ``InvalidArgument`` with a message that says
what to pass instead, and returns the value normalised (plain ``int``/``list``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pie_ctx.proto import messages as M
from pie_ctx.proto.errors import ContextTooLong, InvalidArgument, MessageTooLarge

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "MAX_HOLD_PRIORITY",
    "MAX_HOLD_TTL",
    "MAX_NAME_CHARS",
    "hold_terms",
    "count",
    "positive",
    "token_ids",
    "positions",
    "indices",
    "snapshot_name",
    "channel_name",
    "message",
    "payload",
    "text",
    "stop",
    "mask",
    "finite",
    "is_int",
    "reply_bytes",
    "scores_bytes",
    "sampler",
    "logit_bias",
    "allowed_tokens",
    "top_logprobs_k",
    "constraint",
    "forward",
    "generate",
    "verify",
    "select",
    "keep",
    "keep_ranges",
    "scores",
]

MAX_NAME_CHARS = 256
MAX_DRAFT = 64  # the most tokens one step may draft (prompt lookup, forced tokens)
_INT64 = 2**63


def is_int(x: Any) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def count(value: Any, what: str) -> int:
    """A count ``>= 0`` (an int, not a bool)."""
    if not is_int(value) or not 0 <= value < _INT64:
        raise InvalidArgument(f"{what} must be an int >= 0, got {value!r}")
    return value


def positive(value: Any, what: str) -> int:
    """An int ``>= 1``."""
    if not is_int(value) or not 1 <= value < _INT64:
        raise InvalidArgument(f"{what} must be a positive int, got {value!r}")
    return value


def finite(value: Any, what: str) -> float:
    """A finite real number (int or float, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number, got {value!r}")
    return float(value)


MAX_HOLD_TTL = 86400.0  # a day: OpenAI's longest prompt_cache_retention ("24h")
"""The longest time to live a hold may ask for, in seconds (docs/pages.md, "Holds")."""
MAX_HOLD_PRIORITY = 100
"""The highest priority (of a hold, a context); pages of a higher-priority hold are evicted
later."""


def priority(value: Any, what: str = "priority") -> int:
    """A priority: an int in ``[0, MAX_HOLD_PRIORITY]``, higher first (a hold's pages are
    evicted later; a context is admitted first, preempted and suspended last)."""
    if not is_int(value) or not 0 <= value <= MAX_HOLD_PRIORITY:
        raise InvalidArgument(f"{what} is an int in [0, {MAX_HOLD_PRIORITY}] (higher goes "
                              f"first, is evicted later), got {value!r}")
    return value


def hold_terms(ttl: Any, priority: Any, num_tokens: Any) -> tuple[float, int, int | None]:
    """``retain``'s ``(ttl, priority, num_tokens)``: a finite ``0 < ttl <= MAX_HOLD_TTL``,
    an int priority in ``[0, MAX_HOLD_PRIORITY]``, and None or an int ``>= 0``."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) \
            or not 0 < ttl <= MAX_HOLD_TTL:
        raise InvalidArgument(f"retain: ttl is the seconds to keep the pages, a number in "
                              f"(0, {MAX_HOLD_TTL:g}], got {ttl!r}")
    priority = _priority(priority, "retain: priority")
    if num_tokens is not None:
        num_tokens = count(num_tokens, "retain: num_tokens")
    return float(ttl), priority, num_tokens


def _items(values: Any, what: str) -> list[Any]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise InvalidArgument(f"{what} must be a list of ints, got {type(values).__name__}")
    return list(values)


def token_ids(tokens: Any, vocab_size: int, what: str) -> list[int]:
    """A list copy of ``tokens`` after checking each is an int id in ``[0, vocab_size)``."""
    ids = _items(tokens, what)
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidArgument(f"{what}: token id {t!r} is not in [0, {vocab_size}) for this model")
    return ids


def positions(values: Any, num_tokens: int, max_seq_len: int) -> list[int]:
    """One rotary position per token, each in ``[0, max_seq_len)``."""
    out = _items(values, "positions")
    if len(out) != num_tokens:
        raise InvalidArgument(f"{len(out)} positions for {num_tokens} tokens; give one each")
    for p in out:
        if not is_int(p) or not 0 <= p < max_seq_len:
            raise InvalidArgument(f"position {p!r} is not in [0, {max_seq_len})")
    return out


def indices(values: Any, num_tokens: int, what: str) -> list[int]:
    """Indices into a pass's input tokens, each in ``[0, num_tokens)``."""
    out = _items(values, f"{what} indices")
    for i in out:
        if not is_int(i) or not 0 <= i < num_tokens:
            raise InvalidArgument(
                f"{what} index {i!r} is not in [0, {num_tokens}) (the pass's input tokens)")
    return out


def keep_ranges(keep: Any) -> list[int]:
    """``compact``'s ``keep`` as token indices: ints, ``range``s and ``(start, stop)``
    pairs (stop excluded), in order. Order and range are checked by ``keep``."""
    if isinstance(keep, range):
        return list(keep)
    if isinstance(keep, str | bytes) or not isinstance(keep, Iterable):
        raise InvalidArgument(f"compact: keep is a sorted list of token indices (or ranges), "
                              f"got {keep!r}")
    out: list[int] = []
    for item in keep:
        if isinstance(item, range):
            out.extend(item)
        elif isinstance(item, tuple) and len(item) == 2 and all(is_int(v) for v in item):
            out.extend(range(item[0], item[1]))
        elif not isinstance(item, bool | int) and hasattr(item, "__index__"):
            out.append(item.__index__())  # a numpy integer, say
        else:
            out.append(item)
    return out


def keep(values: Any, seq_len: int) -> list[int]:
    """``compact``'s token indices: non-empty, strictly increasing, in ``[0, seq_len)``."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise InvalidArgument(f"compact: keep is a sorted list of token indices, got {values!r}")
    out = list(values)
    if not out:
        raise InvalidArgument("compact: keep is empty; a context keeps at least one token "
                              "(release it to drop everything)")
    for i in out:
        if not is_int(i):
            raise InvalidArgument(f"compact: keep holds token indices (ints), got {i!r}")
    for a, b in zip(out, out[1:], strict=False):
        if b <= a:
            raise InvalidArgument(f"compact: keep must be strictly increasing (sorted, no "
                                  f"repeats); {b} follows {a}")
    if out[0] < 0 or out[-1] >= seq_len:
        bad = out[0] if out[0] < 0 else out[-1]
        raise InvalidArgument(f"compact: index {bad} is out of range; the context holds "
                              f"{seq_len} tokens (indices 0..{seq_len - 1})")
    return [int(i) for i in out]


SCORE_REDUCE = ("sum", "max")
SCORE_HEADS = ("mean", "all")


def scores(spec: Any, info: M.EngineInfo, num_tokens: int | None) -> M.ScoresSpec:
    """An attention-scores request: query indices into the pass's ``num_tokens`` inputs
    (None: a generation, which names no queries), layers of the model, known modes."""
    if not isinstance(spec, M.ScoresSpec):
        raise InvalidArgument(f"attention scores are asked with a ScoresSpec, got {spec!r}")
    if not info.score_layers:
        raise InvalidArgument(f"this engine cannot return attention scores (the {info.backend} "
                              "backend or tensor parallel); use the native backend on one "
                              "process")
    if num_tokens is None:
        if spec.queries:
            raise InvalidArgument("a generation's attention scores come from the rows that "
                                  "sample its tokens: give no queries")
    else:
        if not spec.queries:
            raise InvalidArgument("attention_scores: give at least one query index")
        indices(spec.queries, num_tokens, "attention_scores query")
    if spec.layers is not None:
        if not spec.layers:
            raise InvalidArgument("attention_scores: layers is None (all) or a non-empty list")
        for layer in _items(spec.layers, "attention_scores layers"):
            if not is_int(layer) or not 0 <= layer < info.score_layers:
                raise InvalidArgument(f"attention_scores layer {layer!r} is not in "
                                      f"[0, {info.score_layers})")
        if len(set(spec.layers)) != len(spec.layers):
            raise InvalidArgument("attention_scores: a layer is named twice")
    if spec.reduce not in SCORE_REDUCE:
        raise InvalidArgument(f"attention_scores reduce is one of {SCORE_REDUCE}, got "
                              f"{spec.reduce!r}")
    if spec.heads not in SCORE_HEADS:
        raise InvalidArgument(f"attention_scores heads is one of {SCORE_HEADS}, got "
                              f"{spec.heads!r}")
    if not isinstance(spec.by_layer, bool):
        raise InvalidArgument("attention_scores by_layer is a boolean")
    return spec


def snapshot_name(name: Any) -> str:
    """A snapshot name: a non-empty str of at most 256 characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"snapshot names are non-empty str of at most {MAX_NAME_CHARS} chars, got {name!r}")
    return name


def channel_name(name: Any, what: str) -> str:
    """A channel or topic name: a non-empty str of at most 256 characters, none of them a
    control character (names show up in logs and URLs)."""
    if (not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS
            or any(c < " " or "\x7f" <= c <= "\x9f" for c in name)):
        raise InvalidArgument(
            f"{what} names are non-empty str of at most {MAX_NAME_CHARS} chars without control "
            f"characters, got {name!r:.80}")
    return text(name, what)


def _message_size(num_bytes: int, limit: int) -> None:
    if num_bytes > limit:
        raise MessageTooLarge(
            f"the message is {num_bytes} bytes, over the engine's limit of {limit} "
            "(rt.info.max_message_bytes): split it, or keep the bulk elsewhere (a snapshot, "
            "a file) and send its name")


def message(value: Any, limit: int) -> tuple[bytes, bool]:
    """A channel message (the SDK's side): a str (sent as UTF-8) or bytes of at most
    ``limit`` bytes.

    Returns:
        ``(payload, text)``: the bytes to send and whether they are text.
    """
    if isinstance(value, str):
        data = text(value, "a message").encode("utf-8")
        _message_size(len(data), limit)
        return data, True
    if isinstance(value, bytes):
        _message_size(len(value), limit)
        return value, False
    raise InvalidArgument(
        f"a message is a str or bytes, got {type(value).__name__}; encode other data first "
        "(e.g. json.dumps)")


def payload(data: Any, is_text: Any, limit: int) -> None:
    """A channel message as the engine receives it: ``data`` bytes of at most ``limit``,
    valid UTF-8 when ``is_text``."""
    if not isinstance(data, bytes) or not isinstance(is_text, bool):
        raise InvalidArgument("a message's payload must be bytes and its text flag a bool")
    _message_size(len(data), limit)
    if is_text:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidArgument(f"a text message must be UTF-8; byte {err.start} is not "
                                  "(send bytes instead)") from None


def text(value: Any, what: str) -> str:
    """A str that a tokenizer can encode (valid Unicode: no lone surrogates)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} takes a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgument(
            f"{what}: the text holds a lone surrogate at index {err.start}; pass valid "
            "Unicode (e.g. decode bytes with errors='replace')") from None
    return value


def stop(value: Any, vocab_size: int) -> tuple[list[int], list[str]]:
    """Stop conditions: None, one str, one token id, or a list of ids and non-empty strs.

    Returns:
        ``(token_ids, strings)``.
    """
    if value is None:
        return [], []
    items = [value] if isinstance(value, str) or is_int(value) else _items(value, "stop")
    ids = [s for s in items if not isinstance(s, str)]
    strings = [text(s, "stop") for s in items if isinstance(s, str)]
    if any(not s for s in strings):
        raise InvalidArgument("stop strings must be non-empty")
    return token_ids(ids, vocab_size, "stop"), strings


def mask(rows: Any, seq_len: int, num_tokens: int, max_entries: int) -> np.ndarray:
    """A custom attention mask: ``num_tokens`` rows of ``seq_len + num_tokens`` booleans,
    each row attending to at least one entry (an all-False row has no defined output).

    Returns:
        The mask as a bool array ``[num_tokens, seq_len + num_tokens]``.

    Raises:
        InvalidArgument: wrong shape or types, an empty row, or more than ``max_entries``.
    """
    import numpy as np

    width = seq_len + num_tokens
    if num_tokens * width > max_entries:
        raise InvalidArgument(
            f"attention_mask of {num_tokens} x {width} entries exceeds the engine's limit of "
            f"{max_entries}; split the pass")
    shape = (num_tokens, width)
    try:
        arr = np.asarray(rows)
    except ValueError:  # ragged rows
        arr = None
    if arr is None or arr.shape != shape:
        raise InvalidArgument(
            f"attention_mask needs {num_tokens} rows (one per new token) of {width} booleans "
            f"(every KV entry: the context's {seq_len} plus the {num_tokens} new ones)")
    if arr.dtype != np.bool_:
        raise InvalidArgument(f"attention_mask holds {arr.dtype} values; give booleans")
    empty = np.flatnonzero(~arr.any(axis=1))
    if empty.size:
        raise InvalidArgument(
            f"attention_mask row {int(empty[0])} attends to nothing; every token must see at "
            "least one entry (e.g. itself)")
    return arr


CONSTRAINT_KINDS = ("regex", "json_schema", "lark", "gbnf", "choice")


def reply_bytes(req: M.Forward, info: M.EngineInfo, seq_len: int) -> int:
    """An upper bound on the size of a ``Forward``'s reply, encoded (``seq_len``: the
    context's length before the pass)."""
    n = 256 + 9 * len(req.sample) + (4 * info.vocab_size + 8) * len(req.logits)
    n += sum(18 * d.top_k + 16 for d in req.distributions)
    n += sum(9 * len(lp.token_ids) + 8 for lp in req.logprobs)
    n += sum(18 * t.k + 16 for t in req.top_logprobs) + 9 * len(req.entropy)
    n += (4 * info.hidden_size + 8) * len(req.hidden)
    entries = seq_len + len(req.tokens)
    n += sum(scores_bytes(spec, info, entries) for spec in req.attention_scores)
    return n


def scores_bytes(spec: M.ScoresSpec, info: M.EngineInfo, entries: int) -> int:
    """An upper bound on one ``AttentionScores``' size over ``entries`` KV entries."""
    rows = len(spec.layers or range(info.score_layers)) if spec.by_layer else 1
    if spec.heads == "all":
        rows *= max(info.score_heads, 1)
    return 32 + 4 * rows * entries


def sampler(value: Any) -> M.SamplerSpec:
    """A ``SamplerSpec`` (it checked its own fields when it was built)."""
    if not isinstance(value, M.SamplerSpec):
        raise InvalidArgument(f"a sampler must be a SamplerSpec (from Sampler.*), got {value!r}")
    return value


def logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    """None, or ``{token id: finite additive bias}``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(f"logit_bias must be a dict of token id -> bias, got "
                              f"{type(value).__name__}")
    token_ids(list(value), vocab_size, "logit_bias")
    return {t: finite(b, f"logit_bias[{t}]") for t, b in value.items()}


def allowed_tokens(value: Any, vocab_size: int) -> list[int] | None:
    """None, or a non-empty list of token ids the draw is restricted to."""
    if value is None:
        return None
    ids = token_ids(value, vocab_size, "allowed_tokens")
    if not ids:
        raise InvalidArgument("allowed_tokens must name at least one token (or be None)")
    return ids


def top_logprobs_k(value: Any, limit: int) -> int:
    """How many top log-probabilities per token: 0 (none) to ``limit``."""
    if not is_int(value) or not 0 <= value <= limit:
        raise InvalidArgument(f"top_logprobs must be an int in [0, {limit}], got {value!r}")
    return value


def constraint(value: Any) -> M.ConstraintSpec | None:
    """None, or a ``ConstraintSpec`` of a known kind (its source compiles in the engine)."""
    if value is None:
        return None
    if not isinstance(value, M.ConstraintSpec):
        raise InvalidArgument("constrain= takes Regex(...), JsonSchema(...), AnyJson(), "
                              f"Grammar(...) or Choice(...) from pie_ctx.constrain, got {value!r}")
    if value.kind not in CONSTRAINT_KINDS or not isinstance(value.source, str):
        raise InvalidArgument(f"unknown constraint kind {value.kind!r}; one of "
                              f"{', '.join(CONSTRAINT_KINDS)}")
    return value


def forward(req: M.Forward, info: M.EngineInfo, seq_len: int) -> np.ndarray | None:
    """Everything about a ``Forward`` that does not depend on the pool's state right now.

    Args:
        req: the request.
        info: the engine's facts and limits.
        seq_len: the context's length before the pass.

    Returns:
        The custom mask as a bool array, or None.

    Raises:
        InvalidArgument: any field is malformed or out of range (the message says which).
        ContextTooLong: the pass would run past the model's maximum length.
    """
    n = len(token_ids(req.tokens, info.vocab_size, "forward input"))
    if n == 0:
        raise InvalidArgument("forward: give at least one input token")
    if seq_len + n > info.max_seq_len:
        raise ContextTooLong(
            f"{seq_len} tokens in the context + {n} new exceed the model's {info.max_seq_len}; "
            "truncate, or start a new context")
    if req.positions is not None:
        positions(req.positions, n, info.max_seq_len)
    for s in req.sample:
        indices([s.index], n, "sample")
        sampler(s.sampler)
        logit_bias(s.logit_bias, info.vocab_size)
        allowed_tokens(s.allowed_tokens, info.vocab_size)
    indices(req.logits, n, "logits")
    indices(req.entropy, n, "entropy")
    indices(req.hidden, n, "hidden_states")
    for spec in req.attention_scores:
        scores(spec, info, n)
    for t in req.top_logprobs:
        indices([t.index], n, "top_logprobs")
        if not is_int(t.k) or not 1 <= t.k <= info.vocab_size:
            raise InvalidArgument(f"top_logprobs k must be in [1, {info.vocab_size}], got {t.k!r}")
    for d in req.distributions:
        indices([d.index], n, "distribution")
        if not is_int(d.top_k) or not 1 <= d.top_k <= info.vocab_size:
            raise InvalidArgument(f"distribution top_k must be in [1, {info.vocab_size}], got {d.top_k!r}")
    for lp in req.logprobs:
        indices([lp.index], n, "logprobs")
        token_ids(lp.token_ids, info.vocab_size, "logprobs")
    if not isinstance(req.commit, bool) or not isinstance(req.reuse_prefix, bool):
        raise InvalidArgument("commit and reuse_prefix are booleans")
    size = reply_bytes(req, info, seq_len)
    if size > info.max_reply_bytes:
        raise InvalidArgument(
            f"this pass asks for a reply of about {size} bytes, over the engine's limit of "
            f"{info.max_reply_bytes}: ask for fewer logits rows (distribution() or logprobs() "
            "return much less) or attention scores with fewer rows (heads=\"mean\", "
            "by_layer=False), or split it into several passes")
    return None if req.mask is None else mask(req.mask, seq_len, n, info.max_mask_entries)


def generate(req: M.Generate, info: M.EngineInfo, seq_len: int) -> None:
    """Everything about a ``Generate`` that does not depend on the pool's state right now.

    Raises:
        InvalidArgument: any field is malformed or out of range.
        ContextTooLong: prompt + ``max_tokens`` would run past the model's maximum length.
    """
    n = len(token_ids(req.tokens, info.vocab_size, "generate prompt"))
    positive(req.max_tokens, "max_tokens")
    sampler(req.sampler)
    logit_bias(req.logit_bias, info.vocab_size)
    allowed_tokens(req.allowed_tokens, info.vocab_size)
    top_logprobs_k(req.top_logprobs, info.max_top_logprobs)
    count(req.min_tokens, "min_tokens")
    for flag in ("jump_forward", "stream"):
        if not isinstance(getattr(req, flag), bool):
            raise InvalidArgument(f"{flag} must be a bool, got {getattr(req, flag)!r}")
    if not is_int(req.prompt_lookup) or not 0 <= req.prompt_lookup <= MAX_DRAFT:
        raise InvalidArgument(f"prompt_lookup must be an int in [0, {MAX_DRAFT}] (the most "
                              f"tokens drafted per step), got {req.prompt_lookup!r}")
    if constraint(req.constraint) is not None and not info.can_constrain:
        raise InvalidArgument("this engine cannot compile constraints (its tokenizer is not "
                              "a Hugging Face tokenizer.json)")
    if req.stop_token_ids is not None:
        token_ids(req.stop_token_ids, info.vocab_size, "stop")
    if req.attention_scores is not None:
        scores(req.attention_scores, info, None)
        size = scores_bytes(req.attention_scores, info, seq_len + n + req.max_tokens)
        if size > info.max_reply_bytes:
            raise InvalidArgument(
                f"these attention scores may come to {size} bytes, over the engine's limit "
                f"of {info.max_reply_bytes}: ask for fewer rows (heads=\"mean\", "
                "by_layer=False, fewer layers) or lower max_tokens")
        if req.prompt_lookup:
            raise InvalidArgument("attention_scores and prompt_lookup do not go together: a "
                                  "speculative step's drafted rows would go unscored")
    strings = _items(req.stop_strings, "stop strings")
    if any(not isinstance(x, str) or not x for x in strings):
        raise InvalidArgument("stop strings must be non-empty str")
    for x in strings:
        text(x, "stop")
    if seq_len + n + req.max_tokens > info.max_seq_len:
        raise ContextTooLong(
            f"{seq_len} + {n} prompt + max_tokens {req.max_tokens} exceed the model's "
            f"{info.max_seq_len} tokens; lower max_tokens")


def verify(req: M.Verify, info: M.EngineInfo, seq_len: int) -> None:
    """Everything about a ``Verify`` round that does not depend on the pool right now.

    Raises:
        InvalidArgument: a malformed field. ContextTooLong: no room for the round.
    """
    n = len(token_ids(req.tokens, info.vocab_size, "verify tokens"))
    if not is_int(req.num_draft) or not 0 <= req.num_draft <= n:
        raise InvalidArgument(f"num_draft must be in [0, {n}], got {req.num_draft!r}")
    sampler(req.sampler)
    token_ids(req.stop_token_ids, info.vocab_size, "stop")
    logit_bias(req.logit_bias, info.vocab_size)
    allowed_tokens(req.allowed_tokens, info.vocab_size)
    top_logprobs_k(req.top_logprobs, info.max_top_logprobs)
    if seq_len + n + 1 > info.max_seq_len:
        raise ContextTooLong(f"{seq_len} tokens in the context + {n} new + 1 exceed the "
                             f"model's {info.max_seq_len}; stop generating or truncate")


def select(req: M.Select, info: M.EngineInfo, seq_len: int) -> int:
    """A ``Select``'s options; returns the number of tokens its one pass writes.

    Raises:
        InvalidArgument: no options, an empty option, a bad token id, too large a pass.
        ContextTooLong: an option would run past the model's maximum length.
    """
    options = _items(req.options, "options")
    if not options:
        raise InvalidArgument("select needs at least one option")
    for i, option in enumerate(options):
        if not token_ids(option, info.vocab_size, f"option {i}"):
            raise InvalidArgument(f"option {i} is empty; every option needs a token")
    longest = max(len(o) for o in options)
    if seq_len + longest > info.max_seq_len:
        raise ContextTooLong(f"an option of {longest} tokens after {seq_len} exceeds the "
                             f"model's {info.max_seq_len}")
    if not isinstance(req.unconditional, bool):
        raise InvalidArgument("unconditional is a bool")
    n = sum(len(o) for o in options) * (2 if req.unconditional else 1)
    if n * (seq_len + n) > info.max_mask_entries:
        raise InvalidArgument(f"these options need a pass of {n} tokens over {seq_len}, over "
                              "the engine's mask limit; score fewer or shorter options at once")
    return n


_priority = priority  # (``hold_terms`` has a parameter of that name)

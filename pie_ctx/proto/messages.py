"""Plain-data messages between the SDK and the runtime.

The same msgspec Structs travel in-process (passed as objects to ``Engine.handle``) and over
a socket (MessagePack frames, see ``pie_ctx.proto.wire``). Part of the torch-free contract.

Requests are a tagged union (``Request``); each request has exactly one reply type, or an
``ErrorReply`` carrying the typed error's class name and message. ``Generate`` is the one
streaming request: it yields ``GenerateChunk`` messages and ends with ``GenerateDone``.
The channel requests (``ChannelSend`` ... ``SettleMessage``) carry messages between
inferlets through the engine (docs/messages.md).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from pie_ctx.proto.errors import InvalidArgument, PieError, error_from_name, known_name

PROTOCOL_VERSION = 2


class SamplerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick a token from a row of logits.

    ``temperature == 0`` means greedy (the other fields are ignored). Filters apply in the
    order temperature, top-k, top-p, min-p. ``seed`` makes sampling reproducible and
    independent of whatever else shares the batch.

    A value can only exist if it is valid: construction (and decoding from the wire)
    checks every field, so neither side checks a sampler again.

    Raises:
        InvalidArgument: a field is out of range or of the wrong type.
    """

    temperature: float = 0.0  # >= 0; 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = no limit
    top_p: float = 1.0  # in (0, 1]: keep the smallest set holding this much probability
    min_p: float = 0.0  # in [0, 1): drop tokens below min_p times the top probability
    seed: int | None = None  # in [0, 2**63): reproducible sampling; None = not seeded

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an int >= 0 (0 = no limit), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < 1:
            raise InvalidArgument(f"min_p must be in [0, 1), got {m!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed < 2**63):
            raise InvalidArgument(f"seed must be an int in [0, 2**63) or None, got {seed!r}")

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature == 0``: the most likely token is taken."""
        return self.temperature == 0


class ContextState(msgspec.Struct, frozen=True, kw_only=True):
    """A context's counters, sent with every reply that may have changed them."""

    seq_len: int  # tokens in the KV cache (committed pages, then the working tail)
    page_size: int  # tokens per page
    num_committed_pages: int  # full, immutable pages (shared with every same prefix)
    num_working_pages: int  # private pages: the partly written tail and pages reserved ahead
    num_working_tokens: int  # tokens written in working pages
    next_position: int  # position the next token gets by default


class PassReport(msgspec.Struct, kw_only=True):
    """What a flush, forward pass, generation or snapshot open did: tokens written, and
    pages reused (found in memory or loaded from disk) vs computed.

    ``pages_reused`` counts both kinds of reuse; ``pages_from_disk`` is the part of it read
    from the snapshot directory, ``pages_from_memory`` the rest. A pass counts full pages
    only (a partly written page is neither shared nor committed). A snapshot open
    (``Context.open_report``) counts every page of the snapshot, the partly filled tail
    page included: a snapshot of 66 full pages and a tail reopens as 67 pages reused,
    though the snapshot directory holds 66 page files for it (the tail's bytes are in the
    snapshot's manifest). The engine's counters (``await rt.stats()``) are the sums of these
    reports, passes and opens alike.
    """

    tokens_written: int = 0  # tokens written into the KV cache, reused or computed
    tokens_computed: int = 0  # tokens run through the model
    pages_reused: int = 0  # pages attached without computing: from memory or from disk
    pages_computed: int = 0  # full pages the model computed and committed
    pages_from_disk: int = 0  # of pages_reused: those read from the snapshot directory
    num_steps: int = 0  # model calls this pass took part in (a generation: one per step)
    # pages of the context brought back before this pass, having been suspended (not part
    # of tokens_written; docs/pages.md, "Suspend and resume"), and of them, those from disk
    pages_resumed: int = 0
    pages_resumed_from_disk: int = 0

    @property
    def pages_from_memory(self) -> int:
        """Pages reused that were already in the pool (``pages_reused - pages_from_disk``)."""
        return self.pages_reused - self.pages_from_disk


# ----------------------------------------------------------------------------- requests


class _Request(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    pass


class CreateContext(_Request):
    adapter: str = ""  # the LoRA adapter its tokens run through ("" = the base model)
    # admitted first, preempted, suspended and evicted last: higher first, [0, 100]
    # (None: the client's default, 0 unless a server's key sets one; docs/scheduling.md)
    priority: int | None = None


class LoadAdapter(_Request):
    """Load a PEFT LoRA folder as adapter ``name`` (reply: the new ``EngineInfo``)."""

    name: str
    path: str


class UnloadAdapter(_Request):
    """Stop serving adapter ``name``; fails while contexts use it (reply: ``EngineInfo``)."""

    name: str


class ForkContext(_Request):
    ctx: int


class ReleaseContext(_Request):
    ctx: int


class GetState(_Request):
    ctx: int


class ReservePages(_Request):
    ctx: int
    num_pages: int


class CommitPages(_Request):
    ctx: int
    num_pages: int


class ReleasePages(_Request):
    ctx: int
    num_pages: int


class TruncateTokens(_Request):
    ctx: int
    num_tokens: int


class Compact(_Request):
    """Keep only the tokens at indices ``keep`` of the context's KV cache (strictly
    increasing, in ``[0, seq_len)``); their K/V keep the positions they were computed at
    (docs/compaction.md). Reply: ``StateReply``."""

    ctx: int
    keep: list[int]


class Retain(_Request):
    """Hold the context's committed pages (those of its first ``num_tokens`` tokens, if
    given) for ``ttl`` seconds at ``priority`` (docs/pages.md, "Holds"). Reply:
    ``HoldReply``."""

    ctx: int
    ttl: float
    priority: int = 0
    num_tokens: int | None = None


class Suspend(_Request):
    """Take the context's pages out of the pool until its next use, which brings them back
    without recomputing (docs/pages.md, "Suspend and resume"). ``lazy``: only say it is
    idle; the engine suspends it when it needs the room. ``back_in``: the program's
    estimate of the seconds until its next use (the engine suspends first the contexts
    expected back furthest off). Reply: ``SuspendReply``."""

    ctx: int
    lazy: bool = False
    back_in: float | None = None


class ReleaseHold(_Request):
    """End a hold now. Reply: ``Ok``."""

    hold: int


class SaveSnapshot(_Request):
    ctx: int
    name: str
    meta: str = ""  # opaque to the engine; the SDK keeps the conversation here


class OpenSnapshot(_Request):
    name: str


class TakeSnapshot(_Request):
    name: str


class DeleteSnapshot(_Request):
    name: str


class ListSnapshots(_Request):
    pass


class SampleSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Sample a token after input ``index``; ``logit_bias`` is added to the logits and
    ``allowed_tokens`` (when given) restricts the draw to those ids."""

    index: int
    sampler: SamplerSpec
    logit_bias: dict[int, float] | None = None
    allowed_tokens: list[int] | None = None


class TopLogprobSpec(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    k: int


class ConstraintSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on generated text, compiled by the engine's grammar library.

    ``kind`` is ``"regex"``, ``"json_schema"`` (``source`` is the schema as JSON text),
    ``"lark"``, ``"gbnf"`` (a grammar) or ``"choice"`` (``source`` is a JSON list of
    strings). Built by the classes of ``pie_ctx.constrain``.
    """

    kind: str
    source: str


class DistributionSpec(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    top_k: int


class LogprobSpec(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    token_ids: list[int]


class ScoresSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Attention scores wanted from a pass (docs/compaction.md): for the query rows
    ``queries`` (indices into the pass's input; a generation uses the rows that sample
    its tokens), the softmax weight each KV entry received, per head, in the layers
    ``layers`` (None: all). ``heads`` is ``"mean"`` (averaged over query heads) or
    ``"all"`` (one row per query head); ``reduce`` (``"sum"`` or ``"max"``) combines the
    query rows, and the layers unless ``by_layer`` keeps one row per layer."""

    queries: list[int] = []
    layers: list[int] | None = None
    reduce: str = "sum"
    heads: str = "mean"
    by_layer: bool = False


class Forward(_Request):
    """Write ``tokens`` into the context and probe the outputs at some of their indices.

    ``positions`` defaults to consecutive positions from the context's ``next_position``.
    ``mask`` (optional) has one row per token, each of length ``seq_len + len(tokens)``
    (every KV entry the token could see, including the new ones); True = attend.
    ``commit`` commits every full working page afterwards; ``reuse_prefix`` lets the engine
    attach already-computed pages instead of computing them (causal, default positions only).
    """

    ctx: int
    tokens: list[int]
    positions: list[int] | None = None
    mask: list[list[bool]] | None = None
    commit: bool = True
    reuse_prefix: bool = False
    sample: list[SampleSpec] = []
    logits: list[int] = []
    distributions: list[DistributionSpec] = []
    logprobs: list[LogprobSpec] = []
    entropy: list[int] = []  # indices whose next-token distribution's entropy is wanted
    top_logprobs: list[TopLogprobSpec] = []
    hidden: list[int] = []  # indices whose final-norm hidden state is wanted
    attention_scores: list[ScoresSpec] = []  # one AttentionScores per spec in the reply


class Generate(_Request):
    """Write ``tokens`` (the prompt not yet in KV), then decode until a stop condition.

    The last token sampled is *not* written to the KV cache (nothing has read it yet); it
    comes back in ``GenerateDone.pending`` for the caller to write with its next pass.
    ``stop_token_ids=None`` means the model's end-of-turn tokens.
    """

    ctx: int
    tokens: list[int]
    sampler: SamplerSpec = SamplerSpec()
    max_tokens: int = 256
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] = []
    constraint: ConstraintSpec | None = None
    logit_bias: dict[int, float] | None = None
    allowed_tokens: list[int] | None = None
    top_logprobs: int = 0  # per generated token: the k most likely tokens and the entropy
    min_tokens: int = 0  # stop tokens are masked until this many tokens were generated
    jump_forward: bool = True  # append the tokens a constraint forces in one pass
    prompt_lookup: int = 0  # draft up to this many tokens per step from the context itself
    # summed (or maxed) over the rows that sample the generation's tokens: GenerateDone
    attention_scores: ScoresSpec | None = None
    # False: no GenerateChunk per token; one chunk with everything, then GenerateDone (a
    # caller that collects the whole text saves a message, and a wake-up, per token)
    stream: bool = True


class Verify(_Request):
    """One round of a generation the client drives (speculation, client-side constraints).

    Writes ``tokens`` (pending tokens, then ``draft``) without committing, verifies the
    draft by speculative rejection sampling under ``sampler`` (exact for every sampler,
    greedy included), drops the rejected draft tokens, and samples one more token after
    the last accepted one (it is not written: it is the new pending token). With no
    ``tokens`` at all the round samples from the logits of the context's last token. An
    accepted draft token in ``stop_token_ids`` ends the round there (no new token).
    """

    ctx: int
    tokens: list[int]
    num_draft: int = 0  # the last num_draft of ``tokens`` are the draft
    sampler: SamplerSpec = SamplerSpec()
    stop_token_ids: list[int] = []
    logit_bias: dict[int, float] | None = None
    allowed_tokens: list[int] | None = None
    top_logprobs: int = 0


class Select(_Request):
    """Score continuations of the context: every option's token log-probabilities (and,
    with ``unconditional``, the same tokens' log-probabilities with no context before
    them), in one pass that leaves the context unchanged."""

    ctx: int
    options: list[list[int]]
    unconditional: bool = False


class GetTokens(_Request):
    """The token ids in a context's KV cache (committed and working)."""

    ctx: int


class Tokenize(_Request):
    text: str


class GetInfo(_Request):
    pass


class GetStats(_Request):
    pass


# Channels between inferlets (docs/messages.md). A message is ``payload`` bytes; ``text``
# says they are UTF-8 text, so the receiver gets back a str. A receive takes a message
# under a *lease* (a positive id the client picks, unique among its unsettled ones): the
# engine keeps it until ``SettleMessage`` says whether the client handed it on, and gives
# it back to the front of its queue if not, or if the client leaves first.


class ChannelSend(_Request):
    """Put a message at the back of a queue; waits while the queue is full."""

    channel: str
    payload: bytes
    text: bool = False


class ChannelReceive(_Request):
    """Take the message at the front of a queue, waiting for one (reply: ``ChannelMessage``)."""

    channel: str
    lease: int


class Broadcast(_Request):
    """Give a message to every present subscription of a topic (never waits)."""

    topic: str
    payload: bytes
    text: bool = False


class Subscribe(_Request):
    """Start a subscription to a topic: from now on it gets every broadcast."""

    topic: str


class SubscriptionReceive(_Request):
    """Take the oldest message of a subscription, waiting for one (reply: ``ChannelMessage``)."""

    sub: int
    lease: int


class Unsubscribe(_Request):
    sub: int


class SettleMessage(_Request):
    """End a lease: ``delivered`` drops the message for good; otherwise it goes back to the
    front of its queue or subscription. An unknown lease is ignored (settling is idempotent)."""

    lease: int
    delivered: bool


# Hosted inferlets (docs/inferlets.md): launched by name from the server's inferlet folder,
# never uploaded. A launch's handle ``id`` is valid for the owner that spawned it.


class SpawnInferlet(_Request):
    """Launch the inferlet ``name`` of the engine's folder with ``argv`` (reply:
    ``InferletStarted``); it runs in the engine's process as an owner of its own."""

    name: str
    argv: list[str] = []


class InferletNext(_Request):
    """Wait for what a launch has said past ``cursor`` texts, or for its end (reply:
    ``InferletEvent``; the end of a launch that failed is its ``ErrorReply``)."""

    id: int
    cursor: int = 0


class CancelInferlet(_Request):
    """Cancel a launch (its contexts are released); idempotent."""

    id: int


# The store of small values shared by inferlets (docs/inferlets.md), namespaced like
# snapshots.


class StoreGet(_Request):
    key: str


class StoreSet(_Request):
    key: str
    payload: bytes
    text: bool = False


class StoreDelete(_Request):
    key: str


class StoreKeys(_Request):
    prefix: str = ""


Request = (
    CreateContext
    | ForkContext
    | LoadAdapter
    | UnloadAdapter
    | ReleaseContext
    | GetState
    | ReservePages
    | CommitPages
    | ReleasePages
    | TruncateTokens
    | Compact
    | Retain
    | Suspend
    | ReleaseHold
    | SaveSnapshot
    | OpenSnapshot
    | TakeSnapshot
    | DeleteSnapshot
    | ListSnapshots
    | Forward
    | Generate
    | Verify
    | Select
    | GetTokens
    | Tokenize
    | GetInfo
    | GetStats
    | ChannelSend
    | ChannelReceive
    | Broadcast
    | Subscribe
    | SubscriptionReceive
    | Unsubscribe
    | SettleMessage
    | SpawnInferlet
    | InferletNext
    | CancelInferlet
    | StoreGet
    | StoreSet
    | StoreDelete
    | StoreKeys
)

# ------------------------------------------------------------------------------ replies


class _Reply(msgspec.Struct, tag=True, kw_only=True):
    pass


class Ok(_Reply):
    pass


class ContextReply(_Reply):
    ctx: int
    state: ContextState
    meta: str = ""  # a snapshot's meta, when opened from one
    report: PassReport | None = None  # when opened from a snapshot: where its pages came from


class StateReply(_Reply):
    state: ContextState
    ok: bool = True  # False = back-pressure (e.g. not enough pages to reserve right now)


class HoldReply(_Reply):
    """A hold taken: its id (for ``ReleaseHold``), the pages it covers, its terms."""

    hold: int
    num_pages: int
    ttl: float
    priority: int


class SuspendReply(_Reply):
    """A context suspended (or, ``lazy``, marked idle): the pages it held in the pool."""

    suspended: bool
    num_pages: int


class SnapshotList(_Reply):
    names: list[str]


class Distribution(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    probs: list[float]


class TopLogprobs(msgspec.Struct, kw_only=True):
    """The k most likely next tokens (most likely first) and their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]


class AttentionScores(msgspec.Struct, kw_only=True):
    """One ``ScoresSpec``'s answer: float32 little-endian values of shape ``shape``
    (``[layers]`` if by_layer, ``[heads]`` if heads="all", then one value per KV entry of
    the context, in KV order)."""

    shape: list[int]
    data: bytes


class ForwardReply(_Reply):
    state: ContextState
    report: PassReport
    sampled: list[int] = []
    logits: list[bytes] = []  # float32 little-endian rows of vocab_size values
    distributions: list[Distribution] = []
    logprobs: list[list[float]] = []
    entropy: list[float] = []
    top_logprobs: list[TopLogprobs] = []
    hidden: list[bytes] = []  # float32 little-endian rows of hidden_size values
    attention_scores: list[AttentionScores] = []


class GenerateChunk(_Reply):
    tokens: list[int]
    text: str
    logprobs: list[float] = []  # the model's log-probability of each token (temperature 1)
    top_logprobs: list[TopLogprobs] = []  # one per token, when asked for
    entropy: list[float] = []  # one per token, when top_logprobs was asked for


class VerifyReply(_Reply):
    """A round's result: ``accepted`` draft tokens stayed, then ``token`` (None when an
    accepted draft token was a stop token) was sampled; per emitted token (the accepted
    drafts, then the new one) the model's log-probability and the asked-for probes."""

    accepted: int
    token: int | None
    logprobs: list[float]
    state: ContextState
    report: PassReport
    top_logprobs: list[TopLogprobs] = []
    entropy: list[float] = []


class SelectReply(_Reply):
    logprobs: list[list[float]]  # per option, per token: log p(token | context, option so far)
    unconditional: list[list[float]] = []  # the same without the context (first token: 0)


class GenerateDone(_Reply):
    finish_reason: str  # "stop_token" | "stop_string" | "length"
    tokens: list[int]  # every token sampled, including the pending one
    pending: list[int]  # tokens sampled but not yet in the KV cache (the last one)
    state: ContextState
    report: PassReport
    attention_scores: AttentionScores | None = None  # when the request asked for them


class TokenIds(_Reply):
    token_ids: list[int]
    positions: list[int] = []  # GetTokens: each token's rotary position


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One loaded LoRA adapter (``EngineInfo.adapters``)."""

    name: str  # what Context(rt, adapter=...) and HTTP's model= name it by
    path: str  # the PEFT folder it was read from
    rank: int  # the largest rank of its modules
    alpha: float  # lora_alpha
    targets: list[str]  # the projections it changes: q_proj ... down_proj
    key: str  # its identity (hex): a hash of its weights, part of its pages' hashes


class EngineInfo(_Reply):
    """The engine's fixed facts and the limits every request must respect."""

    protocol_version: int
    model_name: str
    page_size: int
    num_pages: int
    vocab_size: int
    max_seq_len: int
    stop_token_ids: list[int]
    max_step_tokens: int
    max_reply_bytes: int = 16 * 2**20  # the largest reply one request may produce
    max_mask_entries: int = 2**26  # rows x columns of one custom attention mask
    max_pages_per_owner: int = 0  # the page share of one owner (client); 0 = the whole pool
    max_held_pages_per_owner: int = 0  # the most pages one owner's holds may cover
    hidden_size: int = 0  # size of one hidden_states() row
    max_top_logprobs: int = 20  # the most top_logprobs one generated token may carry
    can_constrain: bool = False  # the engine compiles constraints (its tokenizer allows it)
    score_layers: int = 0  # layers attention_scores() reads; 0 = this engine cannot
    score_heads: int = 0  # query heads: the rows of attention_scores(heads="all")
    dtype: str = "float32"  # the compute dtype: float32, bfloat16, float16
    device: str = "cpu"  # where the model runs: cpu, cuda, cuda:1 ...
    attention: str = "torch"  # the attention backend: torch, flash-gather, flash-paged
    weights: str = "fp32"  # projection weights: fp32 (unquantized, in dtype), int8, gguf
    backend: str = "native"  # the model runner: native or transformers (docs/models.md)
    adapters: list[AdapterInfo] = []  # LoRA adapters loaded now (docs/adapters.md)
    kv_dtype: str = "fp32"  # KV pages: fp32 (unquantized, in dtype), int8 (per-entry scales), bf16
    snapshot_dir: str = ""  # the engine's folder of durable snapshots; "" = kept in memory
    # batch-invariant numerics: a row's bits do not depend on its batch, chunking or cache
    # (docs/performance.md "Deterministic numerics"); False where the engine cannot
    deterministic: bool = False
    kernels: list[str] = []  # the projection kernels chosen at load, one line per shape
    # channels between inferlets (docs/messages.md)
    max_message_bytes: int = 1 << 20  # the largest message (payload bytes)
    max_queue_messages: int = 64  # messages one queue or one subscription's buffer holds
    max_channels: int = 1024  # queues and topics in use at once, per namespace
    max_subscriptions: int = 64  # subscriptions one owner (runtime, connection) holds
    max_channel_bytes: int = 256 << 20  # bytes of every message held, engine-wide
    # hosted inferlets and the store (docs/inferlets.md)
    inferlet_folder: str = ""  # where ``rt.spawn`` finds inferlets by name; "" = none
    max_store_value_bytes: int = 64 << 10  # the largest store value
    max_store_keys: int = 10_000  # keys one namespace's store holds
    max_store_bytes: int = 64 << 20  # bytes of one namespace's store (values plus keys)


class EngineStats(_Reply):
    num_pages_total: int
    num_pages_free: int
    num_pages_used: int
    num_pages_cached: int
    num_contexts: int
    num_snapshots: int
    num_steps: int
    num_model_calls: int
    tokens_computed: int
    # The page counters are the sums of every PassReport handed out (passes that
    # succeeded, snapshot opens and takes): they agree with the reports a program saw.
    pages_reused: int  # pages attached without computing (prefix matches, snapshot opens)
    pages_computed: int  # full pages the model computed and committed
    hit_rate: float  # pages_reused / (pages_reused + pages_computed); 0 before any
    model_seconds: float
    scheduler_seconds: float
    num_isolated_failures: int = 0  # requests failed alone because their rows broke a step
    # the disk tier (all 0 when snapshots are kept in memory; docs/snapshots.md)
    pages_from_disk: int = 0  # of pages_reused: those read from disk (prefixes and opens)
    num_snapshots_resident: int = 0  # snapshots whose pages are in the pool
    num_snapshots_spilled: int = 0  # times a snapshot was dropped from the pool to disk
    num_disk_pages: int = 0  # page files in the snapshot directory
    disk_bytes: int = 0  # their size
    disk_pages_written: int = 0
    disk_bytes_written: int = 0
    # disk I/O: pages read back into the pool (opens + prefixes), counted as they are
    # read, including reads for a request that then failed or was cancelled
    disk_pages_loaded: int = 0
    disk_bytes_loaded: int = 0
    # holds (docs/pages.md, "Holds")
    num_holds: int = 0  # live holds
    num_pages_held: int = 0  # pages in the pool some live hold covers
    # priority -> held pages whose highest covering hold has that priority
    pages_held_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    # suspend and resume (docs/pages.md, "Suspend and resume")
    num_contexts_suspended: int = 0  # contexts whose pages are out of the pool now
    num_suspends: int = 0  # since boot, on request or under pressure
    num_auto_suspends: int = 0  # of them, chosen by the engine to make room
    num_resumes: int = 0
    pages_suspended: int = 0  # pages the suspended contexts held in the pool
    pages_resumed_from_memory: int = 0  # brought back from the pool's cache or host memory
    pages_resumed_from_disk: int = 0  # brought back from the disk tier
    # channels between inferlets (docs/messages.md)
    num_channels: int = 0  # queues and topics in use, every namespace
    num_subscriptions: int = 0
    num_channel_messages: int = 0  # messages held: queued, buffered, or taken and unsettled
    channel_bytes: int = 0  # what they count against max_channel_bytes


class ChannelMessage(_Reply):
    """A message taken by a receive, held under ``lease`` until settled."""

    payload: bytes
    text: bool = False
    lease: int = 0


class BroadcastReply(_Reply):
    num_subscribers: int  # the subscriptions present, each of which got the message


class SubscriptionReply(_Reply):
    sub: int


class InferletStarted(_Reply):
    id: int  # the launch's handle, for InferletNext and CancelInferlet


class InferletEvent(_Reply):
    """Texts a launch sent (``rt.session.send``) past the cursor; then, once it ended, its
    result (``str`` of what ``main`` returned, None for None)."""

    texts: list[str]
    done: bool = False
    result: str | None = None


class StoreValue(_Reply):
    found: bool
    payload: bytes = b""
    text: bool = False


class StoreKeyList(_Reply):
    keys: list[str]


class ErrorReply(_Reply):
    kind: str  # class name in pie_ctx.errors
    message: str


Reply = (
    Ok
    | ContextReply
    | StateReply
    | HoldReply
    | SuspendReply
    | SnapshotList
    | ForwardReply
    | VerifyReply
    | SelectReply
    | GenerateChunk
    | GenerateDone
    | TokenIds
    | EngineInfo
    | EngineStats
    | ChannelMessage
    | BroadcastReply
    | SubscriptionReply
    | InferletStarted
    | InferletEvent
    | StoreValue
    | StoreKeyList
    | ErrorReply
)


def error_reply(err: BaseException) -> ErrorReply:
    """The reply that carries ``err`` to a client of either transport.

    A ``PieError`` keeps the nearest class clients know (a subclass defined elsewhere maps
    to its closest ancestor in ``pie_ctx.errors``); anything else is a bug on the engine's
    side and reaches the client as a plain ``PieError`` that says so.
    """
    if isinstance(err, PieError):
        return ErrorReply(kind=known_name(err), message=str(err))
    return ErrorReply(kind="PieError", message=f"internal error: {type(err).__name__}: {err}")


def raise_if_error(reply: Any) -> Any:
    """Turn an ``ErrorReply`` into its typed exception; pass other replies through."""
    if isinstance(reply, ErrorReply):
        raise error_from_name(reply.kind, reply.message)
    return reply

"""Token sampling over a step's logit rows, plus the raw outputs the SDK exposes.

Owner: the engine calls :func:`sample_rows` once per step on the logits the runner
returned, with each row's ``SamplerSpec`` as the request carried it (the spec validates
itself when it is built or decoded). Each request keeps its own ``torch.Generator`` (see
:func:`make_generator`), seeded from ``SamplerSpec.seed``, and each sampled row draws exactly one uniform number
from its own generator, so a request's tokens are reproducible and do not depend on which
other requests share the batch.

Filters run in fp32 in this order, each on the distribution the previous one left
(HF ``generate`` semantics): temperature, top-k, top-p (smallest prefix of the sorted
distribution whose mass reaches ``top_p``), min-p (drop tokens below ``min_p`` times the
top probability). Every filter keeps a prefix of the tokens sorted by probability, and
always keeps the most likely token. ``temperature == 0`` is greedy (argmax; filters are
irrelevant), vectorised over all greedy rows.

The sampled rows of a step go to one C++ call (``runtime/model/kernels/sampling.cpp``,
:func:`runtime.model.kernels.sampling_ops`), each row on one thread in a fixed order, so a
row's token is the same bits alone or in any batch: one pass for the max, one for the
weights ``exp(x / t - max)`` with their sum and, at five fixed weight thresholds (1/8 down
to 2^-24), the count and mass above each; the smallest threshold whose count or mass shows
it holds every token the filters keep is collected and sorted (most likely first, ties to
the lower id), the filters run on it exactly, and a set that turns out not to close them
(the estimate's rounding) gives way to the next threshold, down to the whole vocabulary.
A top-k set that reaches past the candidates gets its mass from an ``nth_element`` over the
vocabulary. ``filtered_probs`` returns that same kernel's kept weights over their sum: the
very distribution a draw samples (speculative verification draws with ``sample_rows``
itself, row by row: ``runtime.engine.decoding.verify``). ``top_p == 1``
keeps every token (the torch code may round the far tail away). The torch code below is
the fallback when the kernels are off (``PIE_CTX_KERNELS=0``) or unbuilt, and the oracle of
tests/test_sampling.py; the two may draw differently only where the uniform number or a
filter boundary falls within fp32 rounding of a step (a new version may draw differently
from the old for the same seed).

Ties (common with bf16/fp16 logits, which keep 8/11 significant bits) go to the lower
token id wherever an order is shown to the user: greedy picks the first maximum, and
:func:`top_k` (top log-probabilities, ``top_k_distribution``) orders equal values by id,
so a greedy token is always the first of its row's top log-probabilities. Inside the
sampling filters the order of equal values is torch's (deterministic, unspecified).
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import SamplerSpec

__all__ = ["make_generator", "sample_rows", "filtered_probs", "draw", "logprobs",
           "top_k", "top_k_distribution"]


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their indices, largest first, ties to the lower
    index (``torch.topk`` leaves the order of equal values unspecified).

    Args:
        x: Tensor[n, V].
        k: 1 <= k <= V.

    Returns:
        ``(values, ids)``, each Tensor[n, k].
    """
    values, ids = torch.topk(x, k, dim=-1)  # [n, k]
    # A tie that crosses the cut (more values >= the k-th than k) needs the whole row.
    crossing = (x >= values[:, -1:]).sum(dim=-1) > k  # [n]
    if bool(crossing.any()):
        rows = crossing.nonzero().squeeze(1)
        full_v, full_i = torch.sort(x[rows], dim=-1, descending=True, stable=True)
        values, ids = values.clone(), ids.clone()
        values[rows], ids[rows] = full_v[:, :k], full_i[:, :k]
    # Ties inside the top k: order by id, then stably by value.
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(1, by_value), ids.gather(1, by_value)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator: seeded from ``seed``, or from OS entropy if None."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def sample_rows(logits: torch.Tensor, params: list[SamplerSpec],
                generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per logit row.

    Args:
        logits: Tensor[n, V] (any float dtype).
        params: n sampler settings, one per row.
        generators: n generators (None = torch's global RNG); greedy rows ignore theirs.

    Returns:
        n token ids.

    Raises:
        InvalidArgument: the list lengths do not match the number of rows.
    """
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise InvalidArgument(
            f"sample_rows: {n} logit rows but {len(params)} params and {len(generators)} generators")
    out = [0] * n
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        rows = logits if len(greedy) == n else logits[greedy]
        for i, tok in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
            out[i] = tok
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        rows = logits if len(sampled) == n else logits[sampled]  # no copy when all sample
        chosen = _sample(rows.float(), [params[i] for i in sampled],
                         [generators[i] for i in sampled])
        for i, tok in zip(sampled, chosen, strict=True):
            out[i] = tok
    return out


# Rows are first cut to their CANDIDATES most likely tokens; when that prefix provably holds
# every token the filters keep (top-k within it, the nucleus within it, or min-p cutting
# inside it), the draw is exactly the full-sort one at a fraction of the cost of sorting
# the whole vocabulary (1.3 ms instead of 11 ms for 8 rows of 49,152). Otherwise the rows
# are fully sorted.
# The smallest temperature applied as given. Below it fp32 turns ``x / t`` into inf (or
# ``t`` itself into 0) and the softmax into NaN; at it, any two distinct fp32 logits of a
# row are already >= ~1e-6 / 1e-30 apart, so the distribution is the same one-hot (or tie)
# any smaller temperature gives: clamping changes no draw.
MIN_TEMPERATURE = 1e-30
CANDIDATES = 1024


def _kernel() -> Any:
    """The compiled sampling kernel, or None (kernels off or unbuilt: the torch code runs)."""
    from runtime.model.kernels import sampling_ops

    return sampling_ops()


def _settings(params: list[SamplerSpec]) -> tuple[list[float], list[int], list[float], list[float]]:
    """The kernel's per-row settings: clamped temperature, top-k (0: off), top-p, min-p."""
    return ([max(p.temperature, MIN_TEMPERATURE) for p in params], [p.top_k or 0 for p in params],
            [p.top_p for p in params], [p.min_p for p in params])


def _sample(x: torch.Tensor, params: list[SamplerSpec],
            generators: list[torch.Generator | None]) -> list[int]:
    """Filtered multinomial draw for m rows of fp32 logits ``x`` [m, V], each row with one
    uniform number from its own generator (drawn first, in row order). The kernel computes
    every row on one thread in a fixed order; the torch fallback goes row by row: torch
    reduces one row differently alone (split over the threads) than among others (a thread
    per row), and whether its candidate cut holds is decided per call, so a row's draw would
    depend on its batch (docs/performance.md, "Deterministic numerics")."""
    uniforms = [draw(gen, x.device) for gen in generators]
    kernel = _kernel() if x.device.type == "cpu" else None
    if kernel is not None:
        return kernel.sample(x.contiguous(), *_settings(params), uniforms).tolist()
    return [_sample_row(x[i: i + 1], params[i], u) for i, u in enumerate(uniforms)]


def _sample_row(x: torch.Tensor, params: SamplerSpec, u: float) -> int:
    """One filtered multinomial draw from fp32 logits ``x`` [1, V] at the uniform number
    ``u`` (the torch twin of the kernel's draw)."""
    probs, order, keep = _filtered(x, [params])
    width = probs.shape[1]
    cdf = torch.cumsum(probs, dim=-1)  # [1, W] (unnormalised after min-p)
    target = u * cdf[:, -1:]  # [1, 1]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=width - 1)  # [1, 1]
    # A zero-probability tail token can only be hit by rounding: step back into the kept prefix.
    idx = torch.minimum(idx, keep.sum(dim=-1, keepdim=True) - 1)
    return int(order[0, int(idx)])


def draw(gen: torch.Generator | None, device: torch.device | str = "cpu") -> float:
    """One uniform number in [0, 1) from a row's own generator (None: torch's global one)."""
    if gen is None:
        return float(torch.rand((), device=device))
    return float(torch.rand((), generator=gen, device=device))


def filtered_probs(x: torch.Tensor, params: list[SamplerSpec]) -> torch.Tensor:
    """The distribution each row is sampled from: Tensor[m, V] of probabilities.

    Greedy rows are one-hot on their argmax; the others apply temperature, top-k, top-p
    and min-p exactly as :func:`sample_rows` does: the very weights its draw walks.
    """
    m, vocab = x.shape
    out = torch.zeros((m, vocab), dtype=torch.float32, device=x.device)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    for i in greedy:
        out[i, int(x[i].argmax())] = 1.0
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    kernel = _kernel() if sampled and x.device.type == "cpu" else None
    if kernel is not None:  # the very weights the kernel's draw walks
        rows = x[sampled].float().contiguous()
        probs = kernel.filtered_probs(rows, *_settings([params[i] for i in sampled]))
        out[sampled] = probs.to(out.device)
        return out
    for i, p in enumerate(params):  # row by row, as a draw (see _sample)
        if not p.is_greedy:
            probs, order, _ = _filtered(x[i: i + 1].float(), [p])
            probs = probs / probs.sum(dim=-1, keepdim=True)
            out[i: i + 1] = out[i: i + 1].scatter(1, order, probs)
    return out


def _filtered(x: torch.Tensor, params: list[SamplerSpec],
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filtered distribution of m rows of fp32 logits ``x`` [m, V], in sorted order.

    Returns:
        ``(probs, order, keep)``: ``probs[m, W]`` (unnormalised after min-p) over the
        tokens ``order[m, W]``, most likely first, and which of them the filters kept.
    """
    m, vocab = x.shape
    dev = x.device
    temp = torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], device=dev)
    top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)  # [m]
    top_p = torch.tensor([p.top_p for p in params], device=dev)  # [m]
    min_p = torch.tensor([p.min_p for p in params], device=dev)  # [m]
    scaled = x / temp[:, None]  # [m, V]

    sorted_logits, order = None, None
    # The normaliser of each row's top-k set (the whole vocabulary without top-k), computed
    # once: the two places below that need it used to compute it apart (torch.where
    # evaluates both branches), a third of a draw's time.
    set_lse = _top_k_lse(scaled, top_k) if vocab > CANDIDATES else None  # [m]
    if vocab > CANDIDATES:
        cand, cand_order = torch.topk(scaled, CANDIDATES, dim=-1)  # [m, C], descending
        # Mass of the candidates under the top-k-restricted distribution the filters use.
        k_in = torch.minimum(top_k, torch.tensor(CANDIDATES, device=dev))  # [m]
        ranks = torch.arange(CANDIDATES, device=dev)
        full_lse = torch.where(top_k <= CANDIDATES,
                               torch.logsumexp(torch.where(ranks[None, :] < k_in[:, None], cand,
                                                           float("-inf")), dim=-1),
                               set_lse)  # [m]
        inside = torch.exp(torch.logsumexp(cand, dim=-1) - full_lse)  # [m] candidate mass
        # min-p cuts everything below min_p x the top probability: if the last candidate is
        # already below, so is every token outside the candidates.
        below_min_p = (min_p > 0) & (cand[:, -1] - cand[:, 0] < torch.log(min_p))
        if bool(((top_k <= CANDIDATES) | (inside > top_p) | below_min_p).all()):
            sorted_logits, order = cand, cand_order
    if sorted_logits is None:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [m, V]
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=dev)  # [W]
    keep = ranks[None, :] < top_k[:, None]  # [m, W] top-k prefix
    neg_inf = torch.tensor(float("-inf"), device=dev)
    # Normalise over the whole top-k set (the candidates may be only part of it).
    lse = torch.logsumexp(torch.where(keep, sorted_logits, neg_inf), dim=-1, keepdim=True)
    if width < vocab:
        lse = torch.where(top_k[:, None] <= width, lse, set_lse[:, None])
    probs = torch.where(keep, (sorted_logits - lse).exp(), torch.zeros((), device=dev))
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [m, W]
    keep &= mass_before < top_p[:, None]  # top-p prefix (first token always kept)
    probs = torch.softmax(torch.where(keep, sorted_logits, neg_inf), dim=-1)
    keep &= probs >= min_p[:, None] * probs[:, :1]  # min-p relative to the top token
    probs = torch.where(keep, probs, torch.zeros((), device=dev))  # [m, W]
    return probs, order, keep


def _top_k_lse(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The logsumexp of each row's ``top_k`` largest values (all of them where ``top_k``
    reaches the vocabulary): the normaliser of the top-k-restricted distribution that top-p
    and min-p then cut. [m, V], [m] -> [m]."""
    vocab = scaled.shape[1]
    out = torch.logsumexp(scaled, dim=-1)
    for i in (top_k < vocab).nonzero().flatten().tolist():  # rows with a top-k set
        out[i] = torch.logsumexp(torch.topk(scaled[i], int(top_k[i])).values, dim=0)
    return out


def logprobs(logits_row: torch.Tensor, token_ids: list[int]) -> list[float]:
    """Log-probabilities (temperature 1, fp32) of ``token_ids`` under one logit row.

    Args:
        logits_row: Tensor[V].
        token_ids: tokens to score.

    Returns:
        One log-probability per token id.

    Raises:
        InvalidArgument: a token id is outside the vocabulary.
    """
    vocab = logits_row.shape[-1]
    if any(t < 0 or t >= vocab for t in token_ids):
        raise InvalidArgument(f"logprobs: token ids must be in [0, {vocab})")
    lp = torch.log_softmax(logits_row.float(), dim=-1)  # [V]
    return lp[torch.tensor(token_ids, dtype=torch.int64, device=lp.device)].tolist()


def top_k_distribution(logits_row: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens and their probabilities (temperature 1, fp32).

    Args:
        logits_row: Tensor[V].
        k: how many tokens, 1 <= k <= V.

    Returns:
        (ids, probs), most likely first.

    Raises:
        InvalidArgument: k out of range.
    """
    vocab = logits_row.shape[-1]
    if not 1 <= k <= vocab:
        raise InvalidArgument(f"top_k_distribution: k must be in [1, {vocab}], got {k}")
    probs = torch.softmax(logits_row.float(), dim=-1)  # [V]
    values, ids = top_k(probs[None], k)
    return ids[0].tolist(), values[0].tolist()

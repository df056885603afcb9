"""Which kernel each projection runs: timed once per signature, kept per machine.

Owner: the model's load (:func:`runtime.model.numerics.finish_weights`) calls
:func:`choose_kernels` once over a model's final projections
(:class:`runtime.model.matmul.Projection`, in the weight format they keep): the
candidates of each distinct signature are checked against the first, timed per row bucket
(:data:`runtime.model.matmul.ROW_BUCKETS`), and the fastest routes every member
(:meth:`Projection.use`); the log line goes to ``EngineInfo.kernels``.

Deterministic choice (``choose_kernels(..., deterministic=True)``, the engine's default,
docs/performance.md): a row's bits must not depend on how many rows share its call. Which
kernels keep them is measured, per signature, at load: each candidate runs a fixed set of
row counts (:data:`PROBE_ROWS`) and a row's result must be identical in every call of at
least ``p`` rows, at its first and at its last position; calls with fewer rows are then
padded with zero rows to ``p`` (kernel ``name@p``; on the EPYC, MKL's ``F.linear`` is
one class from 4 rows up, with a one-row and a two-to-three-row path of its own).
Candidates whose invariant results are the same bits form a class; each bucket takes the
fastest member of one class, the class that costs least against the free choice. A
candidate :data:`_DOMINATED` times slower at every bucket than one found invariant from
one row is not probed (docs/performance.md, "Start-up").

Once per machine: the deterministic probe takes ~20-45 s for the default model's five
signatures on a busy 2-core EPYC (the free timing up to ~25 s), so each signature's choice (:class:`KernelChoice`:
the kernels with their pads, the classes) is kept in :mod:`runtime.model.machine_cache`,
keyed by the signature, the candidates, this code and the machine; a later process on the
same machine uses it without probing (docs/performance.md, "Start-up").

The fused decode step (``runtime.model.fused_step``) runs some kernels in C++; which, is
the compiled module's own table (:func:`step_kinds`: ``decode_step.cpp``'s
``STEP_KINDS``), and a deterministic choice prefers a class of those for the decode
buckets.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pie_ctx.proto.errors import ModelError
from runtime.model import blocks as blocks_module
from runtime.model import kernels, machine_cache
from runtime.model import kquants as kquants_module
from runtime.model import matmul as matmul_module
from runtime.model.blocks import BlockWeight
from runtime.model.kquants import KQuantWeight
from runtime.model.matmul import ROUNDS_ACTIVATIONS, ROW_BUCKETS, Kernel, Projection

__all__ = ["KernelChoice", "PROBE_ROWS", "adopt_kernel_choices", "choose_kernels",
           "has_step_form", "kernel_choices", "probe_signature", "step_kinds"]

log = logging.getLogger(__name__)

# Row counts a deterministic choice checks a kernel at (the lm_head's up to 64): calls of
# every size a step makes, the edges of the usual kernel tiles, and bigger prefill chunks.
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64, 100, 256, 300, 512)
_MAX_PAD = 16  # the most rows a one-row call is padded to
_WINDOW = 64  # rows a probe covers with calls of each row count (see _invariant_from)
_CHECK_ROWS = 8  # rows each candidate is checked against the reference kernel on


def step_kinds() -> dict[str, int]:
    """The kernels the fused decode step runs in C++, by name -> ``decode_step.cpp``'s
    ``Kind`` number, as the compiled module declares them (``STEP_KINDS``); empty where
    pie-ctx's CPU kernels are off or did not build (no step runs then)."""
    ops = kernels.ops()
    return {} if ops is None else dict(ops.STEP_KINDS)


def has_step_form(name: str) -> bool:
    """Whether kernel ``name`` (``base@p`` too) has a C++ form in the fused decode step."""
    return name.partition("@")[0] in step_kinds()


def _best_seconds(kernels: list[Kernel], x: torch.Tensor, repeats: int) -> float:
    """Best time of one call, averaged over running every member's kernel in turn: each
    member has its own weight, so (for models larger than the caches) the weights come
    from memory as in a real step, not hot from a cache."""
    for k in kernels:  # warm up (and build lazily initialised kernel state)
        k(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in kernels:
            k(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(kernels)


_CHOSEN: dict[tuple, tuple[list[str], str]] = {}  # signature -> (kernels, log line)


def kernel_choices() -> dict[str, list[Any]]:
    """Every kernel choice made in this process, as JSON-ready data (``boot_engine`` keeps
    them beside durable snapshots, so a restarted engine computes exactly as before)."""
    return {json.dumps(sig): [names, line] for sig, (names, line) in _CHOSEN.items()}


def adopt_kernel_choices(choices: dict[str, list[Any]]) -> None:
    """Use choices saved by :func:`kernel_choices` instead of timing those signatures again
    (a choice naming a kernel this machine lacks is timed again instead)."""

    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    for key, (names, line) in choices.items():
        _CHOSEN.setdefault(tuples(json.loads(key)), (list(names), str(line)))


def _one_rounding(chosen: list[str], times: list[dict[str, float]]) -> list[str]:
    """The per-bucket choice ``chosen`` made consistent: a kernel that rounds the activations
    (:data:`ROUNDS_ACTIVATIONS`) computes other numbers than the rest, not only other last
    bits, so it serves every bucket or none (else a sequence's tokens would depend on the
    bucket its batch falls in): every bucket when its time over the best other kernel's,
    multiplied over the buckets, is at most 1 (a geometric mean: decode counts as much as
    prefill)."""
    rounding = {n for n in chosen if n in ROUNDS_ACTIVATIONS}
    if not rounding:
        return chosen
    name = sorted(rounding)[0]
    others = [min((n for n in t if n not in ROUNDS_ACTIVATIONS), key=t.__getitem__)
              for t in times]
    if not all(name in t for t in times):
        return others
    ratio = 1.0
    for t, other in zip(times, others, strict=True):
        ratio *= t[name] / t[other]
    return [name] * len(times) if ratio <= 1 else others


@dataclass(slots=True)
class KernelChoice:
    """What the probe of one signature decided: the kernel per row bucket (``name@p`` for a
    kernel padded to ``p`` rows), the log line, and (deterministic) the classes of
    row-count-invariant kernels with equal bits it chose among."""

    chosen: list[str]
    line: str
    classes: list[list[str]]

    def encode(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "line": self.line, "classes": self.classes}

    @classmethod
    def decode(cls, data: Any, candidates: list[str], buckets: int) -> KernelChoice:
        """The choice stored by :meth:`encode`; ValueError unless it names ``buckets``
        kernels of ``candidates``."""
        chosen, line, classes = data["chosen"], data["line"], data["classes"]
        if (not isinstance(line, str) or not isinstance(chosen, list) or len(chosen) != buckets
                or not all(isinstance(n, str) and n.split("@")[0] in candidates
                           for n in chosen)
                or not all(isinstance(c, list) and all(isinstance(n, str) for n in c)
                           for c in classes)):
            raise ValueError(f"not a choice of {buckets} of {candidates}")
        return cls(list(chosen), line, [list(c) for c in classes])


@functools.cache
def _probe_code() -> str:
    """The version of the probe's code: this module's, the projections' and the block
    kernels' Python side (the compiled kernels are in the machine facts)."""
    return machine_cache.source_digest(Path(__file__), Path(matmul_module.__file__),
                                       Path(blocks_module.__file__),
                                       Path(kquants_module.__file__))


def _probe_inputs(rep: Projection, sig: tuple, names: list[str], repeats: int) -> dict[str, Any]:
    """Everything besides the machine that decides the probe of ``rep``'s signature ``sig``
    (:mod:`runtime.model.machine_cache` adds the machine's facts)."""
    w = rep.weight
    return {"signature": sig, "candidates": names, "repeats": repeats,
            "source": w.source if isinstance(w, (BlockWeight, KQuantWeight)) else None,
            "outliers": 0 if rep.outliers is None else int(rep.outliers.numel()),
            "probe": [PROBE_ROWS, ROW_BUCKETS, _MAX_PAD, _WINDOW], "code": _probe_code()}


def choose_kernels(projections: Iterable[Projection], *, repeats: int = 3,
                   deterministic: bool = False) -> list[str]:
    """Time every candidate kernel per projection signature and row bucket; route each
    projection to the fastest. Returns the log lines (also logged at INFO).

    Candidates that disagree with the reference kernel beyond rounding are discarded
    (with a log line) before timing. A signature is timed once per process: later models
    with the same shapes reuse the choice, so two engines in one process compute alike;
    and once per machine: the choice is kept in :mod:`runtime.model.machine_cache` (kind
    ``"probe"``, keyed by the signature, the candidates, the probe's code and the
    machine), which later processes reuse without timing (``PIE_CTX_MACHINE_CACHE=0``:
    time every time; ``refresh``: time again and keep the new choice).

    ``deterministic``: only kernels whose row results do not depend on the call's row
    count, all of one class of equal bits (see the module doc); the choice is kept apart
    from the free one.
    """
    groups: dict[tuple, list[Projection]] = {}
    for p in projections:
        sig = p.signature + (("deterministic",) if deterministic else ())
        groups.setdefault(sig, []).append(p)
    lines = []
    for sig, members in groups.items():
        if sig in _CHOSEN and ({n.split("@")[0] for n in _CHOSEN[sig][0]}
                               <= set(members[0].candidate_names())):
            names, line = _CHOSEN[sig]
            for p in members:
                p.use(names)
            lines.append(line)
            continue
        rep = members[0]
        names = rep.candidate_names()
        if len(names) == 1 and not deterministic:
            continue
        choice, hit = machine_cache.cached(
            "probe", _probe_inputs(rep, sig, names, repeats),
            lambda rep=rep, members=members, names=names: probe_signature(
                rep, members, names, repeats, deterministic),
            KernelChoice.encode,
            lambda data, names=names, rep=rep: KernelChoice.decode(data, names, rep.buckets))
        for p in members:
            p.use(choice.chosen)
        log.info("projection kernels%s: %s", " (machine cache)" if hit else "", choice.line)
        _CHOSEN[sig] = (choice.chosen, choice.line)
        lines.append(choice.line)
    return lines


def probe_signature(rep: Projection, members: list[Projection], names: list[str],
                    repeats: int, deterministic: bool) -> KernelChoice:
    """The probe of one signature (what :func:`choose_kernels` caches per machine): check
    each of the candidates ``names`` against the first, then time them per row bucket
    over ``members`` (all of ``rep``'s signature) and keep the fastest, or with
    ``deterministic`` the fastest of the best class of row-count-invariant kernels.

    Raises:
        ModelError: deterministic, and no candidate class is invariant for every bucket.
    """
    names = list(names)
    out_f, in_f = rep.shape
    # one seed per signature: a signature probes the same inputs whichever were probed
    # before it (or came from the cache)
    gen = torch.Generator().manual_seed(0)
    dtype = (torch.float32 if rep.is_int8 or rep.is_blocks
             else rep.weight.dtype)  # type: ignore[union-attr]
    probe = torch.randn(_CHECK_ROWS, in_f, generator=gen).to(dtype=dtype, device=rep.device)
    want = rep.kernel(names[0])(probe)
    for n in names[1:]:
        rows = probe[:1] if not rep.allowed(n, 1) else probe
        got = rep.kernel(n)(rows)
        ref = want[: rows.shape[0]]
        if n in ROUNDS_ACTIVATIONS:  # its product of the input it actually multiplies
            ref = rep.kernel(names[0])(
                ROUNDS_ACTIVATIONS[n](rows, rep.outliers, rep.act_levels).to(rows.dtype))
        if not torch.allclose(got.float(), ref.float(), rtol=1e-3,
                              atol=1e-3 * float(ref.abs().max())):
            log.info("projection kernel %s disagrees with %s on %dx%d; not used", n,
                     names[0], out_f, in_f)
            names.remove(n)
    if deterministic:
        return _choose_invariant(rep, members, names, gen, repeats)
    by_name = {n: [p.kernel(n) for p in members] for n in names}
    chosen, report, all_times = [], [], []
    for b in range(rep.buckets):
        rows = ROW_BUCKETS[b]
        x = torch.randn(rows, in_f, generator=gen).to(dtype=dtype, device=rep.device)
        # Few rows are memory-bound (cycle through every member's weight); many rows are
        # compute-bound, where four members time the same and cost less to load.
        sample = slice(None) if rows < 64 else slice(4)
        times = {n: _best_seconds(k[sample], x, repeats) for n, k in by_name.items()
                 if rep.allowed(n, b)}
        best = min(times, key=times.__getitem__)
        chosen.append(best)
        all_times.append(times)
    chosen = _one_rounding(chosen, all_times)
    for b, (best, times) in enumerate(zip(chosen, all_times, strict=True)):
        rows = ROW_BUCKETS[b]
        report.append(f"{rows} row{'s' if rows > 1 else ''}: {best} ("
                      + ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items()) + " ms)")
    line = (f"{len(members)} x {out_f}x{in_f} {rep.form}: "
            + "; ".join(report))
    return KernelChoice(chosen, line, [])


def _invariant_from(rep: Projection, name: str, x: torch.Tensor) -> tuple[int, bytes] | None:
    """``(p, bits)``: kernel ``name`` gives a row the same bits in every call of at least
    ``p`` of the :data:`PROBE_ROWS` rows (every row of each call against the biggest
    call's, and against itself moved one position on), ``p <= _MAX_PAD``; ``bits``: the
    biggest call's whole result (kernels of one class must agree on every row); None if
    no such ``p``.

    Many rows are compared for every row count, not a sample: a bf16 or fp16 result
    rounds two accumulations that differ in their last fp32 bits to the same
    half-precision value unless the sum lies near a rounding boundary (measured: 1 row in
    9 of 576 outputs differs between MKL's one-row and multi-row bf16 paths), so the
    first and last row of one call per count (the earlier probe) let a batch-dependent
    bf16 kernel pass, and bf16 speculation parted from plain greedy decoding."""
    kernel = rep.kernel(name)
    limit = 1 if not rep.allowed(name, 1) else x.shape[0]
    counts = [m for m in PROBE_ROWS if m <= limit]
    biggest = kernel(x[:counts[-1]])

    def same(m: int) -> bool:
        # calls of m rows over the first _WINDOW rows (at least one call): each row at
        # another position than in the biggest call, and many rows even for small m
        starts = range(0, max(1, min(_WINDOW, x.shape[0]) - m + 1), m)
        out = torch.cat([kernel(x[a: a + m]) for a in starts])
        if not torch.equal(out, biggest[: len(out)]):
            return False
        if m == 1:
            return True
        moved = kernel(x[:m].roll(1, 0))  # each row one position on, the last first
        return torch.equal(moved[1:], biggest[: m - 1]) and torch.equal(moved[0],
                                                                         biggest[m - 1])

    p = None
    for m in reversed(counts):
        if not same(m):
            break
        p = m
    if p is None or p > _MAX_PAD:
        return None
    return p, biggest.float().numpy().tobytes()


_STEP_BUCKETS = 2  # the buckets the fused decode step runs (a decode, a decode batch)
# A candidate this many times slower at every bucket than a kernel already found invariant
# from one row is not probed for invariance (_choose_invariant): the probe's biggest cost
# at load (the exact K-quant kernel's on a 128k-row lm_head: ~1,000 rows of calls).
_DOMINATED = 1.5


def _step_kernels(rep: Projection, dtype: torch.dtype) -> Callable[[str], bool]:
    """Which kernels the fused decode step can run for ``rep`` (:func:`step_kinds`; the step:
    CPU, fp32 compute); a deterministic choice takes its decode buckets from a class of
    these when there is one, since the step saves more than any kernel ranking here."""
    if rep.device.type != "cpu" or dtype != torch.float32:
        return lambda name: False
    return has_step_form


def _choose_invariant(rep: Projection, members: list[Projection], names: list[str],
                      gen: torch.Generator, repeats: int) -> KernelChoice:
    """The deterministic choice for one signature: per bucket, the fastest member of the
    class of row-count-invariant kernels (equal bits) that costs least against the
    fastest kernel of each bucket, among the classes whose decode buckets the fused decode
    step can run when there are any (:func:`_step_kernels`).

    Every candidate is timed first; the invariance probe (the costly part: ~1,000 rows of
    calls) then runs fastest first and skips a candidate :data:`_DOMINATED` times slower
    at every bucket than one already found invariant from one row (no pads) that the step
    runs if it does: such a kernel cannot serve a bucket better."""
    out_f, in_f = rep.shape
    dtype = (torch.float32 if rep.is_int8 or rep.is_blocks
             else rep.weight.dtype)  # type: ignore[union-attr]
    if dtype in (torch.bfloat16, torch.float16) and "f32" in names:
        # A half-precision GEMM (MKL's, oneDNN's) can round a row by its batch only where
        # the row's sum lies near a rounding boundary: a random probe passed MKL's bf16
        # path that then gave a 299-row call other bits than one row on other inputs.
        # "f32" (fp32 GEMM on the weight widened once, rounded back) is invariant by
        # construction, so half-precision weights take it under deterministic numerics.
        names = ["f32"]
    top = PROBE_ROWS[-1] if rep.buckets == len(ROW_BUCKETS) else 64
    x = torch.randn(top, in_f, generator=gen).to(dtype=dtype, device=rep.device)
    inputs = [torch.randn(ROW_BUCKETS[b], in_f, generator=gen).to(dtype=dtype, device=rep.device)
              for b in range(rep.buckets)]
    times: dict[tuple[str, int], float] = {}

    def time_all(kernel_names: list[str]) -> None:
        for b in range(rep.buckets):
            sample = slice(None) if ROW_BUCKETS[b] < 64 else slice(4)
            for n in kernel_names:
                if (n, b) not in times and rep.allowed(n.split("@")[0], b):
                    times[n, b] = _best_seconds([p.kernel(n) for p in members][sample],
                                                inputs[b], repeats)

    time_all(names)
    free = [min(t for (n, bb), t in times.items() if bb == b and n in names)
            for b in range(rep.buckets)]
    stepped = _step_kernels(rep, dtype)

    def buckets_of(n: str) -> list[int]:
        return [b for b in range(rep.buckets) if (n, b) in times]

    def dominated(n: str, by: str) -> bool:
        return ((stepped(by) or not stepped(n)) and all(
            (by, b) in times and times[n, b] >= _DOMINATED * times[by, b]
            for b in buckets_of(n)))

    classes: dict[bytes, list[str]] = {}
    plain: list[str] = []  # found invariant from one row
    skipped = []
    for n in sorted(names, key=lambda n: max((times[n, b] / free[b] for b in buckets_of(n)),
                                             default=float("inf"))):
        if any(dominated(n, m) for m in plain):
            skipped.append(n)
            continue
        found = _invariant_from(rep, n, x)
        if found is not None:
            classes.setdefault(found[1], []).append(f"{n}@{found[0]}" if found[0] > 1 else n)
            if found[0] == 1:
                plain.append(n)
    if skipped:
        log.debug("%dx%d: not probed for invariance (%.1fx slower than %s at every bucket): "
                  "%s", out_f, in_f, _DOMINATED, ", ".join(plain), ", ".join(skipped))
    if not classes:
        raise ModelError(
            f"no projection kernel for {out_f}x{in_f} {dtype} gives a row the same result "
            f"whatever its batch on this machine (tried {', '.join(names)}); start the engine "
            "with --deterministic off (deterministic=False)")
    time_all([n for c in classes.values() for n in c])
    options = []  # (not all decode picks in C++, cost, picks) per class that covers all
    for members_of in classes.values():
        picks = []
        for b in range(rep.buckets):
            timed = [n for n in members_of if (n, b) in times]
            if b < _STEP_BUCKETS and any(stepped(n) for n in timed):
                timed = [n for n in timed if stepped(n)]
            picks.append(min(timed, key=lambda n, b=b: times[n, b]) if timed else None)
        if None in picks:
            continue
        cost = max(times[n, b] / free[b] for b, n in enumerate(picks))
        options.append((not all(stepped(n) for n in picks[:_STEP_BUCKETS]), cost, picks))
    chosen = min(options, key=lambda o: o[:2])[2] if options else []
    if not chosen:
        raise ModelError(f"no row-count-invariant projection kernel class covers every row "
                         f"bucket for {out_f}x{in_f} {dtype}; start the engine with "
                         "--deterministic off (deterministic=False)")
    report = [f"{ROW_BUCKETS[b]} row{'s' if ROW_BUCKETS[b] > 1 else ''}: {n} "
              f"({times[n, b] * 1e3:.2f} ms, x{times[n, b] / free[b]:.2f} of the fastest)"
              for b, n in enumerate(chosen)]
    line = (f"{len(members)} x {out_f}x{in_f} {rep.form} "
            "deterministic: " + "; ".join(report))
    order = {n: i for i, n in enumerate(names)}  # the candidates' order, whatever the timing
    return KernelChoice(chosen, line, sorted(
        (sorted(c, key=lambda n: order[n.split("@")[0]]) for c in classes.values()),
        key=lambda c: order[c[0].split("@")[0]]))

"""The step executor: one model call plus the per-row outputs, run off the event loop.

Owns: the per-job sampling generators. Runs on the engine's model thread and touches only
the plan it is given and the pool tensor (through the runner); all page bookkeeping stays
with the scheduler on the event loop. A step that raises leaves every generator as it
was, so the engine can re-run part of it (see ``Engine._run_isolated``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from runtime.engine import decoding
from runtime.engine.rows import RowResult, StepPlan
from runtime.model.runner_protocol import Runner
from runtime.sampling import logprobs, make_generator, sample_rows, top_k_distribution

Saved = list[tuple[int, torch.Generator | None, torch.Tensor | None]]


class StepExecutor:
    """Runs a ``StepPlan`` through a runner and answers every row request."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._generators: dict[int, torch.Generator] = {}
        self.num_model_calls = 0
        self.mask_seconds = 0.0  # time spent building constraint/bias masks
        self.num_masked_steps = 0

    def forget(self, job_key: int) -> None:
        """Drop a finished job's generator."""
        self._generators.pop(job_key, None)

    def run(self, plan: StepPlan) -> list[RowResult]:
        batch = plan.chunks
        given = [i for i, r in enumerate(plan.rows) if r.given_logits is not None]
        computed = [i for i, r in enumerate(plan.rows) if r.given_logits is None]
        logits, hidden = None, None
        if batch:
            if any(r.hidden for r in plan.rows):
                logits, hidden = self.runner.forward(batch, return_hidden=True)
            else:
                logits = self.runner.forward(batch)
            logits = logits.float()  # [num_computed_rows, vocab]
            self.num_model_calls += 1
            if logits.shape[0] != len(computed):
                raise RuntimeError(f"runner returned {logits.shape[0]} rows, expected {len(computed)}")
        if given:
            rows = torch.from_numpy(np.stack([plan.rows[i].given_logits for i in given]))
            if logits is None:
                logits = rows
            else:  # put every row back in plan order
                full = torch.empty((len(plan.rows), logits.shape[1]), dtype=torch.float32)
                full[computed] = logits
                full[given] = rows
                logits = full
        saved: Saved = []
        try:
            results = self._outputs(plan, logits, saved)
        except BaseException:
            self._restore(saved)
            raise
        if hidden is not None:  # hidden rows come in computed-row order
            for j, i in enumerate(computed):
                if plan.rows[i].hidden:
                    results[i].hidden = hidden[j].float().numpy().astype("<f4").tobytes()
        return results

    def _outputs(self, plan: StepPlan, logits: torch.Tensor, saved: Saved) -> list[RowResult]:
        """Every row's answer from the step's raw logits ``[rows, vocab]``."""
        rows = plan.rows
        results = [RowResult() for _ in rows]
        t0 = time.perf_counter()
        adjusted, empty = decoding.adjust(logits, rows)
        if adjusted is not logits:
            self.mask_seconds += time.perf_counter() - t0
            self.num_masked_steps += 1
        for i in empty:
            results[i].error = ("no token is allowed here: the constraint (or allowed_tokens) "
                                "rules out every token this model can produce")
        lp = None
        sample_at, params, gens = [], [], []
        for i, req in enumerate(rows):
            if req.verify is not None:
                self._verify(i, req, logits, adjusted, results, saved)
            elif req.sample is not None and i not in empty:
                sample_at.append(i)
                params.append(req.sample)
                gens.append(self._generator(req.job_key, req.generator_seed, req.sample, saved))
            if req.raw_logits:
                results[i].logits = logits[i].numpy().astype("<f4", copy=False).tobytes()
            if req.top_k:
                ids, probs = top_k_distribution(logits[i], req.top_k)
                results[i].top_ids, results[i].top_probs = list(ids), list(probs)
            if req.logprob_ids:
                results[i].logprob_ids = list(req.logprob_ids)
                results[i].logprobs = list(logprobs(logits[i], req.logprob_ids))
        if sample_at:
            # Every row samples in a plain decode step: use the tensors as they are rather
            # than gather copies of [rows, vocab] (the values are the same either way).
            whole = len(sample_at) == logits.shape[0]
            tokens = sample_rows(adjusted if whole else adjusted[sample_at], params, gens)
            # The model's own log-probability (temperature 1) of each sampled token.
            lp = torch.log_softmax(logits if whole else logits[sample_at], dim=-1)
            picked = lp[torch.arange(len(tokens)), tokens]
            for i, token, value in zip(sample_at, tokens, picked.tolist(), strict=True):
                results[i].sampled = int(token)
                results[i].sampled_logprob = float(value)
        self._probes(rows, logits, results)
        return results

    def _verify(self, first: int, req: Any, logits: torch.Tensor, adjusted: torch.Tensor,
                results: list[RowResult], saved: Saved) -> None:
        """One speculative group: rows ``first .. first + len(draft)``."""
        draft = req.verify
        span = slice(first, first + len(draft) + 1)
        gen = self._generator(req.job_key, req.generator_seed, req.sample, saved)
        accepted, token = decoding.verify(adjusted[span], draft, req.sample, gen, req.stops)
        emitted = list(draft[:accepted]) + ([] if token is None else [token])
        lp = torch.log_softmax(logits[span], dim=-1)
        results[first].accepted = accepted
        for j, t in enumerate(emitted):
            results[first + j].sampled = t
            results[first + j].sampled_logprob = float(lp[j, t])

    def _probes(self, rows: list[Any], logits: torch.Tensor, results: list[RowResult]) -> None:
        """Top log-probabilities and entropy, batched over the rows asking for them."""
        wanted = [i for i, r in enumerate(rows) if r.top_logprobs or r.entropy]
        if not wanted:
            return
        k = max(max(rows[i].top_logprobs for i in wanted), 1)
        tops, entropies = decoding.probes(logits[wanted], k)
        for i, top, ent in zip(wanted, tops, entropies, strict=True):
            n = rows[i].top_logprobs
            if n:
                results[i].top_logprobs = type(top)(token_ids=top.token_ids[:n],
                                                    logprobs=top.logprobs[:n])
            results[i].entropy = ent

    def _generator(self, key: int, seed: int | None, spec: Any, saved: Saved,
                   ) -> torch.Generator | None:
        """The job's generator (a fresh one when ``seed`` is given); its previous state is
        recorded in ``saved`` so a failing step can put it back."""
        if spec.is_greedy:
            return None
        old = self._generators.get(key)
        saved.append((key, old, None if old is None else old.get_state()))
        if seed is not None or old is None:
            self._generators[key] = make_generator(seed)
        return self._generators[key]

    def _restore(self, saved: Saved) -> None:
        for key, gen, state in reversed(saved):
            if gen is None:
                self._generators.pop(key, None)
            else:
                gen.set_state(state)
                self._generators[key] = gen

"""The step executor: one model call plus the per-row outputs, run off the event loop.

Owns: the per-job sampling generators. Runs on the engine's model thread and touches only
the plan it is given and the pool tensor (through the runner); all page bookkeeping stays
with the scheduler on the event loop. A step that raises leaves every generator as it
was, so the engine can re-run part of it (see ``Engine._run_isolated``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from runtime.engine.scheduler import RowResult, StepPlan
from runtime.model.batch import SeqInput
from runtime.sampling import logprobs, make_generator, sample_rows, top_k_distribution


class Runner(Protocol):
    def forward(self, batch: list[SeqInput]) -> torch.Tensor: ...


class StepExecutor:
    """Runs a ``StepPlan`` through a runner and answers every row request."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._generators: dict[int, torch.Generator] = {}
        self.num_model_calls = 0

    def forget(self, job_key: int) -> None:
        """Drop a finished job's generator."""
        self._generators.pop(job_key, None)

    def run(self, plan: StepPlan) -> list[RowResult]:
        batch = plan.chunks
        given = [i for i, r in enumerate(plan.rows) if r.given_logits is not None]
        computed = [i for i, r in enumerate(plan.rows) if r.given_logits is None]
        logits = None
        if batch:
            logits = self.runner.forward(batch).float()  # [num_computed_rows, vocab]
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
        saved: list[tuple[int, torch.Generator | None, torch.Tensor | None]] = []
        try:
            return self._outputs(plan, logits, saved)
        except BaseException:
            self._restore(saved)
            raise

    def _outputs(self, plan: StepPlan, logits: torch.Tensor,
                 saved: list[tuple[int, torch.Generator | None, torch.Tensor | None]],
                 ) -> list[RowResult]:
        """Every row's answer from the step's logits ``[rows, vocab]``."""
        results = [RowResult() for _ in plan.rows]
        sample_at: list[int] = []
        params: list[Any] = []
        gens: list[torch.Generator | None] = []
        for i, req in enumerate(plan.rows):
            if req.sample is not None:
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
            rows = logits[sample_at]
            tokens = sample_rows(rows, params, gens)
            picked = torch.log_softmax(rows, dim=-1)[torch.arange(len(tokens)), tokens]
            for i, token, lp in zip(sample_at, tokens, picked.tolist(), strict=True):
                results[i].sampled = int(token)
                results[i].sampled_logprob = float(lp)
        return results

    def _generator(self, key: int, seed: int | None, spec: Any,
                   saved: list[tuple[int, torch.Generator | None, torch.Tensor | None]],
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

    def _restore(self, saved: list[tuple[int, torch.Generator | None, torch.Tensor | None]],
                 ) -> None:
        for key, gen, state in reversed(saved):
            if gen is None:
                self._generators.pop(key, None)
            else:
                gen.set_state(state)
                self._generators[key] = gen

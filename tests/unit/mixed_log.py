"""Records what each engine step scheduled and sampled, for the mixed-batch tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine import Engine, SamplingParams
from engine.request import RequestOutput
from engine.scheduled_batch import ScheduledBatch


@dataclass(frozen=True)
class StepRecord:
    """One forward as the scheduler built it, and the rows the sampler got."""

    num_decodes: int
    seqs: list[tuple[str, int, int, bool]]  # (request id, start, extend len, samples)
    retracted: list[str]
    decode_ready: set[str]  # running requests with one token left to compute, before it
    sampled: list[str]  # request ids of the rows the sampler got, in order
    logits_rows: int  # rows the LM head produced

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.seqs)

    @property
    def prefill_only(self) -> bool:
        return self.num_decodes == 0

    @property
    def decode_ids(self) -> list[str]:
        return [s[0] for s in self.seqs[: self.num_decodes]]


class StepLog:
    """Wraps ``engine``'s scheduler, runner and sampler to record every step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []
        self._ready: set[str] = set()
        self._sampled: list[str] = []
        self._rows = 0
        schedule = engine.scheduler.schedule
        run = engine.runner.run
        sampler = engine.runner.sampler

        def recording_schedule() -> ScheduledBatch | None:
            self._ready = {
                r.request_id for r in engine.scheduler.running if r.kv_len == r.seq_len - 1
            }
            return schedule()

        def recording_run(batch: ScheduledBatch) -> Any:
            self._sampled, self._rows = [], 0
            seqs = [
                (r.request_id, s, n, do)
                for r, s, n, do in zip(batch.reqs, batch.starts, batch.extend_lens, batch.sample)
            ]
            result = run(batch)
            self.steps.append(
                StepRecord(
                    batch.num_decodes,
                    seqs,
                    [r.request_id for r in batch.retracted],
                    self._ready,
                    self._sampled,
                    self._rows,
                )
            )
            return result

        def recording_sampler(logits: torch.Tensor, reqs: list[Any], *args: Any) -> Any:
            self._sampled = [r.request_id for r in reqs]
            self._rows = int(logits.shape[0])
            return sampler(logits, reqs, *args)

        self._originals = (schedule, run, sampler)
        engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        engine.runner.run = recording_run  # type: ignore[method-assign]
        engine.runner.sampler = recording_sampler  # type: ignore[assignment]

    def restore(self) -> None:
        """Stop recording (for an engine that other tests share)."""
        schedule, run, sampler = self._originals
        self.engine.scheduler.schedule = schedule  # type: ignore[method-assign]
        self.engine.runner.run = run  # type: ignore[method-assign]
        self.engine.runner.sampler = sampler

    @property
    def mixed_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.is_mixed]

    def first_steps(self) -> dict[str, StepRecord]:
        """The step in which each request computed its first tokens."""
        first: dict[str, StepRecord] = {}
        for step in self.steps:
            for rid, *_ in step.seqs:
                first.setdefault(rid, step)
        return first


def run_waves(
    engine: Engine,
    waves: list[tuple[int, list[list[int]]]],
    params: SamplingParams,
    between: Callable[[int, Engine], None] | None = None,
) -> dict[str, RequestOutput]:
    """Add wave k's prompts (as requests ``w{k}p{i}``) before step ``at`` (waves sorted by
    ``at``) and step until every request finished; ``between(step, engine)`` runs before
    each step. Returns the finished outputs by request id."""
    finished: dict[str, RequestOutput] = {}
    pending = list(enumerate(waves))
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][1][0] <= step:
            k, (_, prompts) = pending.pop(0)
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, params, request_id=f"w{k}p{i}")
        if between is not None:
            between(step, engine)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return finished

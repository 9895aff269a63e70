"""The loop that drives engine steps: overlapped (step N+1 launched before step N lands)
or plain (``Engine.step``).

Overlapped, one turn is: schedule step N+1 and launch it (the decode input of a request
whose step-N token is still on the device is a reference into FutureTokens, swapped for
the token on the device), then land step N: wait for its tokens, append them, check
stops, detokenize and emit outputs, all while the device runs step N+1.

Invariant: every sampled token lands exactly once, in launch order, and a request's
``output_ids`` only ever grow by landed tokens; so outputs equal the plain loop's. A
request that a landed token ends may already be in the step in flight: that step's
token for it is dropped when it lands, and its KV slot was released with the request.
Steps whose sampling reads a request's history on the host (grammar masks, penalties,
``min_tokens``) land the step in flight first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.config import EngineConfig
from engine.request import Req
from engine.sampler import SamplerOutput, has_penalties
from engine.scheduled_batch import ScheduledBatch
from engine.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.request import RequestOutput

logger = logging.getLogger("hiserve.engine")

# Device types the overlapped loop is on for by default: none yet. On the CPU the forward
# runs on the host's own cores, so there is nothing to overlap with (docs/performance.md);
# on cuda and musa it has not yet run on a device (tests/gpu/test_gpu_overlap.py is
# written, not run), so it stays opt-in there until the device check passes it.
OVERLAP_DEVICES: tuple[str, ...] = ()


def overlap_enabled(config: EngineConfig, device_type: str) -> bool:
    """Whether the engine drives its steps overlapped (see EngineConfig)."""
    if config.disable_overlap_schedule is None:
        enabled = device_type in OVERLAP_DEVICES
    else:
        enabled = not config.disable_overlap_schedule
    if enabled and config.tensor_parallel_size > 1:
        # The other ranks replay rank 0's inputs: they have no future tokens to resolve.
        logger.info("overlapped scheduling is off under tensor parallelism")
        return False
    return enabled


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued; its tokens land later."""

    batch: ScheduledBatch
    result: SamplerOutput | None  # None: no row sampled (prefill chunks only)
    # When its forward was queued (``perf_counter``), taken before the forward runs: a
    # forward on the CPU runs to its end inside the launch.
    started: float


class StepDriver(Protocol):
    """What drives the engine: ``Engine`` itself (plain) or ``OverlapLoop``."""

    @property
    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


class SteppedEngine(Protocol):
    """What the overlapped loop calls on the engine (``Engine`` has each of these)."""

    scheduler: Scheduler

    @property
    def has_work(self) -> bool: ...

    def drain_ended(self) -> list[RequestOutput]: ...

    def idle(self) -> None: ...

    def launch(self, batch: ScheduledBatch, keep_future: bool = False) -> LaunchedStep: ...

    def land(self, step: LaunchedStep) -> list[RequestOutput]: ...


def needs_landed_tokens(req: Req) -> bool:
    """Whether sampling ``req``'s next token reads its earlier tokens on the host."""
    params = req.params
    return (
        req.grammar is not None or has_penalties(params) or len(req.output_ids) < params.min_tokens
    )


class OverlapLoop:
    """Keeps one step in flight: launches step N+1, then lands step N."""

    def __init__(self, engine: SteppedEngine) -> None:
        self.engine = engine
        self.in_flight: LaunchedStep | None = None
        self.overlapped_steps = 0  # steps landed while the next one was already queued

    @property
    def has_work(self) -> bool:
        return self.in_flight is not None or self.engine.has_work

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        outputs: list[RequestOutput] = []
        if self.in_flight is not None and any(
            needs_landed_tokens(r) for r in engine.scheduler.running
        ):
            outputs.extend(self._land())
        outputs.extend(engine.drain_ended())
        batch = engine.scheduler.schedule()
        launched = engine.launch(batch, keep_future=True) if batch is not None else None
        if self.in_flight is not None:
            self.overlapped_steps += launched is not None
            outputs.extend(self._land())  # while the device runs ``launched``
        elif launched is None and not outputs:
            engine.idle()
        self.in_flight = launched
        return outputs

    def _land(self) -> list[RequestOutput]:
        step, self.in_flight = self.in_flight, None
        assert step is not None
        return self.engine.land(step)

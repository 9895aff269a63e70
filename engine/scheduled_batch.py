"""One forward pass as the scheduler hands it to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.request import Req


@dataclass
class ScheduledBatch:
    """One forward pass: sequence b computes tokens ``[starts[b], starts[b]+extend_lens[b])``.

    The first ``num_decodes`` sequences decode one token each; the rest are prefill chunks
    (a mixed batch has both).
    """

    num_decodes: int
    reqs: list[Req]
    starts: list[int]
    extend_lens: list[int]
    out_slots: torch.Tensor  # [sum(extend_lens)] int64
    sample: list[bool]  # whether sequence b samples a token after this pass
    retracted: list[Req] = field(default_factory=list)
    kv_loads: list[Any] = field(default_factory=list)  # host-tier loads to wait for

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return self.num_decodes == len(self.reqs)

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.reqs)

    @property
    def prefill_reqs(self) -> list[Req]:
        return self.reqs[self.num_decodes :]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.extend_lens[self.num_decodes :])

    @classmethod
    def prefill(
        cls,
        reqs: list[Req],
        starts: list[int],
        lens: list[int],
        slots: list[torch.Tensor],
        sample: list[bool],
    ) -> ScheduledBatch | None:
        """Prefill chunks only (None where there are none): chunk b computes ``lens[b]``
        tokens from ``starts[b]`` into ``slots[b]``."""
        if not reqs:
            return None
        return cls(0, reqs, starts, lens, torch.cat(slots), sample)

    @classmethod
    def merge(cls, decode: ScheduledBatch, prefill: ScheduledBatch) -> ScheduledBatch:
        """One mixed forward: ``decode``'s sequences first, then ``prefill``'s chunks."""
        return cls(
            decode.num_decodes,
            decode.reqs + prefill.reqs,
            decode.starts + prefill.starts,
            decode.extend_lens + prefill.extend_lens,
            torch.cat([decode.out_slots, prefill.out_slots]),
            decode.sample + prefill.sample,
            decode.retracted,
        )

"""What the sampler returns: the chosen tokens, still on the device, and logprobs."""

from __future__ import annotations

from typing import Any

import torch

from engine.host_alloc import pinned_empty
from engine.platform import new_event, parse_device
from engine.request import TokenLogprob


class SamplerOutput:
    """The token chosen per row, still on the device, and the logprobs asked for.

    NOTE: ``token_ids`` is the one place the host waits for the device in a step. The
    overlapped loop calls ``start_download`` at once and reads ``token_ids`` only after
    it has launched the next step; the plain loop reads it straight away.
    """

    def __init__(self, tokens: torch.Tensor, logprobs: list[TokenLogprob | None]) -> None:
        self.tokens = tokens  # [B] int64 on the device
        self.logprobs = logprobs  # [B] None where the row did not ask for logprobs
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._ids: list[int] | None = None

    def start_download(self) -> None:
        """Copy the tokens into pinned host memory without waiting (accelerators only)."""
        if self.tokens.device.type == "cpu" or self._host is not None:
            return
        self._host = pinned_empty(self.tokens.numel(), torch.int64)
        self._host.copy_(self.tokens, non_blocking=True)
        self._event = new_event(parse_device(self.tokens.device))
        if self._event is not None:
            self._event.record()

    @property
    def token_ids(self) -> list[int]:
        """[B] the chosen tokens on the host (waits for them on the first call)."""
        if self._ids is None:
            if self._host is None:
                self._ids = self.tokens.tolist()
            else:
                if self._event is not None:
                    self._event.synchronize()
                self._ids = self._host.tolist()
        return self._ids

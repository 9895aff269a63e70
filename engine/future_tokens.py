"""Tokens a step samples, referenced by index before the host has them ("future" ids).

The overlapped loop (engine/step_loop.py) launches step N+1 before step N's sampled
tokens reach the host. A request whose last token is still on the device feeds step
N+1 a *reference*, ``-1 - index``, into a device buffer that step N's sampler output was
copied into; the forward swaps every reference for its token on the device, in stream
order, so the host never waits for it. Real token ids are never negative.
"""

from __future__ import annotations

import torch


class FutureTokens:
    """Two halves of one device buffer, used by alternate steps.

    NOTE: a reference is only ever read by the step launched right after the one that
    wrote it (the loop lands step N before it schedules step N+2), so two halves of
    ``max_rows`` each never overwrite a token that a queued step still reads.
    """

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.buffer = torch.zeros(2 * max_rows, dtype=torch.int64, device=device)
        self._half = 0

    @staticmethod
    def ref(index: int) -> int:
        """The input id that stands for the token at ``index`` of the buffer."""
        return -1 - index

    def store(self, tokens: torch.Tensor) -> int:
        """Copy one step's sampled ``tokens`` [S] (on the device) into the next half;
        returns the index of the first (row i is at ``first + i``)."""
        count = tokens.numel()
        if count > self.max_rows:
            raise ValueError(f"{count} sampled rows; the buffer holds {self.max_rows} a step")
        first = self._half * self.max_rows
        self._half ^= 1
        self.buffer[first : first + count].copy_(tokens, non_blocking=True)
        return first

    def resolve(self, input_ids: torch.Tensor) -> None:
        """Replace, in place and on the device, every reference in ``input_ids`` by its
        token (no host sync)."""
        index = (-1 - input_ids).clamp_(0, self.buffer.numel() - 1)
        input_ids.copy_(torch.where(input_ids < 0, self.buffer[index], input_ids))

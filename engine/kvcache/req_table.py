"""Request table: row r, column i holds the KV slot of token i of the request in row r."""

from __future__ import annotations

import torch


class ReqTable:
    """``[max_running_requests, max_context]`` int32 on the device, plus a free-row list."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.max_context = max_context
        self.table = torch.zeros(max_rows, max_context, dtype=torch.int32, device=device)
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request-table row; admission must check free_rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        # NOTE: a stale row keeps old slot ids; readers only look at [0, seq_len) of
        # rows they own, so it is not cleared.
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set columns ``start .. start+len(slots)-1`` of ``row``."""
        if slots.numel():
            self.table[row, start : start + slots.numel()] = slots.to(
                device=self.table.device, dtype=torch.int32
            )

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of tokens ``start .. end-1`` of ``row`` as int64 on the CPU."""
        return self.table[row, start:end].to(device="cpu", dtype=torch.int64)

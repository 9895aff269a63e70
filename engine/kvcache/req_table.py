"""Request table: row r, column i holds the KV slot of token i of the request in row r."""

from __future__ import annotations

import torch

from engine.host_alloc import pinned_empty

# (row, start, slots) of every write, in order: what the other tensor-parallel ranks replay.
TableJournal = list[tuple[int, int, torch.Tensor]]


class ReqTable:
    """``[max_running_requests, max_context]`` int32 on the device, plus a free-row list.

    NOTE: the CPU mirror ``cpu`` is the source of truth; every read uses it, so nothing
    waits for the device. On an accelerator, writes collect there and ``flush()`` sends
    them in one upload before the forward that reads ``table``.
    """

    def __init__(
        self,
        max_rows: int,
        max_context: int,
        device: torch.device,
        journal: TableJournal | None = None,
    ) -> None:
        self.max_rows = max_rows
        self.max_context = max_context
        self.cpu = torch.zeros(max_rows, max_context, dtype=torch.int32)
        self.on_device = torch.device(device).type != "cpu"
        self.table = (
            torch.zeros(max_rows, max_context, dtype=torch.int32, device=device)
            if self.on_device
            else self.cpu
        )
        self._dirty: list[tuple[int, int, int]] = []  # (row, start, length) not yet uploaded
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))
        # Tensor parallel (rank 0): every write, for the other ranks' copies of the table.
        self.journal = journal

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
        """Set columns ``start .. start+len(slots)-1`` of ``row`` (CPU slots)."""
        n = slots.numel()
        if n:
            self.cpu[row, start : start + n] = slots.to(dtype=torch.int32)
            if self.journal is not None:
                self.journal.append((row, start, self.cpu[row, start : start + n].clone()))
            if self.on_device:
                self._dirty.append((row, start, n))

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of tokens ``start .. end-1`` of ``row`` as int64 on the CPU."""
        return self.cpu[row, start:end].to(torch.int64)

    def slot(self, row: int, column: int) -> int:
        return int(self.cpu[row, column])

    def flush(self) -> None:
        """Upload the writes since the last flush: one pinned buffer, one asynchronous
        copy, one scatter on the device (ordered before the forward that reads them)."""
        if not self._dirty:
            return
        flat = torch.cat(
            [
                torch.arange(row * self.max_context + start, row * self.max_context + start + n)
                for row, start, n in self._dirty
            ]
        )  # [N] positions in the flattened table
        self._dirty.clear()
        staged = pinned_empty(2 * flat.numel(), torch.int64)
        staged[: flat.numel()] = flat
        staged[flat.numel() :] = self.cpu.view(-1)[flat]
        uploaded = staged.to(self.table.device, non_blocking=True)  # [2 * N]
        positions, values = uploaded.split(flat.numel())
        self.table.view(-1).index_copy_(0, positions, values.to(torch.int32))

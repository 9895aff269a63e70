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
        # Writes not yet uploaded: runs as (flat start, length) and single cells as flat
        # positions (one tensor per batched write); flat = row * max_context + column.
        self._dirty_runs: list[tuple[int, int]] = []
        self._dirty_cells: list[torch.Tensor] = []
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
                self._dirty_runs.append((row * self.max_context + start, n))

    def write_cells(self, rows: torch.Tensor, columns: torch.Tensor, slots: torch.Tensor) -> None:
        """Set one cell per row: ``table[rows[i], columns[i]] = slots[i]`` (CPU tensors,
        ``[B]`` each), for a whole decode step at once."""
        if not rows.numel():
            return
        self.cpu[rows, columns] = slots.to(torch.int32)
        if self.journal is not None:  # tensor parallel: one record per row, as write() does
            for row, column, slot in zip(rows.tolist(), columns.tolist(), slots.split(1)):
                self.journal.append((row, column, slot.to(torch.int32)))
        if self.on_device:
            self._dirty_cells.append(rows.to(torch.int64) * self.max_context + columns)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of tokens ``start .. end-1`` of ``row`` as int64 on the CPU."""
        return self.cpu[row, start:end].to(torch.int64)

    def slot(self, row: int, column: int) -> int:
        return int(self.cpu[row, column])

    def flush(self) -> None:
        """Upload the writes since the last flush: one pinned buffer, one asynchronous
        copy, one scatter on the device (ordered before the forward that reads them).
        Its cost does not grow with the number of writes: every run is expanded to its
        positions in one ``repeat_interleave``."""
        parts = list(self._dirty_cells)
        if self._dirty_runs:
            starts, lengths = torch.tensor(self._dirty_runs, dtype=torch.int64).unbind(1)
            # Position j of the expanded runs: its run's start + (j - the run's offset).
            offsets = torch.cumsum(lengths, 0) - lengths  # [R] where each run begins
            shift = torch.repeat_interleave(starts - offsets, lengths)  # [N]
            parts.append(torch.arange(shift.numel()) + shift)
        if not parts:
            return
        self._dirty_runs.clear()
        self._dirty_cells.clear()
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N] flat positions
        n = flat.numel()
        staged = pinned_empty(2 * n, torch.int64)
        staged[:n] = flat
        staged[n:] = self.cpu.view(-1)[flat]
        uploaded = staged.to(self.table.device, non_blocking=True)  # [2 * N]
        positions, values = uploaded.split(n)
        self.table.view(-1).index_copy_(0, positions, values.to(torch.int32))

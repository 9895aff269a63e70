"""Free list of device KV slots, handed out in pages of ``page_size`` tokens."""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free pages than asked for (the caller should evict first)."""


class PageAllocator:
    """Hands out whole pages; slot ``s`` belongs to page ``s // page_size``.

    NOTE: page 0 (slots ``0 .. page_size-1``) is reserved: slot 0 is the dummy target of
    padded writes. Usable capacity is ``num_pages * page_size`` tokens, slots
    ``page_size .. (num_pages + 1) * page_size - 1``.

    The free list is a CPU tensor used as a stack, so handing out or taking back any
    number of pages is a few tensor operations, never one per page. Frees are only
    recorded; the next call that needs the free list takes back every page freed since
    in one batch (a step's finished and retracted requests together).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        # [num_pages] page ids; [0, _num_free) is the stack, its top at the end. Popped
        # from the end: low page ids are handed out first.
        self._stack = torch.arange(num_pages, 0, -1, dtype=torch.int64)
        self._num_free = num_pages
        self._pending: list[torch.Tensor] = []  # freed slot runs not yet on the stack
        self._pending_sizes: list[int] = []  # their lengths
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    @property
    def num_slots(self) -> int:
        """Size of the slot index space, reserved page included."""
        return (self.num_pages + 1) * self.page_size

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        self._settle()
        return self._num_free

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_size

    def free_page_ids(self) -> list[int]:
        """The free pages, next to be handed out first (for tests and debugging)."""
        self._settle()
        return self._stack[: self._num_free].flip(0).tolist()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc_page_ids(self, num_pages: int) -> torch.Tensor:
        """``num_pages`` fresh pages, ``[num_pages]`` int64 page ids (lowest first)."""
        if num_pages > self.free_pages:
            raise OutOfSlotsError(f"asked for {num_pages} KV pages, only {self._num_free} are free")
        top = self._num_free
        self._num_free = top - num_pages
        return self._stack[top - num_pages : top].flip(0)

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        """Return the slots of ``num_pages`` fresh pages, ``[num_pages * page_size]`` int64."""
        page_ids = self.alloc_page_ids(num_pages)  # [num_pages]
        return (page_ids[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages covering ``slots`` (whole pages of a request or a tree node;
        the last page of a request may be partly used). Taken back at the next use."""
        n = slots.numel()
        if n:
            self._pending.append(slots.reshape(-1))
            self._pending_sizes.append(n)

    def _settle(self) -> None:
        """Push every page freed since the last call onto the stack, in one batch."""
        if not self._pending:
            return
        runs, sizes = self._pending, self._pending_sizes
        self._pending, self._pending_sizes = [], []
        pages = torch.cat(runs).to(torch.int64) // self.page_size  # [slots freed]
        # NOTE: freeing a page twice would hand it to two owners; catch it at the source.
        # A page belongs to one owner, so it appears in one run only: count distinct
        # (page, run) pairs against distinct pages.
        run_ids = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(sizes))
        pairs = torch.unique(pages * len(runs) + run_ids)  # [distinct (page, run)]
        page_ids = torch.unique(pairs // len(runs))  # [n] ascending
        if page_ids.numel() != pairs.numel():
            raise RuntimeError("KV page freed twice: two frees named the same page")
        n = page_ids.numel()
        if self._num_free + n > self.num_pages:
            raise RuntimeError("KV page freed twice: free list longer than the pool")
        # Stored descending (the top at the end): pages freed together are handed out
        # again lowest first.
        self._stack[self._num_free : self._num_free + n] = page_ids.flip(0)
        self._num_free += n

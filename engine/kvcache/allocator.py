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
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        # Popped from the end: low page ids are handed out first.
        self._free_pages: list[int] = list(range(num_pages, 0, -1))
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
        return len(self._free_pages)

    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        """Return the slots of ``num_pages`` fresh pages, ``[num_pages * page_size]`` int64."""
        if num_pages > len(self._free_pages):
            raise OutOfSlotsError(
                f"asked for {num_pages} KV pages, only {len(self._free_pages)} are free"
            )
        if num_pages == 0:
            return torch.empty(0, dtype=torch.int64)
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        page_ids = torch.tensor(pages, dtype=torch.int64)
        return (page_ids[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages covering ``slots`` (a page-aligned run of whole pages)."""
        if slots.numel() == 0:
            return
        page_ids = torch.unique(slots // self.page_size).tolist()
        # NOTE: freeing a page twice would hand it to two owners; catch it at the source.
        if __debug__ and len(page_ids) + len(self._free_pages) > self.num_pages:
            raise RuntimeError("KV page freed twice: free list longer than the pool")
        self._free_pages.extend(page_ids)

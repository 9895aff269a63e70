"""Slot runs for the replay's zero-byte pools: only their length means anything.

The replay's pools hold no bytes and nothing ever reads a slot's KV, so the only thing
the tree and the replay need of a node's slot tensor is how many slots it holds. Real
int64 tensors cost about a microsecond per slice, clone and cat, a dozen times per
replayed request (two fifths of the replay's CPU, measured on the 100k-request trace).
``SlotRun`` stands in for them in the counting pools (bench/whatif_sim.py): it
slices, clones, counts (``numel``) and concatenates (``torch.cat``, through torch's
``__torch_function__`` protocol, also with the tree's real empty tensor), and any other
torch function raises, so a tree change that starts reading slots fails loudly.
tests/unit/test_whatif.py replays traces over real tensors and real pools too and
compares every request's hits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class SlotRun:
    """``n`` slots whose values never matter: a tensor's length, and nothing else."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __getitem__(self, index: slice) -> SlotRun:
        start, stop, step = index.indices(self.n)
        assert step == 1, "the tree only takes contiguous runs of slots"
        return SlotRun(max(stop - start, 0))

    def clone(self) -> SlotRun:
        return self  # nothing to copy, and a run is never changed in place

    def numel(self) -> int:
        return self.n

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> SlotRun:
        if func is not torch.cat or kwargs:
            raise TypeError(f"the replay's slot runs only concatenate, not {func}")
        return SlotRun(sum(int(part.numel()) for part in args[0]))


def slot_run(n: int) -> torch.Tensor:
    """A run of ``n`` slots, typed as the tensor it stands in for."""
    return SlotRun(n)  # type: ignore[return-value]

"""Prefills of one prefix share their work: a waiting request whose prompt an in-flight
prefill is computing now waits for it to land in the prefix tree, then reuses its pages,
instead of computing the same tokens beside it.
"""

from __future__ import annotations

from engine.request import Req

# Shared, uncached tokens always worth waiting a step for (SGLang's in-batch prefix
# threshold is the same 32). Fewer are worth it only where they are at least half of what
# the request would compute: waiting costs the waiter one whole prefill step of latency.
# NOTE: with page size 1 and no such bound, prompts that only shared their first word
# made 2 of a burst of 32 wait for the ~1 s step that prefilled the other 30, to save
# one token each (random 128-token prompts, 2026-12-06).
MIN_SHARED_TOKENS = 32


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; slices compare at C speed, so a binary search
    over slice equality beats a Python loop over long prompts."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n - 1  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def waits_for_in_flight(req: Req, cached_len: int, in_flight: list[Req], page_size: int) -> bool:
    """Whether ``req`` would prefill tokens that an in-flight prefill is computing now.

    NOTE: this never deadlocks: the requests waited for are running (they hold their KV
    and make progress every prefill step); once they land, finish, are retracted or
    aborted they leave ``in_flight`` and the waiter is admitted as usual.
    """
    key = req.all_ids[: req.seq_len - 1]  # what admission matches against the tree
    pending = req.seq_len - cached_len  # what it would compute if admitted now
    for other in in_flight:
        if other.cache_salt != req.cache_salt:
            continue  # another tenant's pages are never this request's hit
        shared = common_prefix_len(key, other.prompt_ids) - cached_len
        # A whole page at least (the tree caches whole pages only), and enough to pay.
        if shared >= page_size and (shared >= MIN_SHARED_TOKENS or 2 * shared >= pending):
            return True
    return False

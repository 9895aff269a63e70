"""Why the uncached part of a prompt missed: one reason per token.

Every prompt token is either cached (device, host or storage) or counted under exactly
one reason, so for each request ``cached + MissReasons.total == prompt tokens``:

- ``below_page``: no cache could have served it: the tokens past the last whole page
  before the final prompt token (that token is always computed, for its logits), or the
  whole prompt of a request that scores it (``prompt_logprobs`` matches nothing);
- ``not_loaded``: on the host tier, but recomputed: a host hit shorter than
  ``--hicache-load-threshold``, or no device room to load it back;
- ``storage_timeout``: the L3 store was asked for it and did not deliver in time (its
  lookup or read ran past the prefetch deadline, or failed); a lookup that never
  answered counts every token it asked about;
- ``evicted``: this process cached it once, and it is gone from the device and host
  tiers (and was not read from L3);
- ``never_seen``: this process never cached it (or it fell out of the eviction record);
- ``not_routed``: a router sent the request here, away from the replica that had it.
  A single server cannot know that: always 0 here (the field is for routers).

Evicted vs never seen: see engine/kvcache/evicted_pages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

MISS_REASONS = (
    "never_seen",
    "evicted",
    "below_page",
    "not_loaded",
    "storage_timeout",
    "not_routed",
)


@dataclass(frozen=True)
class MissReasons:
    """Uncached prompt tokens of one request (or a sum of them), by reason."""

    never_seen: int = 0
    evicted: int = 0
    below_page: int = 0
    not_loaded: int = 0
    storage_timeout: int = 0
    not_routed: int = 0

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MISS_REASONS}

    def __add__(self, other: MissReasons) -> MissReasons:
        mine, theirs = self.as_dict(), other.as_dict()
        return MissReasons(**{name: mine[name] + theirs[name] for name in MISS_REASONS})


def _inside(position: int, span: tuple[int, int] | None) -> bool:
    return span is not None and span[0] <= position < span[1]


def attribute(
    prompt_len: int,
    cacheable_len: int,
    cached_len: int,
    seen: tuple[int, int] | None = None,
    not_loaded: tuple[int, int] | None = None,
    late: tuple[int, int] | None = None,
) -> MissReasons:
    """Split the uncached tokens of one prompt into reasons.

    ``cacheable_len``: tokens a cache could serve at most (whole pages);
    ``cached_len``: tokens it did serve (every tier); ``seen``, ``not_loaded``,
    ``late``: the spans of prompt positions that were evicted once, left on the host
    tier, and asked of the store in vain. A position counts
    once, under the first of not_loaded, storage_timeout, evicted that covers it, else
    under never_seen.
    """
    assert 0 <= cached_len <= cacheable_len <= prompt_len, (cached_len, cacheable_len)
    counts = dict.fromkeys(MISS_REASONS, 0)
    counts["below_page"] = prompt_len - cacheable_len
    cuts = {cached_len, cacheable_len}
    for span in (not_loaded, late, seen):
        if span is not None:
            cuts.update(min(max(edge, cached_len), cacheable_len) for edge in span)
    edges = sorted(cuts)
    for start, end in pairwise(edges):  # segments of one reason each
        if _inside(start, not_loaded):
            reason = "not_loaded"
        elif _inside(start, late):
            reason = "storage_timeout"
        elif _inside(start, seen):
            reason = "evicted"
        else:
            reason = "never_seen"
        counts[reason] += end - start
    return MissReasons(**counts)

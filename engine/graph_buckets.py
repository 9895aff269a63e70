"""The batch and context sizes device graphs are captured for, and the lookup of a step's."""

from __future__ import annotations

import bisect

# The smallest context bucket (gather fallback): below it, one bucket covers every short
# conversation.
MIN_CONTEXT_BUCKET = 256


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 to 64, every 16 to 256,
    every 32 beyond (SGLang's spacing), always ending at ``max_batch``."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16), *range(288, max_batch + 1, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts a mixed step is padded to (engine/mixed_graphs.py): powers of two from
    ``smallest`` to 512, then every 256 to 4,096, every 1,024 to 16,384, every 4,096
    beyond, always ending at ``max_tokens``: padding costs at most a quarter of a step
    past 1,024 tokens, and a 16k prefill budget needs 32 graphs, not 70."""
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s >= smallest]
    sizes += [*range(768, 4097, 256), *range(5120, 16385, 1024)]
    sizes += range(20480, max_tokens + 1, 4096)
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def context_buckets(max_context: int, smallest: int = MIN_CONTEXT_BUCKET) -> list[int]:
    """Context lengths the decode attention is padded to: powers of two from ``smallest``,
    the last one cut to ``max_context`` (the request table's width)."""
    buckets = []
    size = smallest
    while size < max_context:
        buckets.append(size)
        size *= 2
    return [*buckets, max_context]


def bucket_for(value: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= ``value``; None when ``value`` is past the largest."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None

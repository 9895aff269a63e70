"""Host memory bandwidth, the yardstick of the single-stream floors.

Both figures stream a tensor far larger than the CPU caches (L3 is 32 MiB on the boxes
measured), take the best of several repeats, and use torch's own threads, as the engine
does. What made them swing between runs (34-50 GB/s for the copy on one quiet machine):

- first touch: a fresh tensor's pages fault in on first use; the buffers are written once
  before any timed pass, so no timed pass takes a page fault;
- one slow pass: a neighbour holding one core stalls the other thread at the end of the
  pass, so the best of several repeats is the figure, and the median is printed next to
  it to show the spread;
- a copy counts bytes read plus bytes written, but a cached store first reads the target
  line (three memory transfers per element, not two) unless the copy uses non-temporal
  stores, which depends on the size and the C library: the copy figure moves with that,
  the read-only one does not. A GEMV only reads its weights, so the read stream is its
  honest ceiling; the copy is kept because the issue's goal is stated against it;
- page size: the same read stream over 2 MiB transparent huge pages (madvise) read 33-35
  GB/s in a loaded run where 4 KiB pages gave 18-26. torch allocates in 4 KiB pages
  unless the process starts with THP_MEM_ALLOC_ENABLE=1, and so are the model's weights,
  so the figures here use torch's allocator like the weights do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch


class Bandwidth(NamedTuple):
    """Bytes/s over the repeats: the best pass and the median one."""

    best: float
    median: float


def _timed(fn: Callable[[], object], nbytes: int, repeats: int) -> Bandwidth:
    fn()  # warm: pages faulted in, threads up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Bandwidth(nbytes / min(times), nbytes / statistics.median(times))


def read_bandwidth(megabytes: int = 512, repeats: int = 7) -> Bandwidth:
    """Bytes/s of a read-only stream: ``sum`` over a float32 tensor of ``megabytes`` MiB
    (counts the bytes read; the sum itself is one value)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)  # written: pages faulted in
    return _timed(src.sum, src.numel() * src.element_size(), repeats)


def copy_bandwidth(megabytes: int = 256, repeats: int = 7) -> Bandwidth:
    """Bytes/s of a large tensor copy, counted as bytes read plus bytes written (as
    STREAM's copy does)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    return _timed(lambda: dst.copy_(src), 2 * src.numel() * src.element_size(), repeats)

"""The process heap after start-up and while serving: what glibc keeps of freed memory,
and the Python objects start-up leaves for the cyclic collector.

- While serving (``keep_freed_memory``): glibc maps each allocation above a threshold
  that adapts from 128 KiB afresh and unmaps it again when it is freed, and gives the
  heap's top back above a trim threshold. A prefill step's tensors (tens of MB each)
  were then new pages every step, each faulted in and zeroed by the kernel: 12% of a
  4,096-token prefill of the default model was page faults (perf), and with the
  thresholds below the step took 1.5 s instead of 2.1-2.2 s. tcmalloc, which vLLM's CPU
  backend preloads, keeps freed memory the same way. The cost is resident memory that
  stays at the largest step's working set: 251 MiB after a 4,096-token step of the
  default model in bf16, against 56 MiB with glibc's defaults.
- After start-up (``trim_heap``): the memory that loading a model frees (read buffers,
  copies of GGUF blocks, first columns, tokenizer parsing) goes back to the OS; kept, it
  counts as resident memory that nothing uses: about 430 MB after building a 3B packed
  model (docs/weights.md).

- After start-up (``freeze_objects``): the Python objects start-up made (modules,
  classes, the tokenizer's and the grammar backend's tables: about 256,000 for the
  default model) are moved out of the cyclic collector's reach, as vLLM and SGLang do
  (``gc.freeze``). Every full collection walked them all: about 100 ms with the GIL
  held, a stall of every stream and of the engine loop each time the allocations of
  serving set one off (the server's event loop spent 0.1 s more CPU in the first
  burst after start-up than in later ones; 2026-12-06).

The first two are glibc's (``mallopt``, ``malloc_trim``); elsewhere (musl, macOS,
Windows) nothing happens.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations below this come from the heap and are reused once freed: a 4,096-token
# step's largest tensors are 50 MB. Some glibc versions refuse more than half a thread
# arena's 64 MiB heap; then FALLBACK_BELOW.
KEEP_BELOW = 64 << 20
FALLBACK_BELOW = 32 << 20
# Free memory at the heap's top is given back only beyond this.
TRIM_ABOVE = 256 << 20


def _libc() -> Any | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (KEEP_BELOW, TRIM_ABOVE) for this process;
    True if set. An operator's own ``glibc.malloc`` settings in ``GLIBC_TUNABLES`` stand
    (and ``HISERVE_KEEP_FREED_MEMORY=0`` leaves glibc's defaults)."""
    if os.environ.get("HISERVE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        logger.info("GLIBC_TUNABLES sets malloc's own thresholds; leaving them")
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    kept = mallopt(M_MMAP_THRESHOLD, KEEP_BELOW) or mallopt(M_MMAP_THRESHOLD, FALLBACK_BELOW)
    return bool(kept) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))


def trim_heap() -> bool:
    """``malloc_trim(0)`` where the C library has it (glibc); True if it ran."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def freeze_objects() -> int:
    """Collect start-up's garbage, then freeze every object left (``gc.freeze``): later
    collections skip them. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

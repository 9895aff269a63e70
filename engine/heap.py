"""Giving the C heap's free pages back to the OS once start-up is over.

glibc keeps the memory that loading a model frees (read buffers, copies of GGUF blocks,
first columns, tokenizer parsing) for reuse; it counts as resident memory that nothing
uses: about 430 MB after building a 3B packed model (docs/weights.md).
"""

from __future__ import annotations

import ctypes


def trim_heap() -> bool:
    """``malloc_trim(0)`` where the C library has it (glibc); True if it ran. Elsewhere
    (musl, macOS, Windows) nothing happens."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True

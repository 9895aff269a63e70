"""Native CPU kernels (engine/layers/csrc), compiled once on first use.

``torch.utils.cpp_extension`` builds them with the machine's C++ compiler and ninja into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and reuses the build
afterwards. Where there is no compiler or the build fails, callers get None and keep the
pure-PyTorch path; the reason is logged once and kept in ``build_error()``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
# A build lock older than this was left by an interrupted build (torch would wait on it
# forever); a real build takes well under a minute.
STALE_LOCK_SECONDS = 600.0
_lock = threading.Lock()
_module: Any | None = None
_error: str | None = None


def _cflags() -> list[str]:
    # -fopenmp: at::parallel_for is a header template that runs its OpenMP loop in this
    # module's own code; without the flag it silently runs on one thread. The loader
    # resolves libgomp.so.1 to the copy torch has already loaded, so there is one runtime.
    flags = ["-O3", "-fopenmp"]
    # Vector width from what torch itself detected on this CPU (never -march=native: a
    # build cache shared with another machine must still run there).
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def clear_stale_build_lock(name: str) -> bool:
    """Remove the build lock of extension ``name`` if a killed build left it behind."""
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    logger.warning("removing %s, left %.0f s ago by an interrupted kernel build", lock, age)
    lock.unlink(missing_ok=True)
    return True


def paged_decode_kernel() -> Any | None:
    """The compiled module (``paged_decode(q, k_cache, v_cache, table, rows, lens, scale)``),
    or None when it cannot be built here."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        flags = _cflags()
        # The name carries the source and flags: a changed kernel is never served stale.
        digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()
        name = f"hiserve_paged_decode_{digest[:12]}"
        try:
            from torch.utils import cpp_extension

            logger.info("loading the native CPU attention kernel (built once on first use)")
            clear_stale_build_lock(name)
            _module = cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a failed build: keep PyTorch
            lines = str(exc).strip().splitlines()
            _error = f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
            logger.warning(
                "native CPU attention kernel unavailable (%s); decode attention runs in "
                "PyTorch. It needs a C++ compiler and ninja (pip install 'hiserve[cpu]').",
                _error,
            )
        return _module


def build_error() -> str | None:
    """Why the kernel could not be built (None if it was, or was never tried)."""
    return _error

"""Native CPU kernels (engine/layers/csrc), compiled once on first use.

``torch.utils.cpp_extension`` builds them with the machine's C++ compiler and ninja into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and reuses the build
afterwards. Where there is no compiler or the build fails, callers get None and keep the
pure-PyTorch path; the reason is logged once and kept in ``build_error()``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _cflags(avx512: bool = False) -> list[str]:
    # -fopenmp: at::parallel_for is a header template that runs its OpenMP loop in this
    # module's own code; without the flag it silently runs on one thread. The loader
    # resolves libgomp.so.1 to the copy torch has already loaded, so there is one runtime.
    flags = ["-O3", "-fopenmp"]
    # Vector width from what torch itself detected on this CPU (never -march=native: a
    # build cache shared with another machine must still run there).
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]  # F16C: every AVX2 CPU has it
    # Only for a source written for it (``avx512=True``): the others keep their AVX2 build.
    # torch reports AVX512 only where avx512f/bw/vl/dq all exist; 512-bit vectors
    # preferred, or GCC's generic tuning keeps auto-vectorized loops at 256 bits.
    if avx512 and capability == "AVX512":
        flags += ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"]
        flags += ["-mprefer-vector-width=512"]
    return flags


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold the build of extension ``name`` against every other hiserve process, and clear
    what a killed build left behind.

    NOTE: torch's own build lock is a plain file (``<build dir>/lock``) that a build killed
    midway leaves in place, and every later load then waits on it forever (CI once hung
    this way after a test process was killed during a first build). hiserve's loads first
    take an ``flock`` on a file beside it, which the kernel releases when its holder dies:
    whoever holds the flock and still finds torch's lock knows its builder is gone.
    """
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "hiserve.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            lock = build_dir / "lock"
            if lock.exists():
                logger.warning("removing %s, left by an interrupted kernel build", lock)
                lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class NativeExtension:
    """One C++ source in csrc/, built on first use (once per process; the build itself is
    cached across processes), or the reason it could not be."""

    def __init__(
        self,
        source: str,
        prefix: str,
        what: str,
        fallback: str,
        log: logging.Logger,
        avx512: bool = False,
    ) -> None:
        self.source = Path(__file__).parent / "csrc" / source
        self.prefix = prefix  # extension name before the digest
        self.what = what  # for the log lines: "native CPU attention kernel"
        self.fallback = fallback  # what runs instead, said when the build fails
        self.log = log
        self.avx512 = avx512  # AVX-512 code paths, where torch found AVX-512 on this CPU
        self.module: Any | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load_for(self, model: torch.nn.Module, env_switch: str) -> Any | None:
        """The compiled module for a float32 CPU ``model`` whose ``env_switch`` is not set
        to 0; None for any other model, when switched off, or when it cannot be built."""
        if os.environ.get(env_switch, "1") == "0":
            return None
        param = next(model.parameters(), None)
        if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
            return None
        return self.load()

    def load(self) -> Any | None:
        """The compiled module, or None when it cannot be built here."""
        with self._lock:
            if self.module is not None or self.error is not None:
                return self.module
            flags = _cflags(self.avx512)
            # The name carries the source, the headers beside it and the flags: a changed
            # kernel is never served stale.
            headers = b"".join(h.read_bytes() for h in sorted(self.source.parent.glob("*.h")))
            digest = hashlib.sha256(self.source.read_bytes() + headers + " ".join(flags).encode())
            name = f"{self.prefix}_{digest.hexdigest()[:12]}"
            try:
                from torch.utils import cpp_extension

                self.log.info("loading the %s (built once on first use)", self.what)
                with build_lock(name):
                    self.module = cpp_extension.load(
                        name=name,
                        sources=[str(self.source)],
                        extra_cflags=flags,
                        extra_ldflags=["-fopenmp"],
                        verbose=False,
                    )
            except Exception as exc:  # no compiler, no ninja, a failed build: keep PyTorch
                lines = str(exc).strip().splitlines()
                self.error = f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
                self.log.warning("%s unavailable (%s); %s", self.what, self.error, self.fallback)
            return self.module


_PAGED_DECODE = NativeExtension(
    "paged_decode_cpu.cpp",
    "hiserve_paged_decode",
    "native CPU attention kernel",
    "decode attention runs in PyTorch. It needs a C++ compiler and ninja "
    "(pip install 'hiserve[cpu]').",
    logger,
    avx512=True,  # an AVX-512 path for head dims 64 and 128
)


def paged_decode_kernel() -> Any | None:
    """The compiled module (``paged_decode(q, k_cache, v_cache, table, rows, lens, scale)``),
    or None when it cannot be built here."""
    return _PAGED_DECODE.load()


def build_error() -> str | None:
    """Why the kernel could not be built (None if it was, or was never tried)."""
    return _PAGED_DECODE.error

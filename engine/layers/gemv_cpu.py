"""The small-M float32 matmul for CPU decode (csrc/gemv_cpu.cpp).

At decode a linear layer multiplies a handful of tokens by its whole weight, so the call
is bound by how fast the weight streams from memory. oneDNN's packed GEMM reaches about
two thirds of the read bandwidth there and ``F.linear`` under half; this kernel streams
the dense ``[N, K]`` rows once per call. ``FusedLinear`` (and the tied LM head) call it
for up to ``max_tokens()`` rows on float32 CPU models and keep oneDNN for more rows.

NOTE: a layer that uses it keeps its dense weight next to the oneDNN-packed copy that
batches use: the linear weights' size again in host memory (a tied LM head's dense copy
is the embedding table, its packed copy the extra). ``second_copies_fit`` keeps those
copies only while they take at most ``SECOND_COPY_MAX_SHARE`` of the memory still
available; otherwise batches multiply the dense weights with ``F.linear`` (oneDNN's
packed copy was 1.2-1.9x faster at 8-32 rows on the default model's shapes, the same
from 128 on). Built like the other native kernels (see
``cpu_kernels``): once, on first use; where the build fails the layers keep oneDNN or
``F.linear``, and the reason is logged once and kept in ``build_error()``.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from engine.host_memory import available_host_memory
from engine.layers.cpu_kernels import NativeExtension

logger = logging.getLogger(__name__)

# Set to 0 to keep oneDNN / F.linear at every batch size (for comparisons).
ENV_SWITCH = "HISERVE_CPU_GEMV"
# The most rows a layer sends to the kernel; more go to oneDNN. Streaming from memory the
# kernel beat oneDNN's packed GEMM at 1 and 2 rows and lost from 3 on (bench/micro/gemv.py,
# SmolLM2-135M shapes, 2-core Zen 4); the kernel itself takes up to ``MAX_TOKENS`` (8).
GEMV_MAX_TOKENS = 2
# oneDNN's packed copies of the weights the kernel reads dense are made only while they
# take at most this share of the memory still available after loading.
SECOND_COPY_MAX_SHARE = 0.25
_GEMV = NativeExtension(
    "gemv_cpu.cpp",
    "hiserve_gemv_cpu",
    "native CPU GEMV kernel",
    "decode matmuls run in oneDNN or F.linear. It needs a C++ compiler and ninja "
    "(pip install 'hiserve[cpu]').",
    logger,
    avx512=True,
)


def gemv_kernel() -> Any | None:
    """The compiled module (``gemv(x, weight, bias=None)``, ``MAX_TOKENS``), or None when
    it cannot be built here."""
    return _GEMV.load()


def build_error() -> str | None:
    """Why the kernel could not be built (None if it was, or was never tried)."""
    return _GEMV.error


def use_cpu_gemv(model: nn.Module, max_tokens: int = GEMV_MAX_TOKENS) -> int:
    """Send the float32 CPU linear layers of ``model`` (and a tied model's LM head) to the
    kernel for up to ``max_tokens`` rows; returns how many layers switched (0 when the
    kernel cannot be built or is turned off).

    Call after loading the weights and before ``pack_for_cpu``, which then keeps the
    dense weights the kernel reads.
    """
    from engine.layers.linear import FusedLinear

    kernel = _GEMV.load_for(model, ENV_SWITCH)
    if kernel is None:
        return 0
    tied_head = getattr(model, "tied_head", None)
    if getattr(model, "lm_head", False) is None and callable(tied_head):
        model.lm_head = tied_head()  # over the embedding table itself: no copy
    switched = 0
    for module in model.modules():
        if not isinstance(module, FusedLinear):
            continue
        # A layer already packed (its dense weight dropped) stays with oneDNN.
        if module.weight.shape != (module.out_features, module.in_features):
            continue
        module.gemv = kernel.gemv
        module.gemv_max_tokens = max_tokens
        switched += 1
    logger.info("native GEMV kernel in use in %d layers, up to %d rows", switched, max_tokens)
    return switched


def second_copy_bytes(model: nn.Module) -> int:
    """Bytes oneDNN's packed copies would add beside the dense weights the kernel reads."""
    from engine.layers.linear import FusedLinear

    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, FusedLinear) and m.gemv is not None
    )


def second_copies_fit(model: nn.Module, available: int | None = None) -> bool:
    """Whether the layers the kernel serves may keep a oneDNN-packed copy of their weights
    for batches: it takes at most ``SECOND_COPY_MAX_SHARE`` of ``available`` (the memory
    this process can still allocate). Says so in the log when it does not."""
    extra = second_copy_bytes(model)
    if extra == 0:
        return True
    free = available_host_memory() if available is None else available
    if extra <= SECOND_COPY_MAX_SHARE * free:
        return True
    logger.warning(
        "float32 weights held once: oneDNN's packed copy for batches (%.2f GB) would take "
        "more than %d%% of the %.2f GB still available, so batches of more than %d rows "
        "multiply the dense weights (F.linear; up to about 1.5x slower at 8-32 rows)",
        extra / 1e9,
        round(100 * SECOND_COPY_MAX_SHARE),
        free / 1e9,
        GEMV_MAX_TOKENS,
    )
    return False

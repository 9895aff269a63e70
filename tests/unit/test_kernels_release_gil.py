"""The native CPU kernels run without the GIL, as torch's own ops do: while one runs,
another Python thread (the server's event loop, its tokenizer) goes on. A kernel that
held it would let no other thread run for the whole call (a prefill's products take
milliseconds each)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from engine.layers import cpu_kernels, fused_cpu, gemv_cpu, quant_cpu
from tests.unit.quant_blocks import placed, random_blocks

# A call long enough that its first half is the kernel's: once the kernel returns, the
# other thread may hold the GIL for a switch interval or two (5 ms each) before the call
# gets it back to return.
MIN_CALL_S = 0.04


def _stamps_inside(call: Callable[[], object]) -> tuple[int, float]:
    """How many times a pure-Python thread ran in the first half of ``call`` (inside the
    kernel), and how long the call took."""
    stamps: list[float] = []
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=other)
    thread.start()
    try:
        time.sleep(0.01)  # the other thread is running
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    # The first half of the call, past a millisecond for the Python before the kernel.
    inside = [t for t in stamps if start + 1e-3 < t < (start + end) / 2]
    return len(inside), end - start


def _check(make_call: Callable[[int], Callable[[], object]]) -> None:
    """Grow the work until one call lasts MIN_CALL_S, then require the other thread to
    have run during it."""
    for scale in (1, 2, 4, 8, 16, 32):
        call = make_call(scale)
        call()  # warm-up: first-touch of the buffers, the kernel's own set-up
        count, took = _stamps_inside(call)
        if took >= MIN_CALL_S:
            assert count > 0, f"no other thread ran during a {1e3 * took:.0f} ms call"
            return
    pytest.skip("this machine runs the kernel too fast to tell")


def test_the_packed_matmul_releases_the_gil() -> None:
    module = quant_cpu.quant_kernel()
    assert module is not None, quant_cpu.build_error()
    weight = placed(random_blocks(quant_cpu.BF16, 1024, 1024, seed=1), 0)

    def make(scale: int) -> Callable[[], object]:
        x = torch.randn(512 * scale, 1024)
        out = torch.empty(512 * scale, 1024)
        return lambda: module.qmatmul(x, weight, quant_cpu.BF16, out)

    _check(make)


def test_the_fused_ops_release_the_gil() -> None:
    module = fused_cpu.fused_kernels()
    assert module is not None, fused_cpu.build_error()

    def make(scale: int) -> Callable[[], object]:
        x, residual = torch.randn(4096 * scale, 2048), torch.randn(4096 * scale, 2048)
        weight = torch.ones(2048)
        return lambda: module.add_rms_norm(x, residual, weight, 1e-6)

    _check(make)


def test_the_gemv_releases_the_gil() -> None:
    module = gemv_cpu.gemv_kernel()
    assert module is not None, gemv_cpu.build_error()

    def make(scale: int) -> Callable[[], object]:
        weight = torch.randn(4096 * scale, 4096)
        x = torch.randn(8, 4096)
        return lambda: module.gemv(x, weight)

    _check(make)


def test_the_attention_kernels_release_the_gil() -> None:
    from tests.unit.test_prefill_native import Case

    module = cpu_kernels.paged_decode_kernel()
    assert module is not None, cpu_kernels.build_error()
    if not module.prefill_takes(64):
        pytest.skip("the native prefill attention is not built here (no AVX-512)")

    def make(scale: int) -> Callable[[], object]:
        case = Case([(0, 1024 * scale)], kv_heads=4, group=4, head_dim=64)
        return lambda: case.run(module)

    _check(make)

"""The native CPU decode kernel against the pure-PyTorch backend, and backend selection."""

from __future__ import annotations

import pytest
import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers import attention, cpu_kernels
from engine.layers.attention import (
    CpuNativeAttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
)
from engine.layers.attention_meta import AttentionMetadata
from tests.unit.native_build import fail_native_build


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernels.paged_decode_kernel()
    # This machine has a C++ compiler: a failed build is a bug, not a reason to skip.
    assert module is not None, cpu_kernels.build_error()
    return module


def decode_case(
    kv_heads: int, group: int, lens: list[int], seed: int = 0, head_dim: int = 16, slots: int = 400
):
    """A pool with scattered slots per sequence, its request table, and metadata."""
    gen = torch.Generator().manual_seed(seed)
    layers = 2
    pool = DeviceKVPool(layers, slots, kv_heads, head_dim, torch.float32, "cpu")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen))
    table = torch.zeros(8, max(128, max(lens)), dtype=torch.int32)
    rows = torch.randperm(8, generator=gen)[: len(lens)]
    free = torch.randperm(slots - 1, generator=gen) + 1
    used = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = free[used : used + n].int()
        used += n
    # Stale slots past each length must be ignored.
    table[:, max(lens) :] = 7
    meta = AttentionMetadata(
        is_decode=True,
        out_slots=torch.zeros(len(lens), dtype=torch.int64),
        req_rows=rows,
        seq_lens=torch.tensor(lens),
        req_table=table,
        prefix_lens_list=[n - 1 for n in lens],
        extend_lens_list=[1] * len(lens),
        seq_lens_list=list(lens),
        max_seq_len=max(lens),
    )
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    return pool, meta, q


@pytest.mark.parametrize(("kv_heads", "group"), [(1, 1), (2, 1), (3, 3), (1, 4), (2, 2)])
@pytest.mark.parametrize("lens", [[1], [5, 1, 17], [64, 3, 40, 9, 33]])
def test_decode_matches_torch_backend(kernel, kv_heads: int, group: int, lens: list[int]) -> None:
    pool, meta, q = decode_case(kv_heads, group, lens)
    native = CpuNativeAttentionBackend(kernel)
    for layer in range(pool.num_layers):
        want = TorchAttentionBackend()._decode(q, layer, meta, pool)
        got = native._decode(q, layer, meta, pool)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


# 64 and 128 take the AVX-512 path (where the CPU has it); lengths around its 16-wide tail.
@pytest.mark.parametrize("head_dim", [64, 128, 48])
# Group 7: the AVX-512 path takes query heads 3 (2 at head_dim 128) at a time for the
# scores and 4 (2) for the values, so 7 leaves a partial pass of each; lengths cross its
# blocks of 8 and 32 tokens.
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 3), (1, 1), (2, 4), (1, 7)])
def test_decode_matches_torch_backend_at_model_head_dims(
    kernel, head_dim: int, kv_heads: int, group: int
) -> None:
    lens = [1, 15, 16, 17, 33, 70, 120]
    pool, meta, q = decode_case(kv_heads, group, lens, seed=head_dim, head_dim=head_dim)
    q = 3 * q  # peakier softmax
    native = CpuNativeAttentionBackend(kernel)
    for layer in range(pool.num_layers):
        want = TorchAttentionBackend()._decode(q, layer, meta, pool)
        got = native._decode(q, layer, meta, pool)
        # two float32 sums in different orders over up to 120 peaky weights (the portable
        # path, head_dim 48, came to 2.05e-6 at 70 tokens); a wrong weight or row is off
        # by far more
        torch.testing.assert_close(got, want, atol=4e-6, rtol=1e-5)


# Fewer sequences than threads: each sequence's tokens are split into parts of at least
# 128 (one per thread) and merged; with 6 threads and two sequences, the one-token
# sequence has two empty parts. 48: the portable path; 64 the AVX-512 one.
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize(("lens", "threads"), [([700], 2), ([1000, 1], 6), ([300, 129], 3)])
def test_decode_split_over_threads_matches_torch_backend(
    kernel, head_dim: int, lens: list[int], threads: int
) -> None:
    pool, meta, q = decode_case(3, 3, lens, seed=len(lens), head_dim=head_dim, slots=2048)
    q = 3 * q
    native = CpuNativeAttentionBackend(kernel)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layer in range(pool.num_layers):
            want = TorchAttentionBackend()._decode(q, layer, meta, pool)
            got = native._decode(q, layer, meta, pool)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_decode_of_non_contiguous_query(kernel) -> None:
    pool, meta, q = decode_case(2, 2, [6, 9])
    strided = torch.cat([q, q], dim=2)[:, :, : q.shape[2]]  # same values, not contiguous
    assert not strided.is_contiguous()
    got = CpuNativeAttentionBackend(kernel)._decode(strided, 0, meta, pool)
    torch.testing.assert_close(got, TorchAttentionBackend()._decode(q, 0, meta, pool))


def test_decode_reads_a_row_strided_query_in_place(kernel) -> None:
    # The model's q: the first heads of each row of the rotated [B, q + kv, D] tensor.
    pool, meta, q = decode_case(2, 2, [6, 9, 1])
    rotated = torch.cat([q, torch.randn(3, 2, q.shape[2])], dim=1)  # [B, q + kv, D]
    strided = rotated[:, : q.shape[1]]
    assert not strided.is_contiguous() and strided.stride(1) == q.shape[2]
    got = CpuNativeAttentionBackend(kernel)._decode(strided, 1, meta, pool)
    torch.testing.assert_close(got, TorchAttentionBackend()._decode(q, 1, meta, pool))


@pytest.mark.parametrize(("tokens", "kv_heads", "head_dim"), [(1, 3, 64), (5, 1, 16), (70, 2, 24)])
def test_store_kv_writes_what_the_pool_write_does(
    kernel, tokens: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    pools = [DeviceKVPool(3, 200, kv_heads, head_dim, torch.float32, "cpu") for _ in range(2)]
    for pool in pools:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen.manual_seed(1)))
    # k and v as the model passes them: row-strided views of the fused projection.
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, head_dim, generator=gen)
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    slots = torch.randperm(199, generator=gen)[:tokens] + 1
    pools[0].write(1, slots, k, v)  # the reference: two index_put_
    kernel.store_kv(pools[1].k_buffers[1], pools[1].v_buffers[1], slots, k, v)
    assert torch.equal(pools[1].kv_buffer, pools[0].kv_buffer)  # layers 0 and 2 untouched too


def test_native_backend_forward_fills_the_pool_like_the_reference(kernel) -> None:
    pool, meta, q = decode_case(2, 2, [6, 9, 1])
    meta.out_slots = torch.tensor([3, 250, 17])
    ref_pool = DeviceKVPool(pool.num_layers, pool.num_slots, 2, 16, torch.float32, "cpu")
    ref_pool.kv_buffer.copy_(pool.kv_buffer)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    got = CpuNativeAttentionBackend(kernel).forward(q, k, v, 1, meta, pool)
    want = TorchAttentionBackend().forward(q, k, v, 1, meta, ref_pool)
    assert torch.equal(pool.kv_buffer, ref_pool.kv_buffer)
    torch.testing.assert_close(got, want)


def test_store_kv_rejects_bad_inputs(kernel) -> None:
    pool = DeviceKVPool(1, 10, 2, 8, torch.float32, "cpu")
    k_cache, v_cache = pool.k_buffers[0], pool.v_buffers[0]
    k = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.store_kv(k_cache, v_cache, torch.tensor([1, 10]), k, k)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.store_kv(k_cache, v_cache, torch.tensor([1, 2]), k.double(), k)
    with pytest.raises(RuntimeError, match="matching"):
        kernel.store_kv(k_cache, v_cache, torch.tensor([1, 2]), k[:, :1], k[:, :1])


def test_bad_inputs_raise_clear_errors(kernel) -> None:
    pool, meta, q = decode_case(2, 1, [4, 6])
    k, v = pool.k_buffers[0], pool.v_buffers[0]
    args = (meta.req_table, meta.req_rows, meta.seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.paged_decode(q.double(), k, v, *args)
    with pytest.raises(RuntimeError, match="outside"):
        kernel.paged_decode(q, k, v, meta.req_table, meta.req_rows, torch.tensor([4, 500]), 0.25)
    table = meta.req_table.clone()
    table[int(meta.req_rows[1]), 2] = 10_000  # a slot past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_decode(q, k, v, table, meta.req_rows, meta.seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel.paged_decode(q[:, :1].repeat(1, 3, 1), k, v, *args)  # 3 q heads, 2 KV heads


def test_selection(kernel) -> None:
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu, torch.float32).name == "cpu_native"
    assert get_attention_backend("cpu_native", cpu, torch.float32).name == "cpu_native"
    assert get_attention_backend("torch", cpu, torch.float32).name == "torch"
    # The kernel is float32-only: other dtypes and devices get the reference.
    assert get_attention_backend("auto", cpu, torch.bfloat16).name == "torch"
    assert get_attention_backend("auto", torch.device("meta"), torch.float32).name == "torch"
    with pytest.raises(ValueError, match="float32 on the CPU only"):
        get_attention_backend("cpu_native", cpu, torch.float16)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash", cpu, torch.float32)


def test_failed_build_falls_back_or_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels._PAGED_DECODE, "module", None)
    monkeypatch.setattr(cpu_kernels._PAGED_DECODE, "error", "RuntimeError: Ninja is required")
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu, torch.float32).name == "torch"
    with pytest.raises(RuntimeError, match="could not be built: RuntimeError: Ninja"):
        get_attention_backend("cpu_native", cpu, torch.float32)


def test_build_failure_is_caught_and_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    message = "error: command 'c++' failed\nno compiler found"
    fail_native_build(monkeypatch, cpu_kernels._PAGED_DECODE, message)
    assert cpu_kernels.paged_decode_kernel() is None
    assert cpu_kernels.build_error() == "RuntimeError: no compiler found"
    assert attention.get_attention_backend("auto", torch.device("cpu")).name == "torch"


def test_engine_reports_backend(tiny_llama_dir) -> None:
    from engine import Engine, EngineConfig

    for name in ("torch", "cpu_native"):
        eng = Engine(
            EngineConfig(
                model=str(tiny_llama_dir), device="cpu", dtype="float32", attention_backend=name
            )
        )
        assert eng.health()["attention_backend"] == name


_HOLD_BUILD_LOCK = """
import sys, time
from engine.layers import cpu_kernels
with cpu_kernels.build_lock("k"):
    open(sys.argv[1], "w").close()  # what torch's build leaves while it runs
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_build_never_blocks_the_next_one(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build killed midway leaves torch's lock file, which torch would wait on forever:
    the next build waits only while the killed one lives, then removes that file."""
    import os
    import subprocess
    import sys
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "k" / "lock"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_BUILD_LOCK, str(lock)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        entered = threading.Event()

        def build() -> None:
            with cpu_kernels.build_lock("k"):
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)  # a live build is waited for, its lock kept
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(60.0)  # the kernel dropped the dead holder's flock
    assert not lock.exists()
    with cpu_kernels.build_lock("k"):  # and nothing is left to wait on afterwards
        assert not lock.exists()


def test_kernel_runs_on_every_intra_op_thread(kernel) -> None:
    """A build without OpenMP compiles at::parallel_for into a serial loop (the kernel
    was once 2x slower than it should be for exactly that reason)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert kernel.parallel_threads(64) == 2
    finally:
        torch.set_num_threads(previous)

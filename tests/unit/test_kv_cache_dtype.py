"""--kv-cache-dtype: a bfloat16 KV pool under float32 activations on the CPU.

- The native kernels (csrc/kv_rows.h, paged_attention.h): store_kv rounds float32 K/V
  into a bf16 pool exactly as torch's ``.to(torch.bfloat16)`` (the torch backend's
  write); paged_decode over a bf16 pool gives what it gives over a float32 pool holding
  the same rounded values (up to float32 summation order), on the AVX-512 path
  (head_dim 64), the portable one (48) and split over threads.
- The torch backend reads a bf16 pool too (its decode and its extend after a cached
  prefix cast the K/V to the activations' dtype).
- Through the engine (the default model, float32): the pool is bf16, the parity prompts'
  greedy tokens are those of a float32 pool, and HiCache's host tier round-trips the
  pool without loss (the same tokens as the same engine without HiCache).
- Refused on an accelerator where it differs from the model dtype, and for bad names.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.dtypes import kv_cache_dtype
from engine.kvcache.device_pool import DeviceKVPool
from engine.layers import cpu_kernels
from engine.layers.attention import CpuNativeAttentionBackend, TorchAttentionBackend
from engine.layers.attention_meta import AttentionMetadata
from engine.platform import DeviceSpec
from tests.unit.cpu_engine import returning_conversations
from tests.unit.parity_prompts import parity_prompts
from tests.unit.test_attention_native import decode_case


@pytest.fixture(scope="module")
def native() -> CpuNativeAttentionBackend:
    module = cpu_kernels.paged_decode_kernel()
    assert module is not None, cpu_kernels.build_error()
    return CpuNativeAttentionBackend(module)


def _bf16_twins(pool: DeviceKVPool) -> tuple[DeviceKVPool, DeviceKVPool]:
    """(a bf16 pool of ``pool``'s values rounded, a float32 pool of the rounded values)."""
    shape = (pool.num_layers, pool.kv_buffer.shape[2], pool.kv_heads, pool.head_dim)
    bf = DeviceKVPool(*shape, torch.bfloat16, "cpu")
    bf.kv_buffer.copy_(pool.kv_buffer)
    wide = DeviceKVPool(*shape, torch.float32, "cpu")
    wide.kv_buffer.copy_(bf.kv_buffer)
    return bf, wide


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize(("lens", "threads"), [([5, 1, 17, 130], 2), ([700], 2), ([300, 1], 3)])
def test_decode_over_a_bf16_pool_equals_the_rounded_float32_pool(
    native: CpuNativeAttentionBackend, head_dim: int, lens: list[int], threads: int
) -> None:
    pool, meta, q = decode_case(3, 3, lens, seed=head_dim, head_dim=head_dim, slots=1200)
    bf, wide = _bf16_twins(pool)
    assert bf.k_buffers[0].dtype == torch.bfloat16
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layer in range(pool.num_layers):
            got = native._decode(3 * q, layer, meta, bf)
            # The loads widen bf16 exactly: the float32 pool's arithmetic (up to the order
            # the compiler's vectorized sums take on the portable path).
            want = native._decode(3 * q, layer, meta, wide)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(
                TorchAttentionBackend()._decode(3 * q, layer, meta, bf), got, atol=1e-5, rtol=1e-5
            )
    finally:
        torch.set_num_threads(previous)


def test_store_rounds_as_torch_does(native: CpuNativeAttentionBackend) -> None:
    gen = torch.Generator().manual_seed(3)
    pool = DeviceKVPool(2, 64, 3, 64, torch.bfloat16, "cpu")
    twin = DeviceKVPool(2, 64, 3, 64, torch.bfloat16, "cpu")
    slots = torch.tensor([9, 2, 40, 63, 0])
    qkv = torch.randn(5, 3 + 3 + 3, 64, generator=gen) * 1e3  # K and V as views, strided rows
    k, v = qkv[:, 3:6], qkv[:, 6:9]
    meta = AttentionMetadata(
        is_decode=True,
        out_slots=slots,
        req_rows=torch.arange(5),
        seq_lens=torch.ones(5, dtype=torch.int64),
        req_table=torch.zeros(5, 4, dtype=torch.int32),
        prefix_lens_list=[0] * 5,
        extend_lens_list=[1] * 5,
        seq_lens_list=[1] * 5,
        max_seq_len=1,
    )
    for layer in range(2):
        native._store_kv(layer, meta, k, v, pool)
        twin.write(layer, slots, k, v)  # index_put_ of k.to(bfloat16)
    assert torch.equal(pool.kv_buffer.view(torch.int16), twin.kv_buffer.view(torch.int16))
    assert torch.equal(pool.k_buffers[1][slots], k.to(torch.bfloat16))


def test_extend_after_a_cached_prefix_reads_a_bf16_pool() -> None:
    # Two sequences with 6 and 3 cached tokens, 4 and 2 new: the torch backend's extend
    # gathers the prefix from the pool (bf16 here) and casts it for SDPA.
    pool, _, _ = decode_case(2, 2, [10, 5], seed=7, head_dim=32)
    bf, wide = _bf16_twins(pool)
    gen = torch.Generator().manual_seed(7)
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[0, :10] = torch.arange(100, 110, dtype=torch.int32)
    table[2, :5] = torch.arange(200, 205, dtype=torch.int32)
    meta = AttentionMetadata(
        is_decode=False,
        out_slots=torch.tensor([106, 107, 108, 109, 203, 204]),
        req_rows=torch.tensor([0, 2]),
        seq_lens=torch.tensor([10, 5]),
        req_table=table,
        prefix_lens_list=[6, 3],
        extend_lens_list=[4, 2],
        seq_lens_list=[10, 5],
        req_rows_list=[0, 2],
        max_seq_len=10,
    )
    q = torch.randn(6, 4, 32, generator=gen)
    k = torch.randn(6, 2, 32, generator=gen)
    v = torch.randn(6, 2, 32, generator=gen)
    bf.write(0, meta.out_slots, k, v)  # rounded as stored
    rounded = [t.to(torch.bfloat16).float() for t in (k, v)]
    wide.write(0, meta.out_slots, *rounded)
    backend = TorchAttentionBackend()
    got = backend._extend(q, k, v, 0, meta, bf)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, backend._extend(q, k, v, 0, meta, wide), atol=2e-6, rtol=1e-5)


def _conversations(engine: Engine, params: SamplingParams) -> tuple[list[list[int]], int]:
    outputs, host_hits = [], 0
    for _, _, _, out in returning_conversations(engine, params, 5, 48, 6):
        host_hits += out.cached_tokens_host
        outputs.append(out.token_ids)
    return outputs, host_hits


@pytest.mark.slow  # two engines of the default model
def test_engine_serves_from_a_bf16_pool_and_its_host_tier() -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    common = dict(model="default", device="cpu", dtype="float32", kv_cache_dtype="bfloat16")
    plain = Engine(EngineConfig(**common, kv_cache_tokens=4096))  # type: ignore[arg-type]
    assert plain.health()["kv_cache_dtype"] == "bfloat16"
    assert plain.kv.device_pool.k_buffers[0].dtype == torch.bfloat16
    want, _ = _conversations(plain, params)
    # Greedy tokens on the parity prompts: the same as from a float32 pool (measured on
    # 2026-12-06: identical for 96 tokens in float32, bf16 weights and packed alike).
    prompts = parity_prompts(plain.tokenizer)
    parity = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    from_bf16 = [o.token_ids for o in plain.generate(prompts, parity)]
    plain.close()
    wide_config = {**common, "kv_cache_dtype": "float32"}
    wide = Engine(EngineConfig(**wide_config, kv_cache_tokens=4096))  # type: ignore[arg-type]
    assert [o.token_ids for o in wide.generate(prompts, parity)] == from_bf16
    wide.close()
    tiered = Engine(
        EngineConfig(
            **common,  # type: ignore[arg-type]
            kv_cache_tokens=160,  # two conversations' worth: the rest goes to the host
            enable_hierarchical_cache=True,
            hicache_ratio=8,
            hicache_load_threshold=4,
        )
    )
    tiered.check_invariants = True
    assert tiered.kv.host_pool is not None and tiered.kv.host_pool.dtype == torch.bfloat16
    got, host_hits = _conversations(tiered, params)
    tiered.close()
    assert host_hits > 0, "the workload never loaded KV back from the host tier"
    assert got == want


def test_choices_and_refusals() -> None:
    cpu, cuda = DeviceSpec("cpu"), DeviceSpec("cuda", 0)
    assert kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert kv_cache_dtype("float32", torch.bfloat16, cpu) == torch.float32
    assert kv_cache_dtype("auto", torch.float16, cuda) == torch.float16
    assert kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="holds the model dtype"):
        kv_cache_dtype("bfloat16", torch.float16, cuda)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not valid"):
        EngineConfig(kv_cache_dtype="fp8")

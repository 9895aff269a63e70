"""Attention over a mixed batch (decodes first, prefill chunks after) on both backends,
against attention written out by hand in float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers import cpu_kernels
from engine.layers.attention import (
    AttentionBackend,
    CpuNativeAttentionBackend,
    TorchAttentionBackend,
)
from engine.layers.attention_meta import AttentionMetadata

HEAD_DIM, LAYERS = 16, 3


class CountingLoad:
    """A host-tier load handle that records which layers attention waited for."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_layer(self, layer_id: int) -> None:
        self.waited.append(layer_id)


def mixed_case(
    kv_heads: int, group: int, decode_lens: list[int], extends: list[tuple[int, int]], seed: int
) -> tuple[DeviceKVPool, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool, metadata and q/k/v of a batch: one decode per entry of ``decode_lens`` (its
    context length), then one chunk per ``(prefix_len, extend_len)`` of ``extends``."""
    gen = torch.Generator().manual_seed(seed)
    pool = DeviceKVPool(LAYERS, 600, kv_heads, HEAD_DIM, torch.float32, "cpu")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen))
    prefix_lens = [n - 1 for n in decode_lens] + [p for p, _ in extends]
    extend_lens = [1] * len(decode_lens) + [e for _, e in extends]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    table = torch.randint(1, 600, (8, 128), generator=gen, dtype=torch.int32)  # stale cells
    rows = torch.randperm(8, generator=gen)[: len(seq_lens)]
    free = torch.randperm(599, generator=gen) + 1
    out_slots: list[torch.Tensor] = []
    used = 0
    for row, prefix, seq_len in zip(rows.tolist(), prefix_lens, seq_lens):
        table[row, :seq_len] = free[used : used + seq_len].int()
        out_slots.append(free[used + prefix : used + seq_len])
        used += seq_len
    meta = AttentionMetadata(
        is_decode=False,
        out_slots=torch.cat(out_slots),
        req_rows=rows,
        seq_lens=torch.tensor(seq_lens),
        req_table=table,
        prefix_lens_list=prefix_lens,
        extend_lens_list=extend_lens,
        seq_lens_list=seq_lens,
        max_seq_len=max(seq_lens),
        req_rows_list=rows.tolist(),
        num_decodes=len(decode_lens),
    )
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, kv_heads * group, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, kv_heads, HEAD_DIM, generator=gen)
    return pool, meta, q, k, v


def reference(
    pool: DeviceKVPool, layer: int, meta: AttentionMetadata, q: torch.Tensor
) -> torch.Tensor:
    """Causal attention of every new token over its sequence, read from the pool (after
    the forward wrote the new K/V), in float64 with the softmax written out."""
    out = []
    start = 0
    for b, ext_len in enumerate(meta.extend_lens_list):
        seq_len, prefix = meta.seq_lens_list[b], meta.prefix_lens_list[b]
        slots = meta.req_table[meta.req_rows_list[b], :seq_len].long()
        keys = pool.k_buffers[layer][slots].double()  # [S, kv_heads, D]
        values = pool.v_buffers[layer][slots].double()
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [S, q_heads, D]
        values = values.repeat_interleave(group, dim=1)
        for i in range(ext_len):
            query = q[start + i].double()  # [q_heads, D]
            visible = prefix + i + 1
            scores = torch.einsum("hd,shd->hs", query, keys[:visible]) * HEAD_DIM**-0.5
            probs = torch.softmax(scores, dim=-1)  # [q_heads, visible]
            out.append(torch.einsum("hs,shd->hd", probs, values[:visible]).reshape(-1))
        start += ext_len
    return torch.stack(out)  # [T, q_heads * D]


def backend_named(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    kernel = cpu_kernels.paged_decode_kernel()
    assert kernel is not None, cpu_kernels.build_error()
    return CpuNativeAttentionBackend(kernel)


@pytest.mark.parametrize("name", ["torch", "cpu_native"])
@pytest.mark.parametrize(("kv_heads", "group"), [(1, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize(
    ("decode_lens", "extends"),
    [
        ([5], [(0, 7)]),  # one decode beside a whole short prompt
        ([9, 1, 30], [(12, 6), (0, 4)]),  # a later chunk (prefix) and a fresh prompt
        ([17, 3], [(8, 1)]),  # a one-token chunk is still an extend
        # One-token chunks after a prefix (n > 1 copies) among longer ones and fresh ones.
        ([9, 1], [(12, 1), (0, 4), (30, 1), (5, 3), (0, 1)]),
        ([], [(7, 1), (20, 1)]),  # only one-token chunks after a prefix
        ([], [(7, 1), (0, 5)]),
    ],
)
def test_mixed_forward_matches_reference(
    name: str, kv_heads: int, group: int, decode_lens: list[int], extends: Any
) -> None:
    pool, meta, q, k, v = mixed_case(kv_heads, group, decode_lens, extends, seed=len(extends))
    load = CountingLoad()
    meta.kv_loads = [load]
    backend = backend_named(name)
    for layer in range(LAYERS):
        got = backend.forward(q, k, v, layer, meta, pool)
        # The new tokens' K/V went to their slots, decodes' and chunks' alike.
        torch.testing.assert_close(pool.k_buffers[layer][meta.out_slots], k)
        torch.testing.assert_close(pool.v_buffers[layer][meta.out_slots], v)
        want = reference(pool, layer, meta, q)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # Each layer waited for its host-tier copy exactly once, before either part ran.
    assert load.waited == list(range(LAYERS))


@pytest.mark.parametrize("sdpa_gqa", [True, False], ids=["enable_gqa", "repeated K/V"])
def test_extend_with_grouped_heads_either_way(
    monkeypatch: pytest.MonkeyPatch, sdpa_gqa: bool
) -> None:
    # On the CPU with torch >= 2.5 SDPA takes the K/V heads as they are (enable_gqa);
    # elsewhere they are repeated per query head. Both must give the same attention.
    import engine.layers.attention as attention

    monkeypatch.setattr(attention, "_SDPA_GQA", sdpa_gqa)
    pool, meta, q, k, v = mixed_case(2, 3, [], [(0, 9), (11, 5), (0, 1)], seed=5)
    calls: list[dict[str, Any]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    got = TorchAttentionBackend().forward(q, k, v, 0, meta, pool)
    torch.testing.assert_close(got.double(), reference(pool, 0, meta, q), atol=1e-5, rtol=1e-5)
    assert len(calls) == 3 and all(c.get("enable_gqa", False) == sdpa_gqa for c in calls)


def test_split_is_built_once_and_slices_the_batch() -> None:
    _, meta, *_ = mixed_case(2, 2, [9, 1, 30], [(12, 6), (0, 4)], seed=3)
    decode, extend = meta.split_decodes()
    assert meta.split_decodes()[0] is decode  # reused by every layer
    assert decode.is_decode and decode.batch_size == 3 and decode.num_tokens == 3
    assert decode.seq_lens_list == [9, 1, 30] and decode.max_seq_len == 30
    assert not extend.is_decode and extend.num_decodes == 0
    assert extend.extend_lens_list == [6, 4] and extend.prefix_lens_list == [12, 0]
    assert extend.req_rows_list == meta.req_rows_list[3:]
    assert torch.equal(extend.out_slots, meta.out_slots[3:])
    assert not decode.kv_loads and not extend.kv_loads


class SpyKernel:
    """The native module with its calls recorded; ``takes`` stands for prefill_takes."""

    def __init__(self, module: Any, takes: bool = True) -> None:
        self.module, self.takes = module, takes
        self.calls: list[tuple[str, Any]] = []

    def store_kv(self, *args: Any) -> None:
        self.module.store_kv(*args)

    def prefill_takes(self, head_dim: int) -> bool:
        return self.takes and self.module.prefill_takes(head_dim)

    def paged_decode(self, q: torch.Tensor, *args: Any) -> torch.Tensor:
        self.calls.append(("decode", q.shape[0]))
        return self.module.paged_decode(q, *args)

    def prefill_attention(self, *args: Any) -> None:
        self.calls.append(("prefill", list(args[9])))  # the sequences it computes
        self.module.prefill_attention(*args)


@pytest.mark.parametrize("native_prefill", [True, False], ids=["prefill kernel", "SDPA"])
def test_one_token_chunks_after_a_prefix_take_the_native_decode_kernel(
    native_prefill: bool,
) -> None:
    # The copies of an n=128 request each compute one token after the shared prompt: per
    # sequence SDPA calls (a gather each, per layer) made that attack cost the canary
    # seconds. The native backend must run them as one decode call; the longer chunk goes
    # through the prefill kernel, or SDPA where that does not take the head_dim.
    pool, meta, q, k, v = mixed_case(2, 2, [], [(7, 1), (20, 1), (0, 5), (3, 1)], seed=3)
    module = cpu_kernels.paged_decode_kernel()
    assert module is not None, cpu_kernels.build_error()
    spy = SpyKernel(module, takes=native_prefill)
    backend = CpuNativeAttentionBackend(spy)
    calls: list[int] = []
    original = backend._sdpa

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    backend._sdpa = counting  # type: ignore[method-assign]
    got = backend.forward(q, k, v, 0, meta, pool)
    torch.testing.assert_close(got.double(), reference(pool, 0, meta, q), atol=1e-5, rtol=1e-5)
    assert ("decode", 3) in spy.calls
    if native_prefill:
        assert spy.calls == [("prefill", [2]), ("decode", 3)] and not calls
    else:
        assert spy.calls == [("decode", 3)] and len(calls) == 1

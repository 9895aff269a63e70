"""Attention backend on the Triton paged kernel (engine/layers/triton_ops/paged_attention.py):
decode, extend and mixed steps each in one launch per layer, K/V read in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention_base import AttentionBackend
from engine.layers.attention_meta import AttentionMetadata

# AttentionMetadata.cache key of an extend's layout: [2, B] first new token and count of
# each sequence.
EXTEND_LAYOUT = "triton_extend"


def work_key(tokens_per_program: int) -> str:
    """AttentionMetadata.cache key of an extend's work list ``[2, W]`` for layers whose
    programs cover ``tokens_per_program`` new tokens (paged_attention.extend_work)."""
    return f"triton_work:{tokens_per_program}"


class TritonAttentionBackend(AttentionBackend):
    """Causal paged attention for GPUs with a Triton backend (CUDA, ROCm, MUSA).

    Covers sliding windows, soft-capping and custom scales too, so windowed layers need
    no per-sequence path. A decode step reads only tensors and its batch size: its launch
    shapes never depend on context lengths, so it can be captured in a graph.
    """

    name = "triton"
    graph_safe_decode = True
    # An extend or mixed step reads its layout from tensors (EXTEND_LAYOUT, work_key)
    # when the caller provides them, so it can be captured too (engine/mixed_graphs.py).
    graph_safe_extend = True
    decode_reads_pool_in_place = True

    def __init__(
        self,
        sliding_window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        # Imported here: the engine runs without the triton package everywhere else.
        from engine.layers.triton_ops import fused, paged_attention

        self._kernel = paged_attention.paged_attention
        self._per_program = paged_attention.extend_tokens_per_program
        self._work = paged_attention.extend_work
        self._store = fused.store_kv
        self._rope_store = fused.rotary_store
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.scale = scale

    def with_options(
        self, sliding_window: int | None, softcap: float | None, scale: float | None
    ) -> TritonAttentionBackend:
        """The same kernel with a layer's window, soft-capping and scale."""
        return TritonAttentionBackend(sliding_window, softcap, scale)

    def probe(
        self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The K/V store (plain and with RoPE), then one decode and one extend of two
        one-token sequences, over zeros with this layer's options: raises where a kernel
        does not build or launch for these shapes on ``device`` (NoFitError from
        triton_ops.fitting where no block option fits its shared memory)."""
        q = torch.zeros(2, q_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(2, kv_heads, head_dim, dtype=dtype, device=device)  # also the pool
        qk = torch.zeros(2, q_heads + kv_heads, head_dim, dtype=dtype, device=device)
        cos = torch.zeros(2, 1, head_dim, dtype=dtype, device=device)
        table = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
        rows = torch.arange(2, device=device)  # also the slots and first new tokens
        ones = torch.ones(2, dtype=torch.int64, device=device)
        items = self._work([1, 1], self._per_program(q_heads, kv_heads, head_dim))
        work = torch.tensor(items, dtype=torch.int64, device=device).view(2, -1)
        options = {"scale": self.scale, "window": self.sliding_window, "softcap": self.softcap}
        self._store(kv, kv, rows, kv, kv)
        self._rope_store(qk, kv, cos, cos, q_heads, rows, kv, kv)
        self._kernel(q, kv, kv, table, rows, ones, **options)  # type: ignore[arg-type]
        self._kernel(
            q, kv, kv, table, rows, ones, q_starts=rows, q_lens=ones, work=work, **options,  # type: ignore[arg-type]
        )  # fmt: skip

    def _store_kv(
        self,
        layer_id: int,
        meta: AttentionMetadata,
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        kv_pool: DeviceKVPool,
    ) -> None:
        # K and V rows in one launch instead of two index_put_.
        self._store(k, v, meta.out_slots, kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id])

    fuses_rope_store = True

    def rope_forward(
        self,
        qk: torch.Tensor,  # [T, q_heads + kv_heads, head_dim] before RoPE
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:  # [T, q_heads * head_dim]
        for load in meta.kv_loads:  # host-tier copies into this layer land first
            load.wait_layer(layer_id)
        q_heads = qk.shape[1] - kv_pool.kv_heads
        q = self._rope_store(
            qk,
            v,
            cos,
            sin,
            q_heads,
            meta.out_slots,
            kv_pool.k_buffers[layer_id],
            kv_pool.v_buffers[layer_id],
        )  # [T, q_heads, head_dim]
        return self._attend(q, layer_id, meta, kv_pool)

    def forward(
        self,
        q: torch.Tensor,  # [T, q_heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:  # [T, q_heads * head_dim]
        self.store_new_kv(k, v, layer_id, meta, kv_pool)
        return self._attend(q, layer_id, meta, kv_pool)

    def _attend(
        self, q: torch.Tensor, layer_id: int, meta: AttentionMetadata, kv_pool: DeviceKVPool
    ) -> torch.Tensor:
        """Attention of the new tokens' q ``[T, q_heads, D]`` over the pool, which holds
        their K/V already: ``[T, q_heads * D]``."""
        num_tokens, q_heads, head_dim = q.shape
        if q.stride(2) != 1:
            q = q.contiguous()
        options = {"scale": self.scale, "window": self.sliding_window, "softcap": self.softcap}
        if meta.is_decode:
            out = self._kernel(
                q,
                kv_pool.k_buffers[layer_id],
                kv_pool.v_buffers[layer_id],
                meta.req_table,
                meta.req_rows,
                meta.seq_lens,
                **options,  # type: ignore[arg-type]
            )
        else:
            # Mixed steps too: a decode row is an extend of one token.
            q_starts, q_lens, work = self._extend_layout(meta, q.shape[1], kv_pool, q.device)
            out = self._kernel(
                q,
                kv_pool.k_buffers[layer_id],
                kv_pool.v_buffers[layer_id],
                meta.req_table,
                meta.req_rows,
                meta.seq_lens,
                q_starts=q_starts,
                q_lens=q_lens,
                work=work,
                # Rows no sequence owns (a graph's padding) stay zero, never stale memory.
                out=torch.zeros_like(q),
                **options,  # type: ignore[arg-type]
            )
        return out.view(num_tokens, q_heads * head_dim)

    def _extend_layout(
        self, meta: AttentionMetadata, q_heads: int, kv_pool: DeviceKVPool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First new token ``[B]`` and new-token count ``[B]`` of each sequence, and the
        work list ``[2, W]`` (paged_attention.extend_work): uploaded once per forward and
        shared by every layer. A captured mixed step puts static ones in the cache
        (engine/mixed_graphs.py)."""
        per_program = self._per_program(q_heads, kv_pool.kv_heads, kv_pool.head_dim)
        key = work_key(per_program)
        layout = meta.cache.get(EXTEND_LAYOUT)
        work = meta.cache.get(key)
        if layout is None or work is None:
            starts, offset = [], 0
            for n in meta.extend_lens_list:
                starts.append(offset)
                offset += n
            items = self._work(meta.extend_lens_list, per_program)
            batch = len(starts)
            host = torch.tensor(starts + meta.extend_lens_list + items, dtype=torch.int64)
            uploaded = host.to(device, non_blocking=True)
            layout = uploaded[: 2 * batch].view(2, batch)
            work = uploaded[2 * batch :].view(2, -1)
            meta.cache[EXTEND_LAYOUT] = layout
            meta.cache[key] = work
        return layout[0], layout[1], work


def unfit_reason(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernel cannot serve ``model`` on ``device``: a layer shape for which
    no block option fits the device's shared memory (engine/layers/triton_ops/fitting.py),
    or for which the kernel fails to build or launch there (a Triton backend not tried on
    that device, such as torch_musa's); None where every one runs. Each distinct layer
    shape and options launches once, at load, so a model the device cannot take is known
    before serving, not at its first prefill. ``model`` may still be on the meta device:
    only its layers' shapes are read."""
    from engine.layers.triton_ops.fitting import NoFitError

    seen: set[tuple[object, ...]] = set()
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        # Attention layers only (the model holds the shared backend too).
        if not isinstance(backend, TritonAttentionBackend) or not hasattr(module, "q_heads"):
            continue
        layer: Any = module  # an attention layer (LlamaAttention and its kin)
        heads = (int(layer.q_heads), int(layer.kv_heads), int(layer.head_dim))
        shape = (*heads, backend.sliding_window, backend.softcap, backend.scale)
        if shape in seen:
            continue
        seen.add(shape)
        try:
            backend.probe(*heads, dtype, device)
        except NoFitError as exc:
            return exc.reason
        except Exception as exc:  # any failure here means: not this kernel on this device
            return f"the kernel failed for layer shape {shape}: {type(exc).__name__}: {exc}"
    return None

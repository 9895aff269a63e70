"""Paged attention over the device KV pool: pure PyTorch (any device, the reference) and
a native CPU decode kernel."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import ATTENTION_BACKENDS
from engine.kvcache.device_pool import DeviceKVPool
from engine.layers import cpu_kernels
from engine.layers.attention_base import AttentionBackend
from engine.layers.attention_meta import AttentionMetadata

logger = logging.getLogger(__name__)

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Devices whose SDPA kernels accumulate half-precision softmax in float32 themselves:
# half inputs go in as they are (MUSA's flash kernels do, like CUDA's).
_NATIVE_HALF_SDPA = ("cuda", "musa")
# SDPA takes grouped-query attention itself from torch 2.5 on (``enable_gqa``); on the CPU
# its flash kernel then reads each K/V head for its group of query heads.
# NOTE: repeating K/V per query head instead was 40 of a 4,096-token prefill's 300 ms of
# attention on the default model (2026-12-06). Accelerators keep the repeat: not every
# backend's SDPA (MUSA's) is known to take the flag.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype SDPA runs in for ``dtype`` inputs on ``device_type``: half precision
    stays where the kernels accumulate in float32, float32 elsewhere."""
    if dtype in _HALF_DTYPES and device_type not in _NATIVE_HALF_SDPA:
        return torch.float32
    return dtype


class TorchAttentionBackend(AttentionBackend):
    """SDPA-based backend: one batched gather for decode, one SDPA per sequence for extend.

    Half-precision inputs are attended in float32 (softmax included) on devices other than
    CUDA and MUSA, whose fused SDPA kernels already accumulate the softmax in float32.
    """

    name = "torch"
    graph_safe_decode = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        self.store_new_kv(k, v, layer_id, meta, kv_pool)
        if meta.is_decode:
            return self._decode(q, layer_id, meta, kv_pool)
        if meta.num_decodes == 0:
            return self._extend(q, k, v, layer_id, meta, kv_pool)
        # Mixed batch: its decodes (tokens [0, d)) take the batched decode path, not one
        # SDPA call each; the prefill chunks after them go through extend as usual.
        d = meta.num_decodes
        decode_meta, extend_meta = meta.split_decodes()
        decoded = self._decode(q[:d], layer_id, decode_meta, kv_pool)  # [d, q_heads * D]
        extended = self._extend(q[d:], k[d:], v[d:], layer_id, extend_meta, kv_pool)
        return torch.cat([decoded, extended])  # [T, q_heads * head_dim]

    # ---- decode: every sequence has one new token --------------------------------------

    @staticmethod
    def _decode_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat KV slots ``[B * max_seq_len]`` and padding mask, built once per forward."""
        slots = meta.cache.get("decode_slots")
        if slots is not None:
            return slots, meta.cache.get("decode_mask")
        max_len = meta.max_seq_len
        table = meta.req_table[meta.req_rows, :max_len].long()  # [B, max_seq_len]
        mask: torch.Tensor | None = None
        if min(meta.seq_lens_list) == max_len:
            slots = table
        else:
            cols = torch.arange(max_len, device=table.device)  # [max_seq_len]
            valid = cols[None, :] < meta.seq_lens[:, None]  # [B, max_seq_len]
            # NOTE: columns past a sequence's length may hold stale slots; read the dummy
            # slot 0 there instead, and mask those keys out.
            slots = table.masked_fill(~valid, 0)
            mask = valid[:, None, None, :]  # [B, 1, 1, max_seq_len]
            meta.cache["decode_mask"] = mask
        slots = slots.reshape(-1)
        meta.cache["decode_slots"] = slots
        return slots, mask

    def _decode(
        self, q: torch.Tensor, layer_id: int, meta: AttentionMetadata, kv_pool: DeviceKVPool
    ) -> torch.Tensor:
        slots, mask = self._decode_layout(meta)  # slots: [B * max_seq_len]
        num_seqs, q_heads, head_dim = q.shape
        kv_heads = kv_pool.kv_heads
        ctx_shape = (num_seqs, -1, kv_heads, head_dim)
        # index_select on a flat index is several times faster than advanced indexing.
        # [B, kv_heads, max_seq_len, head_dim]
        k_ctx = kv_pool.k_buffers[layer_id].index_select(0, slots).view(ctx_shape).transpose(1, 2)
        v_ctx = kv_pool.v_buffers[layer_id].index_select(0, slots).view(ctx_shape).transpose(1, 2)
        # GQA without copying K/V: the q heads sharing one kv head act as a group of
        # queries. [B, kv_heads, group, head_dim]
        q_groups = q.view(num_seqs, kv_heads, q_heads // kv_heads, head_dim)
        out = self._sdpa(q_groups, k_ctx, v_ctx, mask, causal=False)
        return out.reshape(num_seqs, q_heads * head_dim)

    # ---- extend / prefill: per sequence ------------------------------------------------

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
        skip: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Attention of each sequence's new tokens; rows of the sequences in ``skip`` are
        left unwritten (a subclass fills them another way)."""
        num_tokens, q_heads, head_dim = q.shape
        group = q_heads // kv_pool.kv_heads
        gqa = group > 1 and _SDPA_GQA and q.device.type == "cpu"
        out = torch.empty(num_tokens, q_heads * head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for b, ext_len in enumerate(meta.extend_lens_list):
            end = start + ext_len
            if b in skip:
                start = end
                continue
            prefix_len = meta.prefix_lens_list[b]
            if prefix_len == 0:
                # Whole sequence is new: its K/V are the tensors just written.
                k_seq, v_seq, mask = k[start:end], v[start:end], None  # [L, kv_heads, D]
            else:
                slots, mask = self._extend_layout(meta, b)
                k_seq = kv_pool.k_buffers[layer_id].index_select(0, slots)  # [S, kv_heads, D]
                v_seq = kv_pool.v_buffers[layer_id].index_select(0, slots)
            if group > 1 and not gqa:
                k_seq = k_seq.repeat_interleave(group, dim=1)  # [S, q_heads, head_dim]
                v_seq = v_seq.repeat_interleave(group, dim=1)
            # 4-D inputs: the fused (flash) SDPA kernels do not take 3-D ones.
            seq_out = self._sdpa(
                q[start:end].transpose(0, 1)[None],  # [1, q_heads, L, head_dim]
                k_seq.transpose(0, 1)[None],  # [1, q_heads or kv_heads, S, head_dim]
                v_seq.transpose(0, 1)[None],
                mask,
                causal=mask is None,
                gqa=gqa,
            )  # [1, q_heads, L, head_dim]
            out[start:end] = seq_out[0].transpose(0, 1).reshape(ext_len, q_heads * head_dim)
            start = end
        return out

    @staticmethod
    def _extend_layout(meta: AttentionMetadata, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[S]`` and bottom-right causal mask ``[L, S]`` of sequence ``b`` (cached)."""
        key = f"extend_slots_{b}"
        slots = meta.cache.get(key)
        if slots is not None:
            return slots, meta.cache[f"extend_mask_{b}"]
        seq_len, prefix_len = meta.seq_lens_list[b], meta.prefix_lens_list[b]
        ext_len = meta.extend_lens_list[b]
        row = meta.req_rows_list[b] if meta.req_rows_list else meta.req_rows[b]
        slots = meta.req_table[row, :seq_len].long()  # [S]
        rows = torch.arange(ext_len, device=slots.device)[:, None]  # [L, 1]
        cols = torch.arange(seq_len, device=slots.device)[None, :]  # [1, S]
        # NOTE: new token i sits at position prefix_len + i and sees keys 0..prefix_len + i.
        mask = cols <= rows + prefix_len  # [L, S]
        meta.cache[key] = slots
        meta.cache[f"extend_mask_{b}"] = mask
        return slots, mask

    # ---- shared ------------------------------------------------------------------------

    @staticmethod
    def _sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        gqa: bool = False,
    ) -> torch.Tensor:
        """``gqa``: k and v have fewer heads than q, each shared by a group of q heads."""
        out_dtype = q.dtype
        compute = sdpa_dtype(q.device.type, out_dtype)
        # K/V read from the pool come in its dtype, which --kv-cache-dtype may set apart.
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        extra = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **extra)
        return out if out.dtype == out_dtype else out.to(out_dtype)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    """TorchAttentionBackend with native kernels: decode reads K/V in place from the
    paged pool (engine/layers/csrc/paged_attention.h), no padded gather per layer; extend
    and prefill attend every sequence of the step in one call (prefill_attention.h), or on
    SDPA per sequence where that kernel does not take the head_dim. float32 on the CPU
    only."""

    name = "cpu_native"
    decode_reads_pool_in_place = True

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def _store_kv(
        self,
        layer_id: int,
        meta: AttentionMetadata,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_pool: DeviceKVPool,
    ) -> None:
        # One native call writes K and V rows in place of two index_put_ (~15 us each at
        # decode, almost all dispatch).
        if k.dtype != torch.float32 or k.device.type != "cpu":
            kv_pool.write(layer_id, meta.out_slots, k, v)
            return
        self.kernel.store_kv(
            kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id], meta.out_slots, k, v
        )

    def _decode(
        self, q: torch.Tensor, layer_id: int, meta: AttentionMetadata, kv_pool: DeviceKVPool
    ) -> torch.Tensor:
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._decode(q, layer_id, meta, kv_pool)
        num_seqs, q_heads, head_dim = q.shape
        # q is a row-strided view of the rotated q/k: the kernel takes it as it is.
        out = self.kernel.paged_decode(
            q if q.stride(1) == head_dim and q.stride(2) == 1 else q.contiguous(),
            kv_pool.k_buffers[layer_id],
            kv_pool.v_buffers[layer_id],
            meta.req_table,
            meta.req_rows,
            meta.seq_lens,
            head_dim**-0.5,
        )  # [B, q_heads, head_dim]
        return out.view(num_seqs, q_heads * head_dim)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
        skip: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._extend(q, k, v, layer_id, meta, kv_pool, skip)
        # A one-token extend after a cached prefix (the copies of an n > 1 request, a
        # prompt found in the tree but for its last token) is a decode: the native kernel
        # takes them all in one call instead of a gather and an SDPA call each per layer.
        singles = [
            b
            for b, (n, prefix) in enumerate(zip(meta.extend_lens_list, meta.prefix_lens_list))
            if n == 1 and prefix > 0 and b not in skip
        ]
        if len(singles) == meta.batch_size:
            return self._decode(q, layer_id, meta, kv_pool)
        out = self._extend_rest(q, k, v, layer_id, meta, kv_pool, skip | frozenset(singles))
        if not singles:
            return out
        tokens = meta.cache.get("single_tokens")
        if tokens is None:
            starts = [0]
            for n in meta.extend_lens_list:
                starts.append(starts[-1] + n)
            seqs = torch.tensor(singles, dtype=torch.long, device=q.device)
            tokens = torch.tensor([starts[b] for b in singles], dtype=torch.long, device=q.device)
            meta.cache["single_tokens"] = tokens
            meta.cache["single_rows"] = meta.req_rows.index_select(0, seqs)
            meta.cache["single_lens"] = meta.seq_lens.index_select(0, seqs)
        head_dim = q.shape[2]
        decoded = self.kernel.paged_decode(
            q.index_select(0, tokens),
            kv_pool.k_buffers[layer_id],
            kv_pool.v_buffers[layer_id],
            meta.req_table,
            meta.cache["single_rows"],
            meta.cache["single_lens"],
            head_dim**-0.5,
        )  # [singles, q_heads, head_dim]
        out.index_copy_(0, tokens, decoded.view(len(singles), -1))
        return out

    def _extend_rest(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
        skip: frozenset[int],
    ) -> torch.Tensor:
        """Extend attention of every sequence not in ``skip``: the native prefill kernel
        (prefill_attention.h) where it takes the head_dim, else SDPA per sequence."""
        num_tokens, q_heads, head_dim = q.shape
        if not self.kernel.prefill_takes(head_dim):
            return super()._extend(q, k, v, layer_id, meta, kv_pool, skip)
        seqs = [b for b in range(meta.batch_size) if b not in skip]
        out = torch.empty(num_tokens, q_heads * head_dim, dtype=q.dtype, device=q.device)
        if not seqs:
            return out
        rows = meta.req_rows_list or meta.req_rows.tolist()
        self.kernel.prefill_attention(
            *(
                x if x.stride(2) == 1 and x.stride(1) == head_dim else x.contiguous()
                for x in (q, k, v)
            ),
            kv_pool.k_buffers[layer_id],
            kv_pool.v_buffers[layer_id],
            meta.req_table,
            rows,
            meta.prefix_lens_list,
            meta.extend_lens_list,
            seqs,
            head_dim**-0.5,
            out,
        )
        return out


def get_attention_backend(
    name: str = "torch", device: torch.device | None = None, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend called ``name`` (one of ATTENTION_BACKENDS) for a model on ``device``
    in ``dtype``. ``auto``: the native CPU kernel for float32 on the CPU where it builds,
    the Triton paged kernel on GPUs where triton has a working backend, else the
    pure-PyTorch reference (on a GPU: logged, it gathers K/V every layer)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )
    on_cpu = device is None or device.type == "cpu"
    if name == "triton" or (name == "auto" and not on_cpu):
        return _triton_backend(name, device if device is not None else torch.device("cpu"))
    on_cpu_fp32 = on_cpu and dtype in (None, torch.float32)
    if name == "torch" or (name == "auto" and not on_cpu_fp32):
        return TorchAttentionBackend()
    if not on_cpu_fp32:
        raise ValueError(
            f"attention backend 'cpu_native' runs float32 on the CPU only, not "
            f"{dtype} on {device}; use 'torch' or 'auto'"
        )
    kernel = cpu_kernels.paged_decode_kernel()
    if kernel is not None:
        return CpuNativeAttentionBackend(kernel)
    if name == "cpu_native":
        raise RuntimeError(
            f"attention backend 'cpu_native' could not be built: {cpu_kernels.build_error()}"
        )
    return TorchAttentionBackend()


def _triton_backend(name: str, device: torch.device) -> AttentionBackend:
    """The Triton backend on ``device``; where it cannot run, an error when asked for by
    name, the gather fallback (logged) under ``auto``."""
    from engine.layers import triton_ops

    reason = triton_ops.unavailable_reason(device)
    if reason is None:
        from engine.layers.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "triton":
        raise RuntimeError(f"attention backend 'triton' cannot run on {device}: {reason}")
    logger.warning(
        "attention: Triton paged kernel unavailable on %s (%s); falling back to the "
        "PyTorch backend, which gathers every row's K/V per layer",
        device,
        reason,
    )
    return TorchAttentionBackend()

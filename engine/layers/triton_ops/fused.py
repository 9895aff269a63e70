"""Fused element-wise Triton kernels for GPUs: residual add + RMSNorm, SiLU(gate) x up,
RoPE over q and k in one pass, and RoPE fused with the K/V store (each one launch in
place of two to eight ops).

They plug into the hooks the fused CPU kernels use (RMSNorm.fused_add_norm,
GatedMLP.act_mul, LlamaAttention.rotary_fn); the PyTorch code stays the reference and
what every other device runs. Arithmetic in float32, results rounded to the input dtype
where the reference rounds.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn

logger = logging.getLogger(__name__)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, hidden, eps, stride_x, stride_r,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    # The sum is rounded to the model dtype first, as the unfused `x + residual` is.
    summed = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * hidden + cols, summed, mask=ok)
    s = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, 0) / hidden + eps)
    normed = (s * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``, ``[T, hidden]`` each."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and residual.stride(1) == 1
    normed = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(normed)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x, residual, weight, normed, summed, hidden, eps, x.stride(0), residual.stride(0),
            BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return normed, summed


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=ok, other=0.0).to(tl.float32)
    # Rounded after the SiLU, as the reference's two ops are.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2 * I]`` (gate first): ``[T, I]``."""
    num_tokens, width = gate_up.shape
    size = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            gate_up, out, size, gate_up.stride(0), BLOCK=block
        )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK)
    ok = dims < HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)  # rotate-half's source
    base = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(base + dims, mask=ok, other=0.0).to(tl.float32)
    swapped = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + dims, mask=ok, other=0.0).to(tl.float32)
    out = x * cos + swapped * sin  # sin carries rotate-half's sign
    tl.store(
        out_ptr + (token * heads + head) * HEAD_DIM + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=ok,
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[T, heads, head_dim]`` (any row strides) with ``cos``/``sin``
    ``[T, 1, head_dim]`` as RotaryEmbedding.cos_sin makes them: a new contiguous tensor."""
    num_tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and cos.stride(2) == 1 and sin.stride(2) == 1
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens, heads)](
            x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return out


def use_triton_fused_ops(model: nn.Module) -> int:
    """Switch ``model``'s RMSNorm, SwiGLU, RoPE and SwiGLU-expert layers to the Triton
    kernels; returns how many switched. The caller checks that Triton runs on the
    model's device. Each kernel first runs once on zeros of each distinct shape it will
    see: where one does not build or run there (a Triton backend not tried on the
    device), nothing switches and the reason is logged."""
    from engine.layers.linear import GatedMLP
    from engine.layers.moe import SparseMoE
    from engine.layers.rmsnorm import RMSNorm
    from engine.layers.rotary import apply_rotary
    from engine.layers.triton_ops.fused_moe import fused_experts

    switches: list[tuple[nn.Module, str, object]] = []
    # One call of each kernel per distinct shape: (kernel, its arguments: zeros).
    trials: dict[tuple[object, ...], tuple[Callable[..., object], tuple[object, ...]]] = {}
    for module in model.modules():
        param = next(module.parameters(), None)
        if param is None:
            continue
        zeros = functools.partial(torch.zeros, dtype=param.dtype, device=param.device)
        # Exact types only: a subclass (Gemma's 1 + weight norm) computes something else.
        if type(module) is RMSNorm:
            switches.append((module, "fused_add_norm", add_rms_norm))
            x = zeros(2, module.weight.shape[0])
            trials[("add_rms_norm", x.shape, x.dtype)] = (
                add_rms_norm,
                (x, x, module.weight, module.eps),
            )
        elif type(module) is GatedMLP and module.activation == "silu":
            switches.append((module, "act_mul", silu_mul))
            gate_up = zeros(2, 2 * module.intermediate_size)
            trials[("silu_mul", gate_up.shape, gate_up.dtype)] = (silu_mul, (gate_up,))
        elif type(module) is SparseMoE and module.activation == "silu":
            switches.append((module, "fused_experts", fused_experts))
            chosen = torch.zeros(2, module.top_k, dtype=torch.int64, device=param.device)
            x = zeros(2, module.w13.shape[2])
            weights = zeros(chosen.shape)
            trials[("fused_experts", module.w13.shape, module.w2.shape, x.dtype, module.top_k)] = (
                fused_experts,
                (x, module.w13, module.w2, chosen, weights),
            )
        elif getattr(module, "rotary_fn", None) is apply_rotary:
            backend = getattr(module, "attn_backend", None)
            if getattr(backend, "fuses_rope_store", False):
                # RoPE and the K/V store in the attention backend's one kernel (tried by
                # the backend at load: triton_attention.unfit_reason).
                switches.append((module, "fused_rope_store", True))
            else:
                switches.append((module, "rotary_fn", rotary))
                layer: Any = module
                q, cos = zeros(2, layer.q_heads, layer.head_dim), zeros(2, 1, layer.head_dim)
                trials[("rotary", q.shape, q.dtype)] = (rotary, (q, cos, cos))
    for key, (kernel, inputs) in trials.items():
        try:
            kernel(*inputs)
        except Exception as exc:  # any failure means: not these kernels on this device
            logger.warning(
                "fused Triton kernels not used: %s failed here (%s: %s); keeping the PyTorch ops",
                key[0],
                type(exc).__name__,
                exc,
            )
            return 0
    for module, name, value in switches:
        setattr(module, name, value)
    logger.info("fused Triton kernels in use in %d layers", len(switches))
    return len(switches)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_cs, stride_ch, stride_ds, stride_dh, HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK)
    ok = dims < HEAD_DIM
    slot = tl.load(slots_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=ok)
    tl.store(k_cache_ptr + slot * stride_cs + head * stride_ch + dims, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_ds + head * stride_dh + dims, v, mask=ok)


def store_kv(
    k: torch.Tensor,  # [T, kv_heads, D] (any row strides)
    v: torch.Tensor,  # [T, kv_heads, D]
    slots: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [slots, kv_heads, D]
    v_cache: torch.Tensor,
) -> None:
    """Write the new tokens' K and V rows to their pool slots in one launch (in place of
    two ``index_put_``)."""
    num_tokens, kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
    if num_tokens:
        _store_kv_kernel[(num_tokens, kv_heads)](
            k, v, slots, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim),
        )  # fmt: skip


@triton.jit
def _rotary_store_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    q_heads, stride_xt, stride_xh, stride_vt, stride_vh, stride_ct, stride_st, stride_cs,
    stride_ch, stride_ds, stride_dh, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads first, then kv heads
    dims = tl.arange(0, BLOCK)
    ok = dims < HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    base = qk_ptr + token * stride_xt + head * stride_xh
    x = tl.load(base + dims, mask=ok, other=0.0).to(tl.float32)
    swapped = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + dims, mask=ok, other=0.0).to(tl.float32)
    rotated = x * cos + swapped * sin
    if head < q_heads:
        tl.store(
            q_out_ptr + (token * q_heads + head) * HEAD_DIM + dims,
            rotated.to(q_out_ptr.dtype.element_ty),
            mask=ok,
        )
    else:
        kv_head = head - q_heads
        slot = tl.load(slots_ptr + token).to(tl.int64)
        k_dst = k_cache_ptr + slot * stride_cs + kv_head * stride_ch + dims
        tl.store(k_dst, rotated.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + dims, mask=ok)
        tl.store(v_cache_ptr + slot * stride_ds + kv_head * stride_dh + dims, v, mask=ok)


def rotary_store(
    qk: torch.Tensor,  # [T, q_heads + kv_heads, D] before RoPE (any row strides)
    v: torch.Tensor,  # [T, kv_heads, D]
    cos: torch.Tensor,  # [T, 1, D]
    sin: torch.Tensor,  # [T, 1, D]
    q_heads: int,
    slots: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [slots, kv_heads, D]
    v_cache: torch.Tensor,
) -> torch.Tensor:  # [T, q_heads, D] rotated q
    """RoPE on q and k with the rotated K and V written straight to their pool slots: one
    launch in place of RoPE's ops and the two stores. Returns the rotated q."""
    num_tokens, heads, head_dim = qk.shape
    assert qk.stride(2) == 1 and v.stride(2) == 1 and cos.stride(2) == 1
    q_out = torch.empty((num_tokens, q_heads, head_dim), dtype=qk.dtype, device=qk.device)
    if num_tokens:
        _rotary_store_kernel[(num_tokens, heads)](
            qk, v, cos, sin, q_out, slots, k_cache, v_cache, q_heads, qk.stride(0),
            qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return q_out

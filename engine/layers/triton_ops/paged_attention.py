"""Paged attention in Triton: every sequence of a step in one launch, K/V read in place
from the pool through the request table (no gather, no padding to a context bucket).

One kernel covers decode and varlen prefill/extend with a cached prefix. A program owns
one sequence, one block of its new tokens and one KV head; its rows are (token, q head of
the KV head's group) pairs, so the K/V tile it loads serves the whole GQA group without
repeating K/V. An extend launch takes its (sequence, token block) pairs from a work list
(``extend_work``), one program each, so its grid is the list's length: no program for the
blocks a short sequence does not have, and a fixed grid for a list padded to a size,
which is how a mixed step is captured in a device graph (engine/mixed_graphs.py). Keys are visited in blocks of ``BLOCK_N`` positions: the request table
gives each position's slot, so any page size works (the table is per token).

Decode splits each sequence's keys over ``num_splits`` programs (flash-decoding) and a
second kernel merges their partial softmax sums: a 32k-token row among short ones costs
the step its share of work spread over many programs, not one long program. The grid of
a decode call depends on the batch size only, never on lengths, so it can be captured.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.layers.triton_ops import interpreting
from engine.layers.triton_ops.fitting import launch_fitting, pipeline

# Decode: most programs per (sequence, KV head); a split never takes fewer keys than
# DECODE_MIN_CHUNK, so short rows use one or two and the rest exit at once.
# TODO(gpu): tune both on the H200 (tests/gpu/kernel_goals.py prints the step times).
DECODE_SPLITS = 16
DECODE_MIN_CHUNK = 256
# What to run instead where no launch option fits the device's shared memory.
NO_FIT_ADVICE = (
    "start with --attention-backend torch (gathers K/V: slower) or a half-precision --dtype"
)
# The token block of a padding work item: past every sequence's new tokens, so its
# program loads nothing and stores nothing.
PAD_BLOCK = 1 << 20


@triton.jit
def _tanh(x):
    # tanh through exp (tl.math.tanh is not in every backend); fine for scores.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, q_heads, D]
    k_ptr,  # [slots, kv_heads, D]
    v_ptr,  # [slots, kv_heads, D]
    out_ptr,  # [T, q_heads, D] (NUM_SPLITS == 1)
    part_acc_ptr,  # [NUM_SPLITS, T, q_heads, D] float32 (NUM_SPLITS > 1)
    part_ml_ptr,  # [NUM_SPLITS, T, q_heads, 2] float32: running max, sum
    table_ptr,  # [rows, max_context] int32
    req_rows_ptr,  # [B]
    seq_lens_ptr,  # [B] keys of each sequence, new tokens included
    q_starts_ptr,  # [B] first new token of each sequence in q (not read when IS_DECODE)
    q_lens_ptr,  # [B] new tokens of each sequence (not read when IS_DECODE)
    work_ptr,  # [2, W]: sequence, token block of each program (not read when IS_DECODE)
    num_work,
    num_tokens,
    q_heads,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    scale,
    softcap,
    window,
    min_chunk,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DECODE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    if IS_DECODE:
        seq = tl.program_id(0)
        q_block = 0
    else:
        seq = tl.load(work_ptr + tl.program_id(0)).to(tl.int32)
        q_block = tl.load(work_ptr + num_work + tl.program_id(0)).to(tl.int32)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    tokens_per_block: tl.constexpr = BLOCK_M // GROUP

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    if IS_DECODE:
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(q_starts_ptr + seq).to(tl.int32)
        q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len
    first_tok = q_block * tokens_per_block
    table_row = table_ptr + tl.load(req_rows_ptr + seq).to(tl.int64) * stride_table

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP  # [M] new-token index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [M] q head
    row_ok = (rows < tokens_per_block * GROUP) & (tok < q_len)
    q_pos = prefix_len + tok  # [M] position of each row's token
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if COMPUTE_F32:
        q = q.to(tl.float32)

    # Keys this block's tokens can see: up to its last token, from its first token's
    # window on; then this split's share of them.
    last_tok = tl.minimum(first_tok + tokens_per_block, q_len) - 1
    kv_hi = prefix_len + last_tok + 1
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(prefix_len + first_tok - window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, min_chunk)
    split_lo = kv_lo + split * chunk
    split_hi = tl.minimum(kv_hi, split_lo + chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if first_tok < q_len:
        for start in range(split_lo, split_hi, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)  # [N]
            k_ok = k_pos < split_hi
            slots = tl.load(table_row + k_pos, mask=k_ok, other=0).to(tl.int64)  # [N]
            kv_mask = k_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )  # [N, D]
            v = tl.load(
                v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if COMPUTE_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] float32
            if USE_SOFTCAP:
                scores = softcap * _tanh(scores / softcap)
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row that has seen no visible key yet keeps max -inf: shift by 0 instead.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])  # [M, N]
            alpha = tl.exp(m_i - m_safe)  # [M]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

    out_rows = (q_start + tok).to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offs = out_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptr + o_offs,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        part_row = (split * num_tokens + out_rows) * q_heads + head  # [M]
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,  # [NUM_SPLITS, T, q_heads, D] float32
    part_ml_ptr,  # [NUM_SPLITS, T, q_heads, 2] float32
    out_ptr,  # [T, q_heads, D]
    num_tokens,
    q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part_row = (splits * num_tokens + token).to(tl.int64) * q_heads + head  # [S]
    m = tl.load(part_ml_ptr + part_row * 2)  # [S]
    l_sum = tl.load(part_ml_ptr + part_row * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp(m - m_max)  # [S]: 0 for splits that saw no key
    acc = tl.load(
        part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
        mask=dim_ok[None, :],
        other=0.0,
    )  # [S, D]
    total = tl.sum(weight * l_sum, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def _blocks(group: int, head_dim: int, decode: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): tl.dot wants every side >= 16 on GPUs."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    group_rows = max(16, triton.next_power_of_2(group))
    if decode:
        return group_rows, 64, block_d
    return max(64, group_rows), 64 if block_d <= 128 else 32, block_d


@functools.cache
def _smaller_options(block_n: int) -> tuple[tuple[int, int | None], ...]:
    """(BLOCK_N, num_stages) to try, best first, where the device has less shared memory
    than the first needs (engine/layers/triton_ops/fitting.py): halved key blocks with
    Triton's pipelining, then without it. BLOCK_M stays: the work list is cut by it."""
    blocks = [block_n]
    while blocks[-1] > 16:
        blocks.append(blocks[-1] // 2)
    return tuple((n, stages) for stages in (None, 1) for n in blocks)


@functools.cache
def extend_tokens_per_program(q_heads: int, kv_heads: int, head_dim: int) -> int:
    """New tokens one extend program covers: the token block of ``extend_work``."""
    group = q_heads // kv_heads
    block_m = _blocks(group, head_dim, decode=False)[0]
    if block_m // group == 0:
        raise ValueError(f"GQA group {group} does not fit a block of {block_m} rows")
    return block_m // group


def extend_work(q_lens: list[int], tokens_per_program: int, size: int | None = None) -> list[int]:
    """An extend launch's work list, flattened ``[2, W]``: the sequence of each program,
    then its token block. ``size``: pad the list to that many programs (which do nothing),
    for a launch whose grid must not depend on the step; at least
    ``max_extend_work(sum(q_lens), len(q_lens), tokens_per_program)``."""
    seqs: list[int] = []
    blocks: list[int] = []
    for seq, n in enumerate(q_lens):
        count = -(-n // tokens_per_program)
        seqs.extend([seq] * count)
        blocks.extend(range(count))
    if size is not None:
        if size < len(seqs):
            raise ValueError(f"{len(seqs)} extend programs do not fit a list of {size}")
        seqs.extend([0] * (size - len(seqs)))
        blocks.extend([PAD_BLOCK] * (size - len(blocks)))
    return seqs + blocks


def max_extend_work(num_tokens: int, num_seqs: int, tokens_per_program: int) -> int:
    """Most programs an extend of ``num_tokens`` new tokens over at most ``num_seqs``
    sequences needs: every sequence may end in a partial block."""
    return -(-num_tokens // tokens_per_program) + min(num_seqs, num_tokens)


def paged_attention(
    q: torch.Tensor,  # [T, q_heads, D]
    k_cache: torch.Tensor,  # [slots, kv_heads, D]
    v_cache: torch.Tensor,  # [slots, kv_heads, D]
    req_table: torch.Tensor,  # [rows, max_context] int32
    req_rows: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] keys per sequence (new tokens included)
    *,
    q_starts: torch.Tensor | None = None,  # [B] (extend); None: decode, token b is row b
    q_lens: torch.Tensor | None = None,  # [B] (extend)
    work: torch.Tensor | None = None,  # [2, W] (extend): extend_work's list
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [T, q_heads, D]
) -> torch.Tensor:  # [T, q_heads, D]
    """Attention of every new token over its sequence's keys (causal, optional sliding
    window and soft-capping). Decode when ``q_starts`` is None: one token per sequence.

    An extend writes only the rows of its sequences' new tokens: rows no sequence owns
    (padding) keep what ``out`` held.
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    decode = q_starts is None
    if not decode and (q_lens is None or work is None):
        raise ValueError("an extend needs q_starts, q_lens and its work list")
    if out is None:
        out = torch.empty_like(q)
    batch = int(seq_lens.shape[0])
    if num_tokens == 0 or batch == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert req_table.stride(1) == 1
    block_m, block_n, block_d = _blocks(group, head_dim, decode)
    if block_m // group == 0:
        raise ValueError(f"GQA group {group} does not fit a block of {block_m} rows")
    interp = interpreting()
    if interp:  # the interpreter is numpy: small tiles keep CPU CI fast
        block_n = 16
    # The interpreter runs programs one by one: two splits keep the merge covered there.
    splits = 1 if not decode else (num_splits or (2 if interp else DECODE_SPLITS))
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    if decode:
        grid = (batch, 1, kv_heads * splits)
        work, num_work = seq_lens, 0  # not read
    else:
        assert work is not None and work.dim() == 2 and work.shape[0] == 2
        assert work.is_contiguous()
        num_work = int(work.shape[1])
        grid = (num_work, 1, kv_heads)
        if num_work == 0:
            return out
    if splits > 1:
        part_acc = torch.empty(
            splits, num_tokens, q_heads, head_dim, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(splits, num_tokens, q_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not written
    starts = q_starts if q_starts is not None else seq_lens
    lens = q_lens if q_lens is not None else seq_lens
    # float32 models stay exact; the interpreter (numpy) has no bf16 dot.
    compute_f32 = q.dtype == torch.float32 or interp

    def launch(option: tuple[int, int | None]) -> None:
        keys_per_block, stages = option
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, part_acc, part_ml, req_table, req_rows, seq_lens, starts,
            lens, work, num_work, num_tokens, q_heads, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), req_table.stride(0),
            scale if scale is not None else head_dim**-0.5,
            softcap or 1.0,
            window or 0,
            DECODE_MIN_CHUNK if splits > 1 and not interp else keys_per_block,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
            BLOCK_N=keys_per_block, IS_DECODE=decode, NUM_SPLITS=splits,
            USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
            COMPUTE_F32=compute_f32,
            # float32 models: exact products, not TF32 (greedy output must match eager).
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            **pipeline(stages),
        )  # fmt: skip

    # What decides the kernel's size: its constexprs, but for the options tried.
    key = (q.device, q.dtype, group, head_dim, decode, splits, window is None, softcap is None)
    launch_fitting(("paged_attention", *key), _smaller_options(block_n), launch, NO_FIT_ADVICE)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, q_heads)](
            part_acc,
            part_ml,
            out,
            num_tokens,
            q_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
        )
    return out

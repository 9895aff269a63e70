"""A paged KV layout built from random pages, and plain-PyTorch attention over it: the
independent reference the Triton kernels are checked against (float64, dense masks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """One step: B sequences with ``prefix_lens[b]`` cached keys and ``q_lens[b]`` new
    tokens, their K/V already in the pool at the slots the request table names."""

    q: torch.Tensor  # [T, q_heads, D]
    k_cache: torch.Tensor  # [slots, kv_heads, D]
    v_cache: torch.Tensor
    req_table: torch.Tensor  # [rows, max_context] int32
    req_rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    q_starts: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64
    prefix_lens: list[int]


def make_batch(
    prefix_lens: list[int],
    q_lens: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random q and K/V; each sequence's tokens on shuffled pages of ``page_size`` slots
    (page 0 left unused, as the allocator does), in shuffled request-table rows."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    max_context = max([*seq_lens, 1]) + 3
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    page_order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # skip page 0
    num_rows = len(seq_lens) + 2
    row_order = torch.randperm(num_rows, generator=gen).tolist()
    # Stale slots past each length: the kernel must never read them.
    table = torch.randint(0, num_pages * page_size, (num_rows, max_context), generator=gen)
    table = table.to(torch.int32)
    for b, seq_len in enumerate(seq_lens):
        pages = [page_order.pop() for _ in range(pages_per_seq[b])]
        slots = torch.tensor([p * page_size + i for p in pages for i in range(page_size)])
        table[row_order[b], :seq_len] = slots[:seq_len].to(torch.int32)
    num_slots = num_pages * page_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=gen).to(dtype)
    starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        req_table=table,
        req_rows=torch.tensor(row_order[: len(seq_lens)], dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        q_starts=torch.tensor(starts, dtype=torch.int64),
        q_lens=torch.tensor(q_lens, dtype=torch.int64),
        prefix_lens=list(prefix_lens),
    )


def work_list(batch: PagedBatch, size: int | None = None) -> torch.Tensor:
    """The extend launch's work list ``[2, W]`` of ``batch`` (padded to ``size``)."""
    from engine.layers.triton_ops.paged_attention import extend_tokens_per_program, extend_work

    _, q_heads, head_dim = batch.q.shape
    per_program = extend_tokens_per_program(q_heads, batch.k_cache.shape[1], head_dim)
    items = extend_work(batch.q_lens.tolist(), per_program, size)
    return torch.tensor(items, dtype=torch.int64).view(2, -1)


def reference_attention(
    batch: PagedBatch,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, q_heads, D] float64
    """Dense float64 attention per sequence with K/V repeated per q head."""
    num_tokens, q_heads, head_dim = batch.q.shape
    group = q_heads // batch.k_cache.shape[1]
    scale = scale if scale is not None else head_dim**-0.5
    out = torch.zeros(num_tokens, q_heads, head_dim, dtype=torch.float64)
    for b, prefix_len in enumerate(batch.prefix_lens):
        start, q_len = int(batch.q_starts[b]), int(batch.q_lens[b])
        seq_len = prefix_len + q_len
        if q_len == 0:
            continue
        slots = batch.req_table[int(batch.req_rows[b]), :seq_len].long()
        k = batch.k_cache[slots].double().repeat_interleave(group, dim=1)  # [S, q_heads, D]
        v = batch.v_cache[slots].double().repeat_interleave(group, dim=1)
        q = batch.q[start : start + q_len].double()  # [L, q_heads, D]
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(prefix_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
    return out

"""Mixture-of-experts experts in Triton: no host sync at any token count, and each expert
computes only the tokens routed to it (the grouped PyTorch path computes every expert
over every token of the step).

The step's (token, choice) assignments are sorted by expert on the device and each
expert's run padded to a multiple of ``BLOCK_M`` (``align_by_expert``), so every block
of ``BLOCK_M`` sorted rows belongs to one expert. Two grouped matmul kernels then run
one program per (block, column tile): the first multiplies the block's tokens by the
expert's gate and up rows and writes ``silu(gate) * up`` per assignment, the second
multiplies that by the expert's down projection, scaled by the routing weight. The grid
is bounded by the token count alone (``T * top_k / BLOCK_M + experts`` blocks), so a step
can be captured in a device graph; blocks past the padded runs exit at once. The sum
over each token's choices is one ``[T, top_k, hidden]`` reduction.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.layers.triton_ops.fitting import launch_fitting, pipeline


def align_by_expert(
    experts: torch.Tensor,  # [T, k] int64 expert of each assignment
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The assignments (flat indices ``t * k + j``) sorted by expert, each expert's run
    padded to a multiple of ``block_m`` with the index ``T * k`` (no assignment):
    ``[blocks * block_m]``; and each block's expert ``[blocks]`` (``num_experts`` for a
    block past every run). Device operations only, shapes fixed by ``T``."""
    flat = experts.reshape(-1)  # [A]
    count = flat.numel()
    device = flat.device
    # NOTE: not torch.bincount, which reads the largest value on the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    order = torch.argsort(flat, stable=True)  # [A] assignments grouped by expert
    by_expert = flat[order]  # [A]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E]
    rank = torch.arange(count, device=device) - starts[by_expert]  # [A] place in its run
    blocks = max_blocks(count, num_experts, block_m)
    sorted_ids = torch.full((blocks * block_m,), count, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, ends[by_expert] - padded[by_expert] + rank, order)
    first_rows = torch.arange(blocks, device=device) * block_m  # [blocks]
    block_expert = torch.searchsorted(ends, first_rows, right=True)  # [blocks] in [0, E]
    return sorted_ids, block_expert


def max_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """Most blocks ``align_by_expert`` may fill: every expert's run may end in a partial
    block (and at most ``assignments`` experts have one)."""
    return -(-assignments // block_m) + min(num_experts, assignments)


@triton.jit
def _expert_matmul_kernel(
    a_ptr,  # [rows, K]: tokens (GATE_UP: row = assignment // TOP_K) or the activations
    w_ptr,  # [E, N_total, K]: gate and up rows stacked (GATE_UP), or down
    out_ptr,  # [A, N] one row per assignment
    scale_ptr,  # [A] routing weight of each assignment (not GATE_UP)
    sorted_ids_ptr,  # [blocks * BLOCK_M]
    block_expert_ptr,  # [blocks]
    num_assignments,
    num_experts,
    n_cols,  # N: intermediate (GATE_UP) or hidden
    k_dim,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    row_ok = ids < num_assignments
    if GATE_UP:
        a_rows = ids // TOP_K
    else:
        a_rows = ids
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    col_ok = cols < n_cols
    w_expert = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [K]
        k_ok = ks < k_dim
        a = tl.load(
            a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [M, K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(
            w_expert + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0
        )  # [K, N]
        if COMPUTE_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATE_UP:  # the up row of each column: n_cols rows further
            w_up = tl.load(
                w_expert + (cols + n_cols)[None, :] * stride_wn + ks[:, None],
                mask=w_mask,
                other=0.0,
            )
            if COMPUTE_F32:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
    if GATE_UP:
        out = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    else:
        out = acc * tl.load(scale_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + ids.to(tl.int64)[:, None] * stride_om + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _block_sizes(assignments: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks for decode-sized steps, where most
    experts get a token or two."""
    if interpreted:  # numpy: small tiles keep CPU CI fast
        return 16, 32, 32
    # TODO(gpu): tune on the H200 (tests/gpu/kernel_goals.py times check_moe's cases).
    return (16 if assignments <= 256 else 64), 64, 64


# What to run instead where no launch option fits the device's shared memory.
NO_FIT_ADVICE = (
    "start with HISERVE_TRITON_FUSED=0 (the PyTorch experts) or a half-precision --dtype"
)


@functools.cache
def _smaller_tiles(block_n: int, block_k: int) -> tuple[tuple[int, int, int | None], ...]:
    """(BLOCK_N, BLOCK_K, num_stages) to try, best first, where the device has less shared
    memory than the first needs (engine/layers/triton_ops/fitting.py)."""
    tiles = [(block_n, block_k)]
    while min(tiles[-1]) > 16:
        n, k = tiles[-1]
        tiles.append((n, k // 2) if k >= n else (n // 2, k))
    return tuple((n, k, stages) for stages in (None, 1) for n, k in tiles)


def fused_experts(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [E, hidden, intermediate]
    experts: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k] routing weight of each choice
) -> torch.Tensor:  # [T, hidden]
    """``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e =
    experts[t, j]``, SwiGLU experts."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    count = num_tokens * top_k
    if count == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    assert w13.stride(2) == 1 and w2.stride(2) == 1
    # Triton takes CPU tensors only under its interpreter (numpy), which has no bf16 dot.
    interpreted = x.device.type == "cpu"
    block_m, block_n, block_k = _block_sizes(count, interpreted)
    sorted_ids, block_expert = align_by_expert(experts, num_experts, block_m)
    blocks = block_expert.shape[0]
    options = {
        "TOP_K": top_k,
        "BLOCK_M": block_m,
        # float32 models stay exact.
        "COMPUTE_F32": x.dtype == torch.float32 or interpreted,
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
    }
    tiles = _smaller_tiles(block_n, block_k)

    def matmul(
        a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, gate_up: bool
    ) -> None:
        n_cols, k_dim = out.shape[1], a.shape[1]

        def launch(option: tuple[int, int, int | None]) -> None:
            n, k, stages = option
            _expert_matmul_kernel[(blocks, triton.cdiv(n_cols, n))](
                a, w, out, scale, sorted_ids, block_expert, count, num_experts, n_cols, k_dim,
                a.stride(0), w.stride(0), w.stride(1), out.stride(0), GATE_UP=gate_up,
                BLOCK_N=n, BLOCK_K=k, **pipeline(stages), **options,
            )  # fmt: skip

        key = ("fused_experts", x.device, x.dtype, top_k, block_m, gate_up)
        launch_fitting(key, tiles, launch, NO_FIT_ADVICE)

    act = torch.empty(count, inter, dtype=x.dtype, device=x.device)  # [A, intermediate]
    matmul(x, w13, act, x, gate_up=True)  # the scale is not read
    down = torch.empty(count, hidden, dtype=x.dtype, device=x.device)  # [A, hidden]
    matmul(act, w2, down, weights.reshape(-1).contiguous(), gate_up=False)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)

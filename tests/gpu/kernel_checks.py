"""The Triton kernels checked on the device for issue 27's goals (tests/gpu/kernel_goals.py):
paged attention against the float64 reference and the MoE kernels against the per-expert
loop, both timed. They also run on the CPU under Triton's interpreter
(tests/unit/test_kernel_goals.py), so a wrong kernel fails CI with no GPU."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_kernels(device: str = "cuda") -> list[tuple[str, float, float]]:
    """(case, max abs error, tolerance) of the Triton paged attention on ``device``
    against the float64 reference; raises AssertionError on the first case past it."""
    from engine.layers.triton_ops.paged_attention import paged_attention
    from tests.unit.triton_reference import make_batch, reference_attention, work_list

    cases: list[tuple[str, dict[str, Any], dict[str, Any], torch.dtype, bool]] = [
        (
            "decode fp32 splits",
            dict(prefix_lens=[0, 300, 40, 1000], q_lens=[1] * 4),
            {},
            torch.float32,
            True,
        ),
        (
            "extend fp32 prefix",
            dict(prefix_lens=[0, 77, 5], q_lens=[130, 64, 1]),
            {},
            torch.float32,
            False,
        ),
        (
            "extend window softcap",
            dict(prefix_lens=[20, 200], q_lens=[33, 9]),
            dict(window=32, softcap=30.0),
            torch.float32,
            False,
        ),
        ("decode bf16", dict(prefix_lens=[511, 2000], q_lens=[1, 1]), {}, torch.bfloat16, True),
        ("extend bf16", dict(prefix_lens=[0, 64], q_lens=[96, 40]), {}, torch.bfloat16, False),
    ]
    results = []
    for name, lens, options, dtype, decode in cases:
        batch = make_batch(**lens, q_heads=8, kv_heads=2, head_dim=64, page_size=16, dtype=dtype)
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()
        }
        extend = (
            {}
            if decode
            else {
                "q_starts": moved["q_starts"],
                "q_lens": moved["q_lens"],
                "work": work_list(batch).to(device),
            }
        )
        out = paged_attention(
            moved["q"], moved["k_cache"], moved["v_cache"], moved["req_table"],
            moved["req_rows"], moved["seq_lens"], **extend, **options,
        )  # fmt: skip
        error = (out.double().cpu() - reference_attention(batch, **options)).abs().max().item()
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        assert error <= tolerance, f"{name}: max error {error:.3g} > {tolerance}"
        results.append((name, error, tolerance))
    return results


def check_moe(device: str = "cuda") -> list[tuple[str, float, float, float]]:
    """(case, max abs error against the per-expert PyTorch loop, its ms, the Triton
    kernels' ms) of the MoE kernels on ``device``, Mixtral-like widths (8 experts, top
    2); raises AssertionError on an error past the dtype's tolerance."""
    from engine.layers.moe import SparseMoE
    from engine.layers.triton_ops.fused_moe import fused_experts

    torch.manual_seed(0)
    hidden, inter = (1024, 1536) if device != "cpu" else (64, 96)
    moe = SparseMoE(hidden, inter, 8, 2, renormalize=True).to(device)
    moe.gate.weight.data.normal_()
    moe.w13.data.normal_(std=0.02)
    moe.w2.data.normal_(std=0.02)
    results = []
    for tokens in (1, 64, 2048) if device != "cpu" else (1, 9):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(tokens, hidden, device=device).to(dtype)
            w13, w2 = moe.w13.data.to(dtype), moe.w2.data.to(dtype)
            experts, weights = moe.route(x.float())
            weights = weights.to(dtype)
            reference = SparseMoE(hidden, inter, 8, 2, renormalize=True).to(device, dtype)
            reference.w13.data, reference.w2.data = w13, w2
            loop = functools.partial(reference.per_expert, x, experts, weights)
            fused = functools.partial(fused_experts, x, w13, w2, experts, weights)
            want, got = loop().float(), fused().float()
            error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            name = f"moe {str(dtype)[6:]} {tokens} tokens"
            assert error <= tolerance, f"{name}: relative error {error:.3g} > {tolerance}"
            loop_ms, fused_ms = 1e3 * timed(loop, device), 1e3 * timed(fused, device)
            results.append((name, error, loop_ms, fused_ms))
    return results


def timed(fn: Callable[[], Any], device: str, repeats: int = 5) -> float:
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)

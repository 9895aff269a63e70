"""Issue 27's goal figures in one device run, side by side with the figures before it
(not a test; prints a table):

    python3 tests/gpu/kernel_goals.py [--quick]

1. the Triton kernels against the float64 reference on the device (decode with splits,
   varlen extend over a prefix, windows + soft-capping, bf16), and the MoE kernels
   against the per-expert loop, both timed;
2. 1.1B Llama shape, bf16, decode with graphs: tok/s at batch 1 and 64;
3. batch 64 with one 32k-token context among 63 of 512: step time against all-512;
4. prefill of 8 x 2,048 tokens against the bf16 matmul floor of the same shapes;
5. greedy identity in float32: graphs on/off x Triton/gather attention, and mixed steps
   replayed from graphs;
6. mixed steps with graphs under steady arrivals (tests/gpu/profile_mixed.py's setting):
   median ITL against the decode-only step, throughput against alternating steps.

Uses the machine's own python3 and torch, like the device check. ``check_kernels`` also
runs on the CPU under Triton's interpreter (tests/unit/test_kernel_goals.py).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The 1.1B Llama shape of the README's figures (TinyLlama), with a 32k vocabulary.
LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    initializer_range=0.02,
    max_position_embeddings=40960,
)
# Before issue 27 (README, H200, bf16, graphs): tok/s, and what the issue asks for.
BEFORE = {"decode_b1_tok_s": 386.0, "decode_b64_tok_s": 10910.0}
GOALS = {
    "decode_b1_tok_s": 1000.0,
    "decode_b64_tok_s": 40000.0,
    "outlier_step_ratio": 1.5,
    "prefill_floor_fraction": 0.5,
    "mixed_itl_over_decode_step": 1.3,
    "mixed_tok_s_over_alternating": 1.0,
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- 1. kernels ---------------------------------------------------------------------------


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


# ---- engine helpers -----------------------------------------------------------------------


def make_engine(model_dir: Path, device: str, dtype: str, **overrides: Any) -> Any:
    from engine import Engine, EngineConfig

    config = dict(
        model=str(model_dir),
        device=device,
        dtype=dtype,
        kv_cache_tokens=120_000,
        max_running_requests=64,
        enable_prefix_cache=False,
    )
    config.update(overrides)
    return Engine(EngineConfig(**config))


def decode_step_times(engine: Any, prompt_lens: list[int], output: int, device: str) -> list[float]:
    """Times (s) of the steps in which every request decodes together."""
    from engine import SamplingParams

    rng = random.Random(len(prompt_lens))
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    for n in prompt_lens:
        engine.add_request([rng.randrange(3, vocab) for _ in range(n)], params)
    sampled: dict[str, int] = {}
    times: list[float] = []
    while engine.has_work:
        sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        sync(device)
        if len(outputs) == len(prompt_lens) and all(sampled.get(o.request_id) for o in outputs):
            times.append(time.perf_counter() - start)
        for o in outputs:
            sampled[o.request_id] = sampled.get(o.request_id, 0) + len(o.new_token_ids)
    return times


def matmul_floor(config: dict[str, Any], tokens: int, device: str) -> float:
    """Seconds of the bf16 matmuls of a forward over ``tokens`` tokens (every layer's
    projections; the LM head for one row per prompt is left out), timed here."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = [
        (hidden, (heads + 2 * kv_heads) * head_dim),
        (heads * head_dim, hidden),
        (hidden, 2 * inter),
        (inter, hidden),
    ]
    total = 0.0
    for k, n in shapes:
        a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        total += timed(lambda a=a, b=b: a @ b, device)
    return total * config["num_hidden_layers"]


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


# ---- 2-5. goals ---------------------------------------------------------------------------


def greedy_identity(model_dir: Path, device: str) -> dict[str, bool]:
    """Greedy tokens in float32: every (graphs, attention) combination against eager
    gather attention."""
    from engine import SamplingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (7, 40, 130, 300)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    combos = [(g, b, False) for g in (False, True) for b in ("torch", "triton")]
    for graphs, backend, mixed in [*combos, (True, "triton", True)]:
        engine = make_engine(
            model_dir, device, "float32", attention_backend=backend,
            disable_cuda_graph=not graphs, kv_cache_tokens=8192,
            enable_mixed_batches=mixed or None,
        )  # fmt: skip
        if mixed:
            assert engine.runner.mixed_graphs is not None, "mixed graphs did not capture"
        outputs[(graphs, backend, mixed)] = [o.token_ids for o in engine.generate(prompts, params)]
        engine.close()
    expected = outputs[(False, "torch", False)]
    return {
        f"graphs={g} attention={b}{' mixed graphs' if m else ''}": out == expected
        for (g, b, m), out in outputs.items()
    }


def mixed_schedules(scratch: Path, device: str) -> tuple[float, float, float, float, bool]:
    """tests/gpu/profile_mixed.py's setting once per schedule: (mixed output tok/s,
    alternating tok/s, mixed median ITL ms, decode-only step ms at batch 16, whether the
    mixed run replayed mixed graphs)."""
    from bench.compare import LaunchOptions
    from bench.mixed import decode_step_ms, engine_run, launched_engine
    from bench.workloads import WorkloadConfig, generate
    from tests.gpu.conftest import make_model
    from tests.gpu.profile_mixed import SHAPE

    model = make_model(scratch / "smol", num_hidden_layers=12, **SHAPE)
    launch = LaunchOptions(model=str(model), device=device, dtype="bfloat16", kv_cache_tokens=32768)
    workload = generate(
        WorkloadConfig(
            workload="random", seed=0, num_prompts=64, input_len=128, output_len=32,
            range_ratio=0.5,
        )
    )  # fmt: skip
    # Also the warm-up: its start-up captures compile every kernel the runs use.
    engine = launched_engine(launch, enable_mixed_batches=True)
    graphed = engine.runner.mixed_graphs is not None
    engine.close()
    mixed_tok_s, mixed_itl = engine_run(launch, True, workload, 8.0, 0)
    alternating_tok_s, _ = engine_run(launch, False, workload, 8.0, 0)
    step = decode_step_ms(launch, 16, 128, 30, 0)
    return mixed_tok_s, alternating_tok_s, mixed_itl, step, graphed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 22")
    args = parser.parse_args(argv)
    from tests.gpu.conftest import make_model

    device = args.device
    torch.set_grad_enabled(False)
    print(f"# issue 27 goals, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}")
    for name, error, tolerance in check_kernels(device):
        print(f"kernel {name:24s} max error {error:.2e} (tolerance {tolerance:g})  ok")
    for name, error, loop_ms, fused_ms in check_moe(device):
        print(
            f"kernel {name:24s} relative error {error:.2e}  ok; per-expert loop "
            f"{loop_ms:.3f} ms, Triton {fused_ms:.3f} ms"
        )
    config = dict(LLAMA_1B, num_hidden_layers=4 if args.quick else 22)
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model(Path(scratch) / "llama-1b", **config)
        engine = make_engine(model_dir, device, "bfloat16", max_model_len=34000)
        graphs = engine.runner.graphs is not None
        print(f"attention {engine.attention_backend}, decode graphs {'on' if graphs else 'OFF'}")
        for batch in (1, 64):
            step = statistics.median(decode_step_times(engine, [128] * batch, 48, device))
            key = f"decode_b{batch}_tok_s"
            rows.append(
                (key, f"{batch / step:,.0f}", f"{BEFORE[key]:,.0f}", f">= {GOALS[key]:,.0f}")
            )
        short = statistics.median(decode_step_times(engine, [512] * 64, 16, device))
        outlier = statistics.median(decode_step_times(engine, [512] * 63 + [32768], 16, device))
        ratio = outlier / short
        rows.append(("outlier_step_ratio", f"{ratio:.2f}", "OOM / >>10", "<= 1.5"))
        engine.close()
        prefill_engine = make_engine(
            model_dir, device, "bfloat16", chunked_prefill_size=16384, max_prefill_tokens=16384,
            max_running_requests=8,
        )  # fmt: skip
        prefill = prefill_seconds(prefill_engine, 8, 2048, device)
        floor = matmul_floor(config, 8 * 2048, device)
        rows.append(("prefill_floor_fraction", f"{floor / prefill:.2f}", "n/a", ">= 0.5"))
        prefill_engine.close()
        small = make_model(Path(scratch) / "small", num_hidden_layers=4)
        for combo, same in greedy_identity(small, device).items():
            rows.append((f"greedy fp32 {combo}", "same" if same else "DIFFERENT", "-", "same"))
        mixed, alternating, itl, step, graphed = mixed_schedules(Path(scratch), device)
        print(f"mixed steps {'replay graphs' if graphed else 'EAGER (mixed graphs off)'}")
        rows.append(("mixed_itl_over_decode_step", f"{itl / step:.2f}", "n/a", "<= 1.3"))
        rows.append(("mixed_tok_s_over_alternating", f"{mixed / alternating:.2f}", "n/a", ">= 1.0"))
    print(f"{'figure':40s} {'now':>12s} {'before':>12s} {'goal':>10s}")
    for name, now, before, goal in rows:
        print(f"{name:40s} {now:>12s} {before:>12s} {goal:>10s}")
    print(launch_options_line())
    return 0


def launch_options_line() -> str:
    """Whether the figures are of the kernels' first launch options (the ones tuned for),
    or which launches took smaller ones for want of shared memory."""
    from engine.layers.triton_ops import fitting

    smaller = {key: index for key, index in fitting.taken().items() if index}
    if not smaller:
        return "launch options: every launch took its first"
    return "launch options: smaller ones taken (for want of shared memory): " + "; ".join(
        f"{key} option {index}" for key, index in smaller.items()
    )


def prefill_seconds(engine: Any, prompts: int, length: int, device: str) -> float:
    """Median seconds of one step that prefills ``prompts`` prompts of ``length`` tokens."""
    from engine import SamplingParams

    rng = random.Random(11)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(3):
        for _ in range(prompts):
            engine.add_request([rng.randrange(3, 30000) for _ in range(length)], params)
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        runs.append(time.perf_counter() - start)
        while engine.has_work:
            engine.step()
    return statistics.median(runs[1:])


if __name__ == "__main__":
    sys.exit(main())

"""Issue 27's goal figures in one device run, side by side with the figures before it
(not a test; prints a table):

    python3 tests/gpu/kernel_goals.py [--quick]
    TRITON_INTERPRET=1 python tests/gpu/kernel_goals.py --dry-run   (CPU, tiny sizes)

1. the Triton kernels against the float64 reference on the device (decode with splits,
   varlen extend over a prefix, windows + soft-capping, bf16), and the MoE kernels
   against the per-expert loop, both timed (tests/gpu/kernel_checks.py);
2. 1.1B Llama shape, bf16, decode with graphs: tok/s at batch 1 and 64;
3. batch 64 with one 32k-token context among 63 of 512: step time against all-512;
4. prefill of 8 x 2,048 tokens against the bf16 matmul floor of the same shapes;
5. greedy identity in float32: graphs on/off x Triton/gather attention, and mixed steps
   replayed from graphs;
6. mixed steps with graphs under steady arrivals (tests/gpu/profile_mixed.py's setting):
   median ITL against the decode-only step, throughput against alternating steps.

Uses the machine's own python3 and torch, like the device check. Each figure is printed
once measured, then all of them in a table. The kernel checks also run on the CPU under
Triton's interpreter, and the dry run takes every other step at tiny sizes there
(tests/unit/test_kernel_goals.py), so a broken step fails CI, not a device session.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.kernel_checks import check_kernels, check_moe, sync, timed  # noqa: E402

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


@dataclass(frozen=True)
class Sizes:
    """The shapes the goals are measured at. ``DRY`` shrinks every one of them, so that the
    whole script runs on a CPU in about a minute (tests/unit/test_kernel_goals.py): its
    figures mean nothing there, but every step of the GPU run is taken once."""

    model: dict[str, Any]
    decode_prompt: int = 128  # decode at batch 1 and 64
    decode_steps: int = 48
    short: int = 512  # the outlier case: 63 of these and one of ``outlier``
    outlier: int = 32768
    outlier_steps: int = 16
    prefill: tuple[int, int] = (8, 2048)  # prompts x tokens in one step
    max_model_len: int = 34000
    kv_cache_tokens: int = 120_000
    greedy: tuple[tuple[int, ...], int] = ((7, 40, 130, 300), 24)  # prompts, new tokens
    mixed: dict[str, Any] = field(
        default_factory=lambda: dict(layers=12, prompts=64, input_len=128, output_len=32)
    )
    engine: dict[str, Any] = field(default_factory=dict)  # every engine's extra settings


FULL = Sizes(model=LLAMA_1B)
DRY = Sizes(
    model=dict(LLAMA_1B, vocab_size=384, hidden_size=64, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2),
    decode_prompt=16, decode_steps=3, short=24, outlier=600, outlier_steps=3,
    prefill=(2, 64), max_model_len=1024, kv_cache_tokens=8192, greedy=((7, 40), 4),
    mixed=dict(layers=2, prompts=6, input_len=16, output_len=6, hidden_size=64,
               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    # Small chunks keep the outlier's prefill longer than the timed steps, as on the GPU.
    engine=dict(chunked_prefill_size=64, max_prefill_tokens=256),
)  # fmt: skip

# ---- engine helpers -----------------------------------------------------------------------


def make_engine(
    model_dir: Path, device: str, dtype: str, sizes: Sizes = FULL, **overrides: Any
) -> Any:
    from engine import Engine, EngineConfig

    config = dict(
        model=str(model_dir),
        device=device,
        dtype=dtype,
        kv_cache_tokens=sizes.kv_cache_tokens,
        max_running_requests=64,
        enable_prefix_cache=False,
        **sizes.engine,
    )
    config.update(overrides)
    return Engine(EngineConfig(**config))


def decode_step_times(engine: Any, prompt_lens: list[int], steps: int, device: str) -> list[float]:
    """Times (s) of ``steps`` steps in which every request decodes together, taken once
    all of them have their first token. A long prompt is prefilled in chunks over many
    steps while the others already decode (the outlier case: 32 chunks against 16
    timed steps), so each request may generate enough to outlast that: two steps per
    chunk of every prompt (prefill and decode steps alternate), then the timed steps."""
    from engine import SamplingParams

    rng = random.Random(len(prompt_lens))
    chunk = engine.config.chunked_prefill_size
    admission = 2 * sum(-(-n // chunk) for n in prompt_lens) + 2
    params = SamplingParams(max_tokens=admission + steps, temperature=0, ignore_eos=True)
    ids = [
        engine.add_request([rng.randrange(3, engine.vocab_size) for _ in range(n)], params)
        for n in prompt_lens
    ]
    started: set[str] = set()
    while len(started) < len(ids):
        assert engine.has_work, f"{len(ids) - len(started)} requests never started"
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    times: list[float] = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
        assert len(outputs) == len(ids), f"{len(outputs)} of {len(ids)} requests decoded"
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work:
        engine.step()
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


# ---- 2-5. goals ---------------------------------------------------------------------------


def greedy_identity(model_dir: Path, device: str, sizes: Sizes = FULL) -> dict[str, bool]:
    """Greedy tokens in float32: every (graphs, attention) combination against eager
    gather attention."""
    from engine import SamplingParams

    rng = random.Random(5)
    lengths, new_tokens = sizes.greedy
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outputs = {}
    combos = [(g, b, False) for g in (False, True) for b in ("torch", "triton")]
    for graphs, backend, mixed in [*combos, (True, "triton", True)]:
        engine = make_engine(
            model_dir, device, "float32", sizes, attention_backend=backend,
            disable_cuda_graph=not graphs, kv_cache_tokens=8192,
            enable_mixed_batches=mixed or None,
        )  # fmt: skip
        if mixed and device != "cpu":  # no device graphs on a CPU (the dry run)
            assert engine.runner.mixed_graphs is not None, "mixed graphs did not capture"
        outputs[(graphs, backend, mixed)] = [o.token_ids for o in engine.generate(prompts, params)]
        engine.close()
    expected = outputs[(False, "torch", False)]
    return {
        f"graphs={g} attention={b}{' mixed graphs' if m else ''}": out == expected
        for (g, b, m), out in outputs.items()
    }


def mixed_schedules(
    scratch: Path, device: str, sizes: Sizes = FULL
) -> tuple[float, float, float, float, bool]:
    """tests/gpu/profile_mixed.py's setting once per schedule: (mixed output tok/s,
    alternating tok/s, mixed median ITL ms, decode-only step ms at batch 16, whether the
    mixed run replayed mixed graphs)."""
    from bench.compare import LaunchOptions
    from bench.mixed import decode_step_ms, engine_run, launched_engine
    from bench.workloads import WorkloadConfig, generate
    from tests.gpu.conftest import make_model
    from tests.gpu.profile_mixed import SHAPE

    run = dict(sizes.mixed)
    layers, prompts = run.pop("layers"), run.pop("prompts")
    input_len, output_len = run.pop("input_len"), run.pop("output_len")
    model = make_model(scratch / "smol", num_hidden_layers=layers, **{**SHAPE, **run})
    launch = LaunchOptions(model=str(model), device=device, dtype="bfloat16", kv_cache_tokens=32768)
    workload = generate(
        WorkloadConfig(
            workload="random", seed=0, num_prompts=prompts, input_len=input_len,
            output_len=output_len, range_ratio=0.5,
        )
    )  # fmt: skip
    # Also the warm-up: its start-up captures compile every kernel the runs use.
    engine = launched_engine(launch, enable_mixed_batches=True)
    graphed = engine.runner.mixed_graphs is not None
    engine.close()
    mixed_tok_s, mixed_itl = engine_run(launch, True, workload, 8.0, 0)
    alternating_tok_s, _ = engine_run(launch, False, workload, 8.0, 0)
    step = decode_step_ms(launch, min(16, prompts), input_len, 30, 0)
    return mixed_tok_s, alternating_tok_s, mixed_itl, step, graphed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 22")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every step at tiny sizes on the CPU (Triton interpreted), figures meaningless",
    )
    args = parser.parse_args(argv)
    from tests.gpu.conftest import make_model

    sizes = DRY if args.dry_run else FULL
    device = "cpu" if args.dry_run else args.device
    torch.set_grad_enabled(False)
    print(f"# issue 27 goals, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}")
    if args.dry_run:
        print("# DRY RUN: tiny sizes on the CPU; the figures below mean nothing")
    else:  # the dry run's test checks the kernels apart (tests/unit/test_kernel_goals.py)
        kernel_rows(device)
    layers = sizes.model["num_hidden_layers"]
    config = dict(sizes.model, num_hidden_layers=min(4, layers) if args.quick else layers)
    rows: list[tuple[str, str, str, str]] = []

    def row(name: str, now: str, before: str, goal: str) -> None:
        """A figure printed once measured (a run cut short keeps what it had), and in the
        table at the end."""
        rows.append((name, now, before, goal))
        print(f"measured: {name} {now} (goal {goal})", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model(Path(scratch) / "llama-1b", **config)
        engine = make_engine(
            model_dir, device, "bfloat16", sizes, max_model_len=sizes.max_model_len
        )
        graphs = engine.runner.graphs is not None
        print(f"attention {engine.attention_backend}, decode graphs {'on' if graphs else 'OFF'}")
        for batch in (1, 64):
            prompts = [sizes.decode_prompt] * batch
            step = statistics.median(decode_step_times(engine, prompts, sizes.decode_steps, device))
            key = f"decode_b{batch}_tok_s"
            row(key, f"{batch / step:,.0f}", f"{BEFORE[key]:,.0f}", f">= {GOALS[key]:,.0f}")
        steps = sizes.outlier_steps
        short = statistics.median(decode_step_times(engine, [sizes.short] * 64, steps, device))
        lens = [sizes.short] * 63 + [sizes.outlier]
        outlier = statistics.median(decode_step_times(engine, lens, steps, device))
        row("outlier_step_ratio", f"{outlier / short:.2f}", "OOM / >>10", "<= 1.5")
        engine.close()
        count, length = sizes.prefill
        prefill_engine = make_engine(
            model_dir, device, "bfloat16", sizes, chunked_prefill_size=count * length,
            max_prefill_tokens=count * length, max_running_requests=count,
        )  # fmt: skip
        prefill = prefill_seconds(prefill_engine, count, length, device)
        floor = matmul_floor(config, count * length, device)
        row("prefill_floor_fraction", f"{floor / prefill:.2f}", "n/a", ">= 0.5")
        prefill_engine.close()
        small = make_model(Path(scratch) / "small", num_hidden_layers=4)
        for combo, same in greedy_identity(small, device, sizes).items():
            row(f"greedy fp32 {combo}", "same" if same else "DIFFERENT", "-", "same")
        mixed, alternating, itl, step, graphed = mixed_schedules(Path(scratch), device, sizes)
        print(f"mixed steps {'replay graphs' if graphed else 'EAGER (mixed graphs off)'}")
        row("mixed_itl_over_decode_step", f"{itl / step:.2f}", "n/a", "<= 1.3")
        row("mixed_tok_s_over_alternating", f"{mixed / alternating:.2f}", "n/a", ">= 1.0")
    print(f"{'figure':40s} {'now':>12s} {'before':>12s} {'goal':>10s}")
    for name, now, before, goal in rows:
        print(f"{name:40s} {now:>12s} {before:>12s} {goal:>10s}")
    print(launch_options_line())
    return 0


def kernel_rows(device: str) -> None:
    """Check the kernels on ``device`` (tests/gpu/kernel_checks.py) and print their rows."""
    for name, error, tolerance in check_kernels(device):
        print(f"kernel {name:24s} max error {error:.2e} (tolerance {tolerance:g})  ok")
    for name, error, loop_ms, fused_ms in check_moe(device):
        print(
            f"kernel {name:24s} relative error {error:.2e}  ok; per-expert loop "
            f"{loop_ms:.3f} ms, Triton {fused_ms:.3f} ms"
        )


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
            engine.add_request([rng.randrange(3, engine.vocab_size) for _ in range(length)], params)
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

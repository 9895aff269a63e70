"""Where a GPU decode step's time goes, for the record (not a test): a ~1B-parameter
random-weight Llama in bf16, decode step times at several batch sizes against HF
``generate`` on the same weights, and a profiler summary of one batch's decode steps
(the host-device syncs per step counted).

    python3 tests/gpu/profile_decode.py [--out DIR] [--disable-cuda-graph] [--overlap]
                                        [--skip-hf]

At batch 64 it prints the host's share of a decode step: wall time minus the GPU's busy
time (the profiler's device time of the steps), over wall time (issue 28: <= 15%). With
``--overlap`` the steps run through the overlapped loop, timed turn to turn with no sync.

Uses the machine's own python3 and torch, like the device check.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tests.gpu.conftest import VOCAB, make_model  # noqa: E402

MODEL = dict(  # Llama-3.2-1B's shape, with a 32k vocabulary
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    initializer_range=0.02,
)
PROMPT, OUTPUT = 128, 64
DEVICE = "cuda"  # --device cpu: a dry run of this script on a machine without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(PROMPT)] for _ in range(count)]


def decode_steps(engine: Engine, batch: int, profile: torch.profiler.profile | None = None):
    """Step times (s) of the steps in which all ``batch`` requests decode together. The
    overlapped loop is timed from one turn's end to the next with no sync (its next step
    is on the device by then); the plain loop step by step, synced."""
    params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    for prompt in prompts(batch, seed=batch):
        engine.add_request(prompt, params)
    sampled: dict[str, int] = {}
    times: list[float] = []
    start = time.perf_counter()
    while engine.loop.has_work:
        if not engine.overlap:
            sync()
            start = time.perf_counter()
        outputs = engine.loop.step()
        if not engine.overlap:
            sync()
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        if len(outputs) == batch and all(sampled.get(o.request_id, 0) for o in outputs):
            times.append(elapsed)
            if profile is not None:
                profile.step()
        for o in outputs:
            sampled[o.request_id] = sampled.get(o.request_id, 0) + len(o.new_token_ids)
    return times


def hf_step(model_dir: Path, batch: int) -> float:
    """HF ``generate`` (eager, its default cache) seconds per decode step at ``batch``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    ids = torch.tensor(prompts(batch, seed=batch), device=DEVICE)

    def run(new: int) -> float:
        sync()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - start

    run(4)
    short, long = run(2), run(2 + OUTPUT)
    return (long - short) / OUTPUT


def host_share_line(active: list[float], averages: Any) -> str:
    """Batch 64's wall time a step (the profiled steps: after 2 waited and 2 warm-up),
    the GPU's busy time a step (every event's own device time), and the host's share."""
    wall = sum(active) / len(active)
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in averages) / 1e6 / len(active)
    return (
        f"batch 64, {len(active)} profiled steps: wall {wall * 1e3:.3f} ms a step, GPU busy "
        f"{busy * 1e3:.3f} ms, host share {max(0.0, 1 - busy / wall):.0%} (issue 28: <= 15%)"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None, help="where the profiler tables go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", help="eager decode steps (no CUDA graphs)"
    )
    parser.add_argument("--overlap", action="store_true", help="the overlapped loop")
    parser.add_argument("--skip-hf", action="store_true", help="no HF generate comparison")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    MODEL["num_hidden_layers"] = args.layers
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model(Path(scratch) / "llama-1b", **MODEL)
        engine = Engine(
            EngineConfig(
                model=str(model_dir),
                device=DEVICE,
                dtype="bfloat16",
                kv_cache_tokens=65536,
                max_running_requests=128,
                enable_prefix_cache=False,
                disable_cuda_graph=args.disable_cuda_graph,
                disable_overlap_schedule=not args.overlap,
            )
        )
        params = sum(p.numel() for p in engine.model.parameters())
        graphs = "CUDA graphs" if engine.runner.graphs is not None else "eager"
        print(
            f"model: {params / 1e9:.2f}B parameters, bf16, prompt {PROMPT}, output {OUTPUT}, "
            f"decode {graphs}, {'overlapped' if engine.overlap else 'plain'} loop"
        )
        decode_steps(engine, 4)  # warm-up
        for batch in (1, 16, 64):
            times = decode_steps(engine, batch)
            med = statistics.median(times)
            line = f"batch {batch:3d}: engine decode step {med * 1e3:7.2f} ms ({batch / med:8.0f} tok/s)"
            if not args.skip_hf:
                hf = hf_step(model_dir, batch)
                line += f", HF generate step {hf * 1e3:7.2f} ms, engine/HF time {med / hf:.2f}"
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            print(line)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if DEVICE == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=2, warmup=2, active=8, repeat=1)
        with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
            times = decode_steps(engine, 64, prof)
        averages = prof.key_averages()
        print(host_share_line(times[4:12], averages))
        syncs = {
            e.key: e.count / 8
            for e in averages
            if any(k in e.key for k in ("Synchronize", "Memcpy", "cudaLaunchKernel", "GraphLaunch"))
        }
        print("batch 64, per decode step (8 profiled):")
        for key, per_step in sorted(syncs.items()):
            print(f"  {key}: {per_step:.1f} calls")
        by_cuda = averages.table(
            sort_by="self_device_time_total" if DEVICE == "cuda" else "cpu_time_total", row_limit=20
        )
        by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=20)
        print(by_cuda)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "profile_cuda.txt").write_text(by_cuda)
            (args.out / "profile_cpu.txt").write_text(by_cpu)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

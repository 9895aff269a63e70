"""What-if accuracy: the replay's hit rates at the engine's own tier sizes match what the
engine measures, device and host separately, within 2 points, on three load-tool
workloads (multiturn, shared prefix, long-tail mix).

The engine (a tiny model, small pools so that every workload evicts) runs the requests of
a workload one at a time, as ``hiserve-bench`` with ``--max-concurrency 1`` sends them,
writing its own ``--cache-trace``. Both that trace and the one ``hiserve-bench trace``
writes for the workload without a server are replayed at the engine's sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.whatif import workload_trace
from bench.whatif_sim import SimConfig, replay
from bench.workloads import WorkloadConfig, generate
from engine import SamplingParams
from engine.cache_trace import read_trace
from tests.unit.cpu_engine import checked_engine

PAGE = 4
VOCAB = dict(vocab_low=1000, vocab_high=40000)
WORKLOADS = {
    "multiturn": WorkloadConfig(
        workload="multiturn",
        num_clients=6,
        num_rounds=4,
        system_prompt_len=24,
        user_turn_len=40,
        assistant_turn_len=12,
        range_ratio=0.5,
        output_len=4,
        **VOCAB,
    ),
    "shared-prefix": WorkloadConfig(
        workload="shared-prefix",
        num_groups=5,
        prompts_per_group=6,
        shared_prefix_len=90,
        suffix_len=20,
        range_ratio=0.5,
        output_len=4,
        **VOCAB,
    ),
    "long-tail": WorkloadConfig(
        workload="long-tail",
        num_groups=12,
        num_prompts=40,
        shared_prefix_len=60,
        suffix_len=16,
        range_ratio=0.5,
        output_len=4,
        **VOCAB,
    ),
}


def run_engine(model_dir: Path, config: WorkloadConfig, trace: Path) -> tuple[dict, SimConfig]:
    """Hit rates the engine measures for ``config``'s requests, and its tier sizes."""
    engine = checked_engine(
        model_dir,
        kv_cache_tokens=192,
        page_size=PAGE,
        enable_hierarchical_cache=True,
        hicache_ratio=2,
        cache_trace=str(trace),
    )
    device = host = prompt = 0
    try:
        for request in generate(config).requests:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
            out = engine.generate([request.prompt], params)[0]
            device += out.cached_tokens_device
            host += out.cached_tokens_host
            prompt += len(request.prompt)
        sizes = SimConfig(
            PAGE,
            engine.kv.manager.capacity,
            engine.kv.host_pool.capacity,
            load_threshold=engine.config.hicache_load_threshold,
        )
    finally:
        engine.close()
    return {"device": device / prompt, "host": host / prompt}, sizes


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_replay_matches_the_engine(tiny_llama_dir, tmp_path, name):
    config = WORKLOADS[name]
    trace_path = tmp_path / "server.jsonl"
    measured, sizes = run_engine(tiny_llama_dir, config, trace_path)
    server_trace = read_trace(trace_path)
    assert server_trace.page_size == PAGE
    # The trace's own record of the hits is what the engine reported.
    assert len(server_trace.records) == len(generate(config).requests)
    for source in (server_trace.records, workload_trace(generate(config), PAGE)):
        simulated = replay(source, sizes)
        assert simulated.short_pages == 0
        for tier in ("device", "host"):
            assert abs(simulated.rate(tier) - measured[tier]) <= 0.02, (
                name,
                tier,
                simulated.rate(tier),
                measured,
            )
    # Both tiers took part, or the comparison says little.
    assert measured["device"] > 0.02 and measured["host"] > 0.02, measured

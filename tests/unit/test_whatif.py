"""The what-if replay: the heap-indexed trees evict exactly as the engine's trees do, an
unbounded cache reaches the workload's ideal hit rate, the L3 model, the grid report and
the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.__main__ import main as bench_main
from bench.whatif import workload_trace
from bench.whatif_grid import GridSpec, footprint_tokens, run_grid, size_grid, what_if
from bench.whatif_sim import Replay, SimConfig, ideal_hits, replay
from bench.workloads import WorkloadConfig, generate, ideal_cached_tokens
from engine.cache_trace import read_trace

VOCAB = dict(vocab_low=1000, vocab_high=1300)  # a small vocabulary: prompts collide often


def small_trace(workload: str, page: int, seed: int = 0):
    config = WorkloadConfig(
        workload=workload,
        seed=seed,
        num_clients=6,
        num_rounds=4,
        user_turn_len=20,
        assistant_turn_len=6,
        num_groups=10,
        num_prompts=60,
        prompts_per_group=5,
        shared_prefix_len=40,
        suffix_len=8,
        range_ratio=0.5,
        output_len=5,
        **VOCAB,
    )
    return workload_trace(generate(config), page)


@pytest.mark.parametrize("workload", ["multiturn", "shared-prefix", "long-tail"])
@pytest.mark.parametrize(
    "shares",  # device and host tier sizes, as shares of the trace's footprint
    [(0.15, 0), (0.4, 0), (0.15, 0.3), (0.2, 0.8), (0.1, 0.2)],
)
@pytest.mark.parametrize("running", [1, 4])  # requests in flight at once
def test_indexed_trees_choose_the_same_victims(workload, shares, running) -> None:
    records = [replace(r, t_end=r.t + running - 0.5) for r in small_trace(workload, 2)]
    footprint = footprint_tokens(records, 2)
    device, host = (int(footprint * share) for share in shares)
    config = SimConfig(2, device, host, load_threshold=4)
    plain = Replay(config, indexed=False).run(records)
    indexed = Replay(config)
    indexed.tree.verify = True  # type: ignore[attr-defined]
    result = indexed.run(records)
    assert result.per_request == plain.per_request
    assert indexed.tree.rescans == 0  # type: ignore[attr-defined]  # no victim missed
    indexed.tree.check_device_children()  # the maintained counts equal a recount
    assert indexed.tree.evicted_device_tokens > 0  # the victims were chosen, and compared
    if host:  # the host tier's victims, or its hits, were compared too
        evicted_host = indexed.tree.counters["evicted_host_tokens_total"]  # type: ignore[attr-defined]
        assert evicted_host > 0 or result.host_hit > 0


def test_unbounded_cache_reaches_the_workload_ideal() -> None:
    workload = generate(
        WorkloadConfig(workload="multiturn", num_clients=4, num_rounds=3, user_turn_len=30)
    )
    records = workload_trace(workload, 1)
    result = replay(records, SimConfig(1, 10**6))
    assert result.device_hit == sum(ideal_cached_tokens([r.prompt for r in workload.requests]))
    assert result.rate("total") == pytest.approx(workload.ideal_hit_rate())
    assert ideal_hits(records, 1) == result.device_hit


def test_storage_serves_what_the_host_tier_lost() -> None:
    records = small_trace("long-tail", 2)
    base = SimConfig(2, 48, 48, 0, load_threshold=4, prefetch_threshold=4)
    without = replay(records, base)
    with_l3 = replay(records, SimConfig(2, 48, 48, 10**6, 4, 4))
    assert without.storage_hit == 0
    assert with_l3.storage_hit > 0
    assert with_l3.rate("total") > without.rate("total")
    # A threshold longer than any prompt never reads the store.
    assert replay(records, SimConfig(2, 48, 48, 10**6, 4, 10**6)).storage_hit == 0


def test_size_grid_is_geometric_whole_pages() -> None:
    sizes = size_grid(16, 16000, 7, 16)
    assert sizes[0] == 16 and sizes[-1] == 16000
    assert all(s % 16 == 0 for s in sizes) and sizes == sorted(set(sizes))


def test_reach_names_the_smallest_size_at_each_level() -> None:
    records = small_trace("shared-prefix", 2)
    report = what_if(
        records, GridSpec(SimConfig(2, 64, load_threshold=4), ("device", "host"), 6), 1
    )
    ideal = report["ideal_hit_rate"]
    assert report["footprint_tokens"] == footprint_tokens(records, 2)
    for curve, data in report["curves"].items():
        rates = [
            p["device_rate"] + (p["host_rate"] if curve == "host" else 0) for p in data["points"]
        ]
        sizes = [p["size_tokens"] for p in data["points"]]
        for level, size in data["reach"].items():
            target = float(level.rstrip("%")) / 100 * ideal
            reaching = [s for s, r in zip(sizes, rates, strict=True) if r >= target - 1e-12]
            assert size == (reaching[0] if reaching else None)
    # At the footprint the device alone holds everything: the ideal.
    assert report["curves"]["device"]["points"][-1]["device_rate"] == pytest.approx(ideal)


def test_parallel_grid_equals_serial() -> None:
    records = small_trace("multiturn", 2)
    configs = [SimConfig(2, d, h, load_threshold=4) for d, h in ((48, 0), (48, 200), (200, 0))]
    serial = run_grid(records, configs, 1)
    parallel = run_grid(records, configs, 2)
    assert [(r.device_hit, r.host_hit) for r in parallel] == [
        (r.device_hit, r.host_hit) for r in serial
    ]


def test_command_line_trace_then_whatif(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    args = ["--workload", "long-tail", "--num-prompts", "40", "--num-groups", "8"]
    args += ["--shared-prefix-len", "64", "--suffix-len", "8", "--vocab-range", "1000", "1300"]
    assert bench_main(["trace", *args, "--page-size", "4", "-o", str(trace)]) == 0
    assert len(read_trace(trace).records) == 40
    out_json, plot = tmp_path / "w.json", tmp_path / "w.png"
    code = bench_main(
        ["whatif", str(trace), "--points", "4", "--jobs", "1", "--curves", "device", "host"]
        + ["storage", "--json", str(out_json), "--plot", str(plot)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "smallest host size reaching 90% of ideal" in printed
    report = json.loads(out_json.read_text())
    assert set(report["curves"]) == {"device", "host", "storage"}
    assert plot.stat().st_size > 0
    assert bench_main(["whatif", str(out_json)]) == 2  # not a trace

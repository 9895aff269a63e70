"""bench/ holds the shipped load tool and the whole-engine benchmarks; every benchmark of
one kernel, copy or layer lives in bench/micro/, and nothing outside it imports one from
the old place."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MICRO = {
    "bandwidth",
    "gemv",
    "fused_kernels",
    "layer_profile",
    "host_copy",
    "bookkeeping",
    "packed_gemv",
    "packed_matmul",
    "prefill_attention",
    "int8_activations",
    "kernel_resources",
    "host_step",
    "no_work_server",
    "output_wire",
}
# The load tool (python -m bench / hiserve-bench) and the engine-level benchmarks.
TOP = {
    "__init__",
    "__main__",
    "client",
    "compare",
    "decode_step",
    "fleet",
    "fleet_sim",
    "grammar",
    "grammar_abuse",
    "hicache_offline",
    "http_cost",
    "l3",
    "l3_http",
    "mixed",
    "mooncake_local",
    "offline",
    "outcomes",
    "report",
    "runner",
    "scoring_cost",
    "stats",
    "step_budget",
    "synthetic_gguf",
    "trace_cost",
    "weights",
    "whatif",
    "whatif_grid",
    "whatif_lru",
    "whatif_sim",
    "whatif_slots",
    "whatif_speed",
    "words",
    "workloads",
}


def names(folder: Path) -> set[str]:
    return {path.stem for path in folder.glob("*.py")}


def test_micro_benchmarks_have_their_own_package() -> None:
    assert names(ROOT / "bench" / "micro") == MICRO | {"__init__"}


def test_top_of_bench_is_the_load_tool_and_engine_benchmarks() -> None:
    assert names(ROOT / "bench") == TOP  # a new benchmark: decide where it belongs


def test_nothing_imports_a_micro_benchmark_from_bench_itself() -> None:
    wrong = []
    for folder in ("bench", "tests", "engine", "server", "docker"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "bench":
                    wrong += [f"{path}: bench.{a.name}" for a in node.names if a.name in MICRO]
                elif isinstance(node, ast.ImportFrom | ast.Import):
                    module = node.module if isinstance(node, ast.ImportFrom) else None
                    for target in [module] if module else [a.name for a in node.names]:
                        if target and target.split(".")[:2] in (["bench", m] for m in MICRO):
                            wrong.append(f"{path}: {target}")
    assert wrong == []

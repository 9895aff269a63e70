"""HiCache's L3 tier through the engine: restarts and replicas hit what others stored.

Each "replica" or "restart" is a fresh Engine over the same store; the reference is the
same prompt recomputed by an engine without any cache. Slot accounting is checked on
every step (``check_invariants``), across device, host and store traffic.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.kvcache.storage.file_store import FileStore
from tests.unit.cpu_engine import checked_engine
from tests.unit.mooncake_cluster import Mooncake, mooncake_cluster

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PAGE = 4


def make_engine(model_dir: Path, store_dir: Path | None, **kw: object) -> Engine:
    cfg: dict[str, object] = dict(kv_cache_tokens=256, page_size=PAGE, hicache_load_threshold=PAGE)
    if store_dir is not None:
        cfg.update(
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_dir=str(store_dir),
            hicache_storage_prefetch_threshold=8,
        )
    cfg.update(kw)
    return checked_engine(model_dir, **cfg)


def stall_file_store(monkeypatch: pytest.MonkeyPatch, method: str) -> threading.Event:
    """Make ``FileStore.<method>`` wait until the returned event is set (at most 60 s,
    far past the best_effort prefetch policy's 0.1 s)."""
    release = threading.Event()
    original = getattr(FileStore, method)

    def stalled(self: FileStore, *args: object) -> object:
        release.wait(timeout=60)
        return original(self, *args)

    monkeypatch.setattr(FileStore, method, stalled)
    return release


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[tuple[int, ...], list[int]]:
    engine = make_engine(tiny_llama_dir, None, enable_prefix_cache=False)
    outputs = {}
    for prompt in prompts(3, 41) + prompts(2, 30, seed=1):
        outputs[tuple(prompt)] = engine.generate([prompt], PARAMS)[0].token_ids
    engine.close()
    return outputs


def stored_len(prompt: list[int]) -> int:
    """Tokens of ``prompt`` the store can serve: full pages of all but its last token."""
    return (len(prompt) - 1) // PAGE * PAGE


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_restarted_engine_hits_what_it_stored(
    tiny_llama_dir: Path, tmp_path: Path, reference: dict, layout: str
) -> None:
    first = make_engine(tiny_llama_dir, tmp_path, hicache_mem_layout=layout)
    batch = prompts(3, 41)
    cold = first.generate(batch, PARAMS)
    assert all(out.cached_tokens_storage == 0 for out in cold)
    first.close()  # drains the writer: every page is in the store
    assert FileStore(tmp_path).stats.pages_written == 0  # a fresh view, nothing written
    again = make_engine(tiny_llama_dir, tmp_path, hicache_mem_layout=layout)
    warm = again.generate(batch, PARAMS)
    for prompt, out in zip(batch, warm):
        assert out.token_ids == reference[tuple(prompt)]
        assert out.cached_tokens_storage == stored_len(prompt)
        assert out.cached_tokens == out.cached_tokens_storage  # nothing else was cached
    assert again.counters["cached_tokens_storage_total"] == sum(map(stored_len, batch))
    again.close()


def test_another_model_or_dtype_misses(tiny_llama_dir: Path, tmp_path: Path) -> None:
    batch = prompts(1, 41)
    writer = make_engine(tiny_llama_dir, tmp_path)
    writer.generate(batch, PARAMS)
    writer.close()
    other_dtype = make_engine(tiny_llama_dir, tmp_path, dtype="bfloat16")
    assert other_dtype.generate(batch, PARAMS)[0].cached_tokens_storage == 0
    other_dtype.close()


def test_a_bf16_pool_round_trips_through_the_store(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # --kv-cache-dtype bfloat16: the pages hold bf16 rows, a float32 pool's engine misses
    # them (another namespace), and a bf16 one loads them: its tokens are those of a
    # device prefix hit on the same rounded rows (the same prompt asked twice).
    batch = prompts(1, 41)
    device_hit = make_engine(tiny_llama_dir, None, kv_cache_dtype="bfloat16")
    device_hit.generate(batch, PARAMS)
    want = device_hit.generate(batch, PARAMS)[0]
    assert want.cached_tokens == stored_len(batch[0])
    device_hit.close()
    writer = make_engine(tiny_llama_dir, tmp_path, kv_cache_dtype="bfloat16")
    writer.generate(batch, PARAMS)
    writer.close()
    float32_pool = make_engine(tiny_llama_dir, tmp_path)
    assert float32_pool.generate(batch, PARAMS)[0].cached_tokens_storage == 0
    float32_pool.close()
    reader = make_engine(tiny_llama_dir, tmp_path, kv_cache_dtype="bfloat16")
    out = reader.generate(batch, PARAMS)[0]
    assert out.cached_tokens_storage == stored_len(batch[0])
    assert out.token_ids == want.token_ids
    reader.close()


def test_a_corrupt_store_is_a_miss_with_the_same_output(
    tiny_llama_dir: Path, tmp_path: Path, reference: dict
) -> None:
    batch = prompts(1, 41)
    writer = make_engine(tiny_llama_dir, tmp_path)
    writer.generate(batch, PARAMS)
    writer.close()
    pages = sorted(tmp_path.rglob("*.kv"))
    assert pages
    for page in pages:  # every page truncated: nothing can be loaded
        page.write_bytes(page.read_bytes()[:-3])
    reader = make_engine(tiny_llama_dir, tmp_path)
    out = reader.generate(batch, PARAMS)[0]
    assert out.token_ids == reference[tuple(batch[0])]
    assert out.cached_tokens_storage == 0
    reader.close()


def test_a_store_that_fails_every_call_changes_nothing(
    tiny_llama_dir: Path, tmp_path: Path, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> object:
        raise OSError(5, "Input/output error")

    for name in ("exists_prefix", "get_into", "put_from"):
        monkeypatch.setattr(FileStore, name, broken)
    engine = make_engine(tiny_llama_dir, tmp_path)
    batch = prompts(3, 41)
    for _ in range(2):  # the second round would hit the store, were it working
        outs = engine.generate(batch, PARAMS)
        assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in batch]
        assert all(o.cached_tokens_storage == 0 for o in outs)
    stats = engine.kv.host_stats()
    assert stats["storage_write_tokens_total"] == 0
    engine.close()


def test_two_replicas_share_a_prefix(tiny_llama_dir: Path, tmp_path: Path, reference: dict) -> None:
    replica_a = make_engine(tiny_llama_dir, tmp_path)
    replica_b = make_engine(tiny_llama_dir, tmp_path)
    prompt = prompts(1, 30, seed=1)[0]
    assert replica_a.generate([prompt], PARAMS)[0].cached_tokens_storage == 0
    replica_a.kv.manager.tree.storage.drain()  # A's pages are written, A keeps running
    out = replica_b.generate([prompt], PARAMS)[0]
    assert out.token_ids == reference[tuple(prompt)]
    assert out.cached_tokens_storage == stored_len(prompt)
    replica_a.close()
    replica_b.close()


def test_short_prompts_skip_the_store(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_threshold=64)
    batch = prompts(1, 41)
    engine.generate(batch, PARAMS)
    engine.close()
    again = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_threshold=64)
    assert again.generate(batch, PARAMS)[0].cached_tokens_storage == 0  # 40 < 64 tokens
    assert again.kv.host_stats()["storage_prefetch_tokens_total"] == 0
    again.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"enable_hierarchical_cache": False}, "--enable-hierarchical-cache"),
        ({"page_size": 1}, "--page-size 16 to 64"),
        ({"hicache_storage_prefetch_policy": "eventually"}, "hicache_storage_prefetch_policy"),
    ],
)
def test_bad_storage_settings_are_refused(settings: dict, message: str, tmp_path: Path) -> None:
    cfg = dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        page_size=PAGE,
    )
    cfg.update(settings)
    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        EngineConfig(**cfg)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mooncake() -> Iterator[Mooncake]:
    yield from mooncake_cluster()


def test_mooncake_a_restarted_engine_hits_what_it_stored(
    tiny_llama_dir: Path, mooncake: Mooncake, reference: dict
) -> None:
    # page_first: one object per page for K and one for V (layer_first would be 2 x L).
    settings = dict(
        hicache_storage_backend="mooncake",
        hicache_mooncake_master=mooncake.master,
        hicache_mooncake_metadata_server=mooncake.metadata,
        hicache_mem_layout="page_first",
    )
    batch = prompts(2, 30, seed=1)
    first = make_engine(tiny_llama_dir, Path("unused"), **settings)
    first.kv.manager.tree.storage.store.clear()
    assert all(o.cached_tokens_storage == 0 for o in first.generate(batch, PARAMS))
    first.close()  # its pages live on in the holder process
    again = make_engine(tiny_llama_dir, Path("unused"), **settings)
    for prompt, out in zip(batch, again.generate(batch, PARAMS)):
        assert out.token_ids == reference[tuple(prompt)]
        assert out.cached_tokens_storage == stored_len(prompt)
    again.kv.manager.tree.storage.store.clear()
    again.close()


def test_usage_reports_the_storage_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from server.serving import Plan, make_usage

    batch = prompts(1, 41)
    writer = make_engine(tiny_llama_dir, tmp_path)
    writer.generate(batch, PARAMS)
    writer.close()
    reader = make_engine(tiny_llama_dir, tmp_path)
    out = reader.generate(batch, PARAMS)[0]
    reader.close()
    usage = make_usage(Plan("cmpl-1", batch, 1), {0: out}).prompt_tokens_details
    assert usage.cached_tokens_storage == stored_len(batch[0]) == usage.cached_tokens
    assert usage.cached_tokens_host == usage.cached_tokens_device == 0


@pytest.mark.parametrize("slow", ["exists_prefix", "get_into"])
def test_a_store_slower_than_the_timeout_is_a_miss(
    tiny_llama_dir: Path,
    tmp_path: Path,
    reference: dict,
    monkeypatch: pytest.MonkeyPatch,
    slow: str,
) -> None:
    batch = prompts(3, 41)
    writer = make_engine(tiny_llama_dir, tmp_path)
    writer.generate(batch, PARAMS)
    writer.close()
    release = stall_file_store(monkeypatch, slow)
    reader = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_policy="best_effort")
    outs = reader.generate(batch[:1], PARAMS)
    assert outs[0].token_ids == reference[tuple(batch[0])]
    assert outs[0].cached_tokens_storage == 0
    tier = reader.kv.manager.tree.storage
    if slow == "get_into":
        assert tier.orphaned_tokens == stored_len(batch[0])  # still being written into
    assert tier.down  # the timeout started a backoff: the store is left alone for now
    release.set()
    tier._down_until = 0.0  # the backoff is over (instead of waiting it out)
    for prompt in batch[1:]:  # the store answers again: later prompts hit it
        out = reader.generate([prompt], PARAMS)[0]
        assert out.token_ids == reference[tuple(prompt)]
        assert out.cached_tokens_storage == stored_len(prompt)
    assert tier.orphaned_tokens == 0  # the timed-out read ended and its slots came back
    reader.close()


def test_mooncake_master_killed_mid_run_changes_no_output(
    tiny_llama_dir: Path, reference: dict
) -> None:
    cluster = next(mooncake_cluster_gen := mooncake_cluster())
    settings = dict(
        hicache_storage_backend="mooncake",
        hicache_mooncake_master=cluster.master,
        hicache_mooncake_metadata_server=cluster.metadata,
        hicache_mem_layout="page_first",
    )
    engine = make_engine(tiny_llama_dir, Path("unused"), **settings)
    batch = prompts(3, 41)
    first = engine.generate(batch[:1], PARAMS)[0]
    assert first.token_ids == reference[tuple(batch[0])]
    cluster.stop()  # master and holder gone: every lookup, read and write now fails
    for prompt in batch:
        out = engine.generate([prompt], PARAMS)[0]
        assert out.token_ids == reference[tuple(prompt)]
    engine.close()
    mooncake_cluster_gen.close()


REPLICA = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.unit.test_l3_engine import PARAMS, make_engine, prompts
engine = make_engine(Path(sys.argv[2]), Path(sys.argv[3]))
out = engine.generate(prompts(1, 30, seed=1), PARAMS)[0]
engine.close()
print(json.dumps({"tokens": out.token_ids, "storage": out.cached_tokens_storage}))
"""


@pytest.mark.slow
def test_a_replica_process_hits_what_another_process_computed(
    tiny_llama_dir: Path, tmp_path: Path, reference: dict
) -> None:
    root = str(Path(__file__).resolve().parents[2])
    runs = []
    for _ in range(2):  # replica A computes and exits; replica B, a new process, hits
        done = subprocess.run(
            [sys.executable, "-c", REPLICA, root, str(tiny_llama_dir), str(tmp_path)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    prompt = prompts(1, 30, seed=1)[0]
    assert runs[0]["storage"] == 0 and runs[1]["storage"] == stored_len(prompt)
    assert runs[0]["tokens"] == runs[1]["tokens"] == reference[tuple(prompt)]

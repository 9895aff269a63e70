"""A slow L3 store never stalls the engine loop.

Prefetch: a request waits in the queue for its pages while the others keep running; it
is admitted when they landed or its policy's deadline passed. Write-back: a page evicted
from the host tier is written by the writer thread, its slots freed once it landed.

The store is made slow on purpose: its calls wait on an Event the test opens. The
reference output is the same prompt recomputed by an engine without any cache; slot
accounting (device and host) is checked after every step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.l3_http import writes_pending
from engine import Engine, SamplingParams
from engine.kvcache.storage.file_store import FileStore
from engine.kvcache.storage.prefetch import READ_CHUNK_PAGES
from engine.request import ReqStatus
from server.metrics import ServerMetrics
from tests.unit.test_l3_engine import PAGE, PARAMS, make_engine, prompts, stored_len

STALL_S = 30.0  # how long a gated store call waits before going on regardless


@dataclass
class Gate:
    """Store calls that wait until ``opened`` (from the ``after``-th call on)."""

    after: int = 0
    calls: int = 0
    entered: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Gate]:
    """Slow down FileStore.<request.param> (default get_into) until the test opens it."""
    name, after = getattr(request, "param", ("get_into", 0))
    original = getattr(FileStore, name)
    gate = Gate(after)

    def gated(self: FileStore, *args: object) -> object:
        gate.calls += 1
        if gate.calls > gate.after:
            gate.entered.set()
            gate.opened.wait(timeout=STALL_S)
        return original(self, *args)

    monkeypatch.setattr(FileStore, name, gated)
    yield gate
    gate.opened.set()  # never leave a reader thread stuck


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[tuple[int, ...], list[int]]:
    engine = make_engine(tiny_llama_dir, None, enable_prefix_cache=False)
    outputs = {tuple(p): engine.generate([p], PARAMS)[0].token_ids for p in prompts(2, 41, seed=5)}
    engine.close()
    return outputs


@pytest.fixture
def stored(tiny_llama_dir: Path, tmp_path: Path) -> list[int]:
    """A prompt whose pages are in the store at ``tmp_path`` (written by another engine)."""
    prompt = prompts(2, 41, seed=5)[0]
    writer = make_engine(tiny_llama_dir, tmp_path)
    writer.generate([prompt], PARAMS)
    writer.close()
    return prompt


def run_to_end(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return tokens


class MetricsView:
    """What the server's engine client offers its metrics collector."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def is_alive(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def health(self) -> dict[str, object]:
        return self.engine.health()


def host_slots_add_up(engine: Engine) -> bool:
    tree = engine.kv.manager.tree
    tier = tree.storage  # type: ignore[attr-defined]
    pool = tree.host_pool  # type: ignore[attr-defined]
    free, cached = pool.available, tree.host_cached_tokens  # type: ignore[attr-defined]
    return bool(free + cached + tier.reading_tokens == pool.capacity)


def test_running_requests_decode_while_a_prefetch_is_in_flight(
    tiny_llama_dir: Path, tmp_path: Path, stored: list[int], gate: Gate, reference: dict
) -> None:
    engine = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_policy="wait_complete")
    other = prompts(2, 41, seed=5)[1]
    long_run = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    runner = engine.add_request(other, long_run)
    engine.step()  # the other request is running
    waiter = engine.add_request(stored, PARAMS)
    engine.step()  # starts the lookup
    req = engine.requests[waiter]
    produced = []
    while not gate.entered.is_set() or len(produced) < 5:
        engine.step()
        produced.append(len(engine.requests[runner].output_ids))
        assert req.status == ReqStatus.WAITING  # not admitted while its pages are read
        assert len(produced) < 40, "the store read never started"
    # The read is stalled; the running request kept decoding one token per step.
    assert produced[-1] - produced[-5] == 4
    assert engine.kv.manager.tree.storage.reading_tokens == stored_len(stored)  # type: ignore[attr-defined]
    gate.opened.set()
    tokens = run_to_end(engine)
    assert tokens[waiter] == reference[tuple(stored)]
    assert req.cached_storage == stored_len(stored)  # wait_complete: every page arrived
    assert host_slots_add_up(engine)
    engine.close()


@pytest.mark.parametrize("gate", [("exists_prefix", 0), ("get_into", 0)], indirect=True)
def test_a_request_aborted_during_its_prefetch_frees_its_host_slots(
    tiny_llama_dir: Path, tmp_path: Path, stored: list[int], gate: Gate
) -> None:
    engine = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_policy="wait_complete")
    tree = engine.kv.manager.tree
    pool = tree.host_pool  # type: ignore[attr-defined]
    waiter = engine.add_request(stored, PARAMS)
    while not gate.entered.is_set():
        engine.step()
    engine.abort(waiter)
    engine.kv.manager.check_invariants(engine.scheduler.running)  # host slots included
    assert not engine.has_work
    gate.opened.set()
    tier = tree.storage  # type: ignore[attr-defined]
    for future, _ in list(tier._orphans):
        future.result(timeout=STALL_S)  # the read it gave up on ends
    tree.poll()  # type: ignore[attr-defined]
    assert tier.reading_tokens == 0
    assert pool.available + tree.host_cached_tokens == pool.capacity  # type: ignore[attr-defined]
    engine.close()


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
@pytest.mark.parametrize("gate", [("get_into", 1)], indirect=True)
def test_past_its_deadline_a_request_takes_what_has_landed(
    tiny_llama_dir: Path,
    tmp_path: Path,
    stored: list[int],
    gate: Gate,
    reference: dict,
    policy: str,
) -> None:
    # The first chunk of pages is read, the second stalls past the deadline.
    assert stored_len(stored) > READ_CHUNK_PAGES * PAGE
    engine = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_policy=policy)
    tier = engine.kv.manager.tree.storage  # type: ignore[attr-defined]
    tier.timeout_base_s = 0.5  # timeout policy: 0.5 s (best_effort: a tenth of it)
    out = engine.generate([stored], PARAMS)[0]
    assert out.token_ids == reference[tuple(stored)]
    assert out.cached_tokens_storage == READ_CHUNK_PAGES * PAGE
    assert gate.entered.is_set() and not gate.opened.is_set()
    assert tier.orphaned_tokens == stored_len(stored) - READ_CHUNK_PAGES * PAGE
    assert not tier.down  # some pages arrived: a slow store, not a dead one
    gate.opened.set()
    engine.close()  # waits for the read; its slots come back
    assert tier.orphaned_tokens == 0


@pytest.mark.parametrize("gate", [("put_from", 0)], indirect=True)
def test_write_back_writes_evicted_host_pages_on_the_writer_thread(
    tiny_llama_dir: Path, tmp_path: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    writers: list[str] = []
    gated_put = FileStore.put_from

    def put_from(self: FileStore, *args: object) -> object:
        writers.append(threading.current_thread().name)
        return gated_put(self, *args)

    monkeypatch.setattr(FileStore, "put_from", put_from)
    settings = dict(hicache_write_policy="write_back", hicache_ratio=1.0)
    engine = make_engine(tiny_llama_dir, tmp_path, **settings)
    tree = engine.kv.manager.tree
    tier = tree.storage  # type: ignore[attr-defined]
    # 16 conversations of 11 pages each overflow the device (64 pages) and the host
    # tier (64 pages): the oldest leave the host tier, which writes them to the store.
    batch = prompts(16, 41, seed=7)
    outs = [engine.generate([p], PARAMS)[0] for p in batch]  # invariants on every step
    assert gate.entered.is_set() and not gate.opened.is_set()
    assert set(writers) == {"hiserve-l3-write"}  # never the engine thread
    # The first write is stalled; the engine went on, and the pages being written wait
    # off the tree (not free, not lost) until it lands.
    assert tier.releasing_tokens > 0
    metrics = ServerMetrics(lambda: MetricsView(engine))  # what the server's /metrics shows
    assert writes_pending(metrics.render().decode()) > 0  # what hiserve-bench l3 waits on
    engine.kv.manager.check_invariants(engine.scheduler.running)
    gate.opened.set()
    tier.drain()
    assert tier.releasing_tokens == 0
    assert writes_pending(metrics.render().decode()) == 0
    assert host_slots_add_up(engine)
    assert set(writers) == {"hiserve-l3-write"}
    engine.close()
    # A restarted engine finds the oldest conversation in the store, with the same output.
    again = make_engine(tiny_llama_dir, tmp_path, **settings)
    out = again.generate([batch[0]], PARAMS)[0]
    assert out.cached_tokens_storage == stored_len(batch[0])
    assert out.token_ids == outs[0].token_ids
    again.close()

"""Cache traces: page-hash chains, the writer thread, the engine's --cache-trace, and
nothing hashed while tracing is off."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest

import engine.cache_trace as cache_trace
from engine import SamplingParams
from engine.cache_salt import salt_digest
from engine.cache_trace import (
    CacheTracer,
    TraceRecord,
    make_record,
    page_chain,
    read_trace,
    trace_salt,
    write_trace,
)
from server.args import parse_args
from tests.unit.cpu_engine import checked_engine

RECORD_KEYS = {
    "t",
    "t_admit",
    "t_end",
    "salt",
    "prompt_len",
    "output_len",
    "prompt_pages",
    "pages",
    "hit",
}


def test_chains_share_exactly_the_shared_whole_pages() -> None:
    a = list(range(100, 110))  # pages of 4: [100..103] [104..107], tail 108 109
    b = a[:6] + [999, 998, 997, 996]  # differs inside the second page
    chain_a, chain_b = page_chain(a, 4), page_chain(b, 4)
    assert len(chain_a) == 2 and len(chain_b) == 2  # the partial page is left out
    assert chain_a[0] == chain_b[0]
    assert chain_a[1] != chain_b[1]
    # Chained: the same page after a different prefix hashes differently.
    assert page_chain([7, 7, 7, 7, 1, 2, 3, 4], 4)[1] != page_chain([8, 8, 8, 8, 1, 2, 3, 4], 4)[1]
    assert page_chain(a, 1)[:6] == page_chain(b, 1)[:6]
    assert page_chain(a, 1)[6] != page_chain(b, 1)[6]


def test_first_page_hash_pinned_to_the_documented_formula() -> None:
    seed = hashlib.blake2b(b"hiserve-cache-trace-v1", digest_size=8).digest()
    page = (5).to_bytes(4, "little") + (70000).to_bytes(4, "little")
    expected = int.from_bytes(hashlib.blake2b(seed + page, digest_size=8).digest(), "little")
    assert page_chain([5, 70000], 2) == [expected]


def test_salts_share_no_page() -> None:
    prompt = list(range(64))

    def salt(name: str | None) -> str:
        return trace_salt(salt_digest(name))

    assert salt(None) == salt("") == ""
    assert salt("tenant-a") != salt("tenant-b")
    chains = [page_chain(prompt, 4, salt(s)) for s in (None, "tenant-a", "tenant-b")]
    for i, first in enumerate(chains):
        for second in chains[i + 1 :]:
            assert not set(first) & set(second)
    assert page_chain(prompt, 4, salt("tenant-a")) == chains[1]


def test_records_round_trip_and_hold_no_token_ids(tmp_path) -> None:
    prompt = [31337] * 10
    record = make_record(prompt, 10, 3, 4, 0.5, 1.25, hit={"device": 4, "host": 0, "storage": 0})
    raw = json.loads(record.to_json())
    assert set(raw) == RECORD_KEYS
    assert 31337 not in raw["pages"] and raw["prompt_pages"] == 2
    path = tmp_path / "t.jsonl"
    write_trace(path, 4, "test", [record, record])
    trace = read_trace(path)
    assert trace.page_size == 4 and trace.source == "test"
    assert trace.records == [record, record]


def test_a_file_that_is_not_a_trace_is_refused(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a hiserve cache trace"):
        read_trace(path)
    write_trace(path, 1, "test", [])
    path.write_text(path.read_text() + '{"t": 1}\n')
    with pytest.raises(ValueError, match=":2: broken trace record"):
        read_trace(path)


def test_tracer_hashes_on_its_own_thread(tmp_path, monkeypatch) -> None:
    threads: list[str] = []
    real = cache_trace.page_chain

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_trace, "page_chain", spy)
    tracer = CacheTracer(tmp_path / "t.jsonl", 2)
    hit = {"device": 2, "host": 0, "storage": 0}
    tracer.record([1, 2, 3, 4, 5], 4, 2, tracer.start, salt_digest("s"), hit)
    tracer.record([1, 2, 3], 3, 1, time.monotonic(), None, hit)
    tracer.close()
    assert threads == ["cache-trace", "cache-trace"]
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.source == "server" and trace.page_size == 2
    first, second = trace.records
    assert first.pages[:1] != second.pages[:1]  # salted and unsalted share nothing
    assert first.salt == salt_digest("s")[:16] and second.salt == ""
    assert first.t == 0.0 and first.t_end >= first.t and second.t >= first.t
    assert (first.prompt_len, first.output_len, first.prompt_pages, len(first.pages)) == (
        4,
        2,
        2,
        2,
    )


def test_server_flag_sets_the_engine_field() -> None:
    assert parse_args(["--cache-trace", "/tmp/t.jsonl"], environ={}).engine.cache_trace == (
        "/tmp/t.jsonl"
    )
    assert parse_args([], environ={}).engine.cache_trace is None


def test_engine_trace_records_what_hit(tiny_llama_dir, tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    eng = checked_engine(tiny_llama_dir, kv_cache_tokens=256, page_size=4, cache_trace=str(path))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    shared = list(range(1000, 1030))
    outs = [eng.generate([shared + tail], params)[0] for tail in ([7] * 9, [8] * 3)]
    eng.close()
    records = read_trace(path).records
    assert [r.hit["device"] for r in records if r.hit] == [o.cached_tokens_device for o in outs]
    assert outs[1].cached_tokens_device == 28  # the shared whole pages
    first, second = records
    assert first.prompt_len == 39 and first.output_len == 5 and first.prompt_pages == 9
    assert first.t_admit is not None and first.t <= first.t_admit <= first.t_end <= second.t
    # Pages cover the KV left at the finish: prompt + output but the last sampled token.
    assert len(first.pages) == (39 + 5 - 1) // 4
    assert first.pages[:7] == second.pages[:7] and first.pages[7] != second.pages[7]
    assert first.pages == page_chain(shared + [7] * 9 + outs[0].token_ids, 4)[: len(first.pages)]


def test_no_hashing_while_tracing_is_off(tiny_llama_dir, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("hashed with tracing off")

    monkeypatch.setattr(cache_trace, "page_chain", refuse)
    monkeypatch.setattr(cache_trace, "make_record", refuse)
    eng = checked_engine(tiny_llama_dir, kv_cache_tokens=256, page_size=4)
    assert eng.tracer is None
    out = eng.generate([list(range(1000, 1020))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    eng.close()


def test_record_type_is_frozen() -> None:
    record = TraceRecord(0.0, 0.0, "", 1, 1, 0, [])
    with pytest.raises(AttributeError):
        record.t = 1.0  # type: ignore[misc]

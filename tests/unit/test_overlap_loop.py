"""The overlapped loop (engine/step_loop.py) against the plain one, token for token.

Both loops run the same tiny model on the CPU with KV accounting checked after every
step (``free + owned + cached == capacity``). The overlapped engine must really run
ahead: each test also checks that steps were launched while another was in flight and
that future token references were resolved on the device.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.grammar_spec import GrammarSpec
from engine.request import RequestOutput
from engine.step_loop import overlap_enabled
from server.args import parse_args
from tests.unit.cpu_engine import checked_engine

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize(
    ("flags", "field", "cpu", "cuda"),
    [
        ([], None, False, False),  # the default: off until a device has run it
        (["--disable-overlap-schedule"], True, False, False),
        (["--no-disable-overlap-schedule"], False, True, True),
    ],
)
def test_flag_and_default(flags: list[str], field: Any, cpu: bool, cuda: bool) -> None:
    config = parse_args(flags).engine
    assert config.disable_overlap_schedule is field
    assert overlap_enabled(config, "cpu") is cpu
    assert overlap_enabled(config, "cuda") is cuda
    assert overlap_enabled(config, "musa") is cuda
    # Tensor parallel ranks replay rank 0's inputs, which hold no future references.
    tp = EngineConfig(disable_overlap_schedule=field, tensor_parallel_size=2)
    assert overlap_enabled(tp, "cuda") is False


class Pair:
    """The same engine configuration driven plainly and overlapped."""

    def __init__(self, model_dir: Path, **config: Any) -> None:
        self.plain = checked_engine(model_dir, disable_overlap_schedule=True, **config)
        self.over = checked_engine(model_dir, disable_overlap_schedule=False, **config)
        assert not self.plain.overlap and self.over.overlap
        assert self.over.health()["overlap_schedule"] is True
        self.resolved = 0
        futures = self.over.runner.futures
        assert futures is not None
        resolve = futures.resolve

        def counting_resolve(input_ids: Any) -> None:
            self.resolved += 1
            resolve(input_ids)

        futures.resolve = counting_resolve  # type: ignore[method-assign]

    def fresh(self) -> None:
        """Count overlap from here on (check_overlapped looks at what ran since)."""
        self.resolved = 0
        self.over.loop.overlapped_steps = 0  # type: ignore[attr-defined]

    def generate(self, prompts: list[Any], params: Any) -> tuple[list[Any], list[Any]]:
        self.fresh()
        plain = [summary(o) for o in self.plain.generate(prompts, params)]
        over = [summary(o) for o in self.over.generate(prompts, params)]
        return plain, over

    def check_overlapped(self) -> None:
        assert self.over.loop.overlapped_steps > 0  # type: ignore[attr-defined]
        assert self.resolved > 0

    def close(self) -> None:
        self.plain.close()
        self.over.close()


def summary(out: RequestOutput) -> tuple[Any, ...]:
    logprobs = [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs or []]
    return (out.token_ids, out.text, out.finish_reason, out.stop_reason, logprobs)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path) -> Any:
    engines = Pair(tiny_llama_dir, kv_cache_tokens=4096)
    yield engines
    engines.close()


PROMPTS = make_prompts(8, seed=3)


def test_greedy_and_lengths(pair: Pair) -> None:
    # EOS is allowed, and lengths differ, so requests end at different steps.
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0) for i in range(len(PROMPTS))]
    plain, over = pair.generate(PROMPTS, params)
    assert over == plain
    assert len({len(p[0]) for p in plain}) > 3
    pair.check_overlapped()


def test_seeded_sampling_logprobs_and_penalties(pair: Pair) -> None:
    # Penalties and min_tokens read the history on the host: while those run, each step
    # lands before the next is scheduled; once they end, the seeded rows overlap.
    params = [
        SamplingParams(
            max_tokens=12, temperature=0.9, top_p=0.9, seed=s, logprobs=2, ignore_eos=True
        )
        for s in range(3)
    ]
    params += [
        SamplingParams(max_tokens=4, temperature=0.7, seed=9, presence_penalty=1.5),
        SamplingParams(max_tokens=4, temperature=0, min_tokens=3),
    ]
    plain, over = pair.generate(PROMPTS[: len(params)], params)
    assert over == plain
    pair.check_overlapped()


def test_stop_strings_and_stop_tokens(pair: Pair) -> None:
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    reference, _ = pair.generate(PROMPTS, free)
    params = []
    for token_ids, text, *_ in reference:
        # A stop string from the middle of the text, a stop token from the middle.
        middle = text[len(text) // 2 : len(text) // 2 + 3]
        params.append(
            SamplingParams(
                max_tokens=24,
                temperature=0,
                ignore_eos=True,
                stop=[middle] if middle.strip() else None,
                stop_token_ids=[token_ids[len(token_ids) * 2 // 3]],
            )
        )
    plain, over = pair.generate(PROMPTS, params)
    assert over == plain
    assert any(isinstance(p[3], str) for p in plain)  # a stop string ended one
    assert any(isinstance(p[3], int) for p in plain)  # a stop token ended one
    pair.check_overlapped()


def test_n_copies_of_one_request(pair: Pair) -> None:
    prompt = PROMPTS[0] * 3
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, seed=s, group="req-1") for s in range(6)
    ]
    plain, over = pair.generate([prompt] * 6, params)
    assert over == plain
    pair.check_overlapped()


def test_context_limit_ends_both_alike(tiny_llama_dir: Path) -> None:
    # The in-flight token is the last the context allows: nothing is decoded past it.
    engines = Pair(tiny_llama_dir, kv_cache_tokens=1024, max_model_len=48)
    try:
        prompts = make_prompts(4, seed=5, lo=30, hi=46)
        plain, over = engines.generate(prompts, SamplingParams(max_tokens=100, temperature=0))
        assert over == plain
        assert {p[2] for p in plain} == {"length"}
        engines.check_overlapped()
    finally:
        engines.close()


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "alternating"])
def test_retraction_in_a_small_pool(tiny_llama_dir: Path, mixed: bool) -> None:
    engines = Pair(
        tiny_llama_dir, kv_cache_tokens=96, max_prefill_tokens=64, enable_mixed_batches=mixed
    )
    try:
        for eng in (engines.plain, engines.over):
            eng.scheduler.new_token_ratio = 0.0  # admit greedily so decode must retract
        prompts = make_prompts(6, seed=1)
        plain, over = engines.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
        assert over == plain
        assert engines.over.scheduler.num_retractions > 0
        engines.check_overlapped()
    finally:
        engines.close()


def drive(eng: Engine, prompts: list[list[int]], abort_after: int) -> dict[str, Any]:
    """Run ``prompts`` with ``eng.loop``; abort the first request after ``abort_after``
    turns. Returns each request's tokens (what its outputs carried) and finish reason."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = [eng.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    seen: dict[str, Any] = {i: ([], None) for i in ids}

    def take(out: RequestOutput | None) -> None:
        if out is not None:
            tokens, _ = seen[out.request_id]
            seen[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)

    turns = 0
    while eng.loop.has_work:
        for out in eng.loop.step():
            take(out)
        turns += 1
        if turns == abort_after:
            take(eng.abort(ids[0]))
    return seen


def test_abort_mid_stream(pair: Pair) -> None:
    pair.fresh()
    prompts = make_prompts(4, seed=11)
    plain = drive(pair.plain, prompts, abort_after=5)
    over = drive(pair.over, prompts, abort_after=5)
    full = drive(pair.plain, prompts, abort_after=-1)
    assert plain["r0"][1] == over["r0"][1] == "abort"
    for seen in (plain, over):
        tokens = seen["r0"][0]
        assert 0 < len(tokens) < 20 and tokens == full["r0"][0][: len(tokens)]
        assert {k: v for k, v in seen.items() if k != "r0"} == {
            k: v for k, v in full.items() if k != "r0"
        }
    stats = pair.over.stats()
    assert stats["running"] == 0 and stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    pair.check_overlapped()


def test_hicache_loads(tiny_llama_dir: Path) -> None:
    """Conversations that come back after the others pushed them to the host tier."""
    engines = Pair(
        tiny_llama_dir,
        kv_cache_tokens=128,
        hicache_load_threshold=4,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
    )
    try:
        rng = random.Random(0)
        convos = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(5)]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        host_hits = 0
        for _ in range(3):
            for c, convo in enumerate(convos):
                (plain,) = engines.plain.generate([convo], params)
                (over,) = engines.over.generate([convo], params)
                assert summary(over) == summary(plain)
                host_hits += over.cached_tokens_host
                convos[c] = convo + plain.token_ids + [rng.randrange(100, 40000)]
        assert host_hits > 0
        engines.over.kv.manager.tree.check_host_invariants()  # type: ignore[attr-defined]
        engines.check_overlapped()
    finally:
        engines.close()


@pytest.mark.slow  # both engines compile the schema over the 49k-token vocabulary
def test_grammar_masks(pair: Pair) -> None:
    """Constrained requests read their grammar state on the host: while one runs, the
    in-flight step lands first; unconstrained requests around them overlap again."""
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    params = [SamplingParams(max_tokens=12, temperature=0, grammar=spec)]
    params += [SamplingParams(max_tokens=12, temperature=0.8, seed=s, grammar=spec) for s in (1, 2)]
    params += [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 2
    plain, over = pair.generate(PROMPTS[: len(params)], params)
    assert over == plain
    assert all(p[0] for p in plain[:3])
    pair.check_overlapped()


def test_l3_prefetch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Prompts a first engine stored are prefetched from the file store by both."""
    config: dict[str, Any] = dict(
        kv_cache_tokens=256,
        page_size=4,
        hicache_load_threshold=4,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_threshold=8,
    )
    batch = make_prompts(4, seed=2, lo=40, hi=48)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = checked_engine(tiny_llama_dir, **config)
    first.generate(batch, params)
    first.close()  # drains the writer: every page is in the store
    engines = Pair(tiny_llama_dir, **config)
    try:
        engines.fresh()
        plain = engines.plain.generate(batch, params)
        over = engines.over.generate(batch, params)
        assert [summary(o) for o in over] == [summary(o) for o in plain]
        assert all(o.cached_tokens_storage > 0 for o in over)
        engines.check_overlapped()
    finally:
        engines.close()


def test_async_engine_streams_overlapped(pair: Pair, tiny_llama_dir: Path) -> None:
    """The server's loop thread drives Engine.loop: streamed deltas add up to the plain
    engine's outputs."""
    params = SamplingParams(max_tokens=16, temperature=0)
    plain = [summary(o) for o in pair.plain.generate(PROMPTS[:4], params)]
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=4096, disable_overlap_schedule=False)
    async_engine = AsyncEngine(engine.config, engine=engine)
    async_engine.start()

    async def one(i: int) -> tuple[list[int], str]:
        tokens: list[int] = []
        text = ""
        async for out in async_engine.generate(PROMPTS[i], params, f"a{i}"):
            tokens += out.new_token_ids
            text += out.new_text
        return tokens, text

    async def run() -> list[tuple[list[int], str]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(4)))
        finally:
            await async_engine.shutdown(grace_s=0)

    streamed = asyncio.run(run())
    assert streamed == [(p[0], p[1]) for p in plain]
    assert engine.loop.overlapped_steps > 0  # type: ignore[attr-defined]


def test_outputs_due_alike_with_a_stream_interval(tiny_llama_dir: Path) -> None:
    """--stream-interval and requests that do not stream: each request gets the same
    outputs (when, and with which deltas) from both loops."""
    engines = Pair(tiny_llama_dir, kv_cache_tokens=4096, stream_interval=3)
    params = [
        SamplingParams(max_tokens=5 + 2 * i, temperature=0, ignore_eos=True, stream=i % 3 > 0)
        for i in range(len(PROMPTS))
    ]

    def outputs(eng: Engine) -> list[list[tuple[Any, ...]]]:
        ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        seen: dict[str, list[tuple[Any, ...]]] = {i: [] for i in ids}
        while not all(s and s[-1][-1] for s in seen.values()):
            for out in eng.loop.step():
                seen[out.request_id].append((out.new_token_ids, out.new_text, out.finished))
        return [seen[i] for i in ids]

    try:
        engines.fresh()
        plain, over = outputs(engines.plain), outputs(engines.over)
        assert over == plain
        assert [len(o) for o in plain[:3]] == [2, 3, 4]  # not streamed; 7 and 9 tokens, by 3
        engines.check_overlapped()
    finally:
        engines.close()

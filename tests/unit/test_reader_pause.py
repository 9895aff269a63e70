"""A request whose stream's reader is behind stops computing (issue 25 item 6: "stalled
readers must not hold running slots"): it is retracted, its KV kept in the tree, and
resumes where it was once the reader catches up, with the same greedy tokens.

The engine test flips ``set_reader_behind`` by hand and counts tokens per step; the
AsyncEngine test leaves a stream unread and reads it later.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from tests.unit.cpu_engine import checked_engine

LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[100 + i for i in range(12)], [300 + i for i in range(9)]]
WAIT_S = 120.0  # generous: a loaded 2-core machine


def test_a_request_paused_for_its_reader_resumes_with_the_same_tokens(
    tiny_llama_dir: Path,
) -> None:
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=1024)
    reference = [out.token_ids for out in engine.generate(PROMPTS, LONG)]
    engine.flush_cache()
    ids = [engine.add_request(p, LONG) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> dict[str, int]:
        new = {i: 0 for i in ids}
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            new[out.request_id] += len(out.new_token_ids)
        return new

    for _ in range(4):
        step()
    engine.set_reader_behind(ids[0], True)
    step()  # the step that retracts it may still land its token in flight
    assert engine.stats()["reader_pauses_total"] == 1
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
    for _ in range(5):
        new = step()
        assert new[ids[0]] == 0 and new[ids[1]] == 1  # only the one being read goes on
    engine.set_reader_behind(ids[0], False)
    while engine.has_work:
        step()
    assert [tokens[i] for i in ids] == reference
    assert engine.stats()["retractions_total"] == 0  # counted apart from KV retractions


def test_an_unread_stream_pauses_and_resumes_when_read(tiny_llama_dir: Path) -> None:
    async def main() -> None:
        config = EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            dtype="float32",
            kv_cache_tokens=2048,
            max_queued_outputs=4,
        )
        engine = AsyncEngine(config)
        engine.engine.check_invariants = True
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        (reference,) = engine.engine.generate([PROMPTS[0]], params)  # before the loop runs
        engine.engine.flush_cache()
        engine.start()
        before = engine.engine.stats()["generation_tokens_total"]  # the reference's
        try:
            gen = engine.generate(PROMPTS[0], params, "unread")
            outs = [await gen.__anext__()]
            deadline = time.monotonic() + WAIT_S
            while engine.stats()["reader_pauses_total"] < 1:
                assert time.monotonic() < deadline, "the unread stream was never paused"
                await asyncio.sleep(0.02)
            generated = engine.stats()["generation_tokens_total"]
            await asyncio.sleep(0.5)
            # Paused: nothing more is computed for a reader that is not reading.
            assert engine.stats()["generation_tokens_total"] == generated
            assert generated - before < params.max_tokens
            assert engine.stats()["running"] == 0
            assert not engine.engine.has_work  # the loop sleeps instead of stepping for it
            outs += [out async for out in gen]  # reading lets it go on to its end
            final = outs[-1]
            assert final.finished and final.token_ids == reference.token_ids
            assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        finally:
            await engine.shutdown(1.0)

    asyncio.run(main())

"""Fair shares of the running slots between clients (issue 25 item 6): one client's long
requests holding every running slot do not keep another client's request waiting.

The engine test counts engine steps: with the room full of client "a"'s long requests
(every running slot, or in the second case the KV pool), a short request from client "b"
finishes within a few steps (one of a's requests is retracted, its KV kept in the tree,
and resumes later with the same greedy tokens). The reference is the same queue with the
short request sent as client "a": it then waits until a's requests finish.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine import Engine, SamplingParams
from engine.client_share import MAX_PREEMPTIONS_PER_STEP, ClientShare, client_of
from tests.unit.cpu_engine import checked_engine
from tests.unit.model_configs import random_prompts

MAX_RUNNING = 8
LONG_TOKENS = 40
LONG = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True, client="a")
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _run(engine: Engine, short_client: str) -> tuple[int, dict[str, list[int]], int]:
    """Steps until the short request finished, every long request's tokens, and how
    many share preemptions the run made."""
    before = engine.stats()["share_preemptions_total"]
    longs = [
        engine.add_request(random_prompts([24], seed)[0], LONG) for seed in range(MAX_RUNNING + 4)
    ]
    finished: dict[str, list[int]] = {}
    steps = 0
    for _ in range(4):  # a's requests fill the room and start decoding
        steps += 1
        for out in engine.step():
            assert not out.finished
    assert engine.stats()["waiting"] > 0
    short = dataclasses.replace(SHORT, client=short_client)
    short_id = engine.add_request(random_prompts([8], 99)[0], short)
    short_steps = 0
    while engine.has_work:
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
                if out.request_id == short_id:
                    short_steps = steps
    assert set(finished) == {*longs, short_id}  # nobody starves, nothing is lost
    assert all(len(finished[i]) == LONG_TOKENS for i in longs)
    preempted = int(engine.stats()["share_preemptions_total"] - before)
    return short_steps - 4, {str(k): finished[i] for k, i in enumerate(longs)}, preempted


@pytest.mark.parametrize(
    ("kv_tokens", "max_running"),
    [(4096, MAX_RUNNING), (448, 64)],
    ids=["running-slots-full", "kv-short"],
)
def test_another_client_gets_a_slot_from_a_client_holding_them_all(
    tiny_llama_dir: Path, kv_tokens: int, max_running: int
) -> None:
    engine = checked_engine(
        tiny_llama_dir, kv_cache_tokens=kv_tokens, max_running_requests=max_running
    )
    same_steps, same_tokens, same_preempted = _run(engine, short_client="a")
    engine.flush_cache()
    other_steps, other_tokens, other_preempted = _run(engine, short_client="b")
    print(f"short request done {same_steps} steps after arriving as a, {other_steps} as b")
    # One client: the short request waits for a slot (a's first wave runs to its end).
    assert same_steps >= LONG_TOKENS - 4, same_steps
    assert same_preempted == 0
    # Another client: a slot is handed back at once; prefill, then one decode.
    assert other_steps <= 3, other_steps
    assert 1 <= other_preempted <= MAX_PREEMPTIONS_PER_STEP
    # The retracted request resumed from its cached KV with the same greedy tokens.
    assert other_tokens == same_tokens


def _req(client: str | None, seq: int, ready: bool = True) -> Any:
    return SimpleNamespace(params=SimpleNamespace(client=client), arrival_seq=seq, ready=ready)


def test_one_client_changes_nothing() -> None:
    running = [_req("a", i) for i in range(8)]
    waiting = [_req("a", 10 + i) for i in range(3)]
    share = ClientShare(running, waiting, 8)
    assert not share.shared
    assert share.admission_order(waiting) == waiting
    assert share.victims(running, waiting, lambda r: True) == []
    assert not share.keeps_slot_from(waiting[0], free_slots=1, kept_back=1)
    # requests that name no client all count as one (the engine's own API)
    assert client_of(_req(None, 0)) == client_of(_req(None, 1))


def test_victims_come_from_the_client_most_over_its_share_newest_first() -> None:
    running = [_req("a", i) for i in range(6)] + [_req("b", 10 + i) for i in range(2)]
    waiting = [_req("c", 20)]
    share = ClientShare(running, waiting, 8)
    assert share.shared and share.share == 8 // 3
    victims = share.victims(running, waiting, lambda r: True)
    assert [(client_of(v), v.arrival_seq) for v in victims] == [("a", 5)]


def test_victims_are_capped_per_step_and_stop_at_the_share() -> None:
    running = [_req("a", i) for i in range(16)]
    waiting = [_req("b", 100 + i) for i in range(12)]
    victims = ClientShare(running, waiting, 16).victims(running, waiting, lambda r: True)
    assert len(victims) == MAX_PREEMPTIONS_PER_STEP
    assert [v.arrival_seq for v in victims] == [15, 14, 13, 12]
    # with few waiting, only as many as they need
    few = [_req("b", 100)]
    assert len(ClientShare(running, few, 16).victims(running, few, lambda r: True)) == 1
    # a client at its share gives nothing back
    even = [_req("a", i) for i in range(8)] + [_req("b", 10 + i) for i in range(8)]
    more = [_req("b", 30)]
    assert ClientShare(even, more, 16).victims(even, more, lambda r: True) == []


def test_a_client_with_nothing_retractable_passes_to_the_next_over_its_share() -> None:
    running = [_req("a", i, ready=False) for i in range(5)] + [_req("b", 10 + i) for i in range(3)]
    waiting = [_req("c", 20)]
    share = ClientShare(running, waiting, 8)  # share 2: a holds 5, b holds 3
    victims = share.victims(running, waiting, lambda r: r.ready)
    assert [(client_of(v), v.arrival_seq) for v in victims] == [("b", 12)]
    assert share.victims(running, waiting, lambda r: False) == []


def test_admission_puts_clients_under_their_share_first_and_keeps_slots_for_them() -> None:
    running = [_req("a", i) for i in range(6)]
    waiting = [_req("a", 10), _req("b", 11), _req("a", 12), _req("b", 13)]
    share = ClientShare(running, waiting, 8)  # share 4: a is over it, b under
    order = share.admission_order(waiting)
    assert [(client_of(r), r.arrival_seq) for r in order] == [
        ("b", 11),
        ("b", 13),
        ("a", 10),
        ("a", 12),
    ]
    # b's requests could not start this step: a does not take the slots held for them
    assert share.keeps_slot_from(waiting[0], free_slots=2, kept_back=2)
    assert not share.keeps_slot_from(waiting[0], free_slots=3, kept_back=2)
    assert not share.keeps_slot_from(waiting[1], free_slots=2, kept_back=2)
    for _ in range(4):
        share.admitted(waiting[1])
    assert not share.under_share(waiting[1])  # b reached its share

"""Two real replicas (default model, small KV pools) behind the real SGLang Model Gateway.

Everything listens on 127.0.0.1. One fleet serves the whole module: two replicas, a
``cache_aware`` router, and a ``round_robin`` router added in front of the same replicas.
References are independent of the router: the official ``openai`` client, each
replica's own answers and counters, and the router's own view of its workers.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.fleet import LocalFleet, Process
from tests.integration.fleet_client import (
    WORKER_HEADER,
    admin_auth,
    auth,
    chat_rounds,
    listening_addresses,
    openai_client,
    replica_loads,
    requests_finished,
    router_engine_load,
    system_prompt,
    wait_until,
)

pytestmark = pytest.mark.slow

KV_TOKENS = 2048
SERVER_ARGS = (
    "--model",
    "default",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--kv-cache-tokens",
    str(KV_TOKENS),
    "--max-running-requests",
    "8",
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    log_dir = tmp_path_factory.mktemp("fleet")
    with LocalFleet(
        replicas=2, policy="cache_aware", log_dir=log_dir, server_args=SERVER_ARGS
    ) as running:
        yield running


@pytest.fixture(scope="module")
def round_robin(fleet: LocalFleet) -> Process:
    return fleet.add_router("round_robin")


@pytest.fixture(scope="module")
def model(fleet: LocalFleet) -> str:
    return str(
        httpx.get(fleet.workers[0].url + "/v1/models", headers=auth(fleet)).json()["data"][0]["id"]
    )


def test_worker_surface_as_the_router_reads_it(fleet: LocalFleet, model: str) -> None:
    worker = fleet.workers[0]
    body = replica_loads(worker.url, fleet)
    assert body["dp_rank_count"] == 1 and isinstance(body["timestamp"], str)
    (load,) = body["loads"]
    assert load["dp_rank"] == 0
    assert load["max_total_num_tokens"] == KV_TOKENS
    assert 0.0 <= load["token_usage"] <= 1.0
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens"):
        assert isinstance(load[key], int) and load[key] >= 0

    info = httpx.get(worker.url + "/server_info", headers=admin_auth(fleet)).json()
    assert info["served_model_name"] == model
    assert info["device"] == "cpu" and info["version"]
    assert info["cache"]["kv_total_tokens"] == KV_TOKENS
    assert info["cache"]["enable_prefix_cache"] is True
    model_info = httpx.get(worker.url + "/model_info", headers=admin_auth(fleet)).json()
    assert model_info["model_path"] == info["model_path"]
    assert model_info["is_generation"] is True
    for path in ("/v1/loads", "/server_info", "/model_info", "/v1/models"):
        assert httpx.get(worker.url + path).status_code == 401, path
    for path in ("/v1/loads", "/server_info", "/model_info"):  # the client key: not these
        assert httpx.get(worker.url + path, headers=auth(fleet)).status_code == 401, path
    assert httpx.get(worker.url + "/health").status_code == 200  # no key needed

    # The router registered each replica from these answers and parsed its load.
    workers = httpx.get(fleet.url + "/workers", headers=admin_auth(fleet)).json()["workers"]
    assert {w["url"] for w in workers} == {w.url for w in fleet.workers}
    for registered in workers:
        assert registered["model_id"] == model
        assert registered["labels"]["max_total_tokens"] == str(KV_TOKENS)
    assert wait_until(lambda: router_engine_load(fleet, worker.url) is not None)
    router_view = router_engine_load(fleet, worker.url)
    assert router_view is not None and router_view["max_total_num_tokens"] == KV_TOKENS
    assert [m.id for m in openai_client(fleet.url, fleet.api_key).models.list().data] == [model]


def test_loads_move_with_load(fleet: LocalFleet, model: str) -> None:
    worker = fleet.workers[1]
    client = openai_client(worker.url, fleet.api_key)
    stream = client.completions.create(
        model=model,
        prompt="Write a long story about the sea. " * 8,
        max_tokens=400,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    try:
        next(iter(stream))  # running now

        def busy() -> bool:
            load = replica_loads(worker.url, fleet)["loads"][0]
            return bool(load["num_running_reqs"] >= 1 and load["num_used_tokens"] > 0)

        assert wait_until(busy)
        load = replica_loads(worker.url, fleet)["loads"][0]
        assert load["token_usage"] == pytest.approx(load["num_used_tokens"] / KV_TOKENS)
        # the router polls the same numbers (every second, --load-monitor-interval 1)
        assert wait_until(
            lambda: (router_engine_load(fleet, worker.url) or {}).get("num_running_reqs", 0) >= 1
        )
    finally:
        stream.close()

    def idle() -> bool:
        load = replica_loads(worker.url, fleet)["loads"][0]
        return bool(load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0)

    assert wait_until(idle)
    assert replica_loads(worker.url, fleet)["loads"][0]["token_usage"] == 0.0


def test_openai_client_through_the_router(fleet: LocalFleet, model: str) -> None:
    via_router = openai_client(fleet.url, fleet.api_key)
    messages = [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": "Name three colours."},
    ]
    first = via_router.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    worker_url = first.headers[WORKER_HEADER]
    assert worker_url in {w.url for w in fleet.workers}
    reply = first.parse()
    # The same request sent to a replica directly is the reference.
    direct = openai_client(worker_url, fleet.api_key).chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content == direct.choices[0].message.content
    assert reply.usage is not None and direct.usage is not None
    assert reply.usage.prompt_tokens == direct.usage.prompt_tokens
    # The direct call hit the prefix the routed one left behind: cached tokens are real.
    assert direct.usage.prompt_tokens_details is not None
    assert direct.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1

    stream = via_router.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # cache_aware sent it back to the replica holding the prefix: the usage says so.
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1

    completion = via_router.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    direct_completion = openai_client(fleet.workers[0].url, fleet.api_key).completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert completion.choices[0].text == direct_completion.choices[0].text
    streamed = via_router.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
    with pytest.raises(openai.NotFoundError):
        via_router.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_api_key_enforced_at_router_and_workers(fleet: LocalFleet, model: str) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 1}
    for url in (fleet.url, *(w.url for w in fleet.workers)):
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401, url
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.post(url + "/v1/completions", json=body, headers=wrong).status_code == 401
        right = httpx.post(url + "/v1/completions", json=body, headers=auth(fleet), timeout=60)
        assert right.status_code == 200, (url, right.text)
    with pytest.raises(openai.AuthenticationError):
        openai_client(fleet.url, "not-the-key").completions.create(
            model=model, prompt="x", max_tokens=1
        )


def test_cache_aware_keeps_a_conversation_on_one_replica(fleet: LocalFleet, model: str) -> None:
    client = openai_client(fleet.url, fleet.api_key)
    for _ in range(2):
        rounds = chat_rounds(client, model, rounds=4)
        assert len({worker for worker, _ in rounds}) == 1, rounds
        previous = rounds[0][1].prompt_tokens
        for _, usage in rounds[1:]:
            # every later round hits at least the whole previous prompt
            assert usage.prompt_tokens_details.cached_tokens >= previous - 1
            previous = usage.prompt_tokens


def test_round_robin_spreads_a_conversation(
    fleet: LocalFleet, round_robin: Process, model: str
) -> None:
    rounds = chat_rounds(openai_client(round_robin.url, fleet.api_key), model, rounds=4)
    workers = [worker for worker, _ in rounds]
    assert set(workers) == {w.url for w in fleet.workers}, workers
    # a round sent to the other replica than the round before cannot hit that round's KV
    for (before, usage_before), (after, usage_after) in itertools.pairwise(rounds):
        if before != after:
            assert usage_after.prompt_tokens_details.cached_tokens < usage_before.prompt_tokens


def _registered(router_url: str, fleet: LocalFleet) -> dict[str, str]:
    """url -> worker id, as the router itself lists them (read with the admin key)."""
    listed = httpx.get(router_url + "/workers", headers=admin_auth(fleet), timeout=10.0)
    assert listed.status_code == 200, listed.text
    return {w["url"]: w["id"] for w in listed.json()["workers"]}


def test_client_key_cannot_change_the_routing(
    fleet: LocalFleet, round_robin: Process, model: str
) -> None:
    """Issue 25 item 4: the client key used to be the router's admin key too, so any
    client could register its own URL as a worker or remove the real replicas."""
    before = _registered(round_robin.url, fleet)
    assert set(before) == {w.url for w in fleet.workers}
    victim_url, victim_id = sorted(before.items())[0]
    attacker = {"url": "http://127.0.0.1:9", "api_key": "stolen"}
    for headers in ({}, auth(fleet)):
        for router_url in (fleet.url, round_robin.url):
            added = httpx.post(router_url + "/workers", json=attacker, headers=headers)
            assert added.status_code in (401, 403), added.text
            removed = httpx.delete(f"{router_url}/workers/{victim_id}", headers=headers)
            assert removed.status_code in (401, 403), removed.text
            flushed = httpx.post(router_url + "/flush_cache", headers=headers)
            assert flushed.status_code in (401, 403), flushed.text
    assert _registered(round_robin.url, fleet) == before
    assert set(_registered(fleet.url, fleet)) == set(before)
    # a replica's admin routes refuse the client key as well
    flushed = httpx.post(victim_url + "/flush_cache", headers=auth(fleet))
    assert flushed.status_code == 401, flushed.text

    # The admin key works: take a replica out of the rotation, then put it back.
    removed = httpx.delete(f"{round_robin.url}/workers/{victim_id}", headers=admin_auth(fleet))
    assert removed.status_code < 300, removed.text
    assert wait_until(lambda: victim_url not in _registered(round_robin.url, fleet))
    routed = openai_client(round_robin.url, fleet.api_key)
    for i in range(2):
        raw = routed.completions.with_raw_response.create(
            model=model, prompt=f"Hi {i}", max_tokens=1
        )
        assert raw.headers[WORKER_HEADER] != victim_url
    # a worker added at run time gets no key unless the request names one
    back = {"url": victim_url, "api_key": fleet.admin_key}
    added = httpx.post(round_robin.url + "/workers", json=back, headers=admin_auth(fleet))
    assert added.status_code < 300, added.text
    fleet.wait_healthy(set(before), timeout=60, router=round_robin)


def test_replica_killed_then_restarted(fleet: LocalFleet, round_robin: Process, model: str) -> None:
    client = openai_client(fleet.url, fleet.api_key, timeout=180.0)
    prompt = system_prompt() + " Tell me a long story."
    pinned = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1)
    victim_url = pinned.headers[WORKER_HEADER]
    victim = next(i for i, w in enumerate(fleet.workers) if w.url == victim_url)
    survivor_url = fleet.workers[1 - victim].url
    outcomes: dict[str, BaseException | str] = {}

    def run(kind: str) -> None:
        started = time.monotonic()
        try:
            if kind == "stream":
                chunks = client.completions.create(
                    model=model,
                    prompt=prompt + " It begins",
                    max_tokens=400,
                    extra_body={"ignore_eos": True},
                    stream=True,
                )
                for _ in chunks:
                    pass
            else:
                client.completions.create(
                    model=model,
                    prompt=prompt + " Once",
                    max_tokens=400,
                    extra_body={"ignore_eos": True},
                )
            outcomes[kind] = f"finished after {time.monotonic() - started:.1f} s"
        except BaseException as exc:
            outcomes[kind] = exc

    threads = [threading.Thread(target=run, args=(kind,)) for kind in ("stream", "plain")]
    try:
        for thread in threads:
            thread.start()
        # both in flight on the victim (cache_aware follows the shared prefix)
        assert wait_until(
            lambda: replica_loads(victim_url, fleet)["loads"][0]["num_running_reqs"] >= 2,
            timeout=120,
        )
        fleet.kill_replica(victim)
        for thread in threads:
            thread.join(150)
            assert not thread.is_alive(), "a request to the killed replica hangs"
        for kind in ("stream", "plain"):
            assert isinstance(outcomes[kind], openai.APIError), (kind, outcomes[kind])
        assert isinstance(outcomes["plain"], openai.InternalServerError)
        assert victim_url in str(outcomes["plain"])  # the error names the dead replica

        fleet.wait_healthy({survivor_url}, timeout=60)
        fleet.wait_healthy({survivor_url}, timeout=60, router=round_robin)  # both routers
        for router_url in (fleet.url, round_robin.url):
            routed = openai_client(router_url, fleet.api_key)
            for i in range(3):
                raw = routed.completions.with_raw_response.create(
                    model=model, prompt=prompt + f" Part {i}", max_tokens=2
                )
                assert raw.headers[WORKER_HEADER] == survivor_url
    finally:
        for thread in threads:
            thread.join(150)
        if not fleet.workers[victim].alive():
            fleet.restart_replica(victim)
    every = {w.url for w in fleet.workers}
    fleet.wait_healthy(every, timeout=60)
    fleet.wait_healthy(every, timeout=60, router=round_robin)
    # back in the rotation: round robin sends it every other request again
    routed = openai_client(round_robin.url, fleet.api_key)
    reached = {
        routed.completions.with_raw_response.create(
            model=model, prompt=f"Hello {i}", max_tokens=1
        ).headers[WORKER_HEADER]
        for i in range(2)
    }
    assert reached == every


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
def test_fleet_listens_on_loopback_only(fleet: LocalFleet) -> None:
    for process in (*fleet.workers, fleet.router):
        assert process.proc is not None
        addresses = listening_addresses(process.proc.pid)
        assert addresses, process.name
        assert all(a.startswith("127.0.0.1:") for a in addresses), (process.name, addresses)
    # the router's own port and its metrics port, nothing else
    assert len(listening_addresses(fleet.router.proc.pid)) == 2  # type: ignore[union-attr]


def test_bench_text_mode_through_the_router(fleet: LocalFleet, tmp_path: Path) -> None:
    from bench.__main__ import main as bench_main

    before = {w.url: requests_finished(w.url, fleet) for w in fleet.workers}
    out = tmp_path / "bench.json"
    status = bench_main(
        ["run", "--base-url", fleet.url, "--api-key", fleet.api_key, "--prompt-mode", "text",
         "--workload", "multiturn", "--num-clients", "3", "--num-rounds", "2",
         "--user-turn-len", "24", "--assistant-turn-len", "8", "--output-len", "2",
         "--seed", "11", "--json", str(out), "--no-progress"]
    )  # fmt: skip
    assert status == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["cached_tokens_reported"]
    # the router's worker header, counted by the bench, agrees with each replica's own count
    served = {url: int(requests_finished(url, fleet) - before[url]) for url in before}
    assert report["workers"] == {url: n for url, n in served.items() if n}
    # cache_aware: every second round lands where its first round left the prefix
    assert report["cache_hit_rate"] >= 0.9 * report["ideal_hit_rate"]

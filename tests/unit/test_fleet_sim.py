"""bench/fleet_sim.py: a simulated replica's cached tokens are the longest word prefix
shared with an earlier prompt, counted independently here; the stream ends with usage."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from bench.fleet import free_port
from bench.fleet_sim import serve


@pytest.fixture()
def sim_url() -> Iterator[str]:
    server = serve(free_port(), prefill=0.0, decode=0.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _usage(url: str, prompt: str) -> dict[str, int]:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 5  # 3 tokens, usage, [DONE]
    usage = json.loads(events[-2])["usage"]
    return {
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
    }


def test_cached_tokens_are_the_longest_shared_word_prefix(sim_url: str) -> None:
    first = "alpha beta gamma delta"
    assert _usage(sim_url, first) == {"prompt": 4, "cached": 0}
    assert _usage(sim_url, "alpha beta gamma epsilon zeta") == {"prompt": 5, "cached": 3}
    assert _usage(sim_url, "beta alpha") == {"prompt": 2, "cached": 0}
    assert _usage(sim_url, first) == {"prompt": 4, "cached": 3}  # never the whole prompt
    assert httpx.post(sim_url + "/flush_cache", json={}).status_code == 200
    assert _usage(sim_url, first) == {"prompt": 4, "cached": 0}


def test_answers_what_the_router_asks(sim_url: str) -> None:
    assert httpx.get(sim_url + "/health").status_code == 200
    assert httpx.get(sim_url + "/v1/models").json()["data"][0]["id"] == "sim"
    (load,) = httpx.get(sim_url + "/v1/loads").json()["loads"]
    assert load["num_running_reqs"] == 0

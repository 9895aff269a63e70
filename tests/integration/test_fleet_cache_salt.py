"""Tenants through the real router: a request's ``cache_salt`` reaches the replica
unchanged through ``smg``, and so does each tenant's own key (``--tenant-api-key``),
which ``--cache-salt-from-key`` turns into a partition of its own.

One replica behind smg, so routing cannot explain a miss or a hit: two tenants sending
the same prompt through the router each get 0 cached tokens on their first request and
a hit on their second. The reference for "unchanged" is the replica itself: the same
prompt sent to it directly with the tenant's exact salt hits what the routed request
cached, and with any other salt misses. Clients are the official ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.fleet import FAST_ROUTER_FLAGS, LocalFleet
from tests.integration.fleet_client import WORKER_HEADER, openai_client

pytestmark = pytest.mark.slow

SERVER_ARGS = (
    "--model",
    "default",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--kv-cache-tokens",
    "2048",
    "--max-running-requests",
    "4",
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    log_dir: Path = tmp_path_factory.mktemp("fleet-salt")
    with LocalFleet(
        replicas=1, policy="round_robin", log_dir=log_dir, server_args=SERVER_ARGS
    ) as running:
        yield running


def test_a_tenants_salt_reaches_the_replica_unchanged(fleet: LocalFleet) -> None:
    router = openai_client(fleet.url, fleet.api_key)
    replica = openai_client(fleet.workers[0].url, fleet.api_key)
    model = replica.models.list().data[0].id
    prompt = "Our team's shared onboarding guide, chapter one. " * 10
    salts = {"tenant-a": "salt-7f3a9c0e-a", "tenant-b": "salt-7f3a9c0e-b"}

    def cached(client, salt: str) -> int:  # type: ignore[no-untyped-def]
        raw = client.completions.with_raw_response.create(
            model=model,
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        out = raw.parse()
        if client is router:
            assert raw.headers[WORKER_HEADER]  # smg routed it
        return int(out.usage.prompt_tokens_details.cached_tokens or 0)

    assert cached(router, salts["tenant-a"]) == 0
    assert cached(router, salts["tenant-b"]) == 0  # same prompt, other tenant: nothing
    hit_a = cached(router, salts["tenant-a"])
    assert hit_a > 0
    assert cached(router, salts["tenant-b"]) == hit_a  # each tenant hits its own copy
    # The replica keys its cache by exactly the salt the client sent through smg.
    assert cached(replica, salts["tenant-a"]) == hit_a
    assert cached(replica, salts["tenant-a"] + " ") == 0
    assert cached(replica, salts["tenant-a"].upper()) == 0


TENANT_KEYS = {"tenant-a": "key-a-" + "3" * 16, "tenant-b": "key-b-" + "5" * 16}


@pytest.fixture(scope="module")
def keyed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """A replica that takes each tenant's key from smg: no client key of its own (only
    the gateway reaches it), --cache-salt-from-key; smg checks the tenants' keys."""
    tenants = [arg for t, k in TENANT_KEYS.items() for arg in ("--tenant-api-key", f"{t}:{k}")]
    with LocalFleet(
        replicas=1,
        policy="round_robin",
        log_dir=tmp_path_factory.mktemp("fleet-salt-key"),
        server_args=(*SERVER_ARGS, "--api-key", "", "--cache-salt-from-key"),
        router_args=(*FAST_ROUTER_FLAGS, *tenants),
    ) as running:
        yield running


def test_tenant_keys_through_smg_partition_the_cache(keyed_fleet: LocalFleet) -> None:
    fleet = keyed_fleet
    prompt = "A prompt both tenants send, word for word, with the same salt. " * 8
    model = openai_client(fleet.workers[0].url, "any").models.list().data[0].id

    def cached(url: str, key: str, salt: str = "same") -> int:
        out = openai_client(url, key).completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return int(out.usage.prompt_tokens_details.cached_tokens or 0)

    key_a, key_b = TENANT_KEYS["tenant-a"], TENANT_KEYS["tenant-b"]
    with pytest.raises(openai.AuthenticationError):
        cached(fleet.url, "key-c-not-a-tenant")  # smg checks the tenants' keys
    assert cached(fleet.url, key_a) == 0
    assert cached(fleet.url, key_b) == 0  # same prompt and salt, another tenant's key
    hit = cached(fleet.url, key_a)
    assert hit > 0 and cached(fleet.url, key_b) == hit
    # smg handed the replica each tenant's key unchanged: the replica, asked directly with
    # that key, finds the tenant's copy; with any other key, nothing.
    assert cached(fleet.workers[0].url, key_a) == hit
    assert cached(fleet.workers[0].url, key_a + "x") == 0
    assert cached(fleet.workers[0].url, key_a, salt="other") == 0

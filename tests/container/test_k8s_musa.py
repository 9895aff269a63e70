"""The musa overlays start on real cards: the host tier plus the process's own memory fits
the pod's memory limit (checked with the engine's own sizing and memory-check code against
a cgroup at that limit), the replicas may open the GPU device nodes, and the mthreads
RuntimeClass can be asked for where that runtime is not the default."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from engine import platform
from engine.host_alloc import pinned_size
from engine.host_memory import HostMemoryError, available_host_memory, check_host_memory
from engine.kv_setup import kv_pool_tokens
from engine.kvcache.sizing import host_tier_tokens
from tests.container.k8s_render import K8S, by_kind, container, render, render_with, server_config

GiB = 2**30
# Cards: S4000 (48 GB) and an 80 GB class card.
CARDS = {"48GB": 48 * 10**9, "80GB": 80 * 10**9}
# Host memory of one rank's process besides its tier: Python, torch and torch_musa, the
# tokenizer, staging buffers (the weights go to the device). The base's request before
# the tier existed.
PROCESS_BYTES = 8 * GiB
# KV bytes per token of a Llama-3-8B-like model in bf16 (32 layers, 8 KV heads, head 128).
MODEL_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?)?", text).groups()  # type: ignore[union-attr]
    return int(number) * _UNITS.get(unit or "", 1)


def fake_cgroup(root: Path, limit: int, used: int) -> dict[str, Path]:
    """A cgroup v2 pod at ``limit`` with ``used`` bytes already taken, on a large node."""
    (root / "pod").mkdir(parents=True)
    (root / "pod" / "memory.max").write_text(f"{limit}\n")
    (root / "pod" / "memory.current").write_text(f"{used}\n")
    (root / "pod" / "memory.stat").write_text("inactive_file 0\n")
    (root / "self").write_text("0::/pod\n")
    (root / "meminfo").write_text(f"MemAvailable: {2 * 2**40 // 1024} kB\n")
    return {"cgroup_root": root, "self_cgroup": root / "self", "meminfo": root / "meminfo"}


def tier_bytes(docs: dict[tuple[str, str], Any], card: int, method: str, monkeypatch: Any) -> int:
    """Host bytes one rank pins for its tier on ``card``, as the engine sizes it."""
    config = server_config(docs)
    ranks = config.tensor_parallel_size
    per_token = MODEL_KV_BYTES_PER_TOKEN // ranks  # each rank holds its shard of the heads
    monkeypatch.setattr(platform, "mem_get_info", lambda spec: (card, card))
    device_tokens = kv_pool_tokens(config, platform.parse_device("musa:0"), per_token)
    tokens = host_tier_tokens(config, device_tokens, per_token, config.page_size, method)
    return pinned_size(method, tokens * per_token)


def fits(docs: dict[tuple[str, str], Any], card: int, tmp: Path, monkeypatch: Any) -> list[str]:
    """Why the last rank's tier would be refused by check_host_memory, per method."""
    server = container(docs[("Deployment", "hiserve")], "hiserve")
    limit = quantity(server["resources"]["limits"]["memory"])
    ranks = server_config(docs).tensor_parallel_size
    refused = []
    for method in ("host_register", "pin_memory"):  # torch_musa with / without the call
        tier = tier_bytes(docs, card, method, monkeypatch)
        # Every rank's process is up and the other ranks hold their tiers already.
        used = ranks * PROCESS_BYTES + (ranks - 1) * tier
        free = available_host_memory(**fake_cgroup(tmp / method, limit, used))
        try:
            check_host_memory(tier, "the HiCache host tier", "--hicache-size", available=free)
        except HostMemoryError as exc:
            refused.append(f"{method}: {exc}")
    return refused


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("overlay", ["musa", "musa-tp2"])
def test_host_tier_and_process_fit_the_pod_limit(
    overlay: str, card: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = by_kind(render(K8S / "overlays" / overlay))
    assert fits(docs, CARDS[card], tmp_path, monkeypatch) == []
    server = container(docs[("Deployment", "hiserve")], "hiserve")
    resources = server["resources"]
    # Pinned memory cannot be reclaimed: the scheduler must reserve all of it.
    assert quantity(resources["requests"]["memory"]) == quantity(resources["limits"]["memory"])


def test_a_tier_sized_from_the_device_pool_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check can fail: the base's 2x ratio on a 48 GB card needs ~48 GB of host."""
    docs = by_kind(render(K8S / "overlays" / "musa"))
    server = container(docs[("Deployment", "hiserve")], "hiserve")
    server["env"] = [e for e in server["env"] if e["name"] != "HISERVE_HICACHE_SIZE"]
    refused = fits(docs, CARDS["48GB"], tmp_path, monkeypatch)
    # pin_memory cuts the tier to the power of two below it (32 GiB), which fits.
    assert refused and refused[0].startswith("host_register: ") and "needs 48.00 GB" in refused[0]


@pytest.mark.parametrize("overlay", ["musa", "musa-tp2"])
def test_replicas_join_the_render_group(overlay: str) -> None:
    docs = by_kind(render(K8S / "overlays" / overlay))
    pod = docs[("Deployment", "hiserve")]["spec"]["template"]["spec"]
    assert 109 in pod["securityContext"]["supplementalGroups"]
    assert pod["securityContext"]["runAsUser"] == 10001  # the base's user is kept


def test_cpu_replicas_need_no_device_group() -> None:
    docs = by_kind(render(K8S / "overlays" / "cpu"))
    pod = docs[("Deployment", "hiserve")]["spec"]["template"]["spec"]
    assert "supplementalGroups" not in pod["securityContext"]


def test_the_render_gid_is_patchable(tmp_path: Path) -> None:
    """A user's overlay replaces the gid with the one their nodes use."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(K8S / 'overlays' / 'musa', root)}]\npatches:\n  - path: gid.yaml\n"
    )
    (root / "gid.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: hiserve}\n"
        "spec:\n  template:\n    spec:\n      securityContext:\n        supplementalGroups: [993]\n"
    )
    pod = by_kind(render(root))[("Deployment", "hiserve")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["supplementalGroups"] == [993]


def test_runtime_class_component(tmp_path: Path) -> None:
    docs = render_with("musa", "mthreads-runtime-class", tmp_path)
    pod = docs[("Deployment", "hiserve")]["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "mthreads"
    router = docs[("Deployment", "hiserve-router")]["spec"]["template"]["spec"]
    assert "runtimeClassName" not in router

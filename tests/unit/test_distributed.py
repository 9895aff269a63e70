"""Collective backend by bare device type, rank placement, and a real gloo group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.platform import DeviceSpec
from engine.tp.collectives import (
    COLLECTIVE_BACKENDS,
    abort_collectives,
    check_collective_backend,
    collective_backend,
    init_process_group,
    leave_group,
    rank_devices,
)


@pytest.mark.parametrize(
    ("device", "backend"),
    [
        ("cuda", "nccl"),
        ("cuda:1", "nccl"),
        ("CUDA:0", "nccl"),
        ("hip:0", "nccl"),
        ("musa", "mccl"),
        ("musa:0", "mccl"),
        ("MUSA:3", "mccl"),
        ("npu:0", "hccl"),
        ("xpu", "xccl"),
        ("xpu:1", "xccl"),
        ("cpu", "gloo"),
        (DeviceSpec("musa", 1), "mccl"),
    ],
)
def test_backend_by_bare_device_type(device: str | DeviceSpec, backend: str) -> None:
    assert collective_backend(device) == backend


def test_device_type_without_a_backend_fails_with_the_list() -> None:
    with pytest.raises(ValueError, match=r"'mps'.*musa \(mccl\).*tensor-parallel-size 1"):
        collective_backend("mps")
    with pytest.raises(ValueError, match="resolve the 'auto' device"):
        collective_backend("auto")
    with pytest.raises(ValueError, match="invalid device"):
        collective_backend("tpu:0")


def test_check_asks_for_the_backend_after_importing_the_device_package() -> None:
    # Fakes: torch_musa would register mccl when imported; this build has no GPU stack.
    imported: list[str] = []
    registered: set[str] = set()

    def fake_import(kind: str) -> None:
        imported.append(kind)
        registered.add(COLLECTIVE_BACKENDS[kind])

    backend = check_collective_backend("musa:0", registered.__contains__, fake_import)
    assert backend == "mccl" and imported == ["musa"]
    with pytest.raises(RuntimeError, match=r"'hccl'.*torch_npu"):
        check_collective_backend("npu:1", lambda name: False, lambda kind: None)
    with pytest.raises(RuntimeError, match="'nccl' for device 'cuda:0'"):
        check_collective_backend("cuda:0", lambda name: False, lambda kind: None)


def test_check_on_this_cpu_build_finds_gloo() -> None:
    assert check_collective_backend("cpu") == "gloo"


def test_rank_devices() -> None:
    assert rank_devices("musa:0", 2) == [DeviceSpec("musa", 0), DeviceSpec("musa", 1)]
    assert rank_devices("musa:2", 2, visible=4) == [DeviceSpec("musa", 2), DeviceSpec("musa", 3)]
    assert rank_devices("cuda", 2) == [DeviceSpec("cuda", 0), DeviceSpec("cuda", 1)]
    assert rank_devices("musa", 2, device_ids=[3, 1]) == [
        DeviceSpec("musa", 3),
        DeviceSpec("musa", 1),
    ]
    assert rank_devices("cpu", 2) == [DeviceSpec("cpu"), DeviceSpec("cpu")]
    with pytest.raises(ValueError, match="only 2 are visible"):
        rank_devices("musa:1", 2, visible=2)
    with pytest.raises(ValueError, match="repeat a device"):
        rank_devices("musa", 2, device_ids=[0, 0])
    with pytest.raises(ValueError, match="1 device ids given"):
        rank_devices("musa", 2, device_ids=[0])
    with pytest.raises(ValueError, match=">= 1"):
        rank_devices("musa", 0)


def test_gloo_group_of_one_all_reduces(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    backend = init_process_group("cpu", 0, 1, f"file://{tmp_path / 'rendezvous'}")
    try:
        assert backend == dist.get_backend() == "gloo"
        value = torch.tensor([3.0])
        dist.all_reduce(value)
        assert value.item() == 3.0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_leaving_the_group_destroys_on_gloo_and_aborts_elsewhere(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This torch's abort API must exist and work (the NCCL/MCCL failure path uses it); a
    # gloo group stands in for the device group, which this CPU build cannot make.
    calls: list[str] = []
    real_destroy = dist.destroy_process_group
    real_abort = dist.distributed_c10d._abort_process_group
    monkeypatch.setattr(
        dist, "destroy_process_group", lambda: (calls.append("destroy"), real_destroy())
    )
    monkeypatch.setattr(
        dist.distributed_c10d,
        "_abort_process_group",
        lambda: (calls.append("abort"), real_abort()),
    )
    init_process_group("cpu", 0, 1, f"file://{tmp_path / 'rendezvous'}")
    dist.new_group(backend="gloo")  # the control group goes too
    leave_group(backend)
    assert not dist.is_initialized()
    assert calls == (["destroy"] if backend == "gloo" else ["abort"])
    assert not abort_collectives()  # nothing left to abort
    leave_group(backend)  # and leaving twice is harmless

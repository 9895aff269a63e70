"""The tensor-parallel flags: --tensor-parallel-size / --tp, the HISERVE_ environment,
device lists, and the combinations refused with a clear message."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.tp_runtime import device_ids
from server.args import parse_args


def test_tp_flag_alias_and_environment() -> None:
    assert parse_args([], environ={}).engine.tensor_parallel_size == 1
    assert parse_args(["--tp", "2"], environ={}).engine.tensor_parallel_size == 2
    assert parse_args(["--tensor-parallel-size", "4"], environ={}).engine.tensor_parallel_size == 4
    env = {"HISERVE_TENSOR_PARALLEL_SIZE": "2", "HISERVE_TENSOR_PARALLEL_DEVICES": "2,3"}
    args = parse_args([], environ=env)
    assert (args.engine.tensor_parallel_size, args.engine.tensor_parallel_devices) == (2, "2,3")
    assert parse_args(["--tp", "8"], environ=env).engine.tensor_parallel_size == 8  # flag wins


def test_invalid_tp_sizes_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--tp", "0"], environ={})
    assert exc.value.code == 2
    assert "tensor_parallel_size must be >= 1" in capsys.readouterr().err


def test_l3_storage_with_tp_is_refused() -> None:
    with pytest.raises(ValueError, match="L3 storage tier does not support tensor parallel"):
        EngineConfig(
            tensor_parallel_size=2,
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            page_size=16,
        )


def test_device_lists() -> None:
    assert device_ids(None) is None and device_ids(" ") is None
    assert device_ids("2,3") == [2, 3]
    with pytest.raises(ValueError, match="must list device indices"):
        device_ids("cuda:2,cuda:3")

"""The tensor-parallel flags: --tensor-parallel-size / --tp, the HISERVE_ environment,
device lists, the combinations refused with a clear message, and a worker that dies
before it joins the group."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from engine.config import EngineConfig
from engine.tp.protocol import TPRankDiedError, rank_ready_key
from engine.tp.runtime import device_ids, wait_for_ranks
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


def _exit_at_once(code: int) -> None:
    sys.exit(code)


def _run_until(stop: Any) -> None:
    stop.wait(120)


def test_a_worker_dying_at_start_fails_the_wait_at_once(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "rendezvous"), 3)
    store.set(rank_ready_key(1), "1")  # rank 1 started; rank 2 exits before it does
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    ranks = [
        context.Process(target=_run_until, args=(stop,), daemon=True),
        context.Process(target=_exit_at_once, args=(3,), daemon=True),
    ]
    try:
        for process in ranks:
            process.start()
        with pytest.raises(TPRankDiedError, match=r"rank 2 \(pid \d+\) exited with code 3 while"):
            wait_for_ranks(store, ranks)
        store.set(rank_ready_key(2), "1")
        wait_for_ranks(store, ranks)  # every rank has started: returns
    finally:
        stop.set()
        ranks[0].join(30)

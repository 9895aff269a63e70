"""A tensor-parallel worker's replay of rank 0's host-tier copies on real CUDA streams:
a backup must have read its slots before the next forward overwrites them, and a load
must land what the backup saved (tests/unit/test_tp_engine.py covers the CPU path)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model_runner import StepInputs
from engine.platform import DeviceSpec
from engine.tp.mirror import RankKV
from engine.tp.protocol import KVCopy, KVGeometry, StepMessage

pytestmark = pytest.mark.cuda
SPEC = DeviceSpec("cuda", 0)
SLEEP_CYCLES = 400_000_000  # a few hundred ms of GPU time queued before the copies
TOKENS = 4096


def _message(copies: list[KVCopy]) -> StepMessage:
    inputs = StepInputs(False, [], [], torch.empty(0, dtype=torch.int64), [], [], [], [])
    return StepMessage(inputs, [], copies)


def test_worker_replay_orders_backups_before_overwrites_and_loads_them_back() -> None:
    geometry = KVGeometry(
        num_slots=2 * TOKENS + 1, max_rows=4, max_context=64, page_size=1, host_tokens=TOKENS
    )
    config = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    kv = RankKV(geometry, config, torch.float16, torch.device("cuda", 0), SPEC)
    assert kv.transfer is not None and kv.transfer.asynchronous
    buffer = kv.device_pool.kv_buffer  # [2, L, slots, H, D]
    first = torch.arange(1, TOKENS + 1)
    second = torch.arange(TOKENS + 1, 2 * TOKENS + 1)
    saved = torch.randn(2, 4, TOKENS, 2, 64, device="cuda").half()
    buffer[:, :, first] = saved
    host_slots = torch.arange(TOKENS)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy: the backup starts late
    loads = kv.apply(_message([KVCopy("backup", first, host_slots)]))
    assert loads == []
    buffer[:, :, first] = 0  # the next "forward" reuses the slots rank 0 freed
    loads = kv.apply(_message([KVCopy("load", second, host_slots)]))
    for handle in loads:
        handle.wait()
    torch.cuda.synchronize()
    assert torch.equal(buffer[:, :, second], saved), "the load did not bring back the backup"
    kv.close()

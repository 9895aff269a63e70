"""Fixtures shared by the unit tests: fake accelerator backends, one torch thread."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.unit.fake_backends import FakeStreamBackend, install_fake_streams

# CPU CI has no GPU: Triton kernels (engine/layers/triton_ops/) run under Triton's
# interpreter. Set before any kernel module is imported (triton.jit reads it then).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def fake_musa(monkeypatch: pytest.MonkeyPatch) -> FakeStreamBackend:
    """torch.musa replaced by streams and events that complete when told to."""
    return install_fake_streams(monkeypatch)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module: on a shared 2-core box, OpenMP's spinning barriers
    next to a busy neighbour make two threads up to 10x slower than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

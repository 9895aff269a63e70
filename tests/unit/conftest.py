"""Fixtures shared by the unit tests: fake accelerator backends."""

from __future__ import annotations

import pytest

from tests.unit.fake_backends import FakeStreamBackend, install_fake_streams


@pytest.fixture
def fake_musa(monkeypatch: pytest.MonkeyPatch) -> FakeStreamBackend:
    """torch.musa replaced by streams and events that complete when told to."""
    return install_fake_streams(monkeypatch)

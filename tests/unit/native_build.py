"""Making a native CPU kernel's build fail, as on a host without a C++ compiler."""

from __future__ import annotations

import pytest
from torch.utils import cpp_extension

from engine.layers.cpu_kernels import NativeExtension


def fail_native_build(
    monkeypatch: pytest.MonkeyPatch, extension: NativeExtension, message: str
) -> None:
    """``extension`` forgets any earlier build, and its next build raises
    ``RuntimeError(message)`` (what ``cpp_extension.load`` raises without a compiler)."""

    def broken_load(**kwargs: object) -> None:
        raise RuntimeError(message)

    monkeypatch.setattr(extension, "module", None)
    monkeypatch.setattr(extension, "error", None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)

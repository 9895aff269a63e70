"""What --dtype names, and what auto means per device (fake backends, no accelerator)."""

from __future__ import annotations

import pytest
import torch

from engine.dtypes import default_dtype, parse_dtype
from engine.platform import DeviceSpec
from tests.unit.fake_backends import ExplodingCuda, FakeBackend, install


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((2, 1), torch.float16),
        ((2, 2), torch.bfloat16),
        ((3, 1), torch.bfloat16),
    ],
)
def test_musa_dtype_follows_capability(
    capability: tuple[int, int], expected: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(monkeypatch, "musa", FakeBackend(get_device_capability=lambda index: capability))
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    assert default_dtype(DeviceSpec("musa", 0)) == expected
    assert parse_dtype("auto", DeviceSpec("musa", 0)) == expected


def test_default_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_dtype(DeviceSpec("cpu")) == torch.float32
    assert default_dtype(DeviceSpec("mps")) == torch.float16
    assert default_dtype(DeviceSpec("npu", 0)) == torch.bfloat16
    cuda = install(monkeypatch, "cuda", FakeBackend(is_bf16_supported=lambda **_: False))
    assert default_dtype(DeviceSpec("cuda", 0)) == torch.float16
    cuda.is_bf16_supported = lambda **_: True
    assert default_dtype(DeviceSpec("cuda", 0)) == torch.bfloat16


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("FP16", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_parse_dtype_names(name: str, expected: torch.dtype) -> None:
    assert parse_dtype(name, DeviceSpec("cpu")) == expected


def test_parse_dtype_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        parse_dtype("int8", DeviceSpec("cpu"))

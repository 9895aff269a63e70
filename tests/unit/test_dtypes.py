"""What --dtype names, and what auto means per device (fake backends, no accelerator)."""

from __future__ import annotations

import pytest
import torch

from engine.dtypes import choose_weights, cpu_bf16_reason, default_dtype, parse_dtype
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


def _cpu_with(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)


def test_default_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu_with(monkeypatch, amx=False, avx512_bf16=False)
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


def test_cpu_auto_is_bf16_only_with_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = DeviceSpec("cpu")
    for amx, avx512_bf16, reason in (
        (True, True, "AMX and AVX512-BF16"),
        (False, True, "AVX512-BF16"),
        (True, False, "AMX"),
    ):
        _cpu_with(monkeypatch, amx, avx512_bf16)
        assert cpu_bf16_reason() == reason
        assert default_dtype(cpu) == torch.bfloat16
        chosen = choose_weights("auto", cpu, gguf=False)
        assert (chosen.dtype, chosen.packed_gguf, chosen.bf16_weights) == (
            torch.float32,
            False,
            True,
        )
        assert reason in chosen.reason and "bf16 weights, float32 activations" in chosen.reason
    _cpu_with(monkeypatch, False, False)
    assert cpu_bf16_reason() is None
    chosen = choose_weights("auto", cpu, gguf=False)
    assert chosen.dtype == torch.float32 and "without AMX or AVX512-BF16" in chosen.reason
    assert not chosen.bf16_weights


def test_cpu_auto_keeps_a_gguf_packed_and_explicit_dtypes_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = DeviceSpec("cpu")
    _cpu_with(monkeypatch, amx=True, avx512_bf16=True)
    packed = choose_weights("auto", cpu, gguf=True)
    assert (packed.dtype, packed.packed_gguf) == (torch.float32, True)
    # Tensor parallel shards dense weights: no packing, bf16 on every rank alike.
    sharded = choose_weights("auto", cpu, gguf=True, tp_size=2)
    assert (sharded.dtype, sharded.packed_gguf) == (torch.bfloat16, False)
    assert sharded.dtype == parse_dtype("auto", cpu)  # what a TP worker picks
    explicit = choose_weights("float32", cpu, gguf=True)
    assert (explicit.dtype, explicit.packed_gguf, explicit.bf16_weights) == (
        torch.float32,
        False,
        False,
    )
    assert explicit.reason == "--dtype float32"
    bf16 = choose_weights("bf16", cpu, gguf=True)
    assert (bf16.dtype, bf16.packed_gguf, bf16.bf16_weights) == (torch.float32, False, True)
    gpu_bf16 = choose_weights("bf16", DeviceSpec("npu", 0), gguf=True)
    assert (gpu_bf16.dtype, gpu_bf16.bf16_weights) == (torch.bfloat16, False)

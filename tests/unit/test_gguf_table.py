"""``engine/models/gguf_table.py`` against ``gguf.GGUFReader``: the same architecture,
tensor names, types, dimensions and data offsets, and the same bytes for every
block-quantized tensor, on the default model's GGUF and on files holding every kind of
metadata value and a custom alignment."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.layers.linear import FusedLinear
from engine.loader import default_gguf_path, load_model, resolve_model_path
from engine.models.gguf_table import GGUFTensor, read_blocks, read_table

Q = gguf.GGMLQuantizationType


def assert_matches_reader(path: Path) -> None:
    table = read_table(path)
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    assert table.architecture == arch
    assert list(table.tensors) == [t.name for t in reader.tensors]
    with open(path, "rb") as fh:
        for expected in reader.tensors:
            got = table.tensors[expected.name]
            assert got.qtype == int(expected.tensor_type), expected.name
            assert got.dims == tuple(int(d) for d in expected.shape), expected.name
            assert got.offset == expected.data_offset, expected.name
            block, size = gguf.GGML_QUANT_SIZES[expected.tensor_type]
            if block > 1:  # block-quantized: the bytes, in the reader's shape
                data = read_blocks(fh, got, block, size)
                assert data.dtype == np.uint8
                assert np.array_equal(data, np.asarray(expected.data)), expected.name


def test_default_model_gguf() -> None:
    assert_matches_reader(default_gguf_path())


def _write(path: Path, alignment: int | None) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700)
    writer.add_uint32("t.u32", 70000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strings", ["a", "", "ünïcode", "x" * 300])
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("dense.weight", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("half.bias", rng.standard_normal(7).astype(np.float16))
    for name, kind, rows, cols in (
        ("q8.weight", Q.Q8_0, 4, 64),
        ("q4k.weight", Q.Q4_K, 3, 512),
        ("q6k.weight", Q.Q6_K, 2, 256),
        ("q4_1.weight", Q.Q4_1, 5, 32),
    ):
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    experts = rng.integers(0, 256, (2, 3, 34), dtype=np.uint8)  # [experts, rows, row bytes]
    writer.add_tensor("experts.weight", experts, raw_shape=experts.shape, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_every_metadata_kind_and_alignment(alignment: int | None, tmp_path: Path) -> None:
    path = _write(tmp_path / "kinds.gguf", alignment)
    assert_matches_reader(path)
    assert read_table(path).tensors["experts.weight"].dims == (32, 3, 2)


def test_the_values_asked_for(tmp_path: Path) -> None:
    path = _write(tmp_path / "kinds.gguf", None)
    scalars = ["t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.f32", "t.u64", "t.i64"]
    keys = [*scalars, "t.f64", "t.bool", "t.str", "t.strings", "t.ints", "no.such.key"]
    metadata = read_table(path, keys=keys).metadata
    fields = gguf.GGUFReader(str(path)).fields
    for key in scalars:
        assert metadata[key] == fields[key].parts[fields[key].data[0]][0], key
    assert (metadata["t.f64"], metadata["t.bool"], metadata["t.str"]) == (0.25, True, "héllo")
    # Arrays are passed over, never kept; the architecture is always read.
    assert "t.strings" not in metadata and "t.ints" not in metadata
    assert "no.such.key" not in metadata
    assert metadata["general.architecture"] == "llama"
    assert "t.str" not in read_table(path).metadata


def test_not_a_gguf_and_truncated_data(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_table(junk)
    path = _write(tmp_path / "whole.gguf", None)
    tensor = read_table(path).tensors["q4k.weight"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: tensor.offset + 10])
    with open(cut, "rb") as fh, pytest.raises(ValueError, match="ends inside"):
        read_blocks(fh, tensor, 256, 144)
    with open(path, "rb") as fh, pytest.raises(ValueError, match="whole blocks"):
        read_blocks(fh, GGUFTensor("odd", int(Q.Q8_0), (33, 2), tensor.offset), 32, 34)


def test_loading_packed_weights_never_parses_the_whole_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The packed load reads the tensor table only: ``GGUFReader`` (the whole header, the
    vocabulary included: ~150 MiB while it lives, 10-20 MiB of it for good) is not used."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("GGUFReader used while loading packed weights")

    monkeypatch.setattr(gguf, "GGUFReader", refused)
    packed_dir = resolve_model_path("default", packed=True)  # what the server loads
    model = load_model(
        packed_dir, torch.device("cpu"), torch.float32, gguf_path=default_gguf_path()
    )
    packed = [m for m in model.modules() if isinstance(m, FusedLinear) and m.packed is not None]
    assert packed

"""A GGUF file's tensor table and its tensors' bytes, read without ``gguf.GGUFReader``.

Loading packed weights needs, of the whole header, the architecture and where each
tensor is. ``GGUFReader`` parses every metadata value into numpy views of a memory map:
with a 49152-token vocabulary (the tokenizer's tokens and merges live in the header)
that is about 245,000 small arrays, 150 MiB while the reader lives, 2.6 s, and
10-20 MiB of Python's object arenas that the server never gets back (their pages stay
pinned by objects made meanwhile). Here the header is walked with ``struct`` over a map
that is closed at once, skipping the values nothing reads; a tensor's bytes are read
from the file into memory of their own. ``tests/unit/test_gguf_table.py`` checks every
field against ``GGUFReader`` on the default model's GGUF and on written files.

The format (GGUF v2 and v3, little-endian): magic, version, tensor count, metadata
count; the metadata as (key, type, value); each tensor as (name, dimensions with the
innermost first, ggml type, offset); then the data, aligned to ``general.alignment``
(32 unless set), each tensor's offset counted from its start.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

_MAGIC = 0x46554747  # b"GGUF", little-endian
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Metadata value types: struct formats of the fixed-size ones.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9
# The metadata values always kept; every other one is skipped unless asked for.
_KEPT = ("general.architecture", "general.alignment")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table. ``dims`` in GGUF's order (``dims[0]``: the innermost, a
    weight's columns); ``offset``: where its data starts in the file."""

    name: str
    qtype: int
    dims: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class GGUFTable:
    architecture: str | None
    tensors: dict[str, GGUFTensor]
    # The scalar and string values of the keys read (``_KEPT`` and the ones asked for).
    metadata: dict[str, object]


class _Header:
    """A cursor over the header bytes."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[int, ...]:
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start = self.pos
        self.pos += length
        return self.data[start : self.pos].decode("utf-8")

    def skip_string(self) -> None:
        (length,) = self.unpack("<Q")
        self.pos += length

    def value(self, vtype: int, keep: bool) -> object:
        """The value of type ``vtype`` at the cursor (None when not ``keep``), passed over."""
        if vtype == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if vtype == _ARRAY:
            itype, count = self.unpack("<IQ")
            if itype in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[itype]) * count
            else:
                for _ in range(count):
                    self.value(itype, keep=False)
            return None
        if vtype not in _SCALARS:
            raise ValueError(f"GGUF metadata value of unknown type {vtype}")
        (scalar,) = self.unpack(_SCALARS[vtype])
        return scalar if keep else None


def read_table(path: str | os.PathLike[str], keys: Collection[str] = ()) -> GGUFTable:
    """The architecture and tensor table of the GGUF file at ``path``, with the values of
    the metadata ``keys`` that are scalars or strings (arrays are never kept)."""
    wanted = frozenset(_KEPT).union(keys)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(data)
        magic, version = header.unpack("<II")
        if magic != _MAGIC:
            raise ValueError(f"{os.fspath(path)!r} is not a GGUF file")
        if version not in _VERSIONS:
            raise ValueError(
                f"{os.fspath(path)!r}: GGUF version {version} (a big-endian file, or one this "
                f"reader does not know; it reads versions {_VERSIONS} little-endian)"
            )
        tensor_count, kv_count = header.unpack("<QQ")
        kept: dict[str, object] = {}
        for _ in range(kv_count):
            key = header.string()
            (vtype,) = header.unpack("<I")
            value = header.value(vtype, keep=key in wanted)
            if value is not None:
                kept[key] = value
        entries = []
        for _ in range(tensor_count):
            name = header.string()
            (n_dims,) = header.unpack("<I")
            dims = header.unpack(f"<{n_dims}Q")
            qtype, offset = header.unpack("<IQ")
            entries.append((name, qtype, tuple(dims), offset))
        alignment = kept.get("general.alignment") or _DEFAULT_ALIGNMENT
        assert isinstance(alignment, int)
        start = -(-header.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, qtype, dims, offset in entries:
        if name in tensors:
            raise ValueError(f"{os.fspath(path)!r}: tensor {name!r} appears twice")
        tensors[name] = GGUFTensor(name, qtype, dims, start + offset)
    architecture = kept.get("general.architecture")
    return GGUFTable(architecture if isinstance(architecture, str) else None, tensors, kept)


def read_blocks(
    fh: io.BufferedIOBase, tensor: GGUFTensor, block: int, type_size: int
) -> np.ndarray:
    """The bytes of a block-quantized ``tensor`` (``block`` weights in ``type_size``
    bytes), read from the open file ``fh``: uint8 ``[..., rows, row_bytes]``, the shape
    ``GGUFReader`` gives it."""
    if tensor.dims[0] % block:
        raise ValueError(f"{tensor.name}: {tensor.dims[0]} columns are not whole blocks")
    shape = (*reversed(tensor.dims[1:]), tensor.dims[0] // block * type_size)
    out = np.empty(shape, dtype=np.uint8)
    fh.seek(tensor.offset)
    if fh.readinto(out.data.cast("B")) != out.nbytes:
        raise ValueError(f"{tensor.name}: the file ends inside its data")
    return out

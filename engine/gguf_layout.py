"""Reading a directory that engine/gguf_convert.py wrote, and the GGUF tensors it points at.

The conversion writes config, tokenizer and dense float32 shards with an index. Its
packed layout (for the CPU path that keeps GGUF blocks packed, engine/models/gguf_packed.py)
leaves the packable tensors out: ``HEADS_FILE`` holds only the first ``HEAD_COLS``
columns of each, in transformers' row order, and its metadata names each one's GGUF
tensor. Here are what a load needs of that: which layout a directory has, its heads and
names, and the dense weights, with any packable tensor the model does not pack
dequantized from the GGUF file. The dequantize itself (transformers' per-family tensor
processor, which undoes llama.cpp's q/k row permutation) is shared with the conversion.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model_files import ModelPathError, safetensors_files
from engine.models.gguf_table import read_blocks, read_table

HEADS_FILE = "gguf_packed_heads.safetensors"
# Columns kept of a packed tensor's first block (enough to tell its rows' order apart).
HEAD_COLS = 8
INDEX_FILE = "model.safetensors.index.json"


def is_packed_layout(model_dir: Path) -> bool:
    """Whether ``model_dir`` was converted with ``packed=True`` (needs its GGUF to load)."""
    return (Path(model_dir) / HEADS_FILE).is_file()


def packed_heads(model_dir: Path) -> dict[str, torch.Tensor]:
    """A packed layout's packable tensors, HF name -> the first ``HEAD_COLS`` columns."""
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / HEADS_FILE))


def packed_gguf_names(model_dir: Path) -> dict[str, str]:
    """A packed layout's packable tensors, HF name -> GGUF tensor name."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / HEADS_FILE), framework="pt", device="cpu") as fh:
        names = dict(fh.metadata() or {})
    names.pop("format", None)
    return names


def dense_from_gguf(
    gguf_path: Path, wanted: dict[str, str], config: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for each ``hf_name -> GGUF tensor name`` in
    ``wanted``, dequantized and put in transformers' row order (``config``: the model's
    HF config as a dict)."""
    import gguf

    if not wanted:
        return
    processor = gguf_processor(gguf_path, config)
    # NOTE: the table and each tensor's bytes, not gguf.GGUFReader, which parses the
    # whole header (the vocabulary's 245,000 values: 3.9 s for the default model).
    table = read_table(gguf_path)
    with open(gguf_path, "rb") as fh:
        for hf_name, gguf_name in wanted.items():
            entry = table.tensors[gguf_name]
            qtype = gguf.GGMLQuantizationType(entry.qtype)
            data = read_blocks(fh, entry, *gguf.GGML_QUANT_SIZES[qtype])
            yield hf_name, dequantized(processor, gguf_name, qtype, data)


def dense_weights(
    model_dir: Path, gguf_path: Path | None, skip: Container[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for every weight of a converted directory but those
    in ``skip`` (never read); a packed layout's packable tensors, which it holds only as
    first columns, are dequantized from ``gguf_path``."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name not in skip:
                    yield name, fh.get_tensor(name)
    if not is_packed_layout(model_dir):
        return
    if gguf_path is None:
        raise ModelPathError(
            f"{model_dir} was converted for packed GGUF weights; load it with its GGUF file"
        )
    names = {n: g for n, g in packed_gguf_names(model_dir).items() if n not in skip}
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    yield from dense_from_gguf(gguf_path, names, config)


def gguf_processor(gguf_path: Path, config: Mapping[str, Any]) -> Any:
    """The family's tensor processor, given the model's HF ``config`` as a dict.

    NOTE: transformers builds it from the config its GGUF reader parses; the fields a
    one-tensor processor reads (Llama's ``num_attention_heads`` and
    ``num_key_value_heads``) are the same ones the HF config holds, which is already at
    hand. Parsing the header again took 3.9 s for the default model.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = read_table(gguf_path).architecture or ""
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=dict(config))


def dequantized(processor: Any, name: str, qtype: Any, data: np.ndarray) -> torch.Tensor:
    """``data`` (all of GGUF tensor ``name``'s bytes, of ggml type ``qtype``, or its first
    block column) as float32, in transformers' row order."""
    import gguf

    weights = gguf.quants.dequantize(data, qtype)
    weights = processor.process(weights=weights, name=name).weights
    # F32 tensors dequantize to a read-only view of the file's map: copy those only.
    return torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))

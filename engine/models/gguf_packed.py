"""GGUF weights kept packed on the CPU: which tensors, in what row order, and loading them.

The converted directory (written by engine/gguf_convert.py, read through
engine/gguf_layout.py) still supplies the config, the tokenizer and every tensor that
stays dense (norms, biases, unsupported types). The weights of the linear layers, and the
embedding table, whose GGUF type the packed kernel takes (``quant_cpu.PACKED_TYPES``)
come from the GGUF file itself as blocks: the model never holds a float32 copy of them.

Row order: llama.cpp's converter permutes the rows of some tensors (Llama's q and k, for
its RoPE layout) and transformers undoes that when it reads the file. Rather than a list
of which families need what, each tensor's first block column is dequantized and compared
with the converted (dense) tensor: as stored, or with the per-head q/k un-permutation. A
tensor that matches neither stays dense, with a warning.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine import gguf_layout
from engine.layers.linear import ALL_SHARDS, FusedLinear
from engine.layers.quant_cpu import (
    BF16,
    ENV_SWITCH,
    PACKED_TYPES,
    QuantTensor,
    quant_kernel,
    type_name,
)
from engine.models.gguf_table import read_blocks, read_table

logger = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens"


@dataclass
class PackedPlan:
    """HF tensor name -> its GGUF blocks, for every weight kept packed."""

    tensors: dict[str, QuantTensor] = field(default_factory=dict)
    # HF name -> GGUF type name, for the weights of packable layers left dense.
    dequantized: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.data.numel() for t in self.tensors.values())


def packing_enabled() -> bool:
    """``HISERVE_GGUF_PACKED`` is not 0 (the default: packed)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    # llama.cpp stores each head's rows interleaved in pairs; this order undoes it.
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def _row_order(blocks: np.ndarray, qtype: int, dense_head: np.ndarray, hf_config: Any) -> Any:
    """The row order (None: as stored) in which ``blocks`` equal the converted tensor,
    whose first block column is ``dense_head``; False when no known order does."""
    import gguf

    size = PACKED_TYPES[qtype][2]
    first = gguf.quants.dequantize(
        np.ascontiguousarray(blocks[:, :size]), gguf.GGMLQuantizationType(qtype)
    )
    first = first[:, : dense_head.shape[1]]  # a packed layout keeps only a few columns
    if np.allclose(first, dense_head, rtol=1e-6, atol=1e-7):
        return None
    rows = blocks.shape[0]
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = int(getattr(hf_config, key, 0) or 0)
        if heads and rows % (2 * heads) == 0:
            order = _unpermute_rows(rows, heads)
            if np.allclose(first[order], dense_head, rtol=1e-6, atol=1e-7):
                return order
    return False


def _packable_target(model: nn.Module, hf_name: str) -> tuple[str, Any] | None:
    """``(module path, shard)`` when ``hf_name`` is a weight the model can take packed."""
    target = model.map_name(hf_name)  # type: ignore[operator]
    if target is None:
        return None
    param_name, shard = target
    if param_name == EMBEDDING and hasattr(model, "use_packed_embedding"):
        return EMBEDDING, 0
    module_name, _, kind = param_name.rpartition(".")
    if kind != "weight":
        return None
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return (module_name, shard) if isinstance(module, FusedLinear) else None


def plan_packed(gguf_path: Path, model_dir: Path, model: nn.Module) -> PackedPlan:
    """Which of ``model``'s weights load packed from ``gguf_path`` (the GGUF that
    ``model_dir`` was converted from); ``model`` may still be on the meta device.

    The file's tensor table is read with ``gguf_table`` (not ``gguf.GGUFReader``, which
    parses the tokenizer's vocabulary too) and each packed tensor's blocks straight from
    the file into their own memory."""
    import gguf

    table = read_table(gguf_path)
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(table.architecture or "")
    hf_config: Any = model.config
    if arch is None:
        return PackedPlan()
    name_map = gguf.get_tensor_name_map(arch, int(hf_config.num_hidden_layers))
    plan = PackedPlan()
    # module path -> shard -> HF name, to keep only layers whose every shard is packed.
    shards: dict[str, dict[Any, str]] = collections.defaultdict(dict)
    with open(gguf_path, "rb") as fh:
        for hf_name, head in _first_block_columns(model_dir):
            base, _, suffix = hf_name.rpartition(".")
            gguf_name = name_map.get_name(base)
            tensor = table.tensors.get(f"{gguf_name}.{suffix}") if gguf_name else None
            target = _packable_target(model, hf_name) if tensor is not None else None
            if tensor is None or target is None:
                continue
            qtype = tensor.qtype
            if qtype not in PACKED_TYPES or qtype == BF16:
                if qtype not in (0, 1, BF16):  # F32, F16, BF16: dense anyway
                    plan.dequantized[hf_name] = _ggml_type_name(qtype)
                continue
            _, block, size = PACKED_TYPES[qtype]
            blocks = read_blocks(fh, tensor, block, size)
            order = _row_order(blocks, qtype, head(block), hf_config)
            if order is False:
                logger.warning("%s: GGUF rows match no known order; kept dense", hf_name)
                plan.dequantized[hf_name] = _ggml_type_name(qtype)
                continue
            data = blocks[order] if order is not None else blocks
            plan.tensors[hf_name] = QuantTensor(qtype, torch.from_numpy(data), tensor.dims[0])
            shards[target[0]][target[1]] = hf_name
    for module_name, got in shards.items():
        if module_name == EMBEDDING:
            continue
        module = model.get_submodule(module_name)
        assert isinstance(module, FusedLinear)
        if ALL_SHARDS in got or set(got) == set(module.shard_keys("weight")):
            continue
        for hf_name in got.values():  # a layer with a dense shard stays dense as a whole
            qt = plan.tensors.pop(hf_name)
            plan.dequantized[hf_name] = type_name(qt.qtype)
    return plan


def _ggml_type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"ggml type {qtype}"


def prepare(model: nn.Module, plan: PackedPlan) -> None:
    """Swap the dense weights that ``plan`` packs for placeholders (before allocation)."""
    modules = set()
    for hf_name in plan.tensors:
        target = _packable_target(model, hf_name)
        assert target is not None
        modules.add(target[0])
    for module_name in sorted(modules):
        if module_name == EMBEDDING:
            model.use_packed_embedding()  # type: ignore[operator]
        else:
            layer = model.get_submodule(module_name)
            assert isinstance(layer, FusedLinear)
            layer.use_packed()


def iter_weights(model_dir: Path, plan: PackedPlan, gguf_path: Path) -> Iterator[tuple[str, Any]]:
    """``(hf_name, tensor)`` of the converted directory, with the planned weights as
    ``QuantTensor`` (their dense copy is never read). In a packed layout
    (``gguf_layout``) a weight left out of the plan is dequantized from the GGUF."""
    yield from gguf_layout.dense_weights(model_dir, gguf_path, skip=plan.tensors)
    yield from plan.tensors.items()


def _first_block_columns(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """``(hf_name, head)`` for every weight of ``model_dir``: ``head(n)`` is its first
    ``n`` columns as converted (read from the dense tensor, or a packed layout's heads)."""
    from safetensors import safe_open

    from engine.model_files import safetensors_files

    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                view = fh.get_slice(name)
                yield name, lambda n, view=view: view[:, :n].numpy()
    if gguf_layout.is_packed_layout(model_dir):
        for name, tensor in gguf_layout.packed_heads(model_dir).items():
            yield name, lambda n, tensor=tensor: tensor[:, :n].numpy()


def finish(model: nn.Module, plan: PackedPlan) -> None:
    """After loading: check and merge every packed weight, give a tied model its packed
    LM head, and log what is packed and what was dequantized."""
    for module in model.modules():
        if isinstance(module, FusedLinear) and module.packed is not None:
            module.packed.finish()
    embedding = getattr(model, "packed_embedding", None)
    if embedding is not None:
        embedding.finish()
        if getattr(model, "lm_head", False) is None:
            model.lm_head = model.tied_head()  # type: ignore[operator]
    counts = collections.Counter(type_name(t.qtype) for t in plan.tensors.values())
    logger.info(
        "GGUF weights kept packed: %d tensors (%s), %.1f MB",
        len(plan.tensors),
        ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())),
        plan.nbytes / 1e6,
    )
    if plan.dequantized:
        left = collections.Counter(plan.dequantized.values())
        logger.info(
            "GGUF weights dequantized at load (not supported packed): %s",
            ", ".join(f"{name} x{n}" for name, n in sorted(left.items())),
        )


def packed_source(gguf_path: Path | None, device: torch.device, sharded: bool) -> Path | None:
    """``gguf_path`` when its weights can be kept packed here, else None (with the reason
    logged when there was a GGUF to pack)."""
    if gguf_path is None:
        return None
    if device.type != "cpu" or sharded or not packing_enabled():
        return None
    if quant_kernel() is None:
        logger.warning("the packed-weight kernel is unavailable: GGUF weights are dequantized")
        return None
    return gguf_path

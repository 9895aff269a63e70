"""Valid random GGUF blocks of a given ggml type, for kernel and loader tests."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from engine.layers.quant_cpu import PACKED_TYPES

# Offsets of the float16 scale fields in each K-quant block (random bytes elsewhere).
_K_SCALE_FIELDS = {12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 of valid ``qtype`` blocks: normal weights quantized by
    ``gguf.quants.quantize`` where gguf-py can, else (the K-quants) random bytes with
    float16 scales in [0.001, 0.05]."""
    rng = np.random.default_rng(seed)
    if qtype not in _K_SCALE_FIELDS:
        weights = rng.standard_normal((rows, cols), dtype=np.float32)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType(qtype))
    _, block, size = PACKED_TYPES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_FIELDS[qtype]:
        scale = rng.uniform(0.001, 0.05, (rows, cols // block)).astype(np.float16)
        data[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def placed(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """``blocks`` as a uint8 tensor whose data starts ``offset`` bytes past a 64-byte line
    (on AMX, bf16 weights on a line are read in place, elsewhere copied into the tiles)."""
    flat = torch.zeros(blocks.size + 64, dtype=torch.uint8)
    start = (-flat.data_ptr()) % 64 + offset
    weight = flat[start : start + blocks.size].view(blocks.shape[0], -1)
    weight.copy_(torch.from_numpy(blocks))
    assert weight.data_ptr() % 64 == offset
    return weight

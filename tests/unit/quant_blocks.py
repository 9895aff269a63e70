"""Valid random GGUF blocks of a given ggml type, for kernel and loader tests."""

from __future__ import annotations

import gguf
import numpy as np

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

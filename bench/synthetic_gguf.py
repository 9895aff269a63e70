"""A synthetic Llama GGUF in Q4_K: random weights, real tokenizer, for load and memory tests.

Every 2D weight (the linear layers and the token embedding, which the LM head shares) is
Q4_K, built directly as blocks: 144 bytes per 256 weights (float16 ``d`` and ``dmin``, 12
bytes of 6-bit scales and mins, 128 bytes of 4-bit values), with ``d`` and ``dmin`` small
and finite, so every weight is finite and about 0.02 in size. Norms are float32 ones. The
tokenizer metadata (``tokenizer.*``: vocabulary, merges, chat template) is copied from the
default model's GGUF, so the engine tokenizes and the vocabulary sets the embedding rows.

The file is written tensor by tensor (the writer holds only the tensor list), so memory
stays at one tensor's blocks, whatever the shape.

    python -m bench.synthetic_gguf --out DIR [--shape 3b|tiny] [--seed 0]

``3b``: Llama-3.2-3B-like (hidden 3072, 28 layers, 24 heads, 8 KV heads, intermediate
8192), about 1.7 GB. ``tiny``: 2 layers of hidden 256, a few MB, for tests.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q4_K = gguf.GGMLQuantizationType.Q4_K
Q4_K_BLOCK = 256  # weights per block
Q4_K_BYTES = 144  # bytes per block


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, context=2048),
}


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols / 256 * 144]`` uint8: random Q4_K blocks whose weights are finite.

    A weight is ``d * scale * q - dmin * min`` (scale, min: 6 bits; q: 4 bits), so with
    ``d`` about 1.5e-4 and ``dmin`` 7.5 times that the weights are centred near 0 with a
    spread of about 0.02 (1/sqrt(hidden) for hidden 3072).
    """
    if cols % Q4_K_BLOCK:
        raise ValueError(f"Q4_K needs columns in multiples of {Q4_K_BLOCK}, got {cols}")
    nblocks = cols // Q4_K_BLOCK
    blocks = rng.integers(0, 256, (rows, nblocks, Q4_K_BYTES), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-4, (rows, nblocks)).astype(np.float16)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(rows, nblocks, 2)
    blocks[:, :, 2:4] = dmin.view(np.uint8).reshape(rows, nblocks, 2)
    return blocks.reshape(rows, nblocks * Q4_K_BYTES)


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(GGUF name, (rows, cols) or (n,), is Q4_K)`` of every tensor, in file order.
    The embedding is tied (no ``output.weight``), as in Llama-3.2-3B."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (vocab, h), True)]
    for i in range(shape.layers):
        blk = f"blk.{i}"
        plan += [
            (f"{blk}.attn_norm.weight", (h,), False),
            (f"{blk}.attn_q.weight", (h, h), True),
            (f"{blk}.attn_k.weight", (kv, h), True),
            (f"{blk}.attn_v.weight", (kv, h), True),
            (f"{blk}.attn_output.weight", (h, h), True),
            (f"{blk}.ffn_norm.weight", (h,), False),
            (f"{blk}.ffn_gate.weight", (shape.intermediate, h), True),
            (f"{blk}.ffn_up.weight", (shape.intermediate, h), True),
            (f"{blk}.ffn_down.weight", (h, shape.intermediate), True),
        ]
    plan.append(("output_norm.weight", (h,), False))
    return plan


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every ``tokenizer.*`` key of ``source``; returns the vocabulary size."""
    reader = gguf.GGUFReader(str(source))
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(field.data)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab


def write_synthetic_gguf(
    path: Path, shape: Shape, tokenizer_gguf: Path, seed: int = 0, name: str = "synthetic"
) -> Path:
    """Write the synthetic model to ``path`` and return it."""
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(name)
    vocab = copy_tokenizer(writer, tokenizer_gguf)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_S)  # every weight Q4_K
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = tensor_plan(shape, vocab)
    for tensor_name, dims, quant in plan:
        if quant:
            rows, cols = dims
            nbytes = rows * cols // Q4_K_BLOCK * Q4_K_BYTES
            byte_shape = (rows, cols // Q4_K_BLOCK * Q4_K_BYTES)
            writer.add_tensor_info(tensor_name, byte_shape, np.dtype(np.uint8), nbytes, Q4_K)
        else:
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), dims[0] * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_tensor_name, dims, quant) in enumerate(plan):
        if quant:
            rng = np.random.default_rng([seed, index])
            data = q4_k_blocks(dims[0], dims[1], rng)
            check_q4_k(data[:4], dims[1])
        else:
            data = np.ones(dims, dtype=np.float32)
        writer.write_tensor_data(data)
    writer.close()
    return path


def check_q4_k(blocks: np.ndarray, cols: int) -> None:
    """``gguf.quants`` dequantizes ``blocks`` to finite weights of the expected shape."""
    weights = gguf.quants.dequantize(np.ascontiguousarray(blocks), Q4_K)
    if weights.shape != (blocks.shape[0], cols) or not np.isfinite(weights).all():
        raise AssertionError(f"Q4_K blocks dequantize to {weights.shape}, or not finite")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-gguf",
        type=Path,
        default=None,
        help="GGUF to copy the tokenizer from (default: the default model's)",
    )
    args = parser.parse_args(argv)
    tokenizer_gguf = args.tokenizer_gguf
    if tokenizer_gguf is None:
        from engine.loader import default_gguf_path

        tokenizer_gguf = default_gguf_path()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"synthetic-llama-{args.shape}.Q4_K.gguf"
    start = time.perf_counter()
    write_synthetic_gguf(path, SHAPES[args.shape], tokenizer_gguf, args.seed)
    seconds = time.perf_counter() - start
    print(f"{path}: {path.stat().st_size / 1e9:.3f} GB in {seconds:.1f} s")


if __name__ == "__main__":
    main()

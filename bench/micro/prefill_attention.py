"""Prefill / extend attention on the CPU: the native kernel against SDPA per sequence.

    python -m bench.micro.prefill_attention [--model default] [--batches 32x128 1x2048 8x256+512]

Each batch is ``<sequences>x<new tokens>[+<cached prefix>]`` at the model's head shapes.
For each: milliseconds of one layer's extend attention through the torch backend (SDPA
per sequence, the prefix gathered from the pool) and through the native backend (one
prefill_attention call), alternated, best of several rounds, and the largest difference
between the two.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers import cpu_kernels
from engine.layers.attention import CpuNativeAttentionBackend, TorchAttentionBackend
from engine.layers.attention_meta import AttentionMetadata
from engine.loader import load_hf_config, resolve_model_path
from engine.models.llama import head_dim_of


def parse_batch(text: str) -> tuple[int, int, int]:
    """``32x128`` or ``8x256+512`` -> (sequences, new tokens, prefix)."""
    shape, _, prefix = text.partition("+")
    seqs, _, tokens = shape.partition("x")
    return int(seqs), int(tokens), int(prefix or 0)


def extend_case(
    seqs: int,
    tokens: int,
    prefix: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
) -> tuple[DeviceKVPool, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer pool holding each sequence's prefix and new tokens at scattered slots."""
    length = prefix + tokens
    pool = DeviceKVPool(1, seqs * length + 1, kv_heads, head_dim, kv_dtype, "cpu")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    table = torch.zeros(seqs, length, dtype=torch.int32)
    table.copy_((torch.randperm(seqs * length) + 1).view(seqs, length).int())
    new = table[:, prefix:].reshape(-1).long()
    meta = AttentionMetadata(
        is_decode=False,
        out_slots=new,
        req_rows=torch.arange(seqs),
        seq_lens=torch.full((seqs,), length),
        req_table=table,
        prefix_lens_list=[prefix] * seqs,
        extend_lens_list=[tokens] * seqs,
        seq_lens_list=[length] * seqs,
        max_seq_len=length,
        req_rows_list=list(range(seqs)),
    )
    fused = torch.randn(seqs * tokens, (heads + 2 * kv_heads) * head_dim)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q = fused[:, :q_end].view(-1, heads, head_dim)
    k = fused[:, q_end:k_end].view(-1, kv_heads, head_dim)
    v = fused[:, k_end:].view(-1, kv_heads, head_dim)
    pool.write(0, new, k, v)  # as the layer stores them before attending
    return pool, meta, q, k, v


def best_ms(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Best milliseconds per call of each of ``fns``, taken in turns."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", nargs="+", default=["32x128", "4x512", "1x2048", "8x256+512"])
    parser.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    kernel = cpu_kernels.paged_decode_kernel()
    if kernel is None:
        raise SystemExit(f"the native kernel could not be built: {cpu_kernels.build_error()}")
    config = load_hf_config(resolve_model_path(args.model))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = head_dim_of(config)
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    if not kernel.prefill_takes(head_dim):
        raise SystemExit(f"the native prefill kernel does not take head_dim {head_dim} here")
    torch_backend, native = TorchAttentionBackend(), CpuNativeAttentionBackend(kernel)
    print(f"heads {heads}, kv heads {kv_heads}, head_dim {head_dim}, KV {args.kv_cache_dtype}, "
          f"{torch.get_num_threads()} threads; one layer, best of {args.rounds}")  # fmt: skip
    print(f"{'batch':>12} {'SDPA ms':>9} {'native ms':>10} {'ratio':>6} {'max diff':>9}")
    for text in args.batches:
        seqs, tokens, prefix = parse_batch(text)
        case = extend_case(seqs, tokens, prefix, heads, kv_heads, head_dim, kv_dtype)
        ref, nat, diff = compare(torch_backend, native, case, args.rounds)
        print(f"{text:>12} {ref:9.2f} {nat:10.2f} {ref / nat:6.2f} {diff:9.2e}")


def compare(
    torch_backend: TorchAttentionBackend,
    native: CpuNativeAttentionBackend,
    case: tuple[DeviceKVPool, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor],
    rounds: int,
) -> tuple[float, float, float]:
    """Best ms of SDPA per sequence and of the native call, and their largest difference."""
    pool, meta, q, k, v = case
    ref, nat = best_ms(
        [
            lambda: torch_backend._extend(q, k, v, 0, meta, pool),
            lambda: native._extend(q, k, v, 0, meta, pool),
        ],
        rounds,
    )
    diff = torch_backend._extend(q, k, v, 0, meta, pool) - native._extend(q, k, v, 0, meta, pool)
    return ref, nat, float(diff.abs().max())


if __name__ == "__main__":
    main()

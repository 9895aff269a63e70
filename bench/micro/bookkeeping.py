"""Host cost of one decode step's KV bookkeeping against the batch size.

    python -m bench.micro.bookkeeping [--batches 1 8 32 64 128] [--steps 200] [--device cpu]
                                      [--threads N]

For each batch it admits that many requests and times, per decode step, what the host
does before the forward: the slots of every request's next token (``alloc_decode``, one
batch of tensor operations), the request-table upload (``ReqTable.flush``) and the graph
input fill (``DecodeGraphRunner._copy_in``). The same steps with one ``alloc(req, 1)`` per
request (the path decode took before issue 28, and prefill chunks still take) are timed
beside it. On the CPU the "device" request table is a second CPU tensor, so the flush
runs the accelerator path (stage, copy, scatter); ``--device cuda`` uses the real one.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

import torch

from engine.graph_runner import DecodeGraphRunner
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.req_table import ReqTable
from engine.request import Req, SamplingParams

PAGE = 16


def _fake_model(device: torch.device) -> Any:
    """Just enough of a model for DecodeGraphRunner's constructor (its input buffers)."""
    embed = torch.zeros(8, 4, device=device)
    return SimpleNamespace(
        model=SimpleNamespace(embed_tokens=embed),
        compute_logits=lambda hidden: torch.zeros(hidden.shape[0], 8, device=device),
        modules=lambda: [],
    )


def _setup(batch: int, steps: int, device: torch.device) -> tuple[KVCacheManager, list[Req]]:
    max_context = 64 + steps + PAGE
    allocator = PageAllocator(batch * (max_context // PAGE + 1), PAGE)
    table = ReqTable(batch, max_context, device)
    if device.type == "cpu":  # the accelerator path: a second table the flush uploads to
        table.on_device, table.table = True, table.cpu.clone()
    manager = KVCacheManager(allocator, table, RadixCache(allocator, enabled=False))
    reqs = []
    for i in range(batch):
        prompt_len = 17 + (i * 7) % 40  # varied, so rows open pages at different steps
        req = Req(f"r{i}", list(range(prompt_len + 1)), SamplingParams())
        manager.admit(req)
        manager.alloc(req, prompt_len)
        reqs.append(req)
    table.flush()
    return manager, reqs


def _time_steps(batch: int, steps: int, device: torch.device, batched: bool) -> float:
    """Mean host seconds of one decode step's bookkeeping."""
    manager, reqs = _setup(batch, steps, device)
    pool: Any = None  # the fill never touches the KV pool
    graphs = DecodeGraphRunner(_fake_model(device), pool, manager.req_table, device, batch)
    bucket = graphs.batch_buckets[-1]
    rows = [r.row for r in reqs]
    started = time.perf_counter()
    for _ in range(steps):
        if batched:
            slots = manager.alloc_decode(reqs)
        else:
            slots = torch.cat([manager.alloc(req, 1) for req in reqs])
        manager.req_table.flush()
        positions = [r.kv_len - 1 for r in reqs]
        seq_lens = [r.kv_len for r in reqs]
        graphs._copy_in(bucket, positions, positions, slots, rows, seq_lens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the uploads are asynchronous
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    print(f"decode-step bookkeeping on {device}, page {PAGE}, {args.steps} steps each")
    print(f"{'batch':>6} {'batched us':>11} {'per-request us':>15} {'ratio':>6}")
    for batch in args.batches:
        _time_steps(batch, 20, device, batched=True)  # warm-up
        fast = _time_steps(batch, args.steps, device, batched=True)
        slow = _time_steps(batch, args.steps, device, batched=False)
        print(f"{batch:>6} {fast * 1e6:>11.1f} {slow * 1e6:>15.1f} {slow / fast:>6.1f}x")


if __name__ == "__main__":
    main()

"""Host bookkeeping of a decode step does not grow with the batch (issue 28, item 2).

The torch calls made by the step's slot allocation, the request-table flush, the graph
input fill and a step's frees are counted with a TorchFunctionMode, at batch 2 and batch
16: the counts must be equal, and none of them may read a tensor back to the host.
Slot choices are checked against the one-request-at-a-time allocation they replace.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine import Engine, SamplingParams
from engine.grammar import TokenMasker
from engine.graph_runner import DecodeGraphRunner
from engine.kvcache.allocator import OutOfSlotsError, PageAllocator
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.req_table import ReqTable
from engine.request import Req
from tests.unit.cpu_engine import checked_engine

# Calls that read a tensor's value on the host (a device sync where the tensor lives on
# an accelerator).
HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}
PAGE = 4


class CallCounter(TorchFunctionMode):
    """Counts every torch function and tensor method called inside it, and the host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.host_reads: Counter[str] = Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.host_reads[name] += 1
        return func(*args, **(kwargs or {}))


def counted(fn: Any, *args: Any) -> tuple[Any, CallCounter]:
    counter = CallCounter()
    with counter:
        result = fn(*args)
    return result, counter


def decoding_engine(model_dir: Path, batch: int) -> Engine:
    """An engine whose ``batch`` requests all wait to decode, with a "device" request
    table (a second CPU tensor the flush uploads to), as on an accelerator."""
    engine = checked_engine(model_dir, kv_cache_tokens=2048, page_size=PAGE)
    table = engine.kv.req_table
    table.on_device, table.table = True, table.cpu.clone()
    # Prompts of 7 and 8 tokens: at the first decode the 8-token ones open a page and the
    # 7-token ones continue theirs, so both branches of the allocation run.
    prompts = [[10 + i] * (7 + i % 2) for i in range(batch)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.kv_len < r.seq_len - 1 for r in scheduler.running):
        engine.step()
    assert len(scheduler.running) == batch
    return engine


def step_counts(model_dir: Path, batch: int) -> dict[str, CallCounter]:
    engine = decoding_engine(model_dir, batch)
    counts: dict[str, CallCounter] = {}
    scheduled, counts["allocation"] = counted(engine.scheduler.schedule)
    assert scheduled is not None and scheduled.is_decode and len(scheduled.reqs) == batch
    opened = [r.kv_len - 1 == r.prefix_len for r in scheduled.reqs]
    assert any(opened) and not all(opened)
    _, counts["table flush"] = counted(engine.kv.req_table.flush)
    assert torch.equal(engine.kv.req_table.table, engine.kv.req_table.cpu)

    graphs = DecodeGraphRunner(
        engine.model, engine.kv.device_pool, engine.kv.req_table, engine.device, 32
    )
    inputs, _ = engine.runner.step_inputs(scheduled)
    seq_lens = [s + 1 for s in inputs.prefix_lens]
    bucket = graphs.bucket_of(seq_lens)
    assert bucket is not None
    args = (inputs.input_ids, inputs.positions, inputs.out_slots, inputs.req_rows, seq_lens)
    _, counts["graph input fill"] = counted(graphs._copy_in, bucket[0], *args)
    static = graphs._views(bucket[0])
    for row, values in zip(static, args):
        assert row[:batch].tolist() == list(values if isinstance(values, list) else values.tolist())
    assert static[-1][batch:].tolist() == [1] * (bucket[0] - batch)  # padded rows: context 1

    # The step's frees: every request leaves (its KV goes to the tree, the rest freed).
    running = list(engine.scheduler.running)
    for req in running:
        engine.scheduler.remove(req)
    _, counts["frees"] = counted(lambda: engine.kv.manager.allocator.free_pages)
    engine.kv.manager.check_invariants([])
    return counts


def test_decode_bookkeeping_does_not_grow_with_the_batch(tiny_llama_dir: Path) -> None:
    small = step_counts(tiny_llama_dir, 2)
    large = step_counts(tiny_llama_dir, 16)
    for part in small:
        assert small[part].calls == large[part].calls, (
            f"{part}: {small[part].calls} torch calls at batch 2, {large[part].calls} at 16"
        )
        assert not large[part].host_reads, f"{part} read tensors on the host"
    assert small["allocation"].calls > 0 and small["table flush"].calls > 0


def test_counter_sees_calls_and_host_reads() -> None:
    counter = CallCounter()
    with counter:
        t = torch.arange(4)
        t.tolist()
        int(t[0])
        t[1].item()
    assert counter.calls >= 5
    assert set(counter.host_reads) >= {"tolist", "item"}


# ---- allocation against the one-request-at-a-time path ---------------------------------


def manager_with(num_pages: int, page: int = PAGE) -> KVCacheManager:
    allocator = PageAllocator(num_pages, page)
    table = ReqTable(8, 128, torch.device("cpu"))
    return KVCacheManager(allocator, table, RadixCache(allocator, enabled=False))


def admitted(manager: KVCacheManager, prompt_lens: list[int]) -> list[Req]:
    reqs = []
    for i, n in enumerate(prompt_lens):
        req = Req(f"r{i}", list(range(1, n + 2)), SamplingParams())
        manager.admit(req)
        manager.alloc(req, n)
        reqs.append(req)
    return reqs


@pytest.mark.parametrize(
    "page, lens",
    [
        (PAGE, [3, 4, 5, 8, 1, 6]),  # some rows open a page, others continue theirs
        (PAGE, [4, 8, 4, 12]),  # every row opens a page at once, every fourth step
        (1, [3, 4, 5, 8, 1, 6]),  # every row opens a page at every step
    ],
)
def test_decode_allocation_matches_one_request_at_a_time(page: int, lens: list[int]) -> None:
    one_by_one, batched = manager_with(160 // page, page), manager_with(160 // page, page)
    reqs_a, reqs_b = admitted(one_by_one, lens), admitted(batched, lens)
    for _ in range(9):  # crosses page boundaries for every request
        expected = torch.cat([one_by_one.alloc(r, 1) for r in reqs_a])
        got = batched.alloc_decode(reqs_b)
        assert got.tolist() == expected.tolist()
        assert [r.kv_len for r in reqs_b] == [r.kv_len for r in reqs_a]
    assert torch.equal(batched.req_table.cpu, one_by_one.req_table.cpu)
    assert batched.allocator.free_page_ids() == one_by_one.allocator.free_page_ids()


def test_decode_allocation_is_all_or_nothing() -> None:
    manager = manager_with(4)
    reqs = admitted(manager, [4, 4, 4])  # three full pages: each opens one at decode
    free, table = manager.allocator.free_pages, manager.req_table.cpu.clone()
    with pytest.raises(OutOfSlotsError):
        manager.alloc_decode(reqs)
    assert manager.allocator.free_pages == free == 1
    assert [r.kv_len for r in reqs] == [4, 4, 4]
    assert torch.equal(manager.req_table.cpu, table)
    manager.alloc_decode(reqs[:1])
    assert manager.allocator.free_pages == 0


def test_frees_of_a_step_return_together_and_catch_double_frees() -> None:
    allocator = PageAllocator(8, PAGE)
    runs = [allocator.alloc_pages(2)[:5] for _ in range(3)]  # last page partly used
    for run in runs:
        allocator.free(run)
    assert allocator.free_pages == 8
    assert allocator.free_page_ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    twice = allocator.alloc_pages(1)
    allocator.free(twice)
    allocator.free(twice[2:])
    with pytest.raises(RuntimeError, match="freed twice"):
        _ = allocator.free_pages


def test_grammar_mask_goes_up_from_pinned_staging_without_blocking() -> None:
    masker = TokenMasker(256, torch.device("meta"))  # any device that is not the CPU
    host = torch.arange(12, dtype=torch.int32).reshape(2, 6)

    blocking: list[str] = []

    class Copies(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "to" and not kwargs.get("non_blocking"):
                blocking.append("to")
            return func(*args, **kwargs)

    with Copies():
        device_mask = masker._upload(host)
    assert device_mask.device.type == "meta" and device_mask.shape == host.shape
    assert not blocking
    cpu_masker = TokenMasker(256, torch.device("cpu"))
    assert cpu_masker._upload(host) is host  # nothing to send on the CPU


def test_batched_table_writes_replay_on_other_ranks() -> None:
    """Tensor parallel: the journal of a batched write rebuilds the same table elsewhere."""
    journal: list[tuple[int, int, torch.Tensor]] = []
    rank0 = ReqTable(4, 16, torch.device("cpu"), journal)
    rank0.write(1, 0, torch.tensor([5, 6, 7]))
    rank0.write_cells(torch.tensor([1, 3]), torch.tensor([3, 0]), torch.tensor([9, 11]))
    other = ReqTable(4, 16, torch.device("cpu"))
    for row, start, slots in journal:
        other.write(row, start, slots)
    assert torch.equal(other.cpu, rank0.cpu)
    assert rank0.read(1, 0, 4).tolist() == [5, 6, 7, 9]

"""No host-device synchronisation per step: a CPU run of the engine (HiCache on, the
accelerator copy path forced, every sampler feature) under a detector of the calls that
make the host wait for the device on an accelerator."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from engine import Engine, EngineConfig, SamplingParams
from engine.kvcache.req_table import ReqTable
from engine.request import Req


class SyncDetector(TorchFunctionMode):
    """Records, with the engine line that made it:
    - ``.to(device)`` / ``.copy_`` without ``non_blocking=True`` (from pageable memory,
      or blocking, the copy waits for everything queued on the stream);
    - ``torch.tensor(..., device=)`` / ``torch.as_tensor(..., device=)`` (the same);
    - indexing with a 0-dim tensor (read back to the host to pick the element)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: Counter[tuple[str, str]] = Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        problem = None
        if name in ("to", "copy_"):
            device_args = [
                a for a in (*args[1:], *kwargs.values()) if isinstance(a, (torch.device, str))
            ]
            blocking = not kwargs.get("non_blocking", False) and args[-1] is not True
            if (device_args or name == "copy_") and blocking:
                problem = f"blocking {name}"
        elif name in ("tensor", "as_tensor") and "device" in kwargs:
            problem = f"torch.{name}(device=...)"
        elif name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dim() == 0 for i in index):
                problem = "0-dim tensor index"
        if problem is not None:
            frames = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.hits[(problem, where)] += 1
        return func(*args, **kwargs)


PARAMS = [
    SamplingParams(
        max_tokens=4,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        seed=1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        min_tokens=2,
        logprobs=2,
    ),
    SamplingParams(max_tokens=4, temperature=0.7),  # unseeded, sampled
    SamplingParams(max_tokens=4, temperature=0),  # greedy, in the same batch
]


def test_engine_steps_never_wait_for_the_device(tiny_llama_dir: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            dtype="float32",
            kv_cache_tokens=256,
            page_size=4,
            enable_hierarchical_cache=True,
            hicache_load_threshold=4,
        )
    )
    engine.kv.host_pool._force_staged = True  # the accelerator copy path, on CPU tensors
    prompts = [list(range(100, 140)), list(range(200, 230)), list(range(300, 321))]
    engine.generate(prompts, PARAMS)
    engine.kv.manager.tree.evict(10_000)  # every prefix to the host tier
    detector = SyncDetector()
    with detector:
        # Host hits load back (staged), prefixes extend (chunked extend attention),
        # decode steps sample with every feature.
        outputs = engine.generate([p + [7, 8, 9, 10, 11] for p in prompts], PARAMS)
    stats = engine.stats()
    assert stats["loadback_tokens_total"] > 0 and stats["backup_tokens_total"] > 0
    assert all(len(o.token_ids) == 4 for o in outputs)
    assert dict(detector.hits) == {}


def test_detector_sees_the_calls_it_forbids() -> None:
    detector = SyncDetector()
    with detector:
        torch.tensor([1, 2], device="cpu")
        torch.arange(3).to("cpu")
        torch.arange(3)[torch.tensor(1)]
        torch.arange(3).to("cpu", non_blocking=True)  # allowed
    assert sorted(problem for problem, _ in detector.hits) == [
        "0-dim tensor index",
        "blocking to",
        "torch.tensor(device=...)",
    ]


def test_table_writes_reach_the_device_table_in_one_flush() -> None:
    table = ReqTable(4, 16, torch.device("cpu"))
    table.on_device, table.table = True, torch.zeros(4, 16, dtype=torch.int32)  # "device"
    table.write(2, 0, torch.tensor([5, 6, 7]))
    table.write(1, 3, torch.tensor([9]))
    table.write(2, 3, torch.tensor([8]))
    assert int(table.table.sum()) == 0  # not uploaded yet
    assert table.read(2, 0, 4).tolist() == [5, 6, 7, 8]  # reads use the mirror
    table.flush()
    assert torch.equal(table.table, table.cpu)
    table.flush()  # nothing pending: a no-op
    assert torch.equal(table.table, table.cpu)


def test_slot_lookups_read_the_cpu_mirror(tiny_llama_dir: Path) -> None:
    """Growing a request inside a partial page needs its last slot: from the mirror, never
    an ``int()`` of the device table."""
    engine = Engine(
        EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=64, page_size=4)
    )
    manager = engine.kv.manager
    req = Req("a", [5, 6, 7, 8, 9, 10], SamplingParams())
    manager.admit(req)
    manager.alloc(req, 5)  # one page and one slot of the next

    class Untouchable:
        def __getitem__(self, _: Any) -> Any:
            raise AssertionError("the device table was read by the host")

    real = manager.req_table.table
    manager.req_table.table = Untouchable()  # type: ignore[assignment]
    try:
        slots = manager.alloc(req, 2)  # continues the partial page
    finally:
        manager.req_table.table = real
    assert slots.tolist() == [int(manager.req_table.cpu[req.row, 4]) + i for i in (1, 2)]

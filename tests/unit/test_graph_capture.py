"""Device graphs without a device: the graph API resolved by the bare device type (never
torch.cuda on MUSA), the capture sequence against a fake backend (warm-up on a side
stream, one capture into the shared pool), when the engine turns graphs on or leaves
decode eager, and the flags."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig

from engine import EngineConfig, SamplingParams, platform
from engine.graph_runner import DecodeGraphRunner
from engine.graph_setup import build_decode_graphs, graph_blockers
from engine.graph_startup import WARMUP_RUNS
from engine.layers.moe import DEVICE_ROUTING_MAX_TOKENS
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from server.args import parse_args
from tests.unit.fake_backends import ExplodingCuda, FakeStreamBackend
from tests.unit.model_configs import TINY
from tests.unit.test_engine import engine_for


class FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class FakeGraphBackend:
    """MUSAGraph / graph / graph_pool_handle on a FakeStreamBackend: records the stream
    each capture ran on and the options it got."""

    def __init__(self, backend: FakeStreamBackend) -> None:
        self.backend = backend
        self.captures: list[tuple[FakeGraph, dict[str, Any], str]] = []
        self.capturing = False
        backend.MUSAGraph = FakeGraph
        backend.graph = self.graph
        backend.graph_pool_handle = lambda: ("pool", 7)

    @contextlib.contextmanager
    def graph(
        self,
        graph: FakeGraph,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
    ) -> Iterator[None]:
        options = {"pool": pool, "capture_error_mode": capture_error_mode}
        self.captures.append((graph, options, self.backend.current_stream().name))
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


def test_no_graph_api_on_devices_without_graphs() -> None:
    for device in ("cpu", "mps", "npu:0", "xpu"):
        assert platform.graph_api(device) is None


def test_musa_graphs_come_from_torch_musa(
    fake_musa: FakeStreamBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert platform.graph_api("musa:0") is None  # a torch_musa build without graphs
    FakeGraphBackend(fake_musa)
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    api = platform.graph_api("musa:1")
    assert api is not None
    assert api.module is fake_musa and api.graph_cls is FakeGraph
    assert api.pool_handle() == ("pool", 7)


def test_capture_warms_up_on_a_side_stream_then_captures_once(
    tiny_llama_dir: Path, fake_musa: FakeStreamBackend
) -> None:
    fake = FakeGraphBackend(fake_musa)
    api = platform.graph_api("musa")
    assert api is not None
    engine = engine_for(tiny_llama_dir)
    runner = DecodeGraphRunner(
        engine.model, engine.kv.device_pool, engine.kv.req_table, engine.device, 8, api=api
    )
    runner._spec = platform.DeviceSpec("musa", 0)  # CPU tensors, fake musa streams
    calls: list[tuple[str, bool]] = []
    real_forward = engine.model.forward

    def forward(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append((fake_musa.current_stream().name, fake.capturing))
        assert input_ids.tolist() == [0, 0, 0, 0]  # dummy rows only before a replay
        return real_forward(input_ids, *args)

    engine.model.forward = forward
    before = engine.kv.device_pool.kv_buffer.clone()
    graph = runner.capture(4, 256)
    assert isinstance(graph, FakeGraph) and runner.graphs == {(4, 256): graph}
    warmups, captured = calls[:WARMUP_RUNS], calls[WARMUP_RUNS:]
    assert all(stream.startswith("side") and not capturing for stream, capturing in warmups)
    assert [capturing for _, capturing in captured] == [True]
    ((captured_graph, options, _),) = fake.captures
    assert captured_graph is graph
    assert options == {"pool": ("pool", 7), "capture_error_mode": "thread_local"}
    # The side stream waited for the main one, and the main one for the warm-up.
    waits = [e for e in fake_musa.log if e[0] == "wait_stream"]
    assert waits[0][2] == "compute0" and waits[1][1] == "compute0"
    # The warm-up ran for real and wrote the dummy slot 0 only.
    changed = (engine.kv.device_pool.kv_buffer != before).flatten(3).any(-1).any(0).any(0)
    assert changed.nonzero().flatten().tolist() == [0]


def test_a_failed_capture_leaves_decode_eager(
    tiny_llama_dir: Path, fake_musa: FakeStreamBackend
) -> None:
    fake = FakeGraphBackend(fake_musa)

    @contextlib.contextmanager
    def failing(graph: FakeGraph, **options: Any) -> Iterator[None]:
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    fake_musa.graph = failing
    api = platform.graph_api("musa")
    assert api is not None and fake.captures == []
    prompts = [[100 + i for i in range(n)] for n in (5, 9)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in engine_for(tiny_llama_dir).generate(prompts, params)]
    engine = engine_for(tiny_llama_dir)
    runner = DecodeGraphRunner(
        engine.model, engine.kv.device_pool, engine.kv.req_table, engine.device, 8, api=api
    )
    runner._spec = platform.DeviceSpec("musa", 0)
    engine.runner.graphs = runner
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert isinstance(runner.failure, RuntimeError) and not runner.graphs
    assert not runner.can_run([3])  # no second try


def test_graph_blockers() -> None:
    assert graph_blockers(LlamaForCausalLM(LlamaConfig(**TINY))) == []
    windowed = graph_blockers(LlamaForCausalLM(MistralConfig(**TINY, sliding_window=6)))
    assert windowed == ["attention backend 'torch_windowed' sizes its work per sequence"]
    moe = MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))
    assert graph_blockers(moe, max_batch=DEVICE_ROUTING_MAX_TOKENS) == []  # routed on device
    assert graph_blockers(moe, max_batch=DEVICE_ROUTING_MAX_TOKENS + 1) == [
        "mixture-of-experts routing reads the chosen experts on the host past "
        f"{DEVICE_ROUTING_MAX_TOKENS} tokens (--cuda-graph-max-bs to stay under it)"
    ]


def test_when_the_engine_uses_graphs(
    tiny_llama_dir: Path, fake_musa: FakeStreamBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gather fallback: graphs built, captured lazily (start-up capture is in
    # test_graph_startup.py).
    engine = engine_for(tiny_llama_dir, attention_backend="torch")
    assert engine.runner.graphs is None and engine.health()["device_graphs"] is False

    FakeGraphBackend(fake_musa)
    musa = platform.DeviceSpec("musa", 0)
    kv = engine.kv

    def build(
        model: Any = engine.model, gather: Any = None, **overrides: Any
    ) -> DecodeGraphRunner | None:
        config = EngineConfig(model=str(tiny_llama_dir), max_running_requests=32, **overrides)
        return build_decode_graphs(config, model, kv, musa, engine.device, gather=gather)

    runner = build()
    assert runner is not None and runner.api is not None and runner.max_batch == 32
    assert runner.context_buckets[-1] == kv.req_table.max_context
    capped = build(cuda_graph_max_bs=12)
    assert capped is not None and capped.batch_buckets == [1, 2, 4, 8, 12]
    assert build(disable_cuda_graph=True) is None
    with pytest.raises(ValueError, match="pass gather"):
        build(tensor_parallel_size=2)  # the ranks must agree
    # The gather fallback captures while serving, which ranks cannot agree on: eager.
    assert build(tensor_parallel_size=2, gather=lambda value: [value, value]) is None
    assert build(model=LlamaForCausalLM(MistralConfig(**TINY, sliding_window=6))) is None
    cpu = EngineConfig(model=str(tiny_llama_dir))
    assert (
        build_decode_graphs(cpu, engine.model, kv, platform.DeviceSpec("cpu"), engine.device)
        is None
    )


def test_flags() -> None:
    assert EngineConfig().disable_cuda_graph is False
    assert EngineConfig().cuda_graph_max_bs is None
    args = parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "16"], environ={})
    assert args.engine.disable_cuda_graph is True and args.engine.cuda_graph_max_bs == 16
    env = parse_args([], environ={"HISERVE_DISABLE_CUDA_GRAPH": "1"})
    assert env.engine.disable_cuda_graph is True
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1"):
        EngineConfig(cuda_graph_max_bs=0)

"""Mixed steps replayed from graphs (engine/mixed_graphs.py) on the CPU: the Triton kernels
under Triton's interpreter, the graph path with direct calls (HISERVE_DIRECT_DECODE_GRAPHS),
so a replay runs the function built once at start-up on the static buffers: a forward
that read a step's lists instead would compute the start-up check's layout, not the
step's. Compared token for token with the same engine decoding eagerly."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from engine import Engine, EngineConfig, SamplingParams, platform
from engine.graph_buckets import token_buckets
from engine.graph_setup import DIRECT_GRAPHS_ENV, build_mixed_graphs
from engine.graph_startup import capture_mixed_at_start, check_layout
from engine.mixed_graphs import MixedGraphRunner, mixed_blockers
from tests.unit.test_engine import engine_for, make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _engine(model_dir: Path, graphs: bool, **overrides: Any) -> Engine:
    options: dict[str, Any] = {
        "attention_backend": "triton",
        "enable_mixed_batches": True,
        "max_prefill_tokens": 48,
        "chunked_prefill_size": 24,
        "max_running_requests": 6,
        "disable_cuda_graph": not graphs,
        **overrides,
    }
    return engine_for(model_dir, **options)


def _waves(engine: Engine) -> tuple[list[list[int]], list[Any]]:
    """Streams decoding while others arrive (mixed steps): fresh prompts, a long one in
    chunks, a prefix hit, a seeded sampled request and a scored prompt (which stays
    eager), in the same order on every engine, driven by its loop (plain or overlapped)."""
    loop = engine.loop
    prompts = make_prompts(5, seed=3, lo=4, hi=30)
    long_prompt = make_prompts(1, seed=4, lo=70, hi=71)[0]
    first = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    done: dict[str, Any] = {}

    def step() -> None:
        for out in loop.step():
            if out.finished:
                done[out.request_id] = out

    while any(not engine.requests[r].output_ids for r in first):
        step()
    later = [
        engine.add_request(prompts[2], GREEDY),
        engine.add_request(long_prompt, GREEDY),
        engine.add_request(prompts[0] + prompts[3], GREEDY),  # the first prompt's prefix
        engine.add_request(prompts[4], SamplingParams(max_tokens=5, temperature=0.8, seed=7)),
    ]
    step()
    later += [
        engine.add_request(prompts[1][:6], GREEDY),
        engine.add_request(
            prompts[3], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
        ),
    ]
    ids = first + later
    while loop.has_work:
        step()
    tokens = [list(done[r].token_ids) for r in ids]
    scored = [lp for lp in (done[ids[-1]].prompt_logprobs or []) if lp is not None]
    return tokens, scored


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_replay_graphs_with_the_eager_output(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    eager = _engine(tiny_llama_dir, graphs=False)
    try:
        assert eager.runner.mixed_graphs is None
        want, want_scored = _waves(eager)
    finally:
        eager.close()
    monkeypatch.setenv(DIRECT_GRAPHS_ENV, "1")
    # Overlapped: a decode's input in a mixed step may be a token still on the device,
    # resolved into the graph's static ids.
    engine = _engine(tiny_llama_dir, graphs=True, disable_overlap_schedule=not overlap)
    try:
        assert engine.overlap is overlap
        mixed = engine.runner.mixed_graphs
        assert mixed is not None and engine.health()["mixed_graphs"] is True
        assert sorted(mixed.graphs) == [16, 32, 48]
        assert not mixed.replays  # the start-up checks' replays are not counted
        resolved: list[int] = []
        run = mixed.run

        def counting_run(*args: Any, resolve: Any = None) -> torch.Tensor:
            resolved.append(resolve is not None)
            return run(*args, resolve=resolve)

        monkeypatch.setattr(mixed, "run", counting_run)
        got, got_scored = _waves(engine)
        stats = engine.stats()
        if overlap:
            assert engine.loop.overlapped_steps > 0  # type: ignore[attr-defined]
        assert any(resolved) is overlap  # mixed replays over tokens still in flight
    finally:
        engine.close()
    assert got == want
    assert [s.token_id for s in got_scored] == [s.token_id for s in want_scored]
    assert len(got_scored) > 0
    assert [s.logprob for s in got_scored] == pytest.approx([s.logprob for s in want_scored])
    assert stats["mixed_steps_total"] > 0
    # Steps that prefill replayed, several token sizes among them.
    assert sum(mixed.replays.values()) >= stats["mixed_steps_total"]
    # Reported in stats() (and so in /metrics), serving steps only.
    assert stats["mixed_graph_replays_total"] == sum(mixed.replays.values())
    assert stats["decode_graph_replays_total"] > 0
    assert len(mixed.replays) >= 2


class Captured:
    """Decode graphs captured at start-up, as build_mixed_graphs reads them (direct calls)."""

    captured_at_start = True
    api = None
    pool = None


class OtherRank:
    """A tensor-parallel gather whose other rank answers ``answers`` in turn; records
    what this rank shared."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls: list[Any] = []

    def __call__(self, value: Any) -> list[Any]:
        self.calls.append(value)
        return [value, self.answers[len(self.calls) - 1]]


def _config(**overrides: Any) -> EngineConfig:
    return EngineConfig(
        model="unused",
        max_prefill_tokens=32,
        max_running_requests=4,
        enable_mixed_batches=True,
        **overrides,
    )


CPU = platform.DeviceSpec("cpu")
CAPTURED = Captured()


def _build(
    engine: Engine, config: EngineConfig, decode: Any = CAPTURED, gather: Any = None
) -> MixedGraphRunner | None:
    """build_mixed_graphs for ``engine``'s model and KV over ``decode`` (by default decode
    graphs captured at start-up)."""
    return build_mixed_graphs(config, engine.model, engine.kv, decode, CPU, engine.device, gather)


def _off_by_a_little(runner_cls: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mixed graph's logits a little off the eager forward's."""
    good = runner_cls._bucket_forward

    def wrong_forward(self: Any, bucket: int) -> Any:
        forward = good(self, bucket)

        def wrong() -> None:
            forward()
            self._logits.add_(1e-3)  # past float32's tolerance

        return wrong

    monkeypatch.setattr(runner_cls, "_bucket_forward", wrong_forward)


def test_a_replay_that_differs_leaves_mixed_steps_eager(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(tiny_llama_dir, graphs=False)
    try:
        with monkeypatch.context() as patch:
            _off_by_a_little(MixedGraphRunner, patch)
            runner = MixedGraphRunner(
                engine.model, engine.kv.device_pool, engine.kv.req_table, engine.device, 32, 4
            )
            reason = capture_mixed_at_start(runner)
            assert reason is not None and "32 tokens: the replayed logits differ" in reason
            assert runner.graphs == {}
            # The same through the build: logged, and mixed steps stay eager.
            with caplog.at_level(logging.WARNING):
                built = _build(engine, _config())
            assert built is None
            assert "mixed graphs: off, steps that prefill run eagerly" in caplog.text
        # Without the fault the same build captures and checks every size.
        built = _build(engine, _config())
        assert built is not None and sorted(built.graphs) == [16, 32]
    finally:
        engine.close()


def test_tensor_parallel_ranks_agree_on_mixed_graphs(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(tiny_llama_dir, graphs=False)
    config = _config(tensor_parallel_size=2)

    def build(gather: Any) -> MixedGraphRunner | None:
        return _build(engine, config, gather=gather)

    try:
        with pytest.raises(ValueError, match="pass gather"):
            build(None)
        # A rank that cannot capture, or would capture other sizes: none does.
        for answer in (None, [16]):
            other = OtherRank([answer])
            with caplog.at_level(logging.INFO):
                assert build(other) is None
            assert f"ranks would capture [[16, 32], {answer}] token sizes" in caplog.text
            assert other.calls == [[16, 32]]
        # The other rank fails its check of 32 tokens: both stop there, before 16.
        other = OtherRank([[16, 32], True, False])
        with caplog.at_level(logging.WARNING):
            assert build(other) is None
        assert "tensor-parallel rank 1 failed the replay check of 32 tokens" in caplog.text
        assert other.calls == [[16, 32], True, True]
        # This rank fails its own check: it says so to the other rank and stops too.
        with monkeypatch.context() as patch:
            _off_by_a_little(MixedGraphRunner, patch)
            other = OtherRank([[16, 32], True, True])
            assert build(other) is None
            assert other.calls == [[16, 32], True, False]
        # Both well: every size captured and checked, each outcome shared.
        other = OtherRank([[16, 32]] + [True] * 4)
        runner = build(other)
        assert runner is not None and sorted(runner.graphs) == [16, 32]
        assert other.calls == [[16, 32]] + [True] * 4
        # Decode graphs off on every rank, or mixed batches not asked for: nothing shared.
        other = OtherRank([])
        assert _build(engine, config, decode=None, gather=other) is None
        auto = EngineConfig(model="unused", tensor_parallel_size=2)
        assert _build(engine, auto, gather=other) is None
        assert other.calls == []
    finally:
        engine.close()


def test_blocked_where_an_extend_cannot_be_captured(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    native = engine_for(tiny_llama_dir)  # the native CPU kernel sizes extends per sequence
    try:
        reason = f"attention backend {native.attention_backend!r} sizes an extend per sequence"
        assert mixed_blockers(native.model) == [reason]
        with caplog.at_level(logging.INFO):
            built = _build(native, _config())
        assert built is None and f"mixed graphs: off ({reason})" in caplog.text
    finally:
        native.close()
    engine = _engine(tiny_llama_dir, graphs=False)
    try:
        assert mixed_blockers(engine.model) == []
        # No decode graphs, or lazily captured ones: nothing to build on.
        lazy = Captured()
        lazy.captured_at_start = False
        for decode in (lazy, None):
            assert _build(engine, _config(), decode=decode) is None
    finally:
        engine.close()


def test_bucket_of_refuses_what_does_not_fit(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, graphs=False)
    try:
        runner = MixedGraphRunner(
            engine.model, engine.kv.device_pool, engine.kv.req_table, engine.device, 40, 20
        )
        assert runner.buckets == [16, 32, 40]
        assert runner.bucket_of(10, 2) is None  # nothing captured yet
        assert capture_mixed_at_start(runner) is None
        assert runner.bucket_of(10, 2) == 16
        assert runner.bucket_of(17, 17) == 32
        assert runner.bucket_of(16, 17) is None  # more sequences than the bucket has rows
        assert runner.bucket_of(41, 2) is None  # past the largest
        assert runner.layout_of(40)[0] == 20
    finally:
        engine.close()


def test_token_buckets_and_check_layout() -> None:
    assert token_buckets(48) == [16, 32, 48]
    assert token_buckets(4096)[:8] == [16, 32, 64, 128, 256, 512, 768, 1024]
    assert token_buckets(4096)[-2:] == [3840, 4096]
    assert token_buckets(1000)[-2:] == [768, 1000]
    assert token_buckets(8) == [8]
    assert len(token_buckets(16384)) == 32 and token_buckets(16384)[-3:] == [14336, 15360, 16384]
    assert token_buckets(30000)[-4:] == [20480, 24576, 28672, 30000]
    # A decode and one chunk, one token short of the bucket; chunks capped by the table.
    assert check_layout(16, 4, 100) == [1, 14]
    assert check_layout(16, 4, 6) == [1, 5, 5, 4]
    assert check_layout(16, 3, 6) is None
    assert check_layout(16, 40, 1) is None  # a table one column wide holds no chunk
    assert sum(check_layout(64, 8, 4096) or []) == 63

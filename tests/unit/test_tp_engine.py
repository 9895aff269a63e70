"""``--tensor-parallel-size 2`` on the CPU: two real processes over gloo.

Greedy output must be identical to one rank, for a dense (Llama) and an MoE (Qwen3-MoE)
model, with batched prompts of different lengths, chunked prefill, prefix hits, and the
HiCache host tier evicting KV and loading it back; a killed worker must end the engine
cleanly (reported at once, never a hang); a failure while rank 0 fills a step must stop
every rank at once (the workers were never sent the step); a shutdown is bounded even
when a worker cannot take the stop message."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import Qwen3MoeConfig

from engine import Engine, EngineConfig, SamplingParams
from engine.graph_setup import DIRECT_GRAPHS_ENV
from engine.request import Req
from engine.tp.protocol import TPRankDiedError, TPStepFailedError
from tests.conftest import TOKENIZER_FILES
from tests.unit.hf_reference import hf_greedy, randomize

MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random-weight Qwen3-MoE (routed layer 0, dense layer 1) with the default tokenizer."""
    config = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed=11)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            (path / name).write_bytes((default_model_dir / name).read_bytes())
    return path


def _engine(path: Path, tp: int, **overrides: Any) -> Engine:
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            **{
                "attention_backend": "torch",
                "kv_cache_tokens": 1024,
                "chunked_prefill_size": 16,
                **overrides,
            },
        )
    )
    engine.check_invariants = True
    return engine


def _conversations(engine: Engine) -> tuple[list[list[int]], int, int]:
    """Two turns of four conversations: the first turn batched (prompts of 9..70 tokens,
    chunked by 16), the second one at a time, extending each conversation (prefix hits).
    Returns every output, and the tokens served from the device cache and the host tier."""
    rng = random.Random(0)
    convos = [[rng.randrange(100, 40000) for _ in range(n)] for n in (9, 40, 70, 25)]
    outputs = [o.token_ids for o in engine.generate(convos, PARAMS)]
    convos = [c + o for c, o in zip(convos, outputs)]
    device_hits = host_hits = 0
    for convo in convos:
        convo = convo + [rng.randrange(100, 40000) for _ in range(8)]
        out = engine.generate([convo], PARAMS)[0]
        device_hits += out.cached_tokens - out.cached_tokens_host
        host_hits += out.cached_tokens_host
        outputs.append(out.token_ids)
    return outputs, device_hits, host_hits


@pytest.mark.slow  # two worker start-ups, 20-40 s on a shared 2-core box
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_two_ranks_give_the_greedy_output_of_one(
    model: str, tiny_llama_dir: Path, tiny_moe_dir: Path
) -> None:
    path = tiny_llama_dir if model == "dense" else tiny_moe_dir
    outputs = {}
    for tp in (1, 2):
        engine = _engine(path, tp)
        workers = list(engine.tp.workers) if engine.tp is not None else []
        try:
            outputs[tp], device_hits, _ = _conversations(engine)
        finally:
            engine.close()
        assert device_hits > 0, "the second turn never hit the prefix cache"
        assert [w.exitcode for w in workers] == [0] * (tp - 1)  # an orderly stop
    assert outputs[2] == outputs[1]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng = random.Random(0)
    first = [rng.randrange(100, 40000) for _ in range(9)]
    assert outputs[2][0] == hf_greedy(hf_model, first, MAX_TOKENS)


@pytest.mark.slow  # two worker start-ups
def test_two_ranks_replay_decode_graphs_in_lockstep(
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The CPU has no graph API: the graph path runs with direct calls (DIRECT_GRAPHS_ENV,
    # inherited by the spawned worker), each rank with its own runner, captured at
    # start-up in lockstep and replayed on the same steps (its all-reduces included).
    eager = _engine(tiny_llama_dir, 1, attention_backend="cpu_native")
    try:
        assert eager.runner.graphs is None
        expected, _, _ = _conversations(eager)
    finally:
        eager.close()
    monkeypatch.setenv(DIRECT_GRAPHS_ENV, "1")
    with caplog.at_level(logging.INFO):  # the workers log at rank 0's level
        engine = _engine(tiny_llama_dir, 2, attention_backend="cpu_native")
        graphs = engine.runner.graphs
        try:
            assert graphs is not None and graphs.captured_at_start
            outputs, _, _ = _conversations(engine)
        finally:
            engine.close()
    assert outputs == expected
    replayed = sum(graphs.replays.values())
    assert replayed >= MAX_TOKENS - 1
    assert "in lockstep with the other tensor-parallel ranks" in caplog.text
    log = capfd.readouterr().err
    assert "[tp rank 1]" in log and "in lockstep with the other tensor-parallel ranks" in log
    assert f"rank 1: {replayed} decode steps replayed from device graphs" in log


@pytest.mark.slow  # two worker start-ups
def test_two_ranks_replay_mixed_graphs_in_lockstep(
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Mixed batches with graphs: steps that prefill replay graphs per token size on both
    # ranks (the Triton kernels under the interpreter, inherited by the worker), captured
    # in lockstep after the decode graphs.
    options: dict[str, Any] = {
        "attention_backend": "triton",
        "enable_mixed_batches": True,
        "max_prefill_tokens": 48,
    }
    eager = _engine(tiny_llama_dir, 1, disable_cuda_graph=True, **options)
    try:
        expected, _, _ = _conversations(eager)
    finally:
        eager.close()
    monkeypatch.setenv(DIRECT_GRAPHS_ENV, "1")
    with caplog.at_level(logging.INFO):  # the workers log at rank 0's level
        engine = _engine(tiny_llama_dir, 2, **options)
        mixed = engine.runner.mixed_graphs
        try:
            assert mixed is not None and engine.health()["mixed_graphs"] is True
            outputs, _, _ = _conversations(engine)
        finally:
            engine.close()
    assert outputs == expected
    replayed = sum(mixed.replays.values())
    assert replayed > 0
    log = capfd.readouterr().err
    assert "[tp rank 1]" in log and "mixed graphs: captured 3 token sizes" in log
    assert f"rank 1: {replayed} steps that prefill replayed from device graphs" in log


@pytest.mark.slow  # two worker start-ups
def test_two_ranks_with_a_bf16_pool_give_the_output_of_one(tiny_llama_dir: Path) -> None:
    # --kv-cache-dtype reaches the workers: each rank's pool is bf16, sized alike.
    outputs = {}
    for tp in (1, 2):
        engine = _engine(tiny_llama_dir, tp, kv_cache_dtype="bfloat16")
        try:
            assert engine.kv.device_pool.k_buffers[0].dtype == torch.bfloat16
            outputs[tp], _, _ = _conversations(engine)
        finally:
            engine.close()
    assert outputs[2] == outputs[1]


@pytest.mark.slow
def test_two_ranks_with_hicache_evicting_and_loading_back(tiny_moe_dir: Path) -> None:
    hicache = dict(
        kv_cache_tokens=160,  # two conversations' worth: the rest goes to the host tier
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_load_threshold=4,
    )
    outputs, host_hits = {}, {}
    for tp in (1, 2):
        engine = _engine(tiny_moe_dir, tp, **hicache)
        try:
            outputs[tp], _, host_hits[tp] = _conversations(engine)
            assert engine.stats()["loadback_tokens_total"] > 0
        finally:
            engine.close()
    assert host_hits[1] > 0 and host_hits[2] == host_hits[1]
    assert outputs[2] == outputs[1]


@pytest.mark.slow
def test_a_killed_rank_ends_the_engine_cleanly(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, 2)
    died = threading.Event()
    errors: list[BaseException] = []
    engine.watch_fatal(lambda exc: (errors.append(exc), died.set()))
    try:
        assert engine.generate([[5, 6, 7]], PARAMS)[0].token_ids  # the group works
        assert engine.tp is not None
        worker = engine.tp.workers[0]
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        assert died.wait(timeout=60), "rank 0 did not notice its worker died"
        assert isinstance(errors[0], TPRankDiedError)
        assert "rank 1" in str(errors[0]) and str(worker.pid) in str(errors[0])
        assert engine.failure is errors[0]
        with pytest.raises(TPRankDiedError):  # the next step fails at once, no hang
            engine.generate([[8, 9, 10]], PARAMS)
    finally:
        engine.close()  # returns: no stop message is sent to a dead rank
    assert not worker.is_alive()
    assert not torch.distributed.is_initialized()


class FailingMasker:
    """Rank 0's grammar masker, whose ``fail_at``-th fill raises (mid-generation)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0

    def fill(self, reqs: Sequence[Req]) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected: the grammar mask fill failed")


@pytest.mark.slow
def test_a_failure_while_filling_a_step_stops_every_rank_at_once(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, 2)
    reported: list[BaseException] = []
    engine.watch_fatal(reported.append)
    assert engine.tp is not None
    workers = list(engine.tp.workers)
    try:
        engine.runner.masker = FailingMasker(fail_at=3)  # type: ignore[assignment]
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate([[5, 6, 7]], PARAMS)
        for worker in workers:
            worker.join(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        engine.close()
    # Rank 0 failed before the step went out, so the workers were waiting for a message,
    # not inside the step's all-reduce: they took the stop message and exited cleanly. (A
    # worker stranded in the all-reduce cannot read it; it would be terminated, -15.)
    assert [w.exitcode for w in workers] == [0]
    assert elapsed < 20, f"the ranks took {elapsed:.1f} s to stop"
    assert isinstance(engine.failure, TPStepFailedError) and reported == [engine.failure]
    assert "injected" in str(engine.failure.__cause__)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_shutdown_is_bounded_when_a_worker_cannot_stop(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, 2)
    assert engine.tp is not None
    worker = engine.tp.workers[0]
    try:
        assert engine.generate([[5, 6, 7]], PARAMS)[0].token_ids
        engine.tp.stop_join_s = 1.0
        # Alive and holding its communicator, but it never reads the stop message and a
        # SIGTERM stays pending: only a kill ends it.
        os.kill(worker.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        started = time.monotonic()
    finally:
        engine.close()
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"close() took {elapsed:.1f} s"
    assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
    assert engine.failure is None  # a shutdown, not a failure
    assert not torch.distributed.is_initialized()

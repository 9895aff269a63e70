"""bench.mixed's in-process engine: the launch options' model and KV pool, the engine
switches on top, and a decode-only step timed on it."""

from __future__ import annotations

from pathlib import Path

from bench.compare import LaunchOptions
from bench.mixed import decode_step_ms, launched_engine
from engine import EngineConfig


def test_launched_engine_takes_the_launch_options_and_the_switches(tiny_llama_dir: Path) -> None:
    launch = LaunchOptions(model=str(tiny_llama_dir), kv_cache_tokens=320)
    engine = launched_engine(launch, enable_mixed_batches=False)
    try:
        assert engine.config.model == str(tiny_llama_dir)
        assert (engine.config.device, engine.config.dtype) == ("cpu", "float32")
        assert engine.config.kv_cache_tokens == 320
        assert engine.config.enable_mixed_batches is False
    finally:
        engine.close()
    # No switch: the engine's own default, not one the benchmark picks.
    default = launched_engine(launch)
    try:
        assert default.config.enable_mixed_batches is EngineConfig().enable_mixed_batches
    finally:
        default.close()


def test_decode_step_is_timed_with_every_request_decoding(tiny_llama_dir: Path) -> None:
    launch = LaunchOptions(model=str(tiny_llama_dir), kv_cache_tokens=256)
    assert decode_step_ms(launch, batch=2, input_len=8, steps=2, seed=0) > 0

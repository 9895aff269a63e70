"""--engine-process on CUDA: the engine's own (spawned) process builds its engine on the
device, and the outputs are the in-thread engine's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine_process import EngineProcess
from engine.request import RequestOutput
from tests.gpu.test_gpu_overlap import mixed_params

pytestmark = pytest.mark.cuda


async def collect(
    async_engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in async_engine.generate(prompt, params, rid)]


def run(async_engine: AsyncEngine, batch: list[list[int]]) -> list[tuple[object, ...]]:
    async def go() -> list[tuple[object, ...]]:
        params = mixed_params(len(batch))
        runs = [
            collect(async_engine, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(batch, params))
        ]
        outs = await asyncio.gather(*runs)
        return [(o[-1].token_ids, o[-1].finish_reason) for o in outs]

    async_engine.start()
    try:
        return asyncio.run(go())
    finally:
        asyncio.run(async_engine.shutdown(10.0))


def test_engine_process_on_cuda_matches_the_thread(tiny_model_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=2048
    )
    batch = [[3 + (7 * i + j) % 200 for j in range(10 + 3 * i)] for i in range(9)]
    child = AsyncEngine(config, EngineProcess(config))
    assert str(child.health()["device"]).startswith("cuda")
    assert run(child, batch) == run(AsyncEngine(config), batch)

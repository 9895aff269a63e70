"""The engine the unit tests drive: float32 on the CPU, its KV accounting checked."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from engine import Engine, EngineConfig
from engine.request import RequestOutput, SamplingParams


def checked_engine(model_dir: Path | str, **config: object) -> Engine:
    """An Engine on ``model_dir`` (CPU and float32 unless ``config`` says otherwise) with
    ``config`` on top, that checks after every step that free, owned and cached KV slots
    add up to the pool."""
    fields: dict[str, object] = {"device": "cpu", "dtype": "float32", **config}
    engine = Engine(EngineConfig(model=str(model_dir), **fields))  # type: ignore[arg-type]
    engine.check_invariants = True
    return engine


def returning_conversations(
    engine: Engine, params: SamplingParams, count: int, prompt_len: int, follow_len: int
) -> Iterator[tuple[int, int, list[int], RequestOutput]]:
    """Two turns of ``count`` conversations, one request at a time: ``prompt_len`` random
    tokens, then each comes back with its reply and ``follow_len`` new tokens, so the
    second turn reuses the first's KV (from the device, the host tier or L3). Yields
    ``(turn, conversation, prompt, output)``; the same prompts for the same arguments."""
    rng = random.Random(0)
    convos = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(count)]
    for turn in range(2):
        for c, convo in enumerate(convos):
            if turn:
                convo = convo + [rng.randrange(100, 40000) for _ in range(follow_len)]
            out = engine.generate([convo], params)[0]
            yield turn, c, convo, out
            convos[c] = convo + out.token_ids

"""The engine the unit tests drive: float32 on the CPU, its KV accounting checked."""

from __future__ import annotations

from pathlib import Path

from engine import Engine, EngineConfig


def checked_engine(model_dir: Path | str, **config: object) -> Engine:
    """An Engine on ``model_dir`` (CPU and float32 unless ``config`` says otherwise) with
    ``config`` on top, that checks after every step that free, owned and cached KV slots
    add up to the pool."""
    fields: dict[str, object] = {"device": "cpu", "dtype": "float32", **config}
    engine = Engine(EngineConfig(model=str(model_dir), **fields))  # type: ignore[arg-type]
    engine.check_invariants = True
    return engine

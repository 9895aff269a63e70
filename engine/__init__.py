"""hiserve inference engine: knows nothing about HTTP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.request import FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "FinishReason", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Engine pulls in torch and transformers; import it only when asked for.
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)

"""Server-sent events: framing and a streaming response that always closes its generator."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One ``data:`` event; JSON escapes newlines, so a payload never splits an event."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response whose body generator is closed however the send ends.

    NOTE: the generator owns engine requests; closing it (client gone, send failed,
    shutdown) aborts them, so their KV is freed at once rather than at garbage collection.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()

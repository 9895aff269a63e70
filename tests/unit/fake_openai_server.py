"""A fake OpenAI-compatible completions server for the bench CLI's tests: it streams
tokens, reports usage with cache hits it works out itself (the longest prefix it saw
before), and keeps a log of what it received, so the bench's totals are checked against
numbers the bench did not compute. Switches in FakeState make it fail or stall."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class FakeState:
    """Behaviour switches and the log of the fake server."""

    mode: str = "ok"  # ok | overloaded | drop_odd | slow
    api_key: str | None = None
    reject_first: int = 0  # answer this many completions with 503 first
    chunk_delay: float = 0.004
    tokens_per_chunk: int = 1  # after the first chunk's one token (--stream-interval)
    log: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 0
    flushes: int = 0
    seen: list[list[int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _lcp_cached(prompt: list[int], seen: list[list[int]]) -> int:
    best = 0
    for earlier in seen:
        n = 0
        while n < min(len(prompt), len(earlier)) and prompt[n] == earlier[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1)


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def denied(request: Request) -> Response | None:
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return denied(request) or JSONResponse({"data": [{"id": "fake-model"}]})

    @app.post("/flush_cache")
    async def flush(request: Request) -> Response:
        if (bad := denied(request)) is not None:
            return bad
        with state.lock:
            state.seen.clear()
            state.flushes += 1
        return JSONResponse({"ok": True})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if (bad := denied(request)) is not None:
            return bad
        body = await request.json()
        with state.lock:
            state.attempts += 1
            if state.mode == "overloaded" or state.reject_first > 0:
                state.reject_first -= 1
                return JSONResponse({"error": {"message": "busy"}}, status_code=503,
                                    headers={"Retry-After": "0"})  # fmt: skip
            prompt = [int(t) for t in body["prompt"]]
            cached = _lcp_cached(prompt, state.seen)
            state.seen.append(prompt)
            entry = {"body": body, "start": time.monotonic(), "end": None, "cached": cached,
                     "arrival": len(state.log)}  # fmt: skip
            state.log.append(entry)
        return StreamingResponse(_stream(state, entry, prompt, cached),
                                 media_type="text/event-stream")  # fmt: skip

    return app


async def _stream(
    state: FakeState, entry: dict[str, Any], prompt: list[int], cached: int
) -> AsyncIterator[str]:
    tokens = int(entry["body"]["max_tokens"])
    for i in [0, *range(1, tokens, state.tokens_per_chunk)]:
        await asyncio.sleep(state.chunk_delay if state.mode != "slow" else 0.3)
        chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
        yield f"data: {json.dumps(chunk)}\n\n"
        if state.mode == "drop_odd" and entry["arrival"] % 2 == 1:
            raise RuntimeError("fake server drops this connection")
    device = min(cached, 5)
    missed = {"never_seen": len(prompt) - 1 - cached, "below_page": 1}  # as hiserve says
    usage = {"prompt_tokens": len(prompt), "completion_tokens": int(entry["body"]["max_tokens"]),
             "prompt_tokens_details": {"cached_tokens": cached, "cached_tokens_device": device,
                                       "cached_tokens_host": cached - device,
                                       "cache_miss_reasons": missed}}  # fmt: skip
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"
    entry["end"] = time.monotonic()


@contextlib.contextmanager
def serve(state: FakeState) -> Iterator[str]:
    """The fake app served by uvicorn in a thread; yields its base URL."""
    # NOTE: proto named, as uvicorn's own bind does: asyncio sets TCP_NODELAY only on
    # accepted sockets of proto IPPROTO_TCP. Without it, a request sent in two segments
    # (aiohttp's headers, then its body, on a reused connection) got every streamed chunk
    # ~40 ms late, all at once (Nagle against the client's delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(state), log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

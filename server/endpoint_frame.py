"""The sequence every generation endpoint follows, written once: plan, start, prime,
stream or collect, usage, close. An endpoint (server/serve_*.py) supplies its prompt
building and request checks (``plan``) and its renderers of whole replies and of stream
deltas; a new endpoint is one file with one ``Endpoint`` subclass.

Errors: the engine names the field at fault (``InvalidRequestError.param``), with
``"prompt"`` for whatever carried the prompt; the endpoint's ``prompt_field`` says which
field that is (``prompt``, ``messages``), in this one place.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from typing import ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from engine.request import RequestOutput
from server.engine_client import EngineClient, translate_engine_error
from server.errors import APIError, error_json, internal_error
from server.metrics import RequestTimer, ServerMetrics
from server.protocol import UsageInfo, _SamplingRequest
from server.serving import Item, Plan, make_usage, until_disconnect
from server.sse import SSE_DONE, SSEResponse, sse_event


class Endpoint(ABC):
    """One request to a generation endpoint: what the frame (``serve``) needs from it."""

    prompt_field: ClassVar[str]  # the request field that carries the prompt

    def __init__(self, req: _SamplingRequest, client: EngineClient) -> None:
        self.req = req
        self.client = client
        self.created = int(time.time())  # the stream chunks' timestamp

    @abstractmethod
    async def plan(self, request: Request) -> Plan:
        """Check the request, build its prompts and plan its choices (``make_plan``)."""

    @abstractmethod
    def reply(self, plan: Plan, finals: dict[int, RequestOutput]) -> BaseModel:
        """The whole response body once every choice has finished."""

    @abstractmethod
    def deltas(self, plan: Plan, k: int, out: RequestOutput) -> Iterable[str]:
        """The SSE events of one output of choice ``k``."""

    def flush(self, plan: Plan) -> Iterable[str]:
        """Events held back until every output arrived (none by default)."""
        return ()

    @abstractmethod
    def usage_event(self, plan: Plan, usage: UsageInfo) -> str:
        """The last chunk of a stream that asked for ``stream_options.include_usage``."""

    def error(self, exc: BaseException) -> APIError:
        """The HTTP error an engine exception stands for (a 500 with an id if a bug)."""
        api = translate_engine_error(exc, self.prompt_field)
        if api is None:
            return internal_error("the engine failed this request", exc)
        return api


async def serve(endpoint: Endpoint, request: Request, metrics: ServerMetrics) -> Response:
    """Plan, start every choice, then stream the deltas or answer with the whole reply."""
    start = time.perf_counter()
    plan = await endpoint.plan(request)
    peer = request.client.host if request.client else None
    for params in plan.params:
        params.client = peer  # the scheduler's fair share of running slots counts by it
    gen = endpoint.client.generate_many(
        [plan.prompt_of(k) for k in range(plan.num_choices)], plan.params, plan.request_ids()
    )
    timers = [metrics.timer(start) for _ in range(plan.num_choices)]
    if endpoint.req.stream:
        first = await _prime(endpoint, request, gen)
        return SSEResponse(_stream(endpoint, plan, _chain(first, gen), timers))
    finals = await until_disconnect(request, _collect(endpoint, gen, timers))
    return JSONResponse(endpoint.reply(plan, finals).model_dump())


async def _prime(endpoint: Endpoint, request: Request, gen: AsyncIterator[Item]) -> Item | None:
    """Wait for the first output before the 200 goes out, so a refused request (bad field,
    queue full) is still an HTTP status. None when every choice ended without output."""
    try:
        return await until_disconnect(request, gen.__anext__())
    except StopAsyncIteration:
        return None
    except (APIError, ValueError, RuntimeError) as exc:
        await gen.aclose()  # type: ignore[attr-defined]
        raise endpoint.error(exc) from exc
    except BaseException:
        await gen.aclose()  # type: ignore[attr-defined]
        raise


async def _collect(
    endpoint: Endpoint, gen: AsyncIterator[Item], timers: list[RequestTimer]
) -> dict[int, RequestOutput]:
    """Run every choice to its end; the final snapshot of each, by choice index."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in gen:
            timers[index].observe(out)
            if out.finished:
                finals[index] = out
    except (APIError, ValueError, RuntimeError) as exc:
        raise endpoint.error(exc) from exc
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
    return finals


async def _chain(first: Item | None, gen: AsyncIterator[Item]) -> AsyncIterator[Item]:
    try:
        if first is not None:
            yield first
        async for item in gen:
            yield item
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


async def _stream(
    endpoint: Endpoint, plan: Plan, outputs: AsyncIterator[Item], timers: list[RequestTimer]
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    try:
        async for k, out in outputs:
            timers[k].observe(out)
            if out.finished:
                finals[k] = out
            for event in endpoint.deltas(plan, k, out):
                yield event
        for event in endpoint.flush(plan):
            yield event
        options = endpoint.req.stream_options
        if options is not None and options.include_usage:
            yield endpoint.usage_event(plan, make_usage(plan, finals))
    except Exception as exc:
        # After the 200 went out: the error is an SSE data event (clients raise on it).
        yield sse_event(error_json(endpoint.error(exc)))
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE

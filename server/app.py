"""FastAPI app: routes, engine lifecycle, summary line.

The model loads in a background thread started by the lifespan, so the port is open at
once and ``/health`` answers 503 while loading (a container health check with a
``start_period`` sees the real state). ``/v1/*`` routes answer 503 + Retry-After until
the engine is ready. A load failure is logged and, through ``on_fatal``, ends the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config import EngineConfig
from engine.heap import trim_heap
from server.args import ServerArgs
from server.cache_report import CacheReport
from server.engine_client import RETRY_AFTER_DEAD, EngineClient
from server.errors import APIError, error_response, install_error_handlers, new_error_id
from server.fleet_info import add_fleet_routes
from server.log_limits import install_repeat_limits
from server.log_safety import exposure_warning, install_redaction
from server.metrics import ServerMetrics
from server.middleware import GuardMiddleware, bearer_matches
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.serve_chat import serve_chat
from server.serve_completions import serve_completion
from server.serving import ClientDisconnected

logger = logging.getLogger("hiserve.server")
EngineFactory = Callable[[EngineConfig], Any]
RETRY_AFTER_LOADING = 5


def default_engine_factory(config: EngineConfig) -> Any:
    from engine.async_engine import AsyncEngine

    if config.engine_process:
        from engine.engine_process import EngineProcess

        return AsyncEngine(config, EngineProcess(config))
    return AsyncEngine(config)


class ServerState:
    """What the routes share: arguments, metrics, and the engine once it is loaded."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.engine: Any = None
        self.client: EngineClient | None = None
        self.load_error: str | None = None  # logged, never sent to clients
        self.load_error_id = new_error_id()
        self.closing = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine)
        self.lock = threading.Lock()

    def require_client(self) -> EngineClient:
        if self.load_error is not None:
            raise APIError(
                503,
                f"the model failed to load (error id {self.load_error_id}); "
                "the details are in the server log under this id",
                code="load_failed",
            )
        if self.client is None:
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                code="loading",
                headers={"Retry-After": str(RETRY_AFTER_LOADING)},
            )
        if not self.engine.is_alive():
            raise APIError(
                503,
                "the engine loop is not running",
                code="engine_dead",
                headers={"Retry-After": str(RETRY_AFTER_DEAD)},
            )
        return self.client


def summary_line(args: ServerArgs, health: dict[str, Any]) -> str:
    """One line with the effective configuration and what the engine actually allocated."""
    merged = args.summary()
    merged.update({f"engine.{k}": v for k, v in health.items()})
    return "hiserve ready: " + " ".join(f"{k}={v}" for k, v in merged.items())


def create_app(
    args: ServerArgs,
    engine_factory: EngineFactory | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the app; the engine is created by ``engine_factory`` in a background thread.
    ``on_ready`` runs once it is up, before ``/health`` answers 200 (the server process
    freezes start-up's objects there)."""
    state = ServerState(args)
    factory = engine_factory or default_engine_factory

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def ready(engine: Any) -> None:
            state.engine = engine
            state.client = EngineClient(
                engine,
                args.tool_call_parser,
                max_choices=args.max_choices,
                max_choice_prompt_tokens=args.max_choice_prompt_tokens,
                trust_special_tokens=args.trust_message_special_tokens,
                cache_report=CacheReport(args.cached_tokens_scope),
                require_cache_salt=args.require_cache_salt,
                cache_salt_from_key=args.cache_salt_from_key,
            )
            print(summary_line(args, engine.health()), flush=True)
            if on_ready is not None:
                on_ready()  # before the trim: what its collection frees goes back too
            trim_heap()  # start-up's freed buffers back to the OS before serving
            watch = getattr(engine, "watch_fatal", None)
            if watch is not None:
                watch(lambda exc: loop.call_soon_threadsafe(died, exc))

        def died(exc: BaseException) -> None:
            # /health already answers 503 (the engine is not alive); exit non-zero so the
            # container restarts, instead of serving nothing.
            logger.error("the engine can no longer run, shutting down: %s", exc)
            if on_fatal is not None:
                on_fatal(exc)

        def failed(exc: BaseException) -> None:
            state.load_error = f"{type(exc).__name__}: {exc}"
            logger.error("cannot start the engine [%s]: %s", state.load_error_id, state.load_error)
            if on_fatal is not None:
                on_fatal(exc)

        def load() -> None:
            try:
                engine = factory(args.engine)
                with state.lock:
                    if state.closing:
                        return  # shut down while loading: never start the loop
                    engine.start()
                loop.call_soon_threadsafe(ready, engine)
            except BaseException as exc:
                with contextlib.suppress(RuntimeError):  # the loop may be gone already
                    loop.call_soon_threadsafe(failed, exc)

        logger.info("loading model %s on %s", args.engine.model, args.engine.device)
        # NOTE: a daemon thread, so a SIGTERM during a long load does not wait for it.
        threading.Thread(target=load, name="hiserve-load", daemon=True).start()
        yield
        with state.lock:
            state.closing = True
        if state.engine is not None:
            logger.info("draining: in-flight requests get up to %.0f s", args.shutdown_grace)
            await state.engine.shutdown(args.shutdown_grace)
        if state.client is not None:
            state.client.close()

    # The JSON content type is enforced (415) by GuardMiddleware, before parsing. The docs
    # routes load scripts from a CDN and describe every route: off unless asked for.
    docs = args.enable_docs
    app = FastAPI(
        title="hiserve",
        version="0.1.0",
        lifespan=lifespan,
        strict_content_type=False,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.hiserve = state
    install_error_handlers(app)
    install_redaction()
    install_repeat_limits()
    warning = exposure_warning(args.host, args.api_key)
    if warning is not None:
        logger.warning(warning)
    app.add_middleware(
        GuardMiddleware,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        allowed_hosts=args.allowed_hosts,
        admin_key=args.admin_key,
        metrics_public=args.metrics_public,
        body_timeout=args.body_timeout,
    )
    _add_routes(app, state)
    add_fleet_routes(app, state)
    return app


def _disconnected() -> Response:
    # 499 (nginx's "client closed request"): nobody reads it, the access log does.
    return Response(status_code=499)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    keys = tuple(k.encode("utf-8") for k in (state.args.api_key, state.args.admin_key) if k)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if state.client is None or not state.engine.is_alive():
            status = "failed" if state.load_error else "loading" if state.client is None else "dead"
            response = error_response(
                503,
                f"not ready: {status}",
                code=status,
                err_type="service_unavailable_error",
                headers={"Retry-After": str(RETRY_AFTER_LOADING)},
            )
            return response
        # A probe needs only the status; the details (model path, device, pools) are for
        # callers holding the key (all callers when the server has none).
        authorization = request.headers.get("authorization")
        if keys and not bearer_matches(
            authorization.encode("latin-1") if authorization else None, *keys
        ):
            return JSONResponse({"status": "ok"})
        info = await asyncio.to_thread(state.engine.health)
        return JSONResponse({"status": "ok", **info})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(state)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        card = _model_card(state)
        if state.client is None or model_id not in state.client.model_aliases:
            raise APIError(
                404, f"The model `{model_id}` does not exist", param="model", code="model_not_found"
            )
        return card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        client = state.require_client()
        try:
            return await serve_completion(body, request, client, state.metrics)
        except ClientDisconnected:
            return _disconnected()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        client = state.require_client()
        try:
            return await serve_chat(body, request, client, state.metrics)
        except ClientDisconnected:
            return _disconnected()

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        state.require_client()
        if not await state.engine.flush_cache():
            raise APIError(
                409,
                "cache not flushed: requests are running; retry when idle",
                code="requests_running",
            )
        return JSONResponse({"flushed": True})


def _model_card(state: ServerState) -> ModelCard:
    client = state.require_client()
    return ModelCard(
        id=client.served_model_name,
        created=state.created,
        root=str(getattr(state.engine, "model_path", "")) or None,
        max_model_len=client.max_model_len,
    )

"""OpenAI-shaped errors: one exception type, one body shape, handlers for every source."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger("hiserve.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class APIError(Exception):
    """An error that reaches the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex[:12]}"


def internal_error(
    public: str,
    exc: BaseException | None = None,
    *,
    status: int = 500,
    param: str | None = None,
    code: str | None = None,
    advice: str = "the details are in the server log under this id",
) -> APIError:
    """An error whose cause must not reach the client (exception or template engine text):
    the client gets ``public`` and an id; the detail is logged under that id."""
    error_id = new_error_id()
    logger.error("%s [%s]", public, error_id, exc_info=exc)
    return APIError(
        status,
        f"{public} (error id {error_id}); {advice}",
        param=param,
        code=code or ("internal_error" if status >= 500 else "invalid_request"),
        err_type=None if status < 500 else "server_error",
    )


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
    err_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorDetail(
            message=message,
            type=err_type or _TYPE_BY_STATUS.get(status, "server_error"),
            param=param,
            code=code,
        )
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_json(exc: APIError) -> dict[str, Any]:
    """The body of an error sent inside an SSE stream (after the 200 headers went out)."""
    detail = ErrorDetail(
        message=exc.message, type=exc.err_type, param=exc.param, code=exc.code or exc.status
    )
    return ErrorResponse(error=detail).model_dump()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",):
        loc = loc[1:]
    path: list[str] = []
    for part in loc:
        # A union member shows up as a tag ("str", "list[int]"); the field path ends there.
        if isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[](")):
            break
        path.append(str(part))
    param = ".".join(path) or None
    kind = first.get("type")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', first.get('msg', ''))}", None
    if param is None and kind == "missing":
        return "the request body is empty; send a JSON object", None
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return (
            "the request body must be a JSON object sent with Content-Type: application/json"
        ), None
    if kind == "missing" and param:
        return f"'{param}' is a required field", param
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    """Every error path returns the OpenAI body; bad input never becomes a 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status,
            exc.message,
            param=exc.param,
            code=exc.code,
            err_type=exc.err_type,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        api = internal_error(f"internal server error on {request.method} {request.url.path}", exc)
        return error_response(500, api.message, code=api.code, err_type="server_error")

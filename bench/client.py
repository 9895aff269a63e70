"""Async streaming client for an OpenAI-compatible ``/v1/completions`` endpoint.

The transport is aiohttp, whose HTTP parser is compiled: reading a streamed token event
costs the load tool about a third of httpx's CPU (33 against 99 us, json.loads included,
32 streams against a local server, 2026-12-06). On a small host the load tool shares the
cores with the server it measures, so every microsecond it spends is a step the server
did not get; see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.workloads import BenchRequest

# error_kind values; "auth" and "connect" mean no later request can succeed either.
FATAL_ERRORS = ("auth", "connect")
# The SGLang Model Gateway names the replica that served each response here.
WORKER_HEADER = "x-smg-routed-worker-id"
# The longest stream line read whole (aiohttp's limit is twice its read buffer): events
# with logprobs can be long.
READ_BUFSIZE = 1 << 20


class TargetError(Exception):
    """The target cannot be used at all (unreachable, or it rejects our key)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class RequestResult:
    """What one request measured; times are seconds, ``send_time`` is perf_counter()."""

    index: int
    conversation: int
    round: int
    prompt_len: int  # tokens (text mode: words) the client sent
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None
    retries: int = 0
    send_time: float = 0.0  # start of the last attempt
    ttft: float | None = None
    e2e_latency: float | None = None
    # gaps between streamed chunks, per token where the usage says chunks held several
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # as the server counted them (usage), else prompt_len
    output_tokens: int = 0
    cached_tokens: int | None = None
    cached_tokens_device: int | None = None  # per-tier split, where the server gives it
    cached_tokens_host: int | None = None
    cached_tokens_storage: int | None = None
    # Why the uncached prompt tokens missed (reason -> tokens), where the server says.
    cache_miss_reasons: dict[str, int] | None = None
    worker: str | None = None  # the replica a router sent it to (its response header)


def normalize_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all name the same server."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"target URL {url!r} must start with http:// or https://")
    return url


def parse_logit_bias(text: str) -> dict[str, float]:
    """``--logit-bias``: a JSON object of token id -> bias, e.g. '{"2": -100}'."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--logit-bias must be a JSON object: {exc}") from None
    if not isinstance(value, dict) or not all(
        isinstance(bias, int | float) and not isinstance(bias, bool) for bias in value.values()
    ):
        raise ValueError(
            f"--logit-bias must be a JSON object of token id -> number, got {text[:80]!r}"
        )
    return {str(token): float(bias) for token, bias in value.items()}


def _body_snippet(body: bytes) -> str:
    try:
        data = json.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message", error) if isinstance(error, dict) else error
        return str(message)[:200]
    except (ValueError, UnicodeDecodeError):
        return body.decode(errors="replace")[:200]


def _retry_after(response: aiohttp.ClientResponse) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date; fall back to our own backoff


class CompletionClient:
    """Sends workload requests to one target and measures them; one per target."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        max_retry_wait: float = 30.0,
        temperature: float = 0.0,
        logit_bias: dict[str, float] | None = None,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model
        # Sent as every request's logit_bias: e.g. {"<eos id>": -100} bans EOS on servers
        # that ignore ignore_eos, so each request runs to max_tokens there too.
        self.logit_bias = logit_bias
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.max_retry_wait = max_retry_wait
        self.temperature = temperature
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        # Made on first use: an aiohttp session belongs to the event loop that made it.
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                # No limit on the whole request (a long generation is not a failure);
                # 10 s to connect, ``timeout`` without a byte from the server.
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=10.0, sock_read=self._timeout
                ),
                connector=aiohttp.TCPConnector(limit=0),  # as many as the workload sends
                read_bufsize=READ_BUFSIZE,
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def probe(self) -> list[str]:
        """Check the target answers and accepts our key; return its model ids."""
        try:
            async with self._session().get(
                self.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=15.0)
            ) as response:
                status, body = response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise TargetError(
                "connect",
                f"cannot reach {self.base_url} ({type(exc).__name__}: {exc or 'no detail'}); "
                "is the server running and the URL right?",
            ) from exc
        if status in (401, 403):
            raise TargetError("auth", self._auth_message(status, body))
        if status != 200:
            return []  # not every server lists models; the completions will tell
        try:
            return [str(m["id"]) for m in json.loads(body).get("data", [])]
        except (ValueError, KeyError, TypeError, AttributeError):
            return []

    async def flush_cache(self) -> bool:
        """Empty the target's prefix cache; False where it has no ``/flush_cache``."""
        methods = ["POST", "GET"]
        for _attempt in range(20):
            try:
                async with self._session().request(
                    methods[0],
                    self.base_url + "/flush_cache",
                    timeout=aiohttp.ClientTimeout(total=60.0),
                ) as response:
                    status = response.status
                    await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
            if status == 405 and len(methods) > 1:
                methods.pop(0)  # older servers flush on GET
                continue
            if status in (401, 403):
                # A fleet's /flush_cache takes the admin key, never a client's: the run goes
                # on unflushed (the caller notes it), as against a server without the route.
                return False
            if status in (409, 503):  # still busy with earlier requests
                await asyncio.sleep(0.5)
                continue
            return status == 200
        return False

    def _auth_message(self, status: int, body: bytes) -> str:
        return (
            f"{self.base_url} rejected the request with HTTP {status} "
            f"({_body_snippet(body)}); pass the server's key with --api-key"
        )

    def _payload(self, request: BenchRequest) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model or "default",
            "prompt": request.text if request.text is not None else request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.logit_bias is not None:
            payload["logit_bias"] = self.logit_bias
        return payload

    async def complete(self, request: BenchRequest) -> RequestResult:
        """Send one request, retrying 503/429 and refused connections with backoff."""
        result = RequestResult(
            request.index, request.conversation, request.round, len(request.prompt)
        )
        payload = self._payload(request)
        for attempt in range(self.max_retries + 1):
            result.retries = attempt
            wait = await self._attempt(payload, result)
            if wait is None or attempt == self.max_retries:
                break
            await asyncio.sleep(min(self.max_retry_wait, wait))
        if not result.ok and result.error_kind == "overloaded":
            result.error = f"{result.error} (gave up after {self.max_retries} retries)"
        return result

    async def _attempt(self, payload: dict[str, Any], result: RequestResult) -> float | None:
        """One try; returns how long to wait before retrying, or None when done."""
        backoff = self.retry_backoff * (2**result.retries)
        result.ok, result.error, result.error_kind = False, None, None
        result.itl, result.ttft = [], None
        start = result.send_time = time.perf_counter()
        try:
            async with self._session().post(
                self.base_url + "/v1/completions", json=payload
            ) as response:
                if response.status != 200:
                    return self._http_error(response, await response.read(), result, backoff)
                result.worker = response.headers.get(WORKER_HEADER)
                await self._read_stream(response, result, start)
        except aiohttp.ClientConnectorError as exc:
            result.error_kind = "connect"
            result.error = f"cannot connect to {self.base_url}: {exc or type(exc).__name__}"
            return backoff
        except asyncio.TimeoutError as exc:  # aiohttp's connect and read timeouts
            result.error_kind = "timeout"
            result.error = f"timed out waiting for {self.base_url} ({type(exc).__name__})"
            return None
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a line past the buffer
            result.error_kind = "protocol"
            result.error = (
                f"connection to {self.base_url} broke mid-response "
                f"({type(exc).__name__}: {exc or 'no detail'})"
            )
            return None
        return None

    def _http_error(
        self, response: aiohttp.ClientResponse, body: bytes, result: RequestResult, backoff: float
    ) -> float | None:
        status = response.status
        if status in (401, 403):
            result.error_kind, result.error = "auth", self._auth_message(status, body)
            return None
        if status in (429, 503):
            result.error_kind = "overloaded"
            result.error = f"server overloaded (HTTP {status}: {_body_snippet(body)})"
            retry_after = _retry_after(response)
            return max(backoff, retry_after) if retry_after is not None else backoff
        result.error_kind = "http"
        result.error = f"HTTP {status} from /v1/completions: {_body_snippet(body)}"
        return None

    async def _read_stream(
        self, response: aiohttp.ClientResponse, result: RequestResult, start: float
    ) -> None:
        last_chunk: float | None = None
        chunks = 0
        usage: dict[str, Any] | None = None
        async for line in response.content:  # lines, each with its b"\n"
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            try:
                event = json.loads(data)
            except ValueError:
                text = data[:120].decode(errors="replace")
                result.error_kind = "protocol"
                result.error = f"unparseable stream event from the server: {text!r}"
                return
            if event.get("error"):
                error = event["error"]
                result.error_kind = "http"
                result.error = str(
                    error.get("message", error) if isinstance(error, dict) else error
                )[:200]
                return
            now = time.perf_counter()
            if event.get("choices"):
                # NOTE: a chunk counts as a token event even with empty text: a token that
                # ends inside a UTF-8 character streams no text of its own.
                chunks += 1
                if last_chunk is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last_chunk)
                last_chunk = now
            if event.get("usage"):
                usage = event["usage"]
        end = time.perf_counter()
        if last_chunk is None:
            result.error_kind = "protocol"
            result.error = "the stream ended without any token"
            return
        result.e2e_latency = end - start
        result.prompt_tokens = result.prompt_len
        result.output_tokens = chunks
        if usage is not None:
            _apply_usage(result, usage)
        if 1 < chunks < result.output_tokens:
            # Chunks of several tokens (a server's --stream-interval): each gap is divided
            # by the tokens a chunk brought on average (only the total is reported).
            per_chunk = (result.output_tokens - 1) / (chunks - 1)
            result.itl = [gap / per_chunk for gap in result.itl]
        result.ok = True


def _apply_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_len)
    result.output_tokens = int(usage.get("completion_tokens") or result.output_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])
    for tier in ("device", "host", "storage"):
        value = details.get(f"cached_tokens_{tier}")
        if value is not None:
            setattr(result, f"cached_tokens_{tier}", int(value))
    reasons = details.get("cache_miss_reasons")
    if isinstance(reasons, dict):
        result.cache_miss_reasons = {str(k): int(v) for k, v in reasons.items()}

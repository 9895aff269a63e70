"""Bridge between HTTP handlers and the engine loop.

The engine runs in its own thread (``AsyncEngine``); this side keeps tokenizer work off
the event loop and fans one HTTP request out into several engine requests (``n`` > 1,
several prompts), merging their output streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.async_engine import EngineDeadError, EngineOverloadedError
from engine.request import RequestOutput, SamplingParams
from server.errors import APIError
from server.tools.parsers import ToolCallParser, choose_parser
from server.tools.prompt import template_knows_tools

T = TypeVar("T")

# Retry-After (seconds) sent with 503s.
RETRY_AFTER_OVERLOADED = 1
RETRY_AFTER_DEAD = 5
_FIELD_RE = re.compile(r"^([a-z_]+)\b")
# Request fields a message from SamplingParams.validate / Engine.validate may start with.
_KNOWN_PARAMS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "logprobs",
    "prompt",
    "seed",
}


def param_of(message: str, prompt_param: str = "prompt") -> str | None:
    """The request field an engine ValueError is about (its message starts with it)."""
    match = _FIELD_RE.match(message)
    if match is None:
        return None
    name = match.group(1)
    if name == "prompt":
        return prompt_param
    return name if name in _KNOWN_PARAMS else None


def translate_engine_error(exc: BaseException, prompt_param: str = "prompt") -> APIError | None:
    """Map an engine exception onto the HTTP error it stands for; None if it is a bug."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            503,
            str(exc) or "the server is overloaded; retry later",
            code="overloaded",
            headers={"Retry-After": str(RETRY_AFTER_OVERLOADED)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(
            503,
            f"the engine is not running: {exc}",
            code="engine_dead",
            headers={"Retry-After": str(RETRY_AFTER_DEAD)},
        )
    if isinstance(exc, ValueError):
        # A GrammarError knows its field; other messages start with it.
        param = getattr(exc, "param", None) or param_of(str(exc), prompt_param)
        return APIError(400, str(exc), param=param)
    return None


class EngineClient:
    """Async access to one engine: tokenizer work in a worker thread, fan-out/merge of streams.

    NOTE: all tokenizer calls go through one worker thread; HF fast tokenizers are not safe
    to reconfigure concurrently, and one thread keeps the event loop free either way.
    """

    def __init__(self, engine: Any, tool_call_parser: str = "auto") -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hiserve-tok")
        template = getattr(self.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        # Whether the chat template renders tools itself; if not, hiserve writes the
        # tool instructions in the parser's format.
        self.template_knows_tools = template_knows_tools(template)
        self.tool_parser: ToolCallParser = choose_parser(tool_call_parser, template)

    # ---------------------------------------------------------------- properties
    @property
    def served_model_name(self) -> str:
        return str(self.engine.served_model_name)

    @property
    def model_aliases(self) -> frozenset[str]:
        """Names a request's ``model`` may use: the served name, or --model as given."""
        names = {self.served_model_name}
        config = getattr(self.engine, "config", None)
        if config is not None:
            names.add(str(config.model))
        return frozenset(names)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    # ---------------------------------------------------------------- tokenizer
    async def _in_worker(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, as ``Engine`` tokenizes a string prompt."""

        def work() -> list[list[int]]:
            return [list(self.tokenizer.encode(t)) for t in texts]

        return await self._in_worker(work)

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await self._in_worker(self.tokenizer.decode, list(token_ids))

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Apply the model's chat template (with ``tools`` when given) and tokenize."""

        def work() -> list[int]:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise APIError(
                    400, "this model has no chat template; use /v1/completions", param="messages"
                )
            kwargs: dict[str, Any] = {
                "tokenize": False,
                "add_generation_prompt": add_generation_prompt,
            }
            if continue_final_message:
                kwargs["continue_final_message"] = True
            if tools:
                kwargs["tools"] = tools
            try:
                text = self.tokenizer.apply_chat_template(messages, **kwargs)
            except Exception as exc:  # template errors are the request's fault
                raise APIError(
                    400, f"cannot apply the chat template: {exc}", param="messages"
                ) from exc
            # NOTE: the template already carries BOS and friends; do not add them twice.
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        return await self._in_worker(work)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one client per app, lives as long
    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (logprob tables); cached, microseconds when cold."""
        return str(self.tokenizer.decode([token_id]))

    # ---------------------------------------------------------------- engine
    def validate(
        self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt"
    ) -> None:
        """Engine checks plus the context-length budget, as 400 APIErrors with numbers."""
        try:
            self.engine.validate(prompt_ids, params)
        except ValueError as exc:
            param = getattr(exc, "param", None) or param_of(str(exc), prompt_param)
            raise APIError(400, str(exc), param=param) from exc
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    async def generate_many(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run several engine requests at once; yields ``(index, output)`` as they arrive.

        NOTE: closing this generator (client gone) cancels every member stream, and the
        engine aborts each request and frees its KV. The first failing member closes all.
        """
        gens = [
            self.engine.generate(p, sp, rid)
            for p, sp, rid in zip(prompts, params, request_ids, strict=True)
        ]
        if len(gens) == 1:
            try:
                async for out in gens[0]:
                    yield 0, out
            finally:
                await gens[0].aclose()
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        done = object()

        async def pump(index: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((index, out))
            except Exception as exc:
                queue.put_nowait((index, exc))
            finally:
                with contextlib.suppress(Exception):
                    await gen.aclose()  # type: ignore[attr-defined]
                queue.put_nowait((index, done))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

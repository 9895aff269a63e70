"""Bridge between HTTP handlers and the engine loop.

The engine runs in its own thread (``AsyncEngine``); this side keeps tokenizer work off
the event loop and fans one HTTP request out into several engine requests (``n`` > 1,
several prompts), merging their output streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.async_engine import EngineDeadError, EngineOverloadedError, StreamStalledError
from engine.errors import InvalidRequestError
from engine.request import RequestOutput, SamplingParams
from server.cache_report import CacheReport
from server.chat_tokens import ChatPromptEncoder
from server.errors import APIError, internal_error
from server.tools.parsers import ToolCallParser, choose_parser
from server.tools.prompt import template_knows_tools

T = TypeVar("T")

# Texts longer than this (characters) are tokenized by the bulk worker.
BULK_TEXT_CHARS = 32 * 1024
# Outputs per member that the merged stream of an n > 1 request may hold unread.
MERGE_QUEUE_PER_MEMBER = 4
# Retry-After (seconds) sent with 503s.
RETRY_AFTER_OVERLOADED = 1
RETRY_AFTER_DEAD = 5


def param_at_fault(exc: ValueError, prompt_param: str = "prompt") -> str | None:
    """The request field an engine error names (InvalidRequestError and GrammarError carry
    it; any other ValueError names none); ``prompt`` becomes the endpoint's prompt field."""
    param = exc.param if isinstance(exc, InvalidRequestError) else None
    return prompt_param if param == "prompt" else param


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
        api = internal_error("the engine is not running", exc, status=503, code="engine_dead")
        api.headers = {"Retry-After": str(RETRY_AFTER_DEAD)}
        return api
    if isinstance(exc, StreamStalledError):
        return APIError(408, str(exc), code="stream_stalled")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param_at_fault(exc, prompt_param))
    return None


class EngineClient:
    """Async access to one engine: tokenizer work in a worker thread, fan-out/merge of streams.

    NOTE: all tokenizer calls go through one worker thread; HF fast tokenizers are not safe
    to reconfigure concurrently, and one thread keeps the event loop free either way.
    """

    def __init__(
        self,
        engine: Any,
        tool_call_parser: str = "auto",
        max_choices: int = 256,
        max_choice_prompt_tokens: int = 131072,
        trust_special_tokens: bool = False,
        cache_report: CacheReport | None = None,
        require_cache_salt: bool = False,
        cache_salt_from_key: bool = False,
    ) -> None:
        self.engine = engine
        self.require_cache_salt = require_cache_salt
        self.cache_salt_from_key = cache_salt_from_key
        self.cache_report = cache_report or CacheReport("all")
        self.tokenizer = engine.tokenizer
        self.max_choices = max_choices
        self.max_choice_prompt_tokens = max_choice_prompt_tokens
        self.chat_encoder = ChatPromptEncoder(self.tokenizer, trust_special_tokens)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hiserve-tok")
        # Texts past BULK_TEXT_CHARS are tokenized by a second worker with its own copy of
        # the tokenizer, so one huge prompt never queues small requests behind it.
        self._bulk_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hiserve-bulk")
        self._bulk_encoder: ChatPromptEncoder | None = None
        self.max_prompt_bytes = prompt_byte_bound(self.tokenizer, self.max_model_len)
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

    @property
    def max_grammar_choices(self) -> int:
        return int(getattr(self.engine.config, "max_grammar_choices", 8))

    @property
    def max_logprob_entries(self) -> int:
        return int(getattr(self.engine.config, "max_logprob_entries", 1 << 20))

    @property
    def max_logit_bias(self) -> int:
        return int(getattr(self.engine.config, "max_logit_bias", 300))

    # ---------------------------------------------------------------- tokenizer
    async def _in_worker(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def _in_bulk_worker(self, fn: Callable[[ChatPromptEncoder], T]) -> T:
        def work() -> T:
            if self._bulk_encoder is None:
                tokenizer = copy.deepcopy(self.tokenizer)
                self._bulk_encoder = ChatPromptEncoder(
                    tokenizer, self.chat_encoder.trust_special_tokens
                )
            return fn(self._bulk_encoder)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._bulk_executor, work)

    def check_text_size(self, texts: Sequence[str], param: str) -> None:
        """Reject text that cannot fit the context, before it is tokenized: no token is
        longer than the vocabulary's longest, so past ``max_prompt_bytes`` the text needs
        more tokens than the context holds."""
        if self.max_prompt_bytes is None:
            return
        size = 0
        for text in texts:
            # len() first: a string longer in characters than the bound is too long in bytes.
            size += len(text) if len(text) > self.max_prompt_bytes else len(text.encode())
            if size > self.max_prompt_bytes:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens; "
                    f"the {param} text is over {self.max_prompt_bytes} bytes, more than that "
                    "many tokens can hold. Shorten it.",
                    param=param,
                    code="context_length_exceeded",
                )

    async def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, as ``Engine`` tokenizes a string prompt."""

        if sum(len(t) for t in texts) > BULK_TEXT_CHARS:
            return await self._in_bulk_worker(
                lambda enc: [list(enc.tokenizer.encode(t)) for t in texts]
            )

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
        """Apply the model's chat template and tokenize the result; message content is
        text (see ``ChatPromptEncoder``) unless --trust-message-special-tokens is set."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        self.check_text_size([m.get("content") or "" for m in messages], "messages")
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = tools

        def work(encoder: ChatPromptEncoder) -> list[int]:
            try:
                return encoder.encode(messages, **kwargs)
            except Exception as exc:  # template errors are the request's fault
                # NOTE: template engine text stays in the log; the client gets an id.
                raise internal_error(
                    "the chat template could not be applied to these messages",
                    exc,
                    status=400,
                    param="messages",
                    advice="check the roles and their order; the details are in the "
                    "server log under this id",
                ) from exc

        if sum(len(m.get("content") or "") for m in messages) > BULK_TEXT_CHARS:
            return await self._in_bulk_worker(work)
        return await self._in_worker(lambda: work(self.chat_encoder))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one client per app, lives as long
    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (logprob tables); cached, microseconds when cold."""
        return str(self.tokenizer.decode([token_id]))

    # ---------------------------------------------------------------- engine
    def check_context(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The context budget: prompt and max_tokens together must fit the context (a 400
        as OpenAI words it; the engine itself would end such a request at the limit)."""
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
        # NOTE: the engine validates each choice at this call (InvalidRequestError names
        # the field) and queues nothing until a stream is read: a bad field or budget
        # fails here, before any choice of the request is queued.
        gens = [
            self.engine.generate(p, sp, rid)
            for p, sp, rid in zip(prompts, params, request_ids, strict=True)
        ]
        for prompt_ids, sp in zip(prompts, params, strict=True):
            self.check_context(prompt_ids, sp)
        if len(gens) == 1:
            try:
                async for out in gens[0]:
                    yield 0, out
            finally:
                await gens[0].aclose()
            return
        # NOTE: bounded, so a reader that stops reading stops the pumps too; the engine
        # then holds back (and past --stream-stall-timeout ends) each member's stream.
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(
            maxsize=MERGE_QUEUE_PER_MEMBER * len(gens)
        )
        done = object()

        async def pump(index: int, gen: AsyncIterator[RequestOutput]) -> None:
            # NOTE: nothing is put in the queue on cancellation: it may be full, and the
            # reader that cancels us is gone.
            try:
                async for out in gen:
                    await queue.put((index, out))
                await queue.put((index, done))
            except Exception as exc:
                await queue.put((index, exc))
            finally:
                with contextlib.suppress(Exception):
                    await gen.aclose()  # type: ignore[attr-defined]

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
        self._bulk_executor.shutdown(wait=False, cancel_futures=True)


def prompt_byte_bound(tokenizer: Any, max_model_len: int) -> int | None:
    """Most UTF-8 bytes a prompt that fits the context can have; None if unknown.

    Every token stands for at most as many bytes as the longest vocabulary entry (counted
    as the UTF-8 of its vocabulary string, which for byte-level BPE over-counts), so a
    text longer than ``max_model_len`` times that needs more tokens than fit.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    if not vocab:
        return None
    longest = max(len(str(token).encode("utf-8")) for token in vocab)
    return max_model_len * longest

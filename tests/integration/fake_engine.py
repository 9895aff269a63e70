"""A scripted stand-in for AsyncEngine: the server's view of an engine, with switches for
the states a real model makes slow or hard to provoke (loading, overloaded, dead loop)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine.async_engine import EngineDeadError, EngineOverloadedError
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kvcache.miss_reasons import MissReasons
from engine.request import RequestOutput, SamplingParams, TokenLogprob


class ByteTokenizer:
    """Token id = byte + 3 (0 pad, 1 bos, 2 eos); a trivial chat template."""

    chat_template = "fake"
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **_: Any,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """AsyncEngine's interface; emits 'a', 'b', 'c', ... one token per ``step_delay``."""

    def __init__(self, config: EngineConfig, step_delay: float = 0.002) -> None:
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.model_path = Path("fake-model")
        self.max_model_len = 256
        self.vocab_size = 259
        self.served_model_name = "fake-model"
        self.step_delay = step_delay
        self.alive = False
        self.overloaded = False
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.calls: list[tuple[str, SamplingParams]] = []
        self.seen: set[tuple[str | int | None, ...]] = set()
        self.shutdown_called = False
        # A canned reply (one token per byte) instead of "abc...": what a model would write.
        self.reply: str | None = None
        self.prompts: list[list[int]] = []

    def start(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the context length is {self.max_model_len}",
                param="prompt",
            )
        params.validate(self.vocab_size)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        # As AsyncEngine.generate: validated at the call, before anything is queued.
        self.validate(prompt_ids, params)
        if self.overloaded:
            raise EngineOverloadedError("server overloaded: 9 requests waiting; retry later")
        return self._generate(prompt_ids, params, request_id)

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if not self.alive:
            raise EngineDeadError("loop stopped")
        self.calls.append((request_id, params))
        self.prompts.append(list(prompt_ids))
        # A hit on a prompt seen before under the same cache_salt, as the real caches do.
        seen_key = (params.cache_salt, *prompt_ids)
        cached = len(prompt_ids) - 1 if seen_key in self.seen else 0
        # A repeat misses its last token only; a new prompt was never seen but that one.
        missed = MissReasons(never_seen=len(prompt_ids) - 1 - cached, below_page=1)
        self.seen.add(seen_key)
        self.running[request_id] = len(prompt_ids)
        done = False
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        text = ""
        reply = None if self.reply is None else self.reply.encode("utf-8")
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.step_delay)
                if reply is None:
                    token = 3 + ord("a") + i % 26
                    new = chr(ord("a") + i % 26)
                else:
                    token = 3 + reply[i]
                    # A partial UTF-8 character shows up once it is complete.
                    new = reply[: i + 1].decode("utf-8", errors="ignore")[len(text) :]
                ids.append(token)
                text += new
                self.running[request_id] += 1
                lp = TokenLogprob(token, -0.25, {token: -0.25, token + 1: -2.0})
                lps.append(lp)
                reason = "length" if i == params.max_tokens - 1 else None
                if reply is not None and i == len(reply) - 1:
                    reason = "stop"
                for stop in params.stop:
                    if text.endswith(stop):
                        text, new, reason = text[: -len(stop)], "", "stop"
                done = reason is not None
                want = params.logprobs is not None
                yield RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=prompt_ids,
                    token_ids=list(ids),
                    text=text,
                    new_token_ids=[token],
                    new_text=new,
                    finished=done,
                    finish_reason=reason,
                    cached_tokens=cached,
                    cached_tokens_device=cached,
                    cached_tokens_host=0,
                    cache_miss_reasons=missed,
                    logprobs=list(lps) if want else None,
                    new_logprobs=[lp] if want else None,
                )
                if done:
                    return
        finally:
            self.running.pop(request_id, None)
            if not done:
                self.aborted.append(request_id)

    def stats(self) -> dict[str, float]:
        return {
            "kv_total": 4096,
            "kv_used": sum(self.running.values()),
            "running": len(self.running),
            "waiting": 0,
            "prompt_tokens_total": 10,
            "cached_tokens_device_total": 4,
            "prompt_tokens_missed_never_seen_total": 5,
            "prompt_tokens_missed_below_page_total": 1,
        }

    def health(self) -> dict[str, Any]:
        return {
            "device": "cpu",
            "dtype": "float32",
            "kv_total_tokens": 4096,
            "hicache": False,
            "host_alloc_method": None,
            "pinned": False,
        }

    async def flush_cache(self) -> bool:
        return not self.running

    async def shutdown(self, grace_s: float) -> None:
        self.shutdown_called = True
        self.alive = False

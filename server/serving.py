"""What the generation endpoints share: request caps, sampling params, the plan, usage.

The sequence they follow is server/endpoint_frame.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from engine.grammar_spec import GrammarSpec
from engine.kvcache.miss_reasons import MissReasons
from engine.request import RequestOutput, SamplingParams
from server.engine_client import EngineClient
from server.errors import APIError
from server.protocol import CacheMissReasons, PromptTokensDetails, UsageInfo, _SamplingRequest
from server.tenant_salt import engine_salt

logger = logging.getLogger("hiserve.server")
T = TypeVar("T")
Item = tuple[int, RequestOutput]
SEED_MOD = 2**63


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def check_request(req: _SamplingRequest, client: EngineClient, num_prompts: int = 1) -> None:
    """Model name, fields we parse but cannot honour, and the per-request caps; all of it
    before any per-prompt or per-choice work."""
    choices = num_prompts * (req.n or 1)
    if choices > client.max_choices:
        raise APIError(
            400,
            f"this request asks for {choices} choices ({num_prompts} prompt(s) x n={req.n or 1}); "
            f"at most {client.max_choices} are allowed per request (--max-choices). "
            "Split it into several requests.",
            param="n",
            code="too_many_choices",
        )
    if req.model is not None and req.model not in client.model_aliases:
        raise APIError(
            404,
            f"The model `{req.model}` does not exist; this server serves "
            f"`{client.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    if client.require_cache_salt and req.cache_salt is None:
        raise APIError(
            400,
            "this server keeps each tenant's cached prompts apart and requires a cache_salt "
            "(--require-cache-salt): send a secret string naming your tenant, e.g. "
            '"cache_salt": "<a random token of your team>"',
            param="cache_salt",
            code="cache_salt_required",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )


def parse_logit_bias(
    raw: dict[str, float] | None, max_entries: int
) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` object as (token id, bias) pairs in ascending id order.

    The keys are JSON strings: each must be an integer written in ASCII digits. The count
    is bounded before any key is read; the engine checks the ids against the vocabulary
    and the values' range (``SamplingParams.validate``)."""
    if not raw:
        return ()
    if len(raw) > max_entries:
        raise APIError(
            400,
            f"logit_bias has {len(raw)} entries; at most {max_entries} are allowed "
            "(--max-logit-bias)",
            param="logit_bias",
        )
    pairs: dict[int, float] = {}
    for key, bias in raw.items():
        digits = key[1:] if key.startswith("-") else key
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
            raise APIError(
                400,
                f"logit_bias keys must be token ids, integers such as '50256'; got {key[:40]!r}",
                param="logit_bias",
            )
        token_id = int(key)
        if token_id in pairs:
            raise APIError(400, f"logit_bias names token id {token_id} twice", param="logit_bias")
        pairs[token_id] = bias
    return tuple(sorted(pairs.items()))


def sampling_params(
    req: _SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    seed: int | None,
    vocab_size: int,
    stop_token_ids: frozenset[int] = frozenset(),
    logit_bias: tuple[tuple[int, float], ...] = (),
) -> SamplingParams:
    """Map request fields onto SamplingParams; None always means the default."""
    top_k = (
        -1 if req.top_k is None or req.top_k in (0, -1) or req.top_k >= vocab_size else req.top_k
    )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        seed=seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=stop,
        stop_token_ids=stop_token_ids,
        logit_bias=logit_bias,
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens is not False,
    )


@dataclass
class Plan:
    """One HTTP request fanned out into engine requests: choice k = prompt k // n, sample k % n."""

    base_id: str
    prompts: list[list[int]]  # distinct prompts
    n: int
    params: list[SamplingParams] = field(default_factory=list)  # one per choice
    # Per prompt, the cached tokens its caller may be told about (None: all of them);
    # see server/cache_report.py.
    own_tokens: list[int] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]

    def request_ids(self) -> list[str]:
        return [f"{self.base_id}-{k}" for k in range(self.num_choices)]


def make_plan(
    client: EngineClient,
    req: _SamplingRequest,
    base_id: str,
    prompts: list[list[int]],
    max_tokens: Callable[[list[int]], int],
    logprobs: int | None,
    logprobs_param: str,
    grammar: GrammarSpec | None = None,
    authorization: str | None = None,
    prompt_logprobs: int | None = None,
) -> Plan:
    """The request's choices, after the caps that bound the whole request (choices,
    prompt tokens copied, constrained choices, logprob entries).

    The fields themselves are validated by the engine, once per choice, when the choices
    start (``AsyncEngine.generate``, before any is queued); the context budget of each is
    checked there too (``EngineClient.generate_many``). The samples of one prompt differ
    only in their seed: they share one SamplingParams (and its stop-id set); every
    choice shares one ``logit_bias`` tuple, parsed once.

    ``logprobs_param``: the field that asks for logprobs (``logprobs``, ``top_logprobs``).

    ``grammar``: the output constraint every choice follows (each engine request gets
    its own matcher; the spec itself is shared).

    ``authorization``: the caller's Authorization header, for ``--cached-tokens-scope``.

    ``prompt_logprobs``: score each prompt with this top-N. Only the first choice of a
    prompt scores it (scoring computes the whole prompt; the other choices reuse that
    KV), unless max_tokens is 0, where scoring is all a choice does.
    """
    plan = Plan(base_id=base_id, prompts=prompts, n=req.n or 1)
    copied = sum(len(p) for p in prompts) * plan.n
    if plan.num_choices > 1 and copied > client.max_choice_prompt_tokens:
        raise APIError(
            400,
            f"this request's {plan.num_choices} choices read {copied} prompt tokens in all "
            f"(prompt length x n={plan.n}); at most {client.max_choice_prompt_tokens} are "
            "allowed per request (--max-choice-prompt-tokens). Lower n, or shorten the prompt.",
            param="n",
            code="too_many_prompt_tokens",
        )
    if grammar is not None and plan.num_choices > client.max_grammar_choices:
        raise APIError(
            400,
            f"this request asks for {plan.num_choices} constrained choices ({grammar.param}); "
            f"at most {client.max_grammar_choices} are allowed (--max-grammar-choices). "
            "Lower n or split the request.",
            param="n",
            code="too_many_choices",
        )
    entries = 0  # logprob entries the whole response may carry
    stop_token_ids = frozenset(req.stop_token_ids or ())
    logit_bias = parse_logit_bias(req.logit_bias, client.max_logit_bias)
    for prompt in prompts:
        base = sampling_params(
            req,
            max_tokens=max_tokens(prompt),
            logprobs=logprobs,
            seed=None,
            vocab_size=client.vocab_size,
            stop_token_ids=stop_token_ids,
            logit_bias=logit_bias,
        )
        base.grammar = grammar
        base.group = base_id  # every copy shares ``base``: the scheduler takes turns
        base.cache_salt = engine_salt(req.cache_salt, authorization, client.cache_salt_from_key)
        base.prompt_logprobs = prompt_logprobs
        base.stream = bool(req.stream)
        if logprobs is not None:
            entries += plan.n * base.max_tokens * (1 + logprobs)
        rest = base
        if prompt_logprobs is not None and base.max_tokens > 0:
            rest = dataclasses.replace(base, prompt_logprobs=None)
        for sample in range(plan.n):
            params = base if sample == 0 else rest
            if req.seed is not None:
                seed = (req.seed + sample) % SEED_MOD
                params = dataclasses.replace(params, seed=seed)
            plan.params.append(params)
    if entries > client.max_logprob_entries:
        param = logprobs_param
        raise APIError(
            400,
            f"this request may return {entries} logprob entries ({plan.num_choices} choices x "
            f"max_tokens x (1 + {param}={logprobs})); at most {client.max_logprob_entries} "
            "are allowed (--max-logprob-entries). Lower n, max_tokens or "
            f"{param}.",
            param=param,
            code="too_many_logprobs",
        )
    plan.own_tokens = client.cache_report.own_prefixes(authorization, prompts)
    return plan


def reported_cache(out: RequestOutput, limit: int | None) -> tuple[int, int, int]:
    """Cached tokens (device, host, storage) a caller is told, at most ``limit`` in all.

    The cached prefix is the device hits, then the host hits, then the storage hits, so
    a limit (--cached-tokens-scope) cuts it from the storage end."""
    tiers = (out.cached_tokens_device, out.cached_tokens_host, out.cached_tokens_storage)
    if limit is None:
        return tiers
    device = min(tiers[0], limit)
    host = min(tiers[1], limit - device)
    return device, host, min(tiers[2], limit - device - host)


def make_usage(plan: Plan, finals: dict[int, RequestOutput]) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample); cached split from sample 0."""
    prompt_tokens = sum(len(p) for p in plan.prompts)
    completion_tokens = sum(len(out.token_ids) for out in finals.values())
    device = host = storage = 0
    missed = MissReasons()
    for p in range(len(plan.prompts)):
        first = finals.get(p * plan.n)
        if first is not None:
            limit = None if plan.own_tokens is None else plan.own_tokens[p]
            d, h, s = reported_cache(first, limit)
            device, host, storage = device + d, host + h, storage + s
            missed += first.cache_miss_reasons
    # NOTE: evicted vs never_seen says whether anyone sent a prefix before: where the
    # scope limits what a caller learns about others' prompts, the reasons are left out.
    reasons = CacheMissReasons(**missed.as_dict()) if plan.own_tokens is None else None
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=device + host + storage,
            cached_tokens_device=device,
            cached_tokens_host=host,
            cached_tokens_storage=storage,
            cache_miss_reasons=reasons,
        ),
    )


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (aborting requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()

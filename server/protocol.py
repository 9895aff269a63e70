"""OpenAI request and response schemas (completions, chat completions, models, errors).

Unknown request fields are ignored, as the OpenAI API and vLLM do for forward
compatibility; fields this server parses but cannot honour are rejected with 400
(``suffix``, ``best_of`` > ``n``, image content). ``logit_bias`` is parsed here (an
object of numbers; anything wrong inside it is reported as ``logit_bias`` itself), its
keys become token ids in server/serving.py, and the engine checks ids and values.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from engine.cache_salt import MAX_CACHE_SALT_CHARS

MAX_N = 128
SEED_MAX = 2**63 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    # NaN/inf never reach the engine: json.loads accepts them, pydantic then rejects them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (a JSON key, so a string) -> bias in [-100, 100] (the engine checks the range).
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # vLLM's name: the tenant whose cached KV this request may reuse (every tier); see
    # docs/cache-security.md. The engine checks it again (engine/cache_salt.py).
    cache_salt: StrictStr | None = Field(
        default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS
    )
    # vLLM/SGLang extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=0, ge=0)
    skip_special_tokens: bool | None = True
    # Structured outputs, at most one per request (server/constraints.py reads them):
    # vLLM's structured_outputs and its older guided_* fields, SGLang's regex/ebnf/json_schema.
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _logit_bias_as_one_param(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A bad entry's error names the field the client sent, ``logit_bias``, not
        ``logit_bias.<key>``."""
        try:
            return handler(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = f"at key {str(first['loc'][0])[:40]!r}: " if first["loc"] else ""
            raise ValueError(
                f"expected an object of token id -> bias in [-100, 100]; {where}{first['msg']}"
            ) from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    # 0 only with echo: the prompt is scored and nothing generated (checked when served).
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    # The upper bound is --max-logprobs, checked with the engine's other limits.
    logprobs: int | None = Field(default=None, ge=0)
    # vLLM: top-N per prompt token (0: the prompt token only), in each choice's
    # ``prompt_logprobs``; -1 (the whole vocabulary) is refused.
    prompt_logprobs: int | None = Field(default=None, ge=0)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    response_format: dict[str, Any] | None = None


class TextContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)  # <= --max-logprobs
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool | None = True
    prompt_logprobs: int | None = None  # vLLM's; refused here (see serve_chat)
    continue_final_message: bool | None = False


# ---------------------------------------------------------------- responses


class CacheMissReasons(BaseModel):
    """Uncached prompt tokens by why they missed (engine/kvcache/miss_reasons.py):
    ``cached_tokens`` plus all of these is ``prompt_tokens``."""

    never_seen: int = 0
    evicted: int = 0
    below_page: int = 0
    not_loaded: int = 0
    storage_timeout: int = 0
    not_routed: int = 0  # only a router could know; always 0 from one server


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Extras that OpenAI clients ignore: where the cached tokens came from.
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0  # read from the L3 store, then loaded back
    # Why the rest missed; None (left out of the JSON) where --cached-tokens-scope hides
    # whose prompts are cached.
    cache_miss_reasons: CacheMissReasons | None = None

    @model_serializer(mode="wrap")
    def _leave_out_hidden(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("cache_miss_reasons") is None:
            data.pop("cache_miss_reasons", None)
        return data


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry for one candidate at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's prompt_logprobs: None for the first token, then token id -> entry.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One fragment of a streamed tool call; fragments with the same index concatenate."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hiserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail

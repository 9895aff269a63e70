"""A request checked against the engine's limits before it is queued: the prompt (empty,
token ids outside the vocabulary, longer than the context or the KV pool), the sampling
parameters (SamplingParams.validate, with the configured caps) and the grammar's cheap
checks (grammar_spec.check_spec). Each failure is an InvalidRequestError naming the
field at fault."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.grammar_spec import check_spec
from engine.request import SamplingParams


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    config: EngineConfig,
    vocab_size: int,
    max_model_len: int,
    kv_capacity: int,
) -> None:
    """Raise InvalidRequestError naming the field at fault (``prompt`` for the prompt)."""
    if not prompt_ids:
        raise InvalidRequestError("prompt is empty; send at least one token", param="prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            param="prompt",
        )
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(prompt_ids)} tokens; the context length is "
            f"{max_model_len}, which must also leave room for at least one output token",
            param="prompt",
        )
    if len(prompt_ids) + 1 > kv_capacity:
        raise InvalidRequestError(
            f"prompt has {len(prompt_ids)} tokens but the KV pool holds only "
            f"{kv_capacity}; raise --kv-cache-tokens",
            param="prompt",
        )
    params.validate(
        vocab_size,
        config.max_stop_strings,
        config.max_stop_token_ids,
        config.max_logprobs,
        config.max_stop_chars,
        config.max_logit_bias,
    )
    if params.grammar is not None:
        check_spec(params.grammar)

"""Request errors carry the field at fault as data (engine/errors.py), so the server maps
them to a 400 with ``param`` without reading the message."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.grammar_spec import GrammarError
from engine.request import SamplingParams
from server.engine_client import param_at_fault, translate_engine_error

ROOT = Path(__file__).resolve().parents[2]
BAD_FIELDS = {
    "max_tokens": {"max_tokens": -1},
    "temperature": {"temperature": -0.5},
    "top_p": {"top_p": 0.0},
    "top_k": {"top_k": -3},
    "min_p": {"min_p": 1.5},
    "presence_penalty": {"presence_penalty": 3.0},
    "frequency_penalty": {"frequency_penalty": -3.0},
    "repetition_penalty": {"repetition_penalty": 0.0},
    "stop": {"stop": ["a"] * 17},
    "stop_token_ids": {"stop_token_ids": [10**9]},
    "logit_bias": {"logit_bias": ((10**9, 1.0),)},
    "min_tokens": {"min_tokens": 99, "max_tokens": 4},
    "logprobs": {"logprobs": 50},
    "prompt_logprobs": {"prompt_logprobs": 50},
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
def test_each_bad_field_is_named_by_the_error(field: str) -> None:
    params = dataclasses.replace(SamplingParams(), **BAD_FIELDS[field])
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(vocab_size=1000)
    assert caught.value.param == field
    assert str(caught.value).startswith(field)  # the message still says it first


def test_empty_stop_string_blames_stop() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(stop=[""]).validate(vocab_size=1000)
    assert caught.value.param == "stop"


def test_the_server_takes_the_field_from_the_error_not_its_text() -> None:
    prompt = InvalidRequestError("prompt is empty; send at least one token", param="prompt")
    assert param_at_fault(prompt, "messages") == "messages"
    assert param_at_fault(prompt) == "prompt"
    # A message that starts with a field name names nothing unless the error says so.
    assert param_at_fault(ValueError("temperature looks odd")) is None
    assert param_at_fault(GrammarError("bad schema", "response_format")) == "response_format"
    api = translate_engine_error(InvalidRequestError("top_p must be in (0, 1]", "top_p"))
    assert api is not None and api.status == 400 and api.param == "top_p"


def test_engine_client_parses_no_error_text() -> None:
    tree = ast.parse((ROOT / "server" / "engine_client.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "re" not in imports and "param_of" not in names and "_KNOWN_PARAMS" not in names

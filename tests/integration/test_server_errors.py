"""Bad input gets its status and an OpenAI error body, never a 5xx; the server keeps serving.

A table of known-bad requests, then hypothesis-generated request bodies (valid, nearly
valid and garbage) against both generation routes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 9000  # more tokens than the 8192-token context
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

# (route, body or raw text, status, param)
BAD_INPUTS: list[tuple[str, Any, int, str | None]] = [
    (CMPL, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "x", "seed": -5}, 400, "seed"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [[]]}, 400, "prompt"),
    (CMPL, {"prompt": [10**9]}, 400, "prompt"),
    (CMPL, {"prompt": ["a", 1]}, 400, "prompt"),
    (CMPL, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    (CMPL, {}, 400, "prompt"),
    (CMPL, {"prompt": "x", "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    (CMPL, {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    (CMPL, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {"49152": 5}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"1": 1000}}, 400, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias"),
    (CMPL, '{"prompt": "x", "logit_bias": {"1": NaN}}', 400, "logit_bias"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"prompt": "x", "model": "nope"}, 404, "model"),
    (CMPL, '{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (CMPL, "not json at all", 400, None),
    (CMPL, "[1, 2]", 400, None),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content.0",
    ),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CMPL, {"prompt": "x", "regex": "(a"}, 400, "regex"),
    (CHAT, {"messages": USER, "guided_json": {"type": "nosuchtype"}}, 400, "guided_json"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
]


def _check_error_body(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize(
    "route,body,status,param",
    BAD_INPUTS,
    ids=[f"{i}-{r.rsplit('/', 1)[1]}" for i, (r, *_) in enumerate(BAD_INPUTS)],
)
def test_bad_input(
    http: httpx.Client, route: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, str):
        resp = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(route, json=body)
    error = _check_error_body(resp, status, param)
    if isinstance(body, dict) and LONG_PROMPT[:60] in json.dumps(body):
        assert "8192" in error["message"]  # the numbers are in the message
    assert http.get("/health").status_code == 200  # a valid request follows at the end


def test_route_and_auth_errors(http: httpx.Client, server: Any) -> None:
    _check_error_body(http.get("/v1/nope"), 404, None)
    _check_error_body(http.get(CMPL), 405, None)
    anonymous = httpx.post(server.base_url + CMPL, json={"prompt": "x"})
    assert _check_error_body(anonymous, 401, None)["code"] == "invalid_api_key"
    big = http.post(
        CMPL,
        content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}',
        headers={"Content-Type": "application/json"},
    )
    assert "8388608" in _check_error_body(big, 413, None)["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200  # open without a key
    # curl -d sends a form content type; the message says what to do
    form = http.post(
        CMPL,
        content=b'{"prompt": "x"}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert "Content-Type: application/json" in _check_error_body(form, 415, None)["message"]
    _check_error_body(
        http.post(
            CMPL,
            content=b"[" * 50_000 + b"]" * 50_000,
            headers={"Content-Type": "application/json"},
        ),
        400,
        None,
    )


# ---------------------------------------------------------------- fuzz
# A body is a valid request (every field drawn from its valid range, edges included)
# with up to two fields replaced by anything at all: valid bodies reach the engine,
# mutated ones the validators.

VOCAB = 49152
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.text(alphabet='xyz!{}[]"\\ 0\u00e9\U0001f600', max_size=8),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.lists(st.integers(-3, VOCAB + 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
words = st.text(min_size=1, max_size=30)
SAMPLING_VALID = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "top_k": st.integers(-1, 2**40),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.05, 3.0),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 2),
    "min_tokens": st.integers(0, 1),
    "stop": st.one_of(
        st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)
    ),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=3
    ),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=5),
    "skip_special_tokens": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
completion_valid = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            words,
            token_ids,
            st.lists(words, min_size=1, max_size=2),
            st.lists(token_ids, min_size=1, max_size=2),
        ),
        "max_tokens": st.integers(1, 2),
    },
    optional={
        **SAMPLING_VALID,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 20),
        "best_of": st.integers(1, 2),
        "suffix": st.just(""),
    },
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": st.one_of(
            words,
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": words}),
                min_size=1,
                max_size=2,
            ),
        ),
    }
)
chat_valid = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, 2)},
    optional={
        **SAMPLING_VALID,
        "logprobs": st.booleans(),
        "response_format": st.just({"type": "text"}),
        "tool_choice": st.just("none"),
    },
)
COMPLETION_FIELDS = sorted(
    {
        "prompt",
        "max_tokens",
        "echo",
        "logprobs",
        "best_of",
        "suffix",
        "logit_bias",
        "model",
        *SAMPLING_VALID,
    }
)
CHAT_FIELDS = sorted(
    {
        "messages",
        "max_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "response_format",
        "tool_choice",
        "add_generation_prompt",
        "continue_final_message",
        "logit_bias",
        "model",
        *SAMPLING_VALID,
    }
)


COUNT_FIELDS = frozenset({"max_tokens", "n", "best_of", "min_tokens"})


def _mutated(
    valid: st.SearchStrategy[dict[str, Any]], fields: list[str]
) -> st.SearchStrategy[dict[str, Any]]:
    mutations = st.lists(st.tuples(st.sampled_from(fields), junk), max_size=2)

    def apply(pair: tuple[dict[str, Any], list[tuple[str, Any]]]) -> dict[str, Any]:
        body, changes = pair
        body = dict(body)
        for name, value in changes:
            # NOTE: keep every generation short (a CPU runs this): no chat without
            # max_tokens (that means "until the context ends"), no large valid counts.
            if name == "max_tokens" and value is None and "messages" in body:
                continue
            if name in COUNT_FIELDS and isinstance(value, int | float) and 3 < value < 10**6:
                continue
            body[name] = value
        return body

    return st.tuples(valid, mutations).map(apply)


completion_bodies = _mutated(completion_valid, COMPLETION_FIELDS)
chat_bodies = _mutated(chat_valid, CHAT_FIELDS)
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _post_no_5xx(http: httpx.Client, route: str, body: Any) -> int:
    """POST ``body``; no 5xx, an error body on 4xx, a complete stream on 200. The status."""
    # json.dumps, not httpx's json=: it must be able to send Infinity like any lax client.
    with http.stream(
        "POST",
        route,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    ) as resp:
        text = resp.read().decode("utf-8", errors="replace")
    assert resp.status_code < 500, (body, text)
    if resp.status_code >= 400:
        assert "error" in json.loads(text)
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), text
        assert "server_error" not in text, (body, text)
    return resp.status_code


def _fuzz(http: httpx.Client, route: str, bodies: st.SearchStrategy[dict[str, Any]]) -> None:
    """Post every generated body, then check the fuzz reached the engine (not only the
    validators) and that the server still serves. Each test counts its own statuses."""
    statuses: list[int] = []

    @FUZZ
    @given(body=bodies)
    def post(body: dict[str, Any]) -> None:
        statuses.append(_post_no_5xx(http, route, body))

    post()
    print(f"{route} fuzz statuses: { {s: statuses.count(s) for s in sorted(set(statuses))} }")
    assert statuses.count(200) >= 10, statuses
    resp = http.post(CMPL, json={"prompt": "Still alive?", "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"


def test_fuzz_completions(http: httpx.Client) -> None:
    _fuzz(http, CMPL, completion_bodies)


def test_fuzz_chat(http: httpx.Client) -> None:
    _fuzz(http, CHAT, chat_bodies)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    raw=st.one_of(
        st.binary(max_size=40),
        st.text(max_size=40).map(str.encode),
        st.recursive(junk, lambda c: st.lists(c, max_size=3)).map(lambda v: json.dumps(v).encode()),
    )
)
def test_fuzz_raw_bodies(http: httpx.Client, raw: bytes) -> None:
    for route in (CMPL, CHAT):
        resp = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "error" in resp.json()

"""logit_bias through the official ``openai`` client on both generation routes.

On a scripted engine (fast): every bad value is a 400 naming ``logit_bias`` before
anything is queued, and a good one reaches the engine as token ids, one tuple shared by
every choice. On the default model (slow): +100 forces a token under greedy decoding,
checked against the HF tokenizer's decode of that token, and -100 bans the greedy token
while the returned logprobs stay the model's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from engine.request import SamplingParams
from server.app import create_app
from server.args import parse_args
from tests.integration.fake_engine import FakeEngine

KEY = "fake-key"
CAP = 4  # --max-logit-bias of the scripted server
FAKE_VOCAB = 259  # FakeEngine.vocab_size
CHAT = [{"role": "user", "content": "Name a fruit."}]

Fake = tuple[FakeEngine, openai.OpenAI]


@pytest.fixture(scope="module")
def fake(tools: SimpleNamespace) -> Iterator[Fake]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: Any) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.0)
        return holder["engine"]

    # The cap comes in through the flag, as an operator sets it.
    args = parse_args(["--max-logit-bias", str(CAP), "--api-key", KEY], environ={})
    assert args.engine.max_logit_bias == CAP
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield (
            holder["engine"],
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0),
        )


def _create(client: openai.OpenAI, route: str, **kw: Any) -> Any:
    if route == "completions":
        return client.completions.create(model="fake-model", prompt="hi", max_tokens=2, **kw)
    return client.chat.completions.create(
        model="fake-model",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=2,
        **kw,
    )


BAD_BIAS = {
    "non-integer key": ({"banana": 1}, "token ids"),
    "out of vocabulary": ({str(FAKE_VOCAB): 1}, "vocabulary"),
    "negative id": ({"-1": 1}, "vocabulary"),
    "value 1000": ({"5": 1000}, "[-100, 100]"),
    "value -100.5": ({"5": -100.5}, "[-100, 100]"),
    "not a number": ({"5": "a lot"}, "token id -> bias"),
    "too many entries": ({str(t): 1 for t in range(CAP + 1)}, "--max-logit-bias"),
    "same id twice": ({"7": 1, "07": 2}, "twice"),
}


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("case", sorted(BAD_BIAS))
def test_bad_logit_bias_is_a_400_naming_the_field(fake: Fake, route: str, case: str) -> None:
    engine, client = fake
    bias, words = BAD_BIAS[case]
    queued = len(engine.calls)
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, route, extra_body={"logit_bias": bias})
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "logit_bias", body
    assert words in body["message"], body["message"]
    assert len(engine.calls) == queued  # refused before anything was queued


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logit_bias_reaches_the_engine_shared_by_every_choice(fake: Fake, route: str) -> None:
    engine, client = fake
    queued = len(engine.calls)
    _create(client, route, n=3, seed=5, logit_bias={"7": -100, "5": 2.5, "258": 100})
    params = [p for _, p in engine.calls[queued:]]
    assert len(params) == 3
    assert params[0].logit_bias == ((5, 2.5), (7, -100.0), (258, 100.0))
    # One parsed tuple for the whole request: each choice (its own seed) holds the same.
    assert all(p.logit_bias is params[0].logit_bias for p in params)
    assert len({p.seed for p in params}) == 3
    _create(client, route)
    assert engine.calls[-1][1].logit_bias == ()


# ---------------------------------------------------------------- the default model


def _word_token(ref_engine: Any, word: str) -> int:
    ids = list(ref_engine.tokenizer.encode(word, add_special_tokens=False))
    assert len(ids) == 1, (word, ids)
    return ids[0]


@pytest.mark.slow
def test_plus_100_forces_a_token_in_completions_and_chat(
    client: openai.OpenAI, ref_engine: Any, model_name: str
) -> None:
    forced = _word_token(ref_engine, " banana")
    expected = ref_engine.tokenizer.decode([forced] * 4)
    bias = {str(forced): 100}
    plain = client.completions.create(
        model=model_name, prompt="The sky is", max_tokens=4, temperature=0
    )
    assert plain.choices[0].text != expected  # the bias is what makes the difference
    completion = client.completions.create(
        model=model_name, prompt="The sky is", max_tokens=4, temperature=0, logit_bias=bias
    )
    assert completion.choices[0].text == expected
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=model_name,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logit_bias=bias,
    )
    assert chat.choices[0].message.content == expected
    # The engine's own API gives the same tokens.
    out = ref_engine.generate(
        ["The sky is"], SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((forced, 100.0),))
    )[0]
    assert out.token_ids == [forced] * 4


@pytest.mark.slow
def test_minus_100_bans_the_greedy_token_and_logprobs_stay_raw(
    client: openai.OpenAI, ref_engine: Any, model_name: str
) -> None:
    prompt = "The capital of France is"
    greedy = ref_engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    best = greedy.token_ids[0]
    kw: dict[str, Any] = dict(
        model=model_name, prompt=prompt, max_tokens=1, temperature=0, logprobs=2
    )
    plain = client.completions.create(**kw)
    banned = client.completions.create(**kw, logit_bias={str(best): -100})
    plain_lp, banned_lp = plain.choices[0].logprobs, banned.choices[0].logprobs
    assert plain_lp is not None and banned_lp is not None
    assert plain_lp.tokens and banned_lp.tokens and plain_lp.top_logprobs and banned_lp.top_logprobs
    assert plain_lp.tokens[0] == ref_engine.tokenizer.decode([best])
    assert banned_lp.tokens[0] != plain_lp.tokens[0]
    # The banned token's choice is the model's second best, with the model's logprob...
    ranked = sorted(plain_lp.top_logprobs[0].items(), key=lambda item: -item[1])
    runner_up, runner_up_lp = ranked[1]
    assert banned_lp.tokens[0] == runner_up
    assert banned_lp.token_logprobs is not None
    assert banned_lp.token_logprobs[0] == pytest.approx(runner_up_lp, abs=1e-4)
    # ...and the alternatives are the model's too: the banned token still heads them.
    assert banned_lp.top_logprobs[0] == pytest.approx(plain_lp.top_logprobs[0], abs=1e-4)

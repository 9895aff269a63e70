"""logit_bias: the sampler adds it before sampling (greedy rows too), logprobs stay the
model's, the engine's validation names the field, and the server parses the keys."""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections import Counter
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from engine import sampler as sampler_module
from engine.errors import InvalidRequestError
from engine.request import Req, SamplingParams
from engine.sampler import Sampler, apply_logit_bias, make_generator
from server.args import parse_args
from server.errors import APIError
from server.protocol import CompletionRequest
from server.serving import parse_logit_bias

CPU = torch.device("cpu")
EOS = 2
VOCAB = 50


def make_req(**params: Any) -> Req:
    req = Req(request_id="r", prompt_ids=[5, 6], params=SamplingParams(**params))
    if req.params.seed is not None:
        req.generator = make_generator(req.params.seed, CPU)
    return req


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 3.0  # [rows, VOCAB]


# ---------------------------------------------------------------- sampler


def test_plus_100_makes_greedy_pick_the_token() -> None:
    logits = random_logits(3, seed=1)
    weakest = int(logits[0].argmin())
    reqs = [
        make_req(temperature=0.0, logit_bias={weakest: 100.0}),
        make_req(temperature=0.0),  # an unbiased neighbour keeps its own argmax
        make_req(temperature=0.0, logit_bias={weakest: 0.0}),
    ]
    before = logits.clone()
    out = Sampler(VOCAB, CPU)(logits, reqs, [EOS])
    assert out.token_ids == [weakest, int(before[1].argmax()), int(before[2].argmax())]


def test_the_bias_goes_into_the_steps_logits_unless_logprobs_need_them() -> None:
    logits = random_logits(2, seed=5)
    before = logits.clone()
    reqs = [make_req(temperature=0.0, logit_bias={7: 3.0}), make_req(temperature=0.0)]
    Sampler(VOCAB, CPU)(logits, reqs, [EOS])
    expected = before.clone()
    expected[0, 7] += 3.0
    assert torch.equal(logits, expected)  # written in place: no [B, V] copy
    # A row that asks for logprobs: the raw logits stay as they were (they are read after).
    logits = before.clone()
    reqs = [make_req(temperature=0.0, logit_bias={7: 3.0}), make_req(temperature=0.0, logprobs=1)]
    Sampler(VOCAB, CPU)(logits, reqs, [EOS])
    assert torch.equal(logits, before)
    biased = apply_logit_bias(logits, reqs, in_place=True)
    assert biased.data_ptr() == logits.data_ptr() and torch.equal(biased, expected)


def test_minus_100_on_the_argmax_makes_greedy_pick_the_second_best() -> None:
    logits = random_logits(4, seed=2)
    best, second = logits.topk(2, dim=-1).indices.unbind(dim=1)  # [4], [4]
    reqs = [make_req(temperature=0.0, logit_bias={int(best[b]): -100.0}) for b in range(4)]
    assert Sampler(VOCAB, CPU)(logits, reqs, [EOS]).token_ids == second.tolist()


def test_sampled_rows_only_draw_the_tokens_left_unbanned() -> None:
    # The two allowed tokens are the least likely ones: without the bias they would
    # (almost) never be drawn.
    logits = torch.full((1, VOCAB), 5.0)
    allowed = {7: -2.0, 31: -2.3}
    for token, value in allowed.items():
        logits[0, token] = value
    banned = {t: -100.0 for t in range(VOCAB) if t not in allowed}
    rows = 64
    reqs = [make_req(temperature=1.0, seed=100 + b, logit_bias=banned) for b in range(rows)]
    sampler = Sampler(VOCAB, CPU, seed=0)
    counts: Counter[int] = Counter()
    for _ in range(4):  # each seeded row draws again from its own generator
        counts.update(sampler(logits.repeat(rows, 1), reqs, [EOS]).token_ids)
    assert set(counts) == set(allowed)
    # e^-2 : e^-2.3 is about 57% : 43%; 256 draws.
    assert 0.4 < counts[7] / counts.total() < 0.75


def test_rows_that_share_their_logits_each_get_only_their_own_bias() -> None:
    # One row's logits expanded to two: the bias goes into a copy, not into the shared row.
    shared = random_logits(1, seed=4)
    top = int(shared[0].argmax())
    second = int(shared[0].topk(2).indices[1])
    reqs = [make_req(temperature=0.0, logit_bias={top: -100.0}), make_req(temperature=0.0)]
    before = shared.clone()
    out = Sampler(VOCAB, CPU)(shared.expand(2, VOCAB), reqs, [EOS])
    assert out.token_ids == [second, top]
    assert torch.equal(shared, before)


def test_logprobs_of_a_biased_row_are_the_raw_model_logprobs() -> None:
    logits = random_logits(2, seed=3)
    weakest = int(logits[0].argmin())
    reqs = [
        make_req(temperature=0.0, logprobs=3, logit_bias={weakest: 100.0}),
        make_req(temperature=0.7, seed=1, logprobs=2, logit_bias={weakest: 100.0}),
    ]
    out = Sampler(VOCAB, CPU)(logits, reqs, [EOS])
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_ids == [weakest, weakest]
    for row, entry in enumerate(out.logprobs):
        assert entry is not None and entry.token_id == weakest
        # The chosen token's logprob is the model's (very low), not the biased one's (~0).
        assert math.isclose(entry.logprob, raw[row, weakest].item(), abs_tol=1e-5)
        assert entry.logprob < -1.0
        assert list(entry.top) == raw[row].topk(len(entry.top)).indices.tolist()
        for token, lp in entry.top.items():
            assert math.isclose(lp, raw[row, token].item(), abs_tol=1e-5)


def test_a_bias_cannot_undo_a_grammar_mask_or_the_min_tokens_ban() -> None:
    logits = torch.zeros(1, 6)
    logits[0, 4] = float("-inf")  # what a grammar mask leaves for a forbidden token
    biased = apply_logit_bias(logits, [make_req(logit_bias={4: 100.0, 1: 2.5, 3: -1.0})])
    assert biased.tolist() == [[0.0, 2.5, 0.0, -1.0, float("-inf"), 0.0]]
    assert logits[0, 1] == 0.0  # the input is untouched
    # +100 on EOS does not end a request before min_tokens: the ban comes after.
    req = make_req(temperature=0.0, min_tokens=3, logit_bias={EOS: 100.0})
    assert Sampler(6, CPU)(torch.zeros(1, 6), [req], [EOS]).token_ids != [EOS]


def test_one_upload_for_every_biased_row(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real_upload = sampler_module.upload

    def counting_upload(values: list, device: torch.device, dtype: Any = None) -> torch.Tensor:
        calls.append(values)
        return real_upload(values, device, dtype)

    monkeypatch.setattr(sampler_module, "upload", counting_upload)
    logits = random_logits(8, seed=4)
    reqs = [make_req(logit_bias={b: 1.0, 40 + b: -1.0}) if b % 2 else make_req() for b in range(8)]
    biased = apply_logit_bias(logits, reqs)
    assert len(calls) == 1
    expected = logits.clone()
    for b in range(1, 8, 2):
        expected[b, b] += 1.0
        expected[b, 40 + b] -= 1.0
    assert torch.equal(biased, expected)
    assert apply_logit_bias(logits, [make_req()] * 8) is logits  # nothing to do: no copy
    assert len(calls) == 1


# ---------------------------------------------------------------- SamplingParams


def test_params_hold_one_shared_picklable_tuple() -> None:
    # The engine's own callers may pass a mapping; it becomes the tuple the sampler walks.
    params = SamplingParams(logit_bias={50256: -100.0, 3: 5})  # type: ignore[arg-type]
    assert params.logit_bias == ((50256, -100.0), (3, 5))
    copy = dataclasses.replace(params, seed=7)  # another choice of an n > 1 request
    assert copy.logit_bias is params.logit_bias
    assert pickle.loads(pickle.dumps(params)).logit_bias == params.logit_bias
    assert SamplingParams().logit_bias == ()


@pytest.mark.parametrize(
    "bias,words",
    [
        ({1000: 1.0}, "vocabulary [0, 1000)"),
        ({-1: 1.0}, "vocabulary"),
        ({True: 1.0}, "vocabulary"),
        ({"5": 1.0}, "vocabulary"),
        ({1: math.nan}, "[-100, 100]"),
        ({1: math.inf}, "[-100, 100]"),
        ({1: -math.inf}, "[-100, 100]"),
        ({1: 100.5}, "[-100, 100]"),
        ({1: -1000}, "[-100, 100]"),
        ({1: "5"}, "[-100, 100]"),
        (((1, 1.0), (1, 2.0)), "more than once"),
        (((1, 1.0, 2.0),), "pairs"),
    ],
)
def test_bad_entries_are_refused_naming_logit_bias(bias: Any, words: str) -> None:
    params = SamplingParams(logit_bias=bias)
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(vocab_size=1000)
    assert caught.value.param == "logit_bias"
    assert str(caught.value).startswith("logit_bias") and words in str(caught.value)


def test_entry_cap_and_edges() -> None:
    SamplingParams(logit_bias=((0, -100), (999, 100.0))).validate(vocab_size=1000)
    at_cap = SamplingParams(logit_bias=tuple((t, 1.0) for t in range(300)))
    at_cap.validate(vocab_size=1000)  # the default cap is OpenAI's 300
    with pytest.raises(InvalidRequestError, match="--max-logit-bias") as caught:
        at_cap.validate(vocab_size=1000, max_logit_bias=299)
    assert caught.value.param == "logit_bias" and "300 entries" in str(caught.value)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias=((1, 1.0),)).validate(vocab_size=1000, max_logit_bias=0)


def test_the_cap_is_a_flag_and_an_environment_variable() -> None:
    assert parse_args([], environ={}).engine.max_logit_bias == 300
    assert parse_args(["--max-logit-bias", "7"], environ={}).engine.max_logit_bias == 7
    assert parse_args([], environ={"HISERVE_MAX_LOGIT_BIAS": "5"}).engine.max_logit_bias == 5
    with pytest.raises(SystemExit):
        parse_args(["--max-logit-bias", "-1"], environ={})


# ---------------------------------------------------------------- server parsing


def test_server_parses_keys_into_sorted_token_ids() -> None:
    assert parse_logit_bias(None, 300) == ()
    assert parse_logit_bias({}, 300) == ()
    assert parse_logit_bias({"50256": -100.0, "7": 2.5}, 300) == ((7, 2.5), (50256, -100.0))
    # A negative id parses; the engine then refuses it against the vocabulary.
    assert parse_logit_bias({"-3": 1.0}, 300) == ((-3, 1.0),)


@pytest.mark.parametrize("key", ["x", "", "1.5", "1e3", " 5", "+5", "-", "\u0665", "9" * 21])
def test_server_refuses_keys_that_are_not_integers(key: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_logit_bias({key: 1.0}, 300)
    assert caught.value.status == 400 and caught.value.param == "logit_bias"
    assert "token ids" in caught.value.message


def test_server_refuses_duplicates_and_too_many_before_parsing() -> None:
    with pytest.raises(APIError, match="twice") as caught:
        parse_logit_bias({"1": 1.0, "01": 2.0}, 300)
    assert caught.value.param == "logit_bias"
    with pytest.raises(APIError, match="at most 2 are allowed") as caught:
        parse_logit_bias({"x": 1.0, "y": 1.0, "z": 1.0}, 2)  # bad keys, but the count first
    assert caught.value.param == "logit_bias"


@pytest.mark.parametrize("value", [math.nan, math.inf, "5", True, None, [1]])
def test_schema_errors_inside_logit_bias_name_the_field(value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": value}})
    errors = caught.value.errors()
    assert errors[0]["loc"] == ("logit_bias",)
    assert "token id -> bias" in errors[0]["msg"]
    ok = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": 5, "2": -0.5}})
    assert ok.logit_bias == {"1": 5.0, "2": -0.5}

"""Structured outputs through the whole engine on the default model (SmolLM2-135M)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.grammar_spec import GrammarError, GrammarSpec
from engine.request import RequestOutput
from tests.unit.mixed_log import StepLog

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PROMPT = (
    "<|im_start|>user\nDescribe a person as JSON with name, age and pet.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def engine(default_model_dir: Any) -> Iterator[Engine]:
    # A small KV pool: seven requests of ~60 tokens do not fit, so decode retracts.
    eng = Engine(
        EngineConfig(
            model="default", device="cpu", dtype="float32", kv_cache_tokens=256, page_size=1
        )
    )
    eng.check_invariants = True
    yield eng
    eng.close()


def spec() -> GrammarSpec:
    return GrammarSpec.json_schema(SCHEMA, "response_format")


def test_stop_set_is_the_engines(engine: Engine) -> None:
    assert sorted(engine.grammar.stop_token_ids) == sorted(engine.eos_token_ids)
    assert engine.grammar.vocab_size == engine.vocab_size


def test_json_validates_for_many_seeds_under_retraction(engine: Engine) -> None:
    # Compiled before the test, so that the constrained requests start with the free
    # ones: waiting for a compile, they would run after them and might all fit.
    engine.generate([PROMPT], [SamplingParams(max_tokens=1, grammar=spec())])
    retractions = engine.scheduler.num_retractions
    engine.scheduler.new_token_ratio = 0.0  # admit greedily so that decode must retract
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, top_p=0.95, seed=seed, grammar=spec())
        for seed in range(5)
    ]
    # Free requests in the same batches keep producing free text.
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=s) for s in (100, 101)]
    # Distinct first lines: copies of one prompt would share its KV and not fill the pool.
    prompts = [f"<|im_start|>system\nCase {i}.<|im_end|>\n{PROMPT}" for i in range(len(params))]
    try:
        outs = engine.generate(prompts, params)
    finally:
        engine.scheduler.new_token_ratio = 0.5
    assert engine.scheduler.num_retractions > retractions, "the pool was meant to force retraction"
    for out in outs[:5]:
        assert out.finish_reason == "stop", out.text
        assert out.token_ids[-1] in engine.eos_token_ids
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all(out.finish_reason in ("stop", "length") for out in outs[5:])


def test_greedy_choice_and_regex(engine: Engine) -> None:
    choice = GrammarSpec.choice(["red", "green", "blue"], "guided_choice")
    regex = GrammarSpec.regex(r"\d{3}-[a-z]{2}", "regex")
    outs = engine.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=10, temperature=0, grammar=choice),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3, grammar=regex),
        ],
    )
    assert outs[0].text in ("red", "green", "blue") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"\d{3}-[a-z]{2}", outs[1].text) and outs[1].finish_reason == "stop"


def test_max_tokens_first_is_length(engine: Engine) -> None:
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, grammar=spec()))
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")


def test_prefix_cache_hits_keep_working(engine: Engine) -> None:
    params = SamplingParams(max_tokens=80, temperature=0, grammar=spec())
    (first,) = engine.generate([PROMPT], params)
    (second,) = engine.generate([PROMPT], params)
    assert second.cached_tokens > 0
    assert second.text == first.text
    jsonschema.validate(json.loads(second.text), SCHEMA)


def test_bad_constraints_fail_before_queueing(engine: Engine) -> None:
    with pytest.raises(GrammarError, match="regex: invalid regular expression") as info:
        engine.add_request(PROMPT, SamplingParams(grammar=GrammarSpec.regex("(a", "regex")))
    assert info.value.param == "regex"
    assert not engine.has_work


def test_compile_timeout_ends_only_that_request(engine: Engine) -> None:
    slow = GrammarSpec.json_schema(
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 127}}},
        "response_format",
    )
    backend = engine.grammar
    saved = backend.compile_timeout_s
    backend.compile_timeout_s = 1e-6
    try:
        slow_id = engine.add_request(PROMPT, SamplingParams(max_tokens=3, grammar=slow))
    finally:
        backend.compile_timeout_s = saved
    free_id = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0))
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[slow_id].finish_reason == "abort"
    assert isinstance(finals[slow_id].error, GrammarError)
    assert "did not compile within" in str(finals[slow_id].error)
    assert finals[free_id].finish_reason == "length" and finals[free_id].error is None


def test_abort_while_compiling_frees_everything(engine: Engine) -> None:
    slow = GrammarSpec.json_schema(
        {"type": "object", "properties": {"t": {"type": "string", "maxLength": 126}}},
        "response_format",
    )
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=3, grammar=slow))
    out = engine.abort(request_id)
    assert out is not None and out.finish_reason == "abort" and out.error is None
    assert engine.step() == [] and not engine.has_work
    assert engine.grammars.waiting == []


def test_json_request_inside_mixed_steps(engine: Engine) -> None:
    """A constrained request prefills and decodes in the same forwards as plain ones."""
    eng = engine
    log = StepLog(eng)
    try:
        plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        eng.add_request(PROMPT, plain, request_id="plain0")
        eng.add_request(PROMPT + "Sure", plain, request_id="plain1")
        done: dict[str, RequestOutput] = {}
        for step in range(200):
            if step == 2:
                params = SamplingParams(max_tokens=80, temperature=0, grammar=spec())
                eng.add_request(PROMPT, params, request_id="json")
                req = eng.requests["json"]
                assert req.grammar is not None
                req.grammar.future.result(timeout=120)  # compiled before the next step
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            if not eng.has_work:
                break
        assert set(done) == {"plain0", "plain1", "json"}
        assert log.first_steps()["json"].is_mixed
        # Its masked rows were sampled beside the other requests' rows in one batch.
        assert any("json" in s.sampled and len(s.sampled) > 1 for s in log.steps)
        jsonschema.validate(json.loads(done["json"].text), SCHEMA)
    finally:
        log.restore()


AMBIGUOUS = "root ::= x\nx ::= [a-z]* | x x | x x x"  # issue 25 item 2


def test_an_ambiguous_grammar_ends_at_the_step_budget_and_others_go_on(engine: Engine) -> None:
    """The grammar's per-token work grows without bound (over 0.5 s by the 8th token on
    this vocabulary): the request ends with a clear error once a step passes the budget,
    the free request beside it finishes normally."""
    spec = GrammarSpec.ebnf(AMBIGUOUS, "guided_grammar")
    attack = engine.add_request(PROMPT, SamplingParams(max_tokens=64, seed=1, grammar=spec))
    free = engine.add_request(PROMPT, SamplingParams(max_tokens=24, temperature=0))
    finals: dict[str, RequestOutput] = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    error = finals[attack].error
    assert finals[attack].finish_reason == "abort"
    assert isinstance(error, GrammarError) and error.param == "guided_grammar"
    assert "--grammar-step-budget-ms" in str(error)
    assert len(finals[attack].token_ids) < 64
    assert finals[free].finish_reason == "length" and finals[free].error is None
    assert len(finals[free].token_ids) == 24

"""Grammar masks through the real Sampler: seeded random logits on a toy vocabulary.

Every constrained output must validate independently (``jsonschema``, ``re``, the
choice list); unconstrained rows in the same batch must be bit-identical to a batch
without grammars; ids of a padded LM head must never be chosen.
"""

from __future__ import annotations

import json
import re
import string
import time
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine.grammar import GrammarBackend, TokenMasker
from engine.grammar_spec import GrammarError, GrammarSpec
from engine.request import Req, SamplingParams
from engine.sampler import Sampler, make_generator

CPU = torch.device("cpu")
# Single characters plus a few multi-character pieces, as a real BPE vocabulary has.
# The stop token is last: a row left with no allowed token would pick id 0 instead.
PIECES = [
    *string.printable[:95],
    '{"',
    '": ',
    '", "',
    '"}',
    "true",
    "false",
    "null",
    "name",
    "age",
    "ab",
    "  ",
    "\n\n",
    "<eos>",
]
EOS = len(PIECES) - 1
TOKENIZER_VOCAB = len(PIECES)
# A padded LM head: more logits than tokens (not a multiple of 32 either).
MODEL_VOCAB = TOKENIZER_VOCAB + 37

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "kind"],
    "additionalProperties": False,
}
SAMPLING_MODES: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.2, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 1.0, "repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"temperature": 0.0, "frequency_penalty": 1.0},
]


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    info = xgr.TokenizerInfo(
        PIECES, xgr.VocabType.RAW, vocab_size=MODEL_VOCAB, stop_token_ids=[EOS]
    )
    return GrammarBackend(info, compile_timeout_s=60.0)


def make_req(backend: GrammarBackend, spec: GrammarSpec | None, seed: int, **params: Any) -> Req:
    req = Req(request_id=f"r{seed}", prompt_ids=[5, 6], params=SamplingParams(seed=seed, **params))
    req.generator = make_generator(seed, CPU)
    if spec is not None:
        req.grammar = backend.start(spec)
        req.grammar.future.result(timeout=60)
        assert req.grammar.poll(0.0) is None and req.grammar.ready
    return req


def text_of(token_ids: list[int]) -> str:
    return "".join(PIECES[t] for t in token_ids if t != EOS)


def run(
    reqs: list[Req], seed: int, max_steps: int = 400, tail_logit: float = 0.0
) -> list[list[int]]:
    """Decode ``reqs`` together on seeded random logits until every constrained row ends."""
    sampler = Sampler(MODEL_VOCAB, CPU, seed=seed)
    masker = TokenMasker(MODEL_VOCAB, CPU)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        live = [r for r in reqs if r.grammar is None or not r.grammar.terminated]
        if not any(r.grammar is not None for r in live):
            break
        logits = torch.randn(len(live), MODEL_VOCAB, generator=gen) * 3.0  # [B, V]
        logits[:, TOKENIZER_VOCAB:] = tail_logit
        mask = masker.fill(live)
        out = sampler(logits, live, [EOS], mask)
        for req, token in zip(live, out.token_ids):
            req.output_ids.append(token)
            if req.grammar is not None:
                assert req.grammar.accept(token), f"token {token} broke the grammar"
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("mode", range(len(SAMPLING_MODES)))
@pytest.mark.parametrize("batch", [1, 8])
def test_json_schema_outputs_validate(backend: GrammarBackend, mode: int, batch: int) -> None:
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    params = SAMPLING_MODES[mode]
    for seed in range(2):
        reqs = [
            make_req(backend, spec, 100 * seed + i, max_tokens=400, **params) for i in range(batch)
        ]
        for req, tokens in zip(reqs, run(reqs, seed)):
            assert req.grammar.terminated, text_of(tokens)
            assert tokens[-1] == EOS
            jsonschema.validate(json.loads(text_of(tokens)), PERSON)


def test_batch_of_32_validates(backend: GrammarBackend) -> None:
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    reqs = [make_req(backend, spec, i, temperature=1.0) for i in range(32)]
    for tokens in run(reqs, seed=7):
        jsonschema.validate(json.loads(text_of(tokens)), PERSON)


def test_regex_choice_and_ebnf(backend: GrammarBackend) -> None:
    pattern = r"[a-c]{2,5}-\d{1,3}"
    choices = ["yes", "no", 'say "maybe"', "ab ab"]
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "ab"'
    for seed in range(4):
        reqs = [
            make_req(backend, GrammarSpec.regex(pattern, "regex"), seed, temperature=1.0),
            make_req(
                backend, GrammarSpec.choice(choices, "guided_choice"), seed + 10, temperature=1.0
            ),
            make_req(backend, GrammarSpec.ebnf(ebnf, "ebnf"), seed + 20, temperature=1.0),
        ]
        regex_out, choice_out, ebnf_out = (text_of(t) for t in run(reqs, seed))
        assert re.fullmatch(pattern, regex_out), regex_out
        assert choice_out in choices
        assert re.fullmatch(r"\((\d|ab)(,(\d|ab))*\)", ebnf_out), ebnf_out


def test_free_rows_are_bit_identical_in_a_mixed_batch(backend: GrammarBackend) -> None:
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    sampler = Sampler(MODEL_VOCAB, CPU)
    for params in SAMPLING_MODES:
        mixed = [make_req(backend, spec if b % 2 == 0 else None, b, **params) for b in range(6)]
        alone = [make_req(backend, None, b, **params) for b in (1, 3, 5)]
        logits = torch.randn(6, MODEL_VOCAB, generator=torch.Generator().manual_seed(3))
        mask = TokenMasker(MODEL_VOCAB, CPU).fill(mixed)
        assert mask is not None and mask.rows == [0, 2, 4]
        masked = sampler.apply_grammar(logits.clone(), mixed, mask)
        assert torch.equal(masked[1::2], logits[1::2])
        assert not torch.equal(masked[0::2], logits[0::2])
        got = sampler(logits.clone(), mixed, [EOS], mask).token_ids
        want = sampler(logits[1::2].clone(), alone, [EOS]).token_ids
        assert got[1::2] == want


def test_padded_vocabulary_tail_is_masked(backend: GrammarBackend) -> None:
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    reqs = [make_req(backend, spec, i, temperature=1.0) for i in range(4)]
    mask = TokenMasker(MODEL_VOCAB, CPU).fill(reqs)
    assert mask is not None
    logits = torch.zeros(4, MODEL_VOCAB)
    mask.apply(logits)
    assert torch.isneginf(logits[:, TOKENIZER_VOCAB:]).all()
    # Huge tail logits would win every argmax if the tail were open.
    for tokens in run(reqs, seed=1, tail_logit=1e9):
        assert max(tokens) < TOKENIZER_VOCAB
        jsonschema.validate(json.loads(text_of(tokens)), PERSON)


def test_logprobs_stay_raw_under_a_mask(backend: GrammarBackend) -> None:
    spec = GrammarSpec.choice(["ab"], "guided_choice")
    req = make_req(backend, spec, 0, temperature=0.0, logprobs=2)
    logits = torch.randn(1, MODEL_VOCAB, generator=torch.Generator().manual_seed(0))
    mask = TokenMasker(MODEL_VOCAB, CPU).fill([req])
    out = Sampler(MODEL_VOCAB, CPU)(logits.clone(), [req], [EOS], mask)
    allowed = {PIECES.index("a"), PIECES.index("ab")}
    assert out.token_ids[0] in allowed
    expected = torch.log_softmax(logits[0, :MODEL_VOCAB], dim=-1)[out.token_ids[0]].item()
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(expected, abs=1e-5)


def test_min_tokens_never_leaves_a_row_without_tokens(backend: GrammarBackend) -> None:
    # After "ab" only the stop token is allowed; min_tokens must not ban it too.
    req = make_req(
        backend, GrammarSpec.choice(["ab"], "guided_choice"), 0, temperature=1.0, min_tokens=5
    )
    tokens = run([req], seed=0)[0]
    assert text_of(tokens) == "ab" and tokens[-1] == EOS
    assert req.grammar.terminated


def test_illegal_token_is_rejected(backend: GrammarBackend) -> None:
    req = make_req(backend, GrammarSpec.choice(["yes", "no"], "guided_choice"), 0)
    assert not req.grammar.accept(PIECES.index("z"))
    assert req.grammar.accept(PIECES.index("y"))


def test_identical_constraints_compile_once(backend: GrammarBackend) -> None:
    a = GrammarSpec.json_schema({"type": "object", "properties": {"q": {"type": "integer"}}}, "x")
    b = GrammarSpec.json_schema('{"type": "object", "properties": {"q": {"type": "integer"}}}', "y")
    assert backend.submit(a) is backend.submit(b)
    assert backend.submit(a) is not backend.submit(GrammarSpec.regex("q+", "regex"))


def test_compile_failure_and_timeout_end_the_request(backend: GrammarBackend) -> None:
    bad = backend.start(GrammarSpec.ebnf("root ::= undefined_rule", "ebnf"))
    bad.future.exception(timeout=60)
    error = bad.poll(0.0)
    assert isinstance(error, GrammarError) and error.param == "ebnf"
    slow = backend.start(GrammarSpec.regex("never-compiled-(a|b)", "regex"))
    slow.future = type(slow.future)()  # a compile that never finishes
    assert slow.poll(slow.deadline - 1.0) is None
    late = slow.poll(slow.deadline + 0.1)
    assert isinstance(late, GrammarError) and "did not compile within 60 s" in str(late)


class _SlowMatcher:
    """A matcher whose mask fill computes for ``fill_s`` of CPU time (an ambiguous
    grammar's late steps), or only waits that long with ``busy=False`` (a thread held up
    by the OS or the GIL, which is not the grammar's cost)."""

    def __init__(self, fill_s: float, busy: bool = True) -> None:
        self.fill_s = fill_s
        self.busy = busy

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        if not self.busy:
            time.sleep(self.fill_s)
            return True
        end = time.thread_time() + self.fill_s
        while time.thread_time() < end:
            pass
        return True

    def accept_token(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def is_completed(self) -> bool:
        return False


def test_a_step_over_the_budget_is_an_error_naming_the_field(backend: GrammarBackend) -> None:
    reqs = [make_req(backend, GrammarSpec.regex("[a-z]+", "guided_regex"), s) for s in (1, 2)]
    for req, fill_s in zip(reqs, (0.0, 0.08)):
        assert req.grammar is not None
        req.grammar.matcher = _SlowMatcher(fill_s)
        req.grammar.step_budget_s = 0.05
    TokenMasker(MODEL_VOCAB, CPU).fill(reqs)
    fast, slow = (r.grammar for r in reqs)
    assert fast is not None and slow is not None
    assert fast.accept(5) and slow.accept(5)
    assert fast.over_budget() is None
    error = slow.over_budget()
    assert isinstance(error, GrammarError) and error.param == "guided_regex"
    assert "above the 50 ms budget" in str(error)


def test_a_step_that_only_waited_is_within_the_budget(backend: GrammarBackend) -> None:
    """The budget counts the grammar's CPU time: a loaded machine that holds the engine
    thread up for longer than the budget does not end a well-formed request."""
    req = make_req(backend, GrammarSpec.regex("[a-z]+", "guided_regex"), 1)
    assert req.grammar is not None
    req.grammar.matcher = _SlowMatcher(0.08, busy=False)
    req.grammar.step_budget_s = 0.05
    TokenMasker(MODEL_VOCAB, CPU).fill([req])
    assert req.grammar.accept(5)
    assert req.grammar.over_budget() is None


def test_a_queued_compile_waits_for_a_worker_but_a_running_one_is_timed(
    backend: GrammarBackend,
) -> None:
    """Issue 25 item 7: a small constraint queued behind slow ones (which the workers kill
    at the timeout) must not fail for their slowness; its own compile is timed."""
    from concurrent.futures import Future

    grammar = backend.start(GrammarSpec.choice(["yes", "no"], "guided_choice"))
    grammar.future = Future()  # queued: no worker has taken it yet
    start = grammar.deadline - 4 * grammar.timeout_s
    assert grammar.poll(start + 2 * grammar.timeout_s) is None  # would have failed before
    grammar.future.set_running_or_notify_cancel()
    assert grammar.poll(start + 2 * grammar.timeout_s) is None  # its compile starts now
    assert grammar.poll(start + 3 * grammar.timeout_s) is None
    late = grammar.poll(start + 3 * grammar.timeout_s + 1.5)
    assert isinstance(late, GrammarError) and late.param == "guided_choice"

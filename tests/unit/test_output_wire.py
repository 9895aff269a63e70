"""The wire form of --engine-process's outputs (engine/output_wire.py): what crosses is
smaller, and what the server's side rebuilds equals what the engine made, field for
field, whatever mix of requests, logprobs, retractions and ends a step carries."""

from __future__ import annotations

import copy
import pickle
from dataclasses import fields, replace
from typing import Any

from engine import output_wire
from engine.kvcache.miss_reasons import MissReasons
from engine.output_wire import OutputDecoder, OutputEncoder
from engine.request import RequestOutput, TokenLogprob

PROMPTS = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}


def output(rid: str, token: int, **fields: Any) -> RequestOutput:
    base: dict[str, Any] = dict(
        request_id=rid,
        prompt_token_ids=PROMPTS[rid],
        token_ids=[],
        text="",
        new_token_ids=[token],
        new_text=f" t{token}",
        finished=False,
        finish_reason=None,
        cached_tokens=2,
        cached_tokens_device=1,
        cached_tokens_host=1,
        cache_miss_reasons=MissReasons(never_seen=1),
        first_token_time=10.5,
        arrival_time=10.0,
    )
    base.update(fields)
    return RequestOutput(**base)


def final(rid: str, token: int, **fields: Any) -> RequestOutput:
    return output(
        rid,
        token,
        finished=True,
        finish_reason="length",
        token_ids=[7, 8, token],
        text="all",
        **fields,
    )


def cross(steps: list[list[RequestOutput]]) -> tuple[list[list[Any]], list[list[RequestOutput]]]:
    """Each step through the encoder, pickle (as the pipe does) and the decoder: what went
    on the wire and what came out. The originals are deep-copied first (encoding blanks
    their prompts)."""
    encoder, decoder = OutputEncoder(), OutputDecoder({k: list(v) for k, v in PROMPTS.items()})
    wires, decoded = [], []
    for step in steps:
        wire = encoder.encode(copy.deepcopy(step))
        wires.append(wire)
        decoded.append(decoder.decode(pickle.loads(pickle.dumps(wire))))
    return wires, decoded


def test_a_request_in_the_middle_crosses_as_three_fields_and_comes_back_whole() -> None:
    steps = [
        [output("a", 1), output("b", 11)],
        [output("a", 2), output("b", 12)],
        [output("a", 3), final("b", 13)],
        [final("a", 4)],
    ]
    wires, decoded = cross(steps)
    assert decoded == steps
    kinds = [["tuple" if isinstance(item, tuple) else "whole" for item in w] for w in wires]
    assert kinds == [["whole", "whole"], ["tuple", "tuple"], ["tuple", "whole"], ["whole"]]
    assert wires[1][0] == ("a", [2], " t2")
    compact = len(pickle.dumps(wires[1]))
    whole = len(pickle.dumps([replace(out, prompt_token_ids=[]) for out in steps[1]]))
    assert compact * 2 < whole


def test_changed_cache_figures_cross_whole_and_become_the_template() -> None:
    # A retracted request admitted again: its cached tokens and miss reasons change.
    again = dict(cached_tokens=0, cached_tokens_device=0, cached_tokens_host=0)
    steps = [
        [output("a", 1)],
        [output("a", 2)],
        [output("a", 3, **again, cache_miss_reasons=MissReasons(evicted=3))],
        [output("a", 4, **again, cache_miss_reasons=MissReasons(evicted=3))],
        [output("a", 5, first_token_time=11.0, **again)],
        [final("a", 6)],
    ]
    wires, decoded = cross(steps)
    assert decoded == steps
    assert [isinstance(w[0], tuple) for w in wires] == [False, True, False, True, False, False]


def test_logprobs_errors_and_first_outputs_cross_whole() -> None:
    lp = [TokenLogprob(token_id=1, logprob=-0.5, top={1: -0.5})]
    steps = [
        [output("a", 1, prompt_logprobs=[None, *lp]), output("b", 11, new_logprobs=lp)],
        [output("a", 2), output("b", 12, new_logprobs=lp)],
        [output("a", 3), output("b", 13, new_logprobs=lp)],
        [final("a", 4, error=ValueError("bad grammar")), final("b", 14, new_logprobs=lp)],
        [output("c", 21)],
    ]
    wires, decoded = cross(steps)
    assert [[isinstance(item, tuple) for item in w] for w in wires] == [
        [False, False],
        [False, False],  # "a": its first output carried prompt logprobs, so no template
        [True, False],
        [False, False],
        [False],
    ]
    for got, want in zip(decoded, steps, strict=True):
        for a, b in zip(got, want, strict=True):
            if a.error is not None:
                assert isinstance(a.error, ValueError) and str(a.error) == "bad grammar"
                a.error = b.error
            assert a == b


def test_a_request_ended_leaves_nothing_behind_on_either_side() -> None:
    prompts = {k: list(v) for k, v in PROMPTS.items()}
    encoder, decoder = OutputEncoder(), OutputDecoder(prompts)
    for step in ([output("a", 1), output("b", 2)], [output("a", 3), output("b", 4)]):
        decoder.decode(encoder.encode(step))
    decoder.decode(encoder.encode([final("a", 5), final("b", 6)]))
    assert encoder._sent == {} and decoder._templates == {}
    assert set(prompts) == {"c"}  # the two ended requests' prompts are dropped


def test_outputs_rebuilt_from_one_template_are_separate_objects() -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder({k: list(v) for k, v in PROMPTS.items()})
    first = decoder.decode(encoder.encode([output("a", 1)]))[0]
    second = decoder.decode(encoder.encode([output("a", 2)]))[0]
    third = decoder.decode(encoder.encode([output("a", 3)]))[0]
    second.new_text = "changed by a reader"
    assert (first.new_text, third.new_text) == (" t1", " t3")
    assert third.new_token_ids == [3] and first.prompt_token_ids == PROMPTS["a"]


def test_the_benchmark_times_both_forms(capsys: Any) -> None:
    from bench.micro import output_wire

    output_wire.main(["--batch", "4", "--steps", "5", "--rounds", "1"])
    rows = {line.split()[0]: line.split()[-3:] for line in capsys.readouterr().out.splitlines()}
    whole_bytes, wire_bytes = int(rows["whole"][2]), int(rows["wire"][2])
    assert wire_bytes * 2 < whole_bytes
    assert all(float(v) > 0 for v in rows["whole"][:2] + rows["wire"][:2])


def test_every_field_of_an_output_is_either_sent_kept_or_constant_in_the_middle() -> None:
    # A new RequestOutput field must be placed: sent in the compact form, part of the
    # template's fixed part, or constant on every output but a request's last.
    distinct = dict(
        cached_tokens=31,
        cached_tokens_device=32,
        cached_tokens_host=33,
        cached_tokens_storage=34,
        cache_miss_reasons=MissReasons(evicted=35),
        stop_reason="36",
        first_token_time=37.5,
        arrival_time=38.5,
    )
    out = output("a", 1, **distinct)
    placed = {
        "request_id",
        "new_token_ids",
        "new_text",  # the compact form
        "prompt_token_ids",  # the server's side has it
        "new_logprobs",
        "prompt_logprobs",  # these rule the compact form out
        *output_wire.NON_FINAL_CONSTANT,
    }
    unplaced = [f.name for f in fields(RequestOutput) if f.name not in placed]
    assert sorted(unplaced) == sorted(distinct)
    assert output_wire._fixed(out) == tuple(getattr(out, name) for name in distinct)

"""--stream-interval and non-streamed requests: a running request's output goes out at
its first token and then every N tokens (or, not streamed, only at the end), each one
carrying every delta since the one before; what the caller ends up with is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine import outputs as engine_outputs
from engine.request import Req, RequestOutput

PROMPT = [5, 6, 7, 8, 9]


def _run(model: Path, interval: int, params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, in order."""
    engine = Engine(
        EngineConfig(model=str(model), device="cpu", kv_cache_tokens=4096, stream_interval=interval)
    )
    try:
        engine.check_invariants = True
        engine.add_request(PROMPT, params)
        outputs: list[RequestOutput] = []
        while engine.has_work:
            outputs.extend(engine.step())
        return outputs
    finally:
        engine.close()


def _joined(outputs: list[RequestOutput]) -> tuple[list[int], str, list]:
    ids = [t for o in outputs for t in o.new_token_ids]
    text = "".join(o.new_text for o in outputs)
    logprobs = [lp for o in outputs for lp in (o.new_logprobs or [])]
    return ids, text, logprobs


@pytest.mark.parametrize(
    ("interval", "stream", "sizes"),
    [(1, True, [1] * 10), (3, True, [1, 3, 3, 3]), (4, True, [1, 4, 4, 1]), (3, False, [1, 9])],
)
def test_outputs_come_at_the_first_token_then_every_interval(
    tiny_llama_dir: Path, interval: int, stream: bool, sizes: list[int]
) -> None:
    params = SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, logprobs=1, stream=stream
    )
    outputs = _run(tiny_llama_dir, interval, params)
    assert [len(o.new_token_ids) for o in outputs] == sizes
    assert [o.finished for o in outputs] == [False] * (len(sizes) - 1) + [True]
    final = outputs[-1]
    ids, text, logprobs = _joined(outputs)
    assert ids == final.token_ids and text == final.text and logprobs == final.logprobs
    # the same request, one output per token: the same tokens, text and logprobs
    every = _run(
        tiny_llama_dir, 1, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    )
    assert (final.token_ids, final.text, final.logprobs) == (
        every[-1].token_ids,
        every[-1].text,
        every[-1].logprobs,
    )


def test_a_stop_string_cuts_the_same_text_whatever_the_interval(tiny_llama_dir: Path) -> None:
    free = _run(tiny_llama_dir, 1, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    text = free[-1].text
    assert len(text) > 12
    stop = text[8:11]  # a stop in the middle of the text, held back while it grows
    finals = []
    for interval, stream in [(1, True), (5, True), (1, False)]:
        params = SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], stream=stream
        )
        outputs = _run(tiny_llama_dir, interval, params)
        assert _joined(outputs)[1] == outputs[-1].text  # no held-back text lost or doubled
        assert outputs[-1].finish_reason == "stop"
        finals.append(outputs[-1].text)
    assert finals == [text[: text.index(stop)]] * 3


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        EngineConfig(stream_interval=0)


@pytest.mark.parametrize(
    ("interval", "stream", "stop"),
    [(1, True, None), (3, True, None), (1, False, None), (1, True, 4), (4, True, 3), (1, False, 2)],
)
def test_old_text_moves_out_of_the_growing_string_without_changing_any_output(
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    interval: int,
    stream: bool,
    stop: int | None,
) -> None:
    reference = _run(tiny_llama_dir, 1, SamplingParams(max_tokens=60, temperature=0))[-1]
    text = reference.text
    stops = [text[40 : 40 + stop]] if stop else []
    params = SamplingParams(max_tokens=60, temperature=0, stop=stops, stream=stream)
    expected = _run(tiny_llama_dir, interval, params)
    monkeypatch.setattr(engine_outputs, "COMPACT_CHARS", 5)
    longest: list[int] = []
    seen = engine_outputs._compact

    def watched(req: Req) -> None:
        seen(req)
        longest.append(len(req.text))

    monkeypatch.setattr(engine_outputs, "_compact", watched)
    got = _run(tiny_llama_dir, interval, params)
    assert [(o.new_token_ids, o.new_text, o.finished) for o in got] == [
        (o.new_token_ids, o.new_text, o.finished) for o in expected
    ]
    assert got[-1].text == expected[-1].text == _joined(got)[1]
    if stop:
        assert got[-1].text == text[: text.index(stops[0])]
    # the string appended to stays short: kept stop reach, unsent deltas, one move's worth
    assert len(text) > 150 and max(longest) < 5 + (stop or 0) + 40 * interval

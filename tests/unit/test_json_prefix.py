"""The canonical prefix of growing JSON: every prefix of the raw text gives a prefix of
``json.dumps(json.loads(raw), ensure_ascii=False)``, growing, and the whole text gives it."""

from __future__ import annotations

import json

import pytest

from server.tools.json_prefix import canonical_prefix, scan_call

SAMPLES = [
    '{"city": "Par\\u00eds \\ud83d\\ude00 \\"q\\" \\n\\t/", "n": [1, 2.50, -0, 1e3, -1.5E-2]}',
    '{ "x" :1 , "y":[ ] ,"z" : { } , "t": [true,false , null] }',
    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    '"just a string with ünïcode"',
    "12345",
]


@pytest.mark.parametrize("raw", SAMPLES)
def test_every_prefix_is_a_prefix_of_the_canonical_text(raw: str) -> None:
    final = json.dumps(json.loads(raw), ensure_ascii=False)
    previous = ""
    for k in range(len(raw)):
        text, end = canonical_prefix(raw[:k])
        assert final.startswith(text) and text.startswith(previous), (raw[:k], text)
        assert end is None
        previous = text
    # A bare number is complete only once something follows it.
    text, end = canonical_prefix(raw + " ")
    assert text == final and end == len(raw)


@pytest.mark.parametrize("raw", ['{"a" 1}', '{"a": 1 2}', "[1,]x", '{"a": tru e}', "-x"])
def test_text_that_cannot_be_json_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        canonical_prefix(raw)


def test_a_call_gives_its_name_then_its_arguments() -> None:
    raw = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    cut = raw.index("Paris") + 3
    partial = scan_call(raw[:cut], 0, "arguments")
    assert partial.name == "get_weather" and partial.arguments == '{"city": "Par'
    assert not partial.arguments_done and partial.end is None
    assert scan_call(raw[: raw.index("weather")], 0, "arguments").name is None
    done = scan_call(raw + "\n</tool_call>", 0, "arguments")
    assert done.arguments == json.dumps(json.loads(raw)["arguments"], ensure_ascii=False)
    assert done.arguments_done and done.end == len(raw)
    # Arguments under another key, or as a string, are left to the final parse.
    assert scan_call('{"name": "f", "parameters": {"a": 1}}', 0, "arguments").arguments == ""
    assert scan_call('{"name": "f", "arguments": "{}"}', 0, "arguments").arguments == ""

"""GrammarSpec canonical forms and the checks that run before anything is queued."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from engine.grammar_spec import GrammarError, GrammarSpec, check_spec
from server.engine_client import translate_engine_error


def test_identical_constraints_are_equal_whatever_their_field() -> None:
    a = GrammarSpec.json_schema({"type": "object", "b": 1, "a": 2}, "guided_json")
    b = GrammarSpec.json_schema('{"type": "object", "b": 1, "a": 2}', "response_format")
    assert a == b and hash(a) == hash(b)
    # Key order is kept: it is the order properties are generated in.
    assert list(json.loads(a.value)) == ["type", "b", "a"]
    assert GrammarSpec.json_object("x") == GrammarSpec.json_schema({"type": "object"}, "y")


def test_choices_become_an_escaped_ebnf() -> None:
    choices = ['say "hi"', "back\\slash", "new\nline", "é"]
    ebnf = GrammarSpec.choice(choices, "guided_choice").as_ebnf()
    grammar = xgr.Grammar.from_ebnf(ebnf)
    info = xgr.TokenizerInfo(
        [chr(c) for c in range(32, 127)] + ["\n", "é", "<eos>"], stop_token_ids=[97]
    )
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    assert not xgr.GrammarMatcher(compiled).accept_string("say hi")


@pytest.mark.parametrize(
    "spec,fragment",
    [
        (GrammarSpec.regex("(a", "regex"), "invalid regular expression"),
        (GrammarSpec.ebnf("root ::= missing", "ebnf"), "invalid grammar"),
        (GrammarSpec.json_schema({"type": "nosuch"}, "guided_json"), "invalid JSON schema"),
        (GrammarSpec.json_schema({"not": {"type": "string"}}, "guided_json"), "`not`"),
        (GrammarSpec.json_schema({"items": {"if": {}}}, "guided_json"), "at /items"),
        (GrammarSpec.json_schema({"type": "string", "format": "phone"}, "guided_json"), "format"),
        (GrammarSpec.json_schema({"type": "string", "format": ["x"]}, "guided_json"), "format"),
        (GrammarSpec.json_schema({"maxItems": 1000}, "guided_json"), "maxItems"),
        (GrammarSpec.json_schema({"propertyNames": {}, "properties": {}}, "x"), "propertyNames"),
        (GrammarSpec.regex("a" * 70000, "regex"), "at most"),
    ],
)
def test_rejected_with_the_field_named(spec: GrammarSpec, fragment: str) -> None:
    with pytest.raises(GrammarError) as info:
        check_spec(spec)
    assert info.value.param == spec.param
    assert fragment in str(info.value)
    api = translate_engine_error(info.value)
    assert api is not None and api.status == 400 and api.param == spec.param


def test_accepted_constraints() -> None:
    for spec in (
        GrammarSpec.json_schema({"type": "string", "format": "date", "enum": ["not", "if"]}, "x"),
        GrammarSpec.json_schema({"type": "string", "maxLength": 128}, "x"),
        GrammarSpec.json_schema(True, "x"),
        GrammarSpec.regex(r"\d+", "x"),
        GrammarSpec.ebnf('root ::= "a"+', "x"),
    ):
        check_spec(spec)


@pytest.mark.parametrize(
    "make,value",
    [
        (GrammarSpec.json_schema, "{bad json"),
        (GrammarSpec.json_schema, 3),
        (GrammarSpec.regex, ""),
        (GrammarSpec.regex, 5),
        (GrammarSpec.choice, []),
        (GrammarSpec.choice, ["a", ""]),
        (GrammarSpec.choice, "ab"),
        (GrammarSpec.ebnf, "   "),
    ],
)
def test_malformed_values(make: object, value: object) -> None:
    with pytest.raises(GrammarError, match=re.escape("field")) as info:
        make(value, "field")  # type: ignore[operator]
    assert info.value.param == "field"

"""GrammarSpec canonical forms and the checks that run before anything is queued."""

from __future__ import annotations

import json
import re
from typing import Any

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


def _nested_arrays(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "make,value,fragment",
    [
        # 100 levels parse in ~0.15 s and compile in seconds; 950 froze a server 38 s
        (GrammarSpec.json_schema, _nested_arrays(100), "nested more than 64"),
        (
            GrammarSpec.json_schema,
            {"type": "object", "properties": {f"p{i}": {} for i in range(1100)}},
            "more than 1024 objects and arrays",
        ),
        (GrammarSpec.regex, "|".join(f"w{i:05d}" for i in range(700)), "4096"),
    ],
    ids=["deep", "wide", "long-regex"],
)
def test_oversized_shapes_are_refused_before_parsing(
    make: Any, value: object, fragment: str
) -> None:
    """Issue 25 items 1 and 7: the caps apply without the grammar engine parsing anything."""
    from engine.grammar_spec import check_spec_static

    with pytest.raises(GrammarError) as info:
        check_spec_static(make(value, "response_format.json_schema.schema"))
    assert info.value.param == "response_format.json_schema.schema"
    assert fragment in str(info.value)


def test_any_depth_is_refused_without_recursion() -> None:
    """A schema nested past Python's recursion limit, as an object or as JSON text, is a
    GrammarError naming the field, never a RecursionError (a 500)."""
    deep = _nested_arrays(5000)
    for value in (deep, "[" * 5000 + "]" * 5000, '{"items":' * 5000 + "{}" + "}" * 5000):
        with pytest.raises(GrammarError) as info:
            GrammarSpec.json_schema(value, "guided_json")
        assert info.value.param == "guided_json"


def test_shapes_just_inside_the_caps_are_accepted() -> None:
    check_spec(GrammarSpec.json_schema(_nested_arrays(60), "x"))
    check_spec(GrammarSpec.regex("|".join(f"w{i:03d}" for i in range(800))[:4096], "x"))

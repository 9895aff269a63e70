"""What a structured-output constraint is, and whether hiserve accepts it.

A ``GrammarSpec`` names one constraint (a JSON schema, a regex, a list of choices or an
EBNF grammar) in a canonical text form, so that identical constraints compile once.
``check_spec`` rejects, with a message naming the request field, everything the grammar
engine would reject, silently ignore, or take too long on. Pure Python apart from the
final parse check, which imports xgrammar.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import InvalidRequestError

GrammarKind = Literal["json_schema", "regex", "choice", "ebnf"]

# A constraint's text (schema, regex, grammar) may not be longer than this.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
# A regex compiles to an automaton that can grow exponentially with its length (a 7 KB
# alternation held a compile worker for minutes, issue 25): regexes are kept short.
MAX_REGEX_CHARS = 4096
# JSON schema shape, checked (without recursion) before anything parses the schema.
# Compile time grows cubically with nesting (950 nested arrays: 38 s; 200: 1.1 s to parse;
# 63: 68 ms to compile) and super-linearly with width (2,000 optional properties: 78 s;
# 512: 0.6 s). Depth counts nested JSON objects and arrays; nodes counts all of them.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 1024
# String length bounds make xgrammar's grammar grow with the bound: measured here,
# maxLength 40 compiles in 0.4 s and 200 in 1.9 s, and every step inside such a string
# costs milliseconds. Past this cap, ask for a `pattern` instead.
MAX_STRING_LENGTH_BOUND = 128
# Array and object size bounds unroll the same way.
MAX_ITEMS_BOUND = 128
# The string formats xgrammar 0.2.8 enforces; any other `format` would be ignored.
SUPPORTED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords xgrammar 0.2.8 accepts but does not enforce (`not`, `if` checked here) or that
# hiserve has not verified: a schema using them is refused rather than producing output
# that may not validate.
UNENFORCED_KEYWORDS = ("multipleOf", "contains", "minContains", "maxContains", "not", "if")


class GrammarError(InvalidRequestError):
    """A constraint the server cannot honour; ``param`` is the request field at fault."""

    param: str

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint: ``kind`` and its canonical text.

    ``value`` is the schema as compact JSON (key order kept: it is the order properties
    are generated in), the regex, the EBNF grammar, or the choices as a JSON list.
    ``param`` names the request field it came from, for error messages only.
    """

    kind: GrammarKind
    value: str
    param: str = field(default="response_format", compare=False)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"{param} is not valid JSON: {exc}", param) from exc
            except RecursionError as exc:
                raise GrammarError(
                    f"{param} is nested too deeply; at most {MAX_SCHEMA_DEPTH} levels of "
                    "objects and arrays are allowed",
                    param,
                ) from exc
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(
                f"{param} must be a JSON schema object, got {type(schema).__name__}", param
            )
        check_schema_shape(schema, param)  # before json.dumps recurses into it
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, param: str) -> GrammarSpec:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_schema", '{"type":"object"}', param)

    @classmethod
    def regex(cls, pattern: Any, param: str) -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"{param} must be a non-empty regular expression string", param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: Any, param: str) -> GrammarSpec:
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise GrammarError(f"{param} must be a non-empty list of non-empty strings", param)
        if len(choices) > MAX_CHOICES:
            raise GrammarError(
                f"{param} has {len(choices)} entries; at most {MAX_CHOICES} are allowed", param
            )
        return cls("choice", json.dumps(choices, ensure_ascii=False), param)

    @classmethod
    def ebnf(cls, grammar: Any, param: str) -> GrammarSpec:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(
                f"{param} must be a non-empty EBNF grammar string with a `root` rule", param
            )
        return cls("ebnf", grammar, param)

    def choices(self) -> list[str]:
        assert self.kind == "choice"
        values: list[str] = json.loads(self.value)
        return values

    def as_ebnf(self) -> str:
        """The grammar this spec compiles to when it is a choice or an EBNF grammar."""
        if self.kind == "ebnf":
            return self.value
        # json.dumps writes a double-quoted literal with the escapes EBNF strings take.
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices())
        return f"root ::= {literals}"


@functools.lru_cache(maxsize=1024)
def check_spec(spec: GrammarSpec) -> None:
    """Raise GrammarError unless ``spec`` is something the grammar engine enforces fully.

    Cached: parsing a schema takes up to milliseconds, and every choice of a request is
    checked (failures raise and are not cached). The parse releases the GIL; the server
    runs this in a worker thread, never on its event loop.
    """
    check_spec_static(spec)
    _parse_check(spec)


@functools.lru_cache(maxsize=1024)
def check_spec_static(spec: GrammarSpec) -> None:
    """The checks of ``check_spec`` that need no parse: sizes, shapes, keywords.
    Microseconds to a millisecond, whatever the constraint: safe on an event loop."""
    if len(spec.value) > MAX_SPEC_CHARS:
        raise GrammarError(
            f"{spec.param} is {len(spec.value)} characters long; at most {MAX_SPEC_CHARS} "
            "are allowed",
            spec.param,
        )
    if spec.kind == "regex" and "\x00" in spec.value:
        raise GrammarError(f"{spec.param} may not contain a NUL character", spec.param)
    if spec.kind == "regex" and len(spec.value) > MAX_REGEX_CHARS:
        raise GrammarError(
            f"{spec.param} is a regular expression of {len(spec.value)} characters; at most "
            f"{MAX_REGEX_CHARS} are allowed. Shorten it (long alternations compile slowly and "
            "take much memory), or use a JSON schema with an `enum`",
            spec.param,
        )
    if spec.kind == "json_schema":
        check_schema_features(json.loads(spec.value), spec.param)


def check_schema_shape(schema: Any, param: str) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH or with more than
    MAX_SCHEMA_NODES objects and arrays; iterative, so any depth is safe to walk."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(
                f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and "
                "arrays); flatten it",
                param,
            )
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(
                f"{param} has more than {MAX_SCHEMA_NODES} objects and arrays; split it or "
                "simplify it",
                param,
            )
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children)


def check_schema_features(schema: Any, param: str, path: str = "") -> None:
    """Refuse schema keywords xgrammar would silently ignore or unroll at great cost."""
    if not path:
        check_schema_shape(schema, param)  # bounds the recursion below
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_features(item, param, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    where = path or "/"

    def refuse(why: str) -> None:
        raise GrammarError(f"{param}: at {where}: {why}", param)

    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            refuse(f"the keyword `{keyword}` is not supported; remove it")
    if schema.get("uniqueItems") is True:
        refuse("`uniqueItems: true` is not supported; remove it")
    fmt = schema.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt not in SUPPORTED_FORMATS):
        refuse(
            f"the string format {fmt!r} is not supported; use one of "
            f"{', '.join(sorted(SUPPORTED_FORMATS))} or a `pattern`"
        )
    has_length = "minLength" in schema or "maxLength" in schema
    if has_length and ("pattern" in schema or "format" in schema):
        refuse("`minLength`/`maxLength` cannot be combined with `pattern` or `format`")
    for keyword, cap in (
        ("maxLength", MAX_STRING_LENGTH_BOUND),
        ("minLength", MAX_STRING_LENGTH_BOUND),
        ("maxItems", MAX_ITEMS_BOUND),
        ("minItems", MAX_ITEMS_BOUND),
        ("maxProperties", MAX_ITEMS_BOUND),
        ("minProperties", MAX_ITEMS_BOUND),
    ):
        bound = schema.get(keyword)
        if isinstance(bound, int) and not isinstance(bound, bool) and bound > cap:
            refuse(
                f"`{keyword}: {bound}` is above the supported {cap}; lower it, or bound the "
                "value with a `pattern` instead"
            )
    if "propertyNames" in schema and ("properties" in schema or "patternProperties" in schema):
        refuse("`propertyNames` cannot be combined with `properties` or `patternProperties`")
    pattern_props = schema.get("patternProperties")
    if isinstance(pattern_props, dict) and len(pattern_props) > 1:
        refuse("at most one `patternProperties` entry is supported")
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples", "description", "title"):
            continue  # literal values, not subschemas
        if isinstance(value, (dict, list)):
            check_schema_features(value, param, f"{path}/{key}")


def _parse_check(spec: GrammarSpec) -> None:
    """Parse ``spec`` with xgrammar (no tokenizer, milliseconds) to surface syntax errors."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise GrammarError(
            f"{spec.param}: structured outputs need the grammar engine; install it with "
            "`pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi`",
            spec.param,
        ) from exc
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        else:
            xgr.Grammar.from_ebnf(spec.as_ebnf())
    except Exception as exc:  # any parse failure is the constraint's fault
        what = {"json_schema": "JSON schema", "regex": "regular expression"}.get(
            spec.kind, "grammar"
        )
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"{spec.param}: invalid {what}: {first_line}", spec.param) from exc

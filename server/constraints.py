"""The output constraint of a request: OpenAI ``response_format``, vLLM and SGLang extras.

At most one constraint per request. Every malformed or unsupported one is a 400 naming
its field, raised before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.grammar_spec import GrammarError, GrammarSpec, check_spec, check_spec_static
from server.errors import APIError
from server.protocol import _SamplingRequest

SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# vLLM's structured_outputs: exactly one of these keys carries the constraint.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# The grammar engine's parse check runs here, off the event loop: a schema that takes
# seconds to parse must not stop the server answering /health and other requests.
_CHECK_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hiserve-grammar-check")


def response_format_spec(fmt: Any) -> GrammarSpec | None:
    """OpenAI ``response_format``: text (no constraint), json_object or json_schema."""
    param = "response_format"
    if not isinstance(fmt, dict):
        raise APIError(400, "response_format must be an object with a `type`", param=param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object(param)
    if kind != "json_schema":
        raise APIError(
            400,
            f"response_format.type {kind!r} is not supported; use text, json_object or json_schema",
            param="response_format.type",
        )
    body = fmt.get("json_schema")
    if body is None and "schema" in fmt:  # SGLang's shorthand: the schema at the top
        body = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
    if not isinstance(body, dict):
        raise APIError(
            400,
            "response_format.json_schema must be an object with `name` and `schema`",
            param="response_format.json_schema",
        )
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not SCHEMA_NAME_RE.match(name)):
        raise APIError(
            400,
            "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
            param="response_format.json_schema.name",
        )
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(
            400,
            "response_format.json_schema.strict must be a boolean",
            param="response_format.json_schema.strict",
        )
    if "schema" not in body:
        raise APIError(
            400,
            "response_format.json_schema.schema is required",
            param="response_format.json_schema.schema",
        )
    # NOTE: the schema is enforced whether or not `strict` is set, as vLLM and SGLang do.
    return _spec(GrammarSpec.json_schema, body["schema"], "response_format.json_schema.schema")


def structured_outputs_spec(options: dict[str, Any]) -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` object."""
    given = [k for k in STRUCTURED_OUTPUT_KINDS if options.get(k) not in (None, False)]
    if len(given) > 1:
        raise APIError(
            400,
            f"structured_outputs takes one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
            f"{', '.join(given)}",
            param="structured_outputs",
        )
    if not given:
        return None
    kind = given[0]
    param = f"structured_outputs.{kind}"
    value = options[kind]
    if kind == "json":
        return _spec(GrammarSpec.json_schema, value, param)
    if kind == "json_object":
        return GrammarSpec.json_object(param)
    if kind == "regex":
        return _spec(GrammarSpec.regex, value, param)
    if kind == "choice":
        return _spec(GrammarSpec.choice, value, param)
    if kind == "grammar":
        return _spec(GrammarSpec.ebnf, value, param)
    raise APIError(
        400,
        "structured_outputs.structural_tag is not supported; use json, regex, choice or grammar",
        param=param,
    )


def request_constraint(req: _SamplingRequest) -> GrammarSpec | None:
    """The one output constraint ``req`` asks for, checked; None for free text."""
    found: list[GrammarSpec] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = response_format_spec(response_format)
        if spec is not None:
            found.append(spec)
    if req.structured_outputs is not None:
        spec = structured_outputs_spec(req.structured_outputs)
        if spec is not None:
            found.append(spec)
    simple = (
        ("guided_json", GrammarSpec.json_schema),
        ("guided_regex", GrammarSpec.regex),
        ("guided_choice", GrammarSpec.choice),
        ("guided_grammar", GrammarSpec.ebnf),
        ("json_schema", GrammarSpec.json_schema),
        ("regex", GrammarSpec.regex),
        ("ebnf", GrammarSpec.ebnf),
    )
    for name, make in simple:
        value = getattr(req, name)
        if value is not None:
            found.append(_spec(make, value, name))
    if len(found) > 1:
        raise APIError(
            400,
            "a request may carry one output constraint; got "
            f"{', '.join(s.param for s in found)}. Send only one of them.",
            param=found[1].param,
        )
    if not found:
        return None
    return statically_checked(found[0])


def statically_checked(spec: GrammarSpec) -> GrammarSpec:
    """``spec`` after the checks that need no parse (sizes, nesting, keywords), as a 400
    naming its field if one fails; cheap enough for the event loop."""
    try:
        check_spec_static(spec)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    return spec


def checked(spec: GrammarSpec) -> GrammarSpec:
    """``spec`` after all the engine's checks, as a 400 naming its field if it fails.
    Blocking (the grammar engine parses it): see ``parse_checked``."""
    try:
        check_spec(spec)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    return spec


async def parse_checked(spec: GrammarSpec | None) -> GrammarSpec | None:
    """``checked`` in a worker thread, so the event loop keeps serving meanwhile."""
    if spec is None:
        return None
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_CHECK_POOL, checked, spec)


def _spec(make: Any, value: Any, param: str) -> GrammarSpec:
    try:
        spec: GrammarSpec = make(value, param)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    return spec

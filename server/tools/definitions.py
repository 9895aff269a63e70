"""A chat request's tools: validated definitions, the tool choice, and its constraint.

``tool_choice`` "required" and a named function are enforced by a JSON schema (the model
can only produce calls); "auto" leaves the text free and a parser finds the calls;
"none" turns tools off for the turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from engine.grammar_spec import GrammarError, GrammarSpec, check_schema_features
from server.errors import APIError
from server.protocol import ChatCompletionRequest

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolPlan:
    """What the tools of one request mean for generation and for the response."""

    tools: list[ToolDef]
    mode: ToolMode
    named: str | None = None  # the forced function when mode is "named"
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    def constraint(self) -> GrammarSpec | None:
        """The schema that enforces a required or named call; None for auto and none."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return GrammarSpec.json_schema(tool.parameters, "tool_choice")
        if self.mode == "required":
            return GrammarSpec.json_schema(self.required_schema(), "tools")
        return None

    def required_schema(self) -> dict[str, Any]:
        """A JSON array of ``{"name", "parameters"}`` calls, at least one (one at most when
        parallel calls are off)."""
        # NOTE: "#/$defs/..." references resolve from the root, so each tool's $defs move
        # up to the array schema.
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools:
            parameters = dict(tool.parameters)
            for key, value in (parameters.pop("$defs", None) or {}).items():
                if key in defs and defs[key] != value:
                    raise APIError(
                        400,
                        f"tools define $defs/{key} differently; rename one of them",
                        param="tools",
                    )
                defs[key] = value
            items.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls``; 400 on bad input."""
    tools = _parse_tools(req.tools)
    mode, named = _parse_choice(req.tool_choice, tools)
    return ToolPlan(tools, mode, named, req.parallel_tool_calls is not False)


def _parse_tools(raw: list[dict[str, Any]] | None) -> list[ToolDef]:
    if raw is None:
        return []
    if len(raw) > MAX_TOOLS:
        raise APIError(
            400, f"tools has {len(raw)} entries; at most {MAX_TOOLS} are allowed", param="tools"
        )
    tools: list[ToolDef] = []
    for i, entry in enumerate(raw):
        param = f"tools.{i}"
        if entry.get("type", "function") != "function":
            raise APIError(
                400, f"{param}.type must be 'function', got {entry.get('type')!r}", param=param
            )
        function = entry.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{param}.function must be an object", param=f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            raise APIError(
                400,
                f"{param}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                param=f"{param}.function.name",
            )
        if any(t.name == name for t in tools):
            raise APIError(
                400, f"tools has two functions named {name!r}", param=f"{param}.function.name"
            )
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise APIError(
                400,
                f"{param}.function.description must be a string",
                param=f"{param}.function.description",
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        pparam = f"{param}.function.parameters"
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise APIError(400, f"{pparam} must be a JSON schema of type object", param=pparam)
        try:
            check_schema_features(parameters, pparam)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=pparam) from exc
        tools.append(ToolDef(name, description, parameters))
    return tools


def _parse_choice(choice: Any, tools: list[ToolDef]) -> tuple[ToolMode, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice.function.name must be a string", param="tool_choice")
        if not any(t.name == name for t in tools):
            known = ", ".join(t.name for t in tools) or "none"
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not in tools (known: {known})",
                param="tool_choice",
            )
        return "named", name
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def arguments_text(arguments: Any) -> str:
    """OpenAI's ``function.arguments``: a JSON object as text."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)

"""The canonical text of a growing JSON value, as far as the text so far settles it.

A tool call's ``arguments`` are sent as ``json.dumps(json.loads(raw), ensure_ascii=False)``
(server/tools/parsers.py). To stream them while the model writes them, each stable piece
of the raw text is written in that same form as soon as it is complete: punctuation with
``json.dumps``'s separators, whole numbers and literals, and string contents character by
character. So the pieces streamed so far are always a prefix of the final ``arguments``
(for JSON without duplicate keys; a later parse that disagrees is the caller's concern).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_SPACE = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")


class Incomplete(Exception):
    """The text ends inside the value; what was written so far is stable."""


@dataclass
class Scan:
    """A pass over ``text`` from the start; ``out`` collects canonical pieces."""

    text: str
    out: list[str] = field(default_factory=list)

    def skip(self, i: int) -> int:
        while i < len(self.text) and self.text[i] in _SPACE:
            i += 1
        if i >= len(self.text):
            raise Incomplete
        return i

    def value(self, i: int) -> int:
        """Write the value at ``i`` (after spaces); the index past it."""
        i = self.skip(i)
        c = self.text[i]
        if c in "{[":
            return self.container(i)
        if c == '"':
            return self.string(i)
        return self.scalar(i)

    def container(self, i: int) -> int:
        is_object = self.text[i] == "{"
        close = "}" if is_object else "]"
        self.out.append(self.text[i])
        i = self.skip(i + 1)
        if self.text[i] == close:
            self.out.append(close)
            return i + 1
        while True:
            if is_object:
                i = self.key(i)
            i = self.skip(self.value(i))
            if self.text[i] == close:
                self.out.append(close)
                return i + 1
            if self.text[i] != ",":
                raise ValueError(f"expected ',' or {close!r} at {i}")
            self.out.append(", ")
            i = self.skip(i + 1)

    def key(self, i: int) -> int:
        if self.text[i] != '"':
            raise ValueError(f"expected a key at {i}")
        i = self.skip(self.string(i))
        if self.text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        self.out.append(": ")
        return i + 1

    def string(self, i: int) -> int:
        j = i + 1
        text = self.text
        while j < len(text) and text[j] != '"':
            if text[j] != "\\":
                j += 1
                continue
            # An escape is written only once whole (a surrogate pair: both halves).
            width = 2
            if text[j + 1 : j + 2] == "u":
                width = 6
                if re.fullmatch(r"[dD][89abAB][0-9a-fA-F]{2}", text[j + 2 : j + 6]):
                    width = 12
            if j + width > len(text):
                break
            j += width
        if j < len(text) and text[j] == '"':  # the closing quote
            self.out.append(json.dumps(json.loads(text[i : j + 1]), ensure_ascii=False))
            return j + 1
        if j > i + 1:
            partial = json.loads(text[i:j] + '"')
            self.out.append('"' + json.dumps(partial, ensure_ascii=False)[1:-1])
        else:
            self.out.append('"')
        raise Incomplete

    def scalar(self, i: int) -> int:
        text = self.text
        for literal in _LITERALS:
            if text.startswith(literal, i):
                self.out.append(literal)
                return i + len(literal)
            if literal.startswith(text[i:]):
                raise Incomplete
        end = i
        while end < len(text) and text[end] in "0123456789+-.eE":
            end += 1
        if end == len(text):
            raise Incomplete  # more digits may follow
        if end == i or not _NUMBER.fullmatch(text, i, end):
            raise ValueError(f"not JSON at {i}")
        self.out.append(json.dumps(json.loads(text[i:end])))
        return end


def canonical_prefix(text: str, start: int = 0) -> tuple[str, int | None]:
    """(canonical text of the JSON value at ``start`` so far, the index past it or None
    while it is incomplete). Raises ValueError if the text cannot be JSON."""
    scan = Scan(text)
    try:
        end: int | None = scan.value(start)
    except Incomplete:
        end = None
    return "".join(scan.out), end


@dataclass
class CallProgress:
    """A call object ``{"name": ..., <args key>: {...}}`` as far as it is written."""

    name: str | None = None
    arguments: str = ""  # canonical prefix of the arguments object
    arguments_done: bool = False
    end: int | None = None  # index past the call object once it is complete


def scan_call(text: str, start: int, args_key: str) -> CallProgress:
    """The name and arguments of the call object at ``start`` of a growing ``text``.

    Only an ``args_key`` whose value is an object streams; anything else is left to the
    final parse. Raises ValueError if the text cannot be such an object.
    """
    progress = CallProgress()
    scan = Scan(text)
    try:
        i = scan.skip(start)
        if text[i] != "{":
            raise ValueError("a call is a JSON object")
        i = scan.skip(i + 1)
        while text[i] != "}":
            key_scan = Scan(text)
            i = key_scan.skip(key_scan.key(i))
            key = json.loads(key_scan.out[0])
            value = Scan(text)
            complete = False
            try:
                i = value.value(i)
                complete = True
            finally:
                written = "".join(value.out)
                if key == "name" and complete:
                    name = json.loads(written)
                    progress.name = name if isinstance(name, str) else None
                elif key == args_key and written.startswith("{"):
                    progress.arguments = written
                    progress.arguments_done = complete
            i = scan.skip(i)
            if text[i] == ",":
                i = scan.skip(i + 1)
            elif text[i] != "}":
                raise ValueError(f"expected ',' or '}}' at {i}")
        progress.end = i + 1
    except Incomplete:
        pass
    return progress

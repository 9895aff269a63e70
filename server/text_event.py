"""The SSE event of a streamed chunk that carries only new text, without pydantic per token.

Most events of a stream are one choice's next few characters: the same chunk each time
but for that string. Building and dumping the pydantic chunk for each of them was about a
fifth of the HTTP thread's time at 32 streams (2026-12-06, `py-spy --gil`). ``TextEvent``
renders the chunk once through pydantic with a marker in place of the text, cuts the
event at the marker, and then only encodes each new text between the two halves: the
same bytes, since the standard library's JSON string encoding (non-ASCII kept as it is)
is pydantic's (tests/unit/test_text_event.py holds the two equal, control characters,
quotes and non-BMP characters included).
"""

from __future__ import annotations

import json
from collections.abc import Callable

# A text no model emits: a chunk rendered with it in the text field has the marker's
# JSON at exactly that place and nowhere else.
MARKER = "\x00hiserve text\x00"
_MARKER_JSON = json.dumps(MARKER)


def encode_text(text: str) -> str:
    """``text`` as a JSON string, as pydantic's JSON writes it."""
    return json.dumps(text, ensure_ascii=False)


class TextEvent:
    """``event(text)``: the SSE event that ``render`` gives for ``text``, where ``render``
    builds a whole event (a chunk through ``sse_event``) around the one text it is given.
    """

    __slots__ = ("_head", "_tail")

    def __init__(self, render: Callable[[str], str]) -> None:
        event = render(MARKER)
        head, found, tail = event.partition(_MARKER_JSON)
        if not found or _MARKER_JSON in tail:
            raise ValueError("the rendered event must hold the text exactly once")
        self._head, self._tail = head, tail

    def __call__(self, text: str) -> str:
        return self._head + encode_text(text) + self._tail

"""server.text_event: the per-token SSE event cut from pydantic's rendering equals it."""

from __future__ import annotations

import random

import pytest

from server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
)
from server.serve_chat import _chunk_event
from server.sse import sse_event
from server.text_event import MARKER, TextEvent, encode_text


def _completion(text: str) -> str:
    choice = CompletionChoice(index=3, text=text)
    return sse_event(CompletionChunk(id="cmpl-x", created=7, model='m"odel', choices=[choice]))


def _chat(text: str) -> str:
    choice = ChatStreamChoice(index=1, delta=DeltaMessage(content=text))
    return _chunk_event(
        ChatCompletionChunk(id="chatcmpl-x", created=7, model="m", choices=[choice])
    )


def _texts() -> list[str]:
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x80)] + list('"\\/\u2028\u2029\x7f\ufeffé€😀中')
    texts = ["", " ", "hello", "\n", "\\n", '"quoted"', "\ud7ff\ue000\U0010ffff"]
    texts += [chr(c) for c in range(0x80)]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    return texts


@pytest.mark.parametrize("render", [_completion, _chat])
def test_the_event_equals_pydantics_for_any_text(render: object) -> None:
    assert callable(render)
    event = TextEvent(render)
    for text in _texts():
        assert event(text) == render(text), repr(text)


def test_strings_are_encoded_as_pydantic_encodes_them() -> None:
    from pydantic import TypeAdapter

    adapter = TypeAdapter(str)
    for cp in [*range(0x800), 0x2028, 0x2029, 0xFEFF, 0xFFFF, 0x1F600, 0x10FFFF]:
        text = f"a{chr(cp)}b"
        assert encode_text(text) == adapter.dump_json(text).decode(), hex(cp)


def test_a_render_without_the_text_exactly_once_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextEvent(lambda text: "data: {}\n\n")
    with pytest.raises(ValueError, match="exactly once"):
        TextEvent(lambda text: sse_event({"a": text, "b": text}))
    assert MARKER not in _completion("x")

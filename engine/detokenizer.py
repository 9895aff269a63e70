"""Incremental detokenization and stop-string matching for streamed output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer, decoders

# Prompt tokens decoded in front of the first output token, so that tokenizers whose
# decoder treats the start of a sequence specially (SentencePiece strips its leading
# space) give the first output token the spacing it has inside the whole text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def _direct_backend(tokenizer: Any) -> Tokenizer | None:
    """A fast tokenizer's Rust backend where its decode is the backend's alone (no
    clean-up of spaces by the wrapper), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return backend
    return None


def decoder_of(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=...)`` gives it.

    A fast HF tokenizer's decode is its Rust backend's, then an optional clean-up of
    spaces; where no clean-up applies, the backend is called directly. NOTE: the HF
    wrapper costs more than the decode itself (7.6 against 1.8 us a call, 2026-12-06), and
    a streamed token takes one or two decodes, on the engine thread, inside every step."""
    backend = _direct_backend(tokenizer)
    if backend is not None:
        backend_decode = backend.decode

        def decode_fast(token_ids: list[int]) -> str:
            return backend_decode(token_ids, skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode(token_ids: list[int]) -> str:
        text: str = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    return decode


def decodes_piecewise(tokenizer: Any) -> bool:
    """Whether ``decode(a + b) == decode(a) + decode(b)`` wherever ``decode(a)`` ends in a
    whole character: a fast tokenizer decoded by its backend (``decoder_of``'s fast path)
    whose decoder is ByteLevel alone (GPT-2, Llama 3, SmolLM, Qwen), which maps each
    token to its bytes and decodes them together. Not SentencePiece's (it strips the
    first token's leading space) nor a wrapper's clean-up of spaces."""
    backend = _direct_backend(tokenizer)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character.

    It keeps a small window of token ids: ``[0, read_offset)`` is text already
    emitted, kept only as decoding context, and ``[read_offset, end)`` is not emitted
    yet. Each ``add`` decodes the window with the new tokens and emits what it adds to
    the decode without them, so decoder rules that depend on neighbouring tokens
    (SentencePiece's leading space, ByteLevel byte pairs) come out as in a full decode.
    The decode without them is the emitted tokens' own, made when they were emitted: a
    second decode, except where ``decodes_piecewise`` says it is the delta itself.

    NOTE: while the decoded window ends in U+FFFD the tail is an incomplete UTF-8
    sequence: nothing is emitted until a later token completes it (or ``flush``).
    Invariant: everything before ``read_offset`` decodes to complete characters, so the
    concatenation of all deltas plus ``flush()`` equals
    ``decode(context + output)[len(decode(context)):]``, which for ByteLevel tokenizers
    (GPT-2, Llama 3, SmolLM, Qwen) is ``decode(output)``. For SentencePiece tokenizers it
    differs from ``decode(output)`` only by the first token's leading space, which is
    kept (as vLLM and HF pipelines return it).
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._decode_ids = decoder_of(tokenizer, skip_special_tokens)
        self._piecewise = decodes_piecewise(tokenizer)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # A context that ends inside a character would be completed by the output
            # and shift the first delta; decode the output on its own instead.
            context, context_text = [], ""
        self._token_ids = context  # window: context tokens, then output tokens
        self._read_offset = len(context)
        self._prefix_text = context_text  # decode of [0, read_offset)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""

    def add(self, token_ids: list[int]) -> str:
        """Append output tokens; return the text they complete (may be empty)."""
        self._token_ids.extend(token_ids)
        text = self._decode(self._token_ids)
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._prefix_text):
            return ""  # incomplete character, or nothing visible yet
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever is held back (the request has finished)."""
        if self._read_offset == len(self._token_ids):
            return ""
        return self._emit(self._decode(self._token_ids))

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # The emitted tokens become the context of the next window.
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        # The new window is the tokens just emitted. Piecewise, the text before them ended
        # in a whole character, so their decode is the delta: one decode a token, not two.
        self._prefix_text = delta if self._piecewise else self._decode(self._token_ids)
        return delta


class StopChecker:
    """Finds stop strings in generated text and says how much text to hold back.

    NOTE: streaming never emits the beginning of a stop string: ``holdback`` counts
    the trailing characters that could still grow into a stop, and the caller emits only
    ``text[:len(text) - holdback(text)]`` until more text (or the end) decides.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_stop_len = max((len(s) for s in self.stops), default=0)

    def check(self, text: str, new_start: int) -> tuple[int, str] | None:
        """Earliest stop string in ``text`` that ends after ``new_start``.

        ``new_start`` is where the newest delta begins; a stop may begin up to
        ``max_stop_len - 1`` characters before it (straddling deltas). Returns
        ``(index where the stop starts, stop)``; between stops starting at the same
        index the shorter one (the one completed first) wins.
        """
        if not self.stops:
            return None
        begin = max(0, new_start - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = text.find(stop, begin)
            if index < 0:
                continue
            if best is None or index < best[0] or (index == best[0] and len(stop) < len(best[1])):
                best = (index, stop)
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

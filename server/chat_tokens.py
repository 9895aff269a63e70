"""Chat prompts whose message content is text: special-token strings a user types stay text.

Applying a chat template and tokenizing its output would turn ``<|im_end|>`` typed inside
a message into the real control token, so a caller could forge system or assistant turns.
Here every special-token string found in message fields is swapped for a sentinel before
the template runs; the rendered prompt is then tokenized piecewise: the template's own text
with its markers as control tokens, each shielded string as plain text.
"""

from __future__ import annotations

import re
from typing import Any

# Private-use code points: the sentinel is U+E000 <index> U+E001. A U+E000 typed by the
# caller is itself shielded (and encoded as text), so it can never fake a sentinel.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")


def special_strings(tokenizer: Any) -> list[str]:
    """Every special-token string of ``tokenizer``, longest first (so a regex alternation
    prefers ``<|im_start|>`` over any shorter special it contains)."""
    found: set[str] = set(getattr(tokenizer, "all_special_tokens", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token in added.values():
        if getattr(token, "special", False):
            found.add(str(token.content))
    return sorted((s for s in found if s), key=len, reverse=True)


class ChatPromptEncoder:
    """Renders messages through the chat template and tokenizes them, content as text."""

    def __init__(self, tokenizer: Any, trust_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.trust_special_tokens = trust_special_tokens
        strings = special_strings(tokenizer)
        # Without special tokens nothing can be forged: the template output is tokenized whole.
        self._shield = bool(strings) and not trust_special_tokens
        self._pattern = re.compile("|".join(re.escape(s) for s in [*strings, _OPEN]))

    def render_text(self, messages: list[dict[str, str]], **template_kw: Any) -> str:
        """The chat template applied as the model defines it (no shielding)."""
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **template_kw))

    def encode(self, messages: list[dict[str, str]], **template_kw: Any) -> list[int]:
        """Token ids of the rendered prompt; the template already holds BOS and friends."""
        if not self._shield:
            text = self.render_text(messages, **template_kw)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        shielded: list[str] = []

        def shield(match: re.Match[str]) -> str:
            shielded.append(match.group(0))
            return f"{_OPEN}{len(shielded) - 1}{_CLOSE}"

        # Only text is shielded: tool calls and other structured fields pass as they are.
        safe = [
            {k: self._pattern.sub(shield, v) if isinstance(v, str) else v for k, v in m.items()}
            for m in messages
        ]
        text = self.render_text(safe, **template_kw)
        ids: list[int] = []
        pos = 0
        for match in _SENTINEL.finditer(text):
            ids += self._encode(text[pos : match.start()], as_text=False)
            ids += self._encode(shielded[int(match.group(1))], as_text=True)
            pos = match.end()
        ids += self._encode(text[pos:], as_text=False)
        return ids

    def _encode(self, text: str, as_text: bool) -> list[int]:
        if not text:
            return []
        if as_text:
            return list(
                self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

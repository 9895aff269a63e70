"""Real English words for text prompts (``--prompt-mode text``).

A router such as smg refuses token-id prompts and keys its cache-aware routing on the
prompt's text, so a load test through it sends text. Each drawn id picks one word; the
words are common, lower-case and ASCII, so every tokenizer splits them the same way at
the spaces and a shared word prefix is a shared token prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

_WORD_TEXT = """
    time year people way day man thing woman life child world school state family
    student group country problem hand part place case week company system program
    question work government number night point home water room mother area money
    story fact month lot right study book eye job word business issue side kind head
    house service friend father power hour game line end member law car city name
    president team minute idea kid body information back parent face others level
    office door health person art war history party result change morning reason
    research girl guy moment air teacher force education foot boy age policy music
    market sense nation plan college interest death experience effect class control
    care field development role effort rate heart drug show leader light voice wife
    police mind price report decision son view relationship town road arm difference
    value building action model season society tax director position player record
    paper space ground form event official matter center couple site project activity
    star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie
    north love support technology step baby computer type attention film tree source
    organization hair window evidence population river garden bridge letter summer
    winter island forest mountain valley ocean cloud stone glass paint bread apple
    coffee kitchen train station ticket journey planet engine signal memory
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def words_for(ids: Sequence[int]) -> list[str]:
    """One word per id (ids index the list modulo its length)."""
    return [WORDS[i % len(WORDS)] for i in ids]


def text_for(ids: Sequence[int]) -> str:
    """The prompt text of ``ids``: their words joined by single spaces."""
    return " ".join(words_for(ids))

"""--cached-tokens-scope: what ``cached_tokens`` may tell a caller about others' prompts."""

from __future__ import annotations

import pytest

from server.cache_report import CHUNK, CacheReport

ALICE, MALLORY = "Bearer alice-token", "Bearer mallory-token"
PIN_PROMPT = list(range(1000, 1000 + 3 * CHUNK + 5))  # 3 chunks and a tail


def test_all_reports_everything_and_none_nothing() -> None:
    assert CacheReport("all").own_prefixes(ALICE, [PIN_PROMPT]) is None
    assert CacheReport("none").own_prefixes(ALICE, [PIN_PROMPT, [1, 2]]) == [0, 0]
    with pytest.raises(ValueError, match="cached_tokens_scope"):
        CacheReport("some")


def test_key_scope_reports_only_what_the_same_caller_sent_before() -> None:
    report = CacheReport("key")
    assert report.own_prefixes(ALICE, [PIN_PROMPT]) == [0]  # first send
    # Mallory guesses Alice's prompt: whatever the cache holds, she is told nothing ...
    assert report.own_prefixes(MALLORY, [PIN_PROMPT]) == [0]
    # ... until she sent it herself, which tells her only about her own history.
    assert report.own_prefixes(MALLORY, [PIN_PROMPT]) == [len(PIN_PROMPT)]
    assert report.own_prefixes(ALICE, [PIN_PROMPT]) == [len(PIN_PROMPT)]
    # A longer prompt over Alice's: her own prefix up to its last chunk boundary.
    longer = [*PIN_PROMPT, 7, 7, 7]
    assert report.own_prefixes(ALICE, [longer]) == [3 * CHUNK]
    # Another caller sharing only the first chunk is told nothing of Alice's rest.
    other = [*PIN_PROMPT[:CHUNK], *range(5000, 5000 + 2 * CHUNK)]
    assert report.own_prefixes("Bearer bob", [other]) == [0]
    assert report.own_prefixes(ALICE, [other]) == [CHUNK]


def test_the_record_is_bounded_and_forgets_by_under_reporting() -> None:
    report = CacheReport("key", max_records=4)
    report.own_prefixes(ALICE, [PIN_PROMPT])  # 4 boundaries: fills the record
    report.own_prefixes(ALICE, [list(range(9000, 9000 + CHUNK))])  # evicts the oldest
    assert report.own_prefixes(ALICE, [PIN_PROMPT]) == [0]  # the first chunk is forgotten
    assert len(report._records) == 4

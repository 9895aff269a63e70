"""What ``cached_tokens`` may tell a caller (``--cached-tokens-scope``).

A shared prefix cache answers "has anyone sent this prefix?": a caller who guesses a
prompt and reads ``cached_tokens`` learns whether another user sent it (a 6-digit PIN
fell in 60 requests). The scopes:

- ``all``: every hit is reported, whoever caused it (the default; OpenAI's behaviour);
- ``key``: a prompt's cached prefix is reported only as far as the *same caller* sent
  that prefix before (the caller is the bearer token it presents); a prefix this caller
  never sent counts 0, whoever cached it. The report then depends only on the caller's
  own history (and on eviction), never on what others sent;
- ``none``: ``cached_tokens`` is always 0.

Only the report changes: the KV is still reused, so time to first token still differs
(see docs/cache-security.md). Per caller, the record holds digests of prompt prefixes
at every ``CHUNK`` tokens plus each prompt's full length, in a bounded LRU: a prefix
that fell out of it, or that ends between two chunk boundaries, is under-reported,
never over-reported.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

CACHED_TOKENS_SCOPES = ("all", "key", "none")
CHUNK = 32  # tokens between two recorded prefix boundaries
MAX_RECORDS = 1 << 18  # prefix digests kept (about 30 MB), shared by all callers


class CacheReport:
    """Per caller, the prompt prefixes it sent; how many cached tokens it may be told."""

    def __init__(self, scope: str = "all", max_records: int = MAX_RECORDS) -> None:
        if scope not in CACHED_TOKENS_SCOPES:
            raise ValueError(
                f"cached_tokens_scope must be one of {', '.join(CACHED_TOKENS_SCOPES)}, "
                f"got {scope!r}"
            )
        self.scope = scope
        self.max_records = max_records
        self._records: OrderedDict[bytes, None] = OrderedDict()
        # NOTE: digests are keyed by a per-process secret, so the record never holds
        # anything that identifies a token or a prompt outside this process.
        self._process_key = os.urandom(32)

    def caller(self, authorization: str | None) -> bytes:
        """The caller's identity: its bearer token, hashed (no token: the empty one)."""
        token = ""
        if authorization:
            scheme, _, value = authorization.partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else ""
        return hashlib.blake2b(token.encode(), key=self._process_key, digest_size=16).digest()

    def own_prefixes(
        self, authorization: str | None, prompts: Sequence[Sequence[int]]
    ) -> list[int] | None:
        """Per prompt, the tokens of its cached prefix the caller may be told about (None:
        no limit), then record the prompts as sent by this caller."""
        if self.scope == "all":
            return None
        if self.scope == "none":
            return [0] * len(prompts)
        caller = self.caller(authorization)
        owned = []
        for prompt in prompts:
            boundaries = self._boundaries(caller, prompt)
            own = 0
            for length, digest in boundaries:
                if digest not in self._records:
                    break
                own = length
            owned.append(own)
            for _, digest in boundaries:
                self._remember(digest)
        return owned

    def _boundaries(self, caller: bytes, prompt: Sequence[int]) -> list[tuple[int, bytes]]:
        """(length, digest of caller + prompt[:length]) at every CHUNK tokens and at the
        prompt's end; each digest chains the one before, so it names the whole prefix."""
        marks = list(range(CHUNK, len(prompt) + 1, CHUNK))
        if not marks or marks[-1] != len(prompt):
            marks.append(len(prompt))
        out, previous, start = [], caller, 0
        for end in marks:
            h = hashlib.blake2b(previous, key=self._process_key, digest_size=16)
            h.update(b"".join(int(t).to_bytes(4, "little") for t in prompt[start:end]))
            previous = h.digest()
            out.append((end, previous))
            start = end
        return out

    def _remember(self, digest: bytes) -> None:
        self._records[digest] = None
        self._records.move_to_end(digest)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

"""``cache_salt``: the tenant a request's cached KV belongs to.

A request with a salt reuses KV only from requests with the same salt, on every tier:
the radix tree (the salt's digest is part of every root-level child key, so each salt
has its own subtree and the host tier follows the tree) and the L3 store (the page-key
chain of a salted prompt starts from a digest of the namespace and the salt, so its
keys share nothing with another salt's or with unsalted keys). Requests without a salt
behave exactly as before: same tree keys, same L3 keys.

The engine never keeps the salt itself, only its SHA-256 digest (hex).
"""

from __future__ import annotations

import hashlib

from engine.errors import InvalidRequestError

MAX_CACHE_SALT_CHARS = 256
# Per-salt metrics carry one of this many bucket labels (never the salt or its digest),
# so their cardinality stays fixed however many tenants there are.
SALT_BUCKETS = 16


def check_cache_salt(salt: object) -> None:
    """Raise InvalidRequestError (param ``cache_salt``) unless ``salt`` is None or a
    non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError(
            "cache_salt must be a non-empty string if given", param="cache_salt"
        )
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt may be at most {MAX_CACHE_SALT_CHARS} characters long, got {len(salt)}",
            param="cache_salt",
        )


def salt_digest(salt: str | None) -> str:
    """The digest the caches key a salt by; "" for no salt (the unsalted cache)."""
    if not salt:
        return ""
    return hashlib.sha256(b"hiserve-cache-salt\0" + salt.encode()).hexdigest()


def salt_bucket(digest: str) -> int:
    """Which of SALT_BUCKETS metric buckets a salt digest counts in."""
    return int(digest[:8], 16) % SALT_BUCKETS

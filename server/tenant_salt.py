"""``--cache-salt-from-key``: the caller's bearer token partitions the cache too.

A ``cache_salt`` in the body is chosen by the client: a tenant who learns or guesses
another tenant's salt shares (and can probe) that cache. Behind a gateway that
authenticates each tenant with its own key and forwards it (smg with
``--tenant-api-key TENANT:KEY`` forwards the client's ``Authorization`` header to the
replica), the key is an identity the client cannot borrow. With this flag the engine's
salt is derived from the bearer token and the body's salt together, so two keys never
share a cached token, whatever salts they send; a request without a token keeps its
body salt as is (nothing to derive from).

The derived salt is a plain SHA-256 (no per-process key), so every replica and every
restart derives the same one: L3 pages stay shared across the fleet.
"""

from __future__ import annotations

import hashlib


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer`` header; "" for none or another scheme."""
    if not authorization:
        return ""
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def engine_salt(cache_salt: str | None, authorization: str | None, from_key: bool) -> str | None:
    """The cache_salt the engine keys a request by: the body's, or with ``from_key`` one
    derived from the caller's token and the body's salt ("key:" + 64 hex characters)."""
    token = bearer_token(authorization) if from_key else ""
    if not token:
        return cache_salt
    digest = hashlib.sha256(b"hiserve-key-salt\0" + token.encode())
    digest.update(b"\0" + (cache_salt or "").encode())
    return "key:" + digest.hexdigest()

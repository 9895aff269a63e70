"""Authentication (and optional encryption) of L3 pages with a fleet secret.

A page is stored with an HMAC-SHA256 tag over its key and its bytes, so a page moved to
another key (a swap), cut short, flipped or written by someone without the secret fails
the check and is a miss. With ``encrypt`` the bytes are also sealed with AES-GCM (the
``cryptography`` package, extra ``l3-crypt``), the page key being its associated data.

The secret comes from ``HISERVE_HICACHE_STORAGE_SECRET`` (the secret itself) or from
``--hicache-storage-secret-file``; never from a command line, where ``ps`` shows it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

SECRET_ENV = "HISERVE_HICACHE_STORAGE_SECRET"
# A secret shorter than this is refused: it would be guessable offline from one page.
MIN_SECRET_BYTES = 16
TAG_BYTES = 32
NONCE_BYTES = 12
_MAC_LABEL = b"hiserve-l3-page-mac-v1"
_AES_LABEL = b"hiserve-l3-page-aes-v1"


class SecretError(ValueError):
    """The storage secret is missing, unreadable or too short."""


def load_secret(secret_file: str | None) -> bytes | None:
    """The fleet secret: the environment variable, else the file, else None."""
    value = os.environ.get(SECRET_ENV, "").strip()
    if value:
        secret = value.encode("utf-8")
        where = f"${SECRET_ENV}"
    elif secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise SecretError(
                f"--hicache-storage-secret-file {secret_file}: cannot read it ({exc})"
            ) from exc
        where = f"--hicache-storage-secret-file {secret_file}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"{where} holds {len(secret)} bytes; an L3 storage secret needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


class PageSeal:
    """Tags (and optionally encrypts) page bytes under keys derived from one secret."""

    def __init__(self, secret: bytes, encrypt: bool = False) -> None:
        self._mac_key = hmac.new(secret, _MAC_LABEL, hashlib.sha256).digest()
        self.encrypt = encrypt
        self._aead = None
        if encrypt:
            try:
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            except ImportError as exc:
                raise SecretError(
                    "--hicache-storage-encrypt needs the `cryptography` package "
                    f"(pip install 'hiserve[l3-crypt]'): {exc}"
                ) from exc
            self._aead = AESGCM(hmac.new(secret, _AES_LABEL, hashlib.sha256).digest())

    def tag(self, key: str, header: bytes, chunks: Iterable[memoryview | bytes]) -> bytes:
        """HMAC over the page key, its header fields and its stored bytes."""
        mac = hmac.new(self._mac_key, digestmod=hashlib.sha256)
        encoded = key.encode("utf-8")
        mac.update(len(encoded).to_bytes(2, "little") + encoded + header)
        for chunk in chunks:
            mac.update(chunk)
        return mac.digest()

    def check(
        self, tag: bytes, key: str, header: bytes, chunks: Iterable[memoryview | bytes]
    ) -> bool:
        return hmac.compare_digest(tag, self.tag(key, header, chunks))

    def seal(self, key: str, plain: bytes) -> bytes:
        """``nonce || AES-GCM(plain)`` with the key as associated data."""
        assert self._aead is not None
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plain, key.encode("utf-8"))

    def open(self, key: str, sealed: bytes) -> bytes | None:
        """The plain bytes of ``seal``'s output, or None if it does not authenticate."""
        if self._aead is None:
            return None
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(
                sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], key.encode("utf-8")
            )
        except InvalidTag:
            return None

    @staticmethod
    def sealed_len(plain_len: int) -> int:
        return NONCE_BYTES + plain_len + 16  # nonce, ciphertext, GCM tag

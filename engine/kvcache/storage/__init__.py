"""HiCache L3: a KV page store below the host tier, shared by replicas, kept across restarts.

``make_store`` builds a backend by name; see ``base.KVStore`` for the interface and
``keys`` for how pages are named.
"""

from __future__ import annotations

from pathlib import Path

from engine.kvcache.storage.base import KVStore, PagePieces, StoreStats
from engine.kvcache.storage.keys import KVNamespace, model_digest, page_keys

STORAGE_BACKENDS = ("none", "file", "mooncake")
# The file store's budget when none is given (--hicache-storage-size, GB).
DEFAULT_STORE_BYTES = 16 * 10**9

__all__ = [
    "DEFAULT_STORE_BYTES",
    "STORAGE_BACKENDS",
    "KVNamespace",
    "KVStore",
    "PagePieces",
    "StoreStats",
    "make_store",
    "model_digest",
    "page_keys",
]


def make_store(
    backend: str,
    *,
    directory: str | None = None,
    max_bytes: int = DEFAULT_STORE_BYTES,
    secret: bytes | None = None,
    encrypt: bool = False,
    mooncake_master: str | None = None,
    mooncake_metadata_server: str = "P2PHANDSHAKE",
    mooncake_protocol: str = "tcp",
) -> KVStore | None:
    """The store named ``backend`` (None for ``none``); raises ValueError on bad settings.

    ``secret``: the fleet secret pages are authenticated with (``page_seal``); without
    one the file store keeps its own in its directory and Mooncake uses a public one
    (see docs/cache-security.md)."""
    if backend == "none":
        return None
    if backend == "file":
        if not directory:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        from engine.kvcache.storage.file_store import FileStore

        return FileStore(Path(directory), max_bytes, secret, encrypt)
    if backend == "mooncake":
        if not mooncake_master:
            raise ValueError(
                "--hicache-storage-backend mooncake needs --hicache-mooncake-master host:port"
            )
        from engine.kvcache.storage.mooncake_store import MooncakeConfig, MooncakeStore

        return MooncakeStore(
            MooncakeConfig(
                master=mooncake_master,
                metadata_server=mooncake_metadata_server,
                protocol=mooncake_protocol,
            ),
            secret,
            encrypt,
        )
    raise ValueError(
        f"--hicache-storage-backend {backend!r} is not valid; one of {', '.join(STORAGE_BACKENDS)}"
    )

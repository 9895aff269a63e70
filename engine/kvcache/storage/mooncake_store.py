"""The ``mooncake`` L3 backend: Mooncake Store, the distributed KV store SGLang uses.

A ``mooncake_master`` holds the metadata; the bytes live in segments that clients
contribute. An engine contributes none by default (``segment_bytes=0``), so its pages
live in a holder process (``mooncake_client``) or in other replicas and outlive the
engine's restarts. The host pool is registered once; pages move with
``batch_put_from`` / ``batch_get_into`` straight between host memory and the store.

A page is one object per piece (K and V for ``page_first``), named ``<key>_<i>``, and a
tag object ``<key>_t``: an HMAC over the key and every piece (``page_seal``), written
last. A page counts as stored only when every piece and its tag are; a page whose tag
does not match what was read (swapped, forged, written without the fleet secret) is a
miss, counted in ``pages_rejected``. Reads take a lease in Mooncake, so removal uses
``force``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kvcache.storage.base import KVStore, byte_view
from engine.kvcache.storage.page_seal import PageSeal

logger = logging.getLogger(__name__)

# Without a fleet secret pages are still bound to their key (a swap or a torn page is a
# miss), but anyone who reads this source can forge a tag: see docs/cache-security.md.
PUBLIC_SECRET = b"hiserve-l3-no-fleet-secret-given"
_TAG_HEADER = b"mooncake-page-v1"


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the store is and how this client joins it."""

    master: str  # host:port of mooncake_master's RPC
    metadata_server: str = "P2PHANDSHAKE"  # or http://host:port/metadata
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    segment_bytes: int = 0  # bytes this process contributes to the store
    local_buffer_bytes: int = 16 << 20


class MooncakeStore(KVStore):
    """KV pages in Mooncake Store."""

    name = "mooncake"

    def __init__(
        self, config: MooncakeConfig, secret: bytes | None = None, encrypt: bool = False
    ) -> None:
        super().__init__()
        if encrypt:
            raise ValueError(
                "--hicache-storage-encrypt is for the file backend (pages at rest on disk); "
                "Mooncake keeps pages in memory: drop it or use the file backend"
            )
        if secret is None:
            logger.warning(
                "L3 mooncake store: no fleet secret (HISERVE_HICACHE_STORAGE_SECRET or "
                "--hicache-storage-secret-file); pages are checked against their key but "
                "anyone who can write to the store can forge them"
            )
        self.seal = PageSeal(secret or PUBLIC_SECRET)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise RuntimeError(
                "--hicache-storage-backend mooncake needs the Mooncake Store client "
                f"({exc}); install mooncake-transfer-engine (CUDA), "
                "mooncake-transfer-engine-musa (MUSA) or mooncake-transfer-engine-non-cuda "
                "(CPU; needs the libibverbs1 system library)"
            ) from exc
        self.config = config
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.device,
            config.master,
        )
        if rc != 0:
            raise RuntimeError(
                f"cannot join Mooncake Store at {config.master} (setup returned {rc}); "
                "check that mooncake_master runs there and the metadata server answers"
            )
        self._registered: list[int] = []
        self._warned: set[str] = set()

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Register host memory (the whole host pool) for zero-copy transfers."""
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer of {nbytes} bytes failed ({rc})")
        self._registered.append(ptr)

    def _piece_keys(self, key: str, count: int) -> list[str]:
        return [f"{key}_{i}" for i in range(count)]

    def _tag(self, key: str, host_page: int) -> bytes:
        return self.seal.tag(key, _TAG_HEADER, [byte_view(p) for p in self.pieces(host_page)])

    def _fail(self, what: str, detail: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("L3 mooncake store: %s failed (%s); treating it as a miss", what, detail)

    def _stored(self, keys: Sequence[str]) -> list[bool]:
        """Per page: whether every piece of it is in the store (all False if it is down)."""
        if not keys:
            return []
        count = len(self.pieces(0)) + 1  # the pieces and the tag
        flat = [k for key in keys for k in [*self._piece_keys(key, count - 1), f"{key}_t"]]
        try:
            found = self._store.batch_is_exist(flat)
        except Exception as exc:  # the store down is a miss
            self._fail("lookup", exc)
            return [False] * len(keys)
        return [all(f == 1 for f in found[i * count : (i + 1) * count]) for i in range(len(keys))]

    def exists_prefix(self, keys: Sequence[str]) -> int:
        stored = self._stored(keys)
        return stored.index(False) if False in stored else len(stored)

    def _transfer(self, keys: Sequence[str], host_pages: Sequence[int], write: bool) -> list[bool]:
        names: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        per_page: list[int] = []
        for key, page in zip(keys, host_pages):
            pieces = self.pieces(page)
            per_page.append(len(pieces))
            names += self._piece_keys(key, len(pieces))
            ptrs += [p.data_ptr() for p in pieces]
            sizes += [p.numel() * p.element_size() for p in pieces]
        if not names:
            return []
        try:
            if write:
                codes = self._store.batch_put_from(names, ptrs, sizes)
                ok = [code == 0 for code in codes]
            else:
                codes = self._store.batch_get_into(names, ptrs, sizes)
                ok = [code == size for code, size in zip(codes, sizes)]
        except Exception as exc:
            self._fail("write" if write else "read", exc)
            ok = [False] * len(names)
        done, start = [], 0
        for count in per_page:
            done.append(all(ok[start : start + count]))
            start += count
        return done

    def _tags_match(self, keys: Sequence[str], host_pages: Sequence[int], done: list[bool]) -> None:
        """Clear ``done[i]`` where page i's stored tag does not match the bytes read."""
        wanted = [i for i, ok in enumerate(done) if ok]
        if not wanted:
            return
        try:
            tags = self._store.get_batch([f"{keys[i]}_t" for i in wanted])
        except Exception as exc:
            self._fail("read", exc)
            tags = [b""] * len(wanted)
        for i, tag in zip(wanted, tags):
            if not self.seal.check(
                bytes(tag), keys[i], _TAG_HEADER, [byte_view(p) for p in self.pieces(host_pages[i])]
            ):
                done[i] = False
                self.stats.pages_rejected += 1
                self._fail("authentication", f"page {keys[i][:12]}... does not match its tag")

    def _put_tags(self, keys: Sequence[str], host_pages: Sequence[int], done: list[bool]) -> None:
        """Write the tags of the pages whose pieces landed (last: a page is visible as
        stored only once its tag is); clears ``done`` where that failed."""
        wanted = [i for i, ok in enumerate(done) if ok]
        if not wanted:
            return
        try:
            rc = self._store.put_batch(
                [f"{keys[i]}_t" for i in wanted],
                [self._tag(keys[i], host_pages[i]) for i in wanted],
            )
        except Exception as exc:
            self._fail("write", exc)
            rc = -1
        if rc != 0:
            for i in wanted:
                done[i] = False

    def get_into(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        done = self._transfer(keys, host_pages, write=False)
        self._tags_match(keys, host_pages, done)
        self.stats.pages_read += sum(done)
        self.stats.bytes_read += sum(done) * self.page_nbytes
        self.stats.read_failures += len(done) - sum(done)
        return done

    def put_from(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        # Content-addressed keys: a page someone already stored is not sent again.
        stored = self._stored(keys)
        missing = [i for i, there in enumerate(stored) if not there]
        missing_keys, missing_pages = [keys[i] for i in missing], [host_pages[i] for i in missing]
        sent = self._transfer(missing_keys, missing_pages, True)
        self._put_tags(missing_keys, missing_pages, sent)
        done = list(stored)
        for i, ok in zip(missing, sent):
            done[i] = ok
        self.stats.pages_written += sum(sent)
        self.stats.bytes_written += sum(sent) * self.page_nbytes
        self.stats.write_failures += len(sent) - sum(sent)
        return done

    def clear(self) -> None:
        try:
            self._store.remove_all(True)
        except Exception as exc:
            self._fail("clear", exc)

    def close(self) -> None:
        try:
            self._store.close()
        except Exception as exc:
            self._fail("close", exc)

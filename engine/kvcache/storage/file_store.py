"""The ``file`` L3 backend: one file per page in a directory, local or shared.

Each page is a file ``<dir>/<key[:2]>/<key>.kv``: a header (magic, payload length,
CRC-32 of the payload) and the page's bytes. Writes go to a private temporary file that
is renamed into place, so a reader sees a page whole or not at all, even with several
writers (replicas on a shared volume) or a crash mid-write. A page whose length or
checksum is wrong is a miss and is removed. The directory is bounded by ``max_bytes``:
past it, the least recently used pages (by modification time, which reads refresh) go.
"""

from __future__ import annotations

import logging
import os
import struct
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.kvcache.storage.base import KVStore

logger = logging.getLogger(__name__)

_MAGIC = b"HSKV1\0"
_HEADER = struct.Struct("<6sQI")  # magic, payload bytes, crc32 of the payload
_SUFFIX = ".kv"
# Eviction frees down to this share of the limit, so it does not run on every write.
_EVICT_TO = 0.9


def _byte_view(piece: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(piece.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class FileStore(KVStore):
    """KV pages as files under ``root``, at most ``max_bytes`` of them (0: no limit)."""

    name = "file"

    def __init__(self, root: Path, max_bytes: int = 0) -> None:
        super().__init__()
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._used = sum(p.stat().st_size for p in self._files())
        self._warned: set[str] = set()

    # ------------------------------------------------------------ paths

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def _files(self) -> list[Path]:
        return [p for p in self.root.glob(f"*/*{_SUFFIX}") if p.is_file()]

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(
                "L3 file store %s: %s failed (%s); treating it as a miss", self.root, what, exc
            )

    # ------------------------------------------------------------ the interface

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for count, key in enumerate(keys):
            if not self._path(key).is_file():
                return count
        return len(keys)

    def get_into(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        return [self._read(key, page) for key, page in zip(keys, host_pages)]

    def put_from(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        done = [self._write(key, page) for key, page in zip(keys, host_pages)]
        if self.max_bytes and self._used > self.max_bytes:
            self._evict()
        return done

    def clear(self) -> None:
        for path in self._files():
            path.unlink(missing_ok=True)
        self._used = 0

    # ------------------------------------------------------------ one page

    def _read(self, key: str, host_page: int) -> bool:
        path = self._path(key)
        try:
            with path.open("rb") as handle:
                header = handle.read(_HEADER.size)
                if len(header) != _HEADER.size:
                    return self._corrupt(path, "short header")
                magic, length, crc = _HEADER.unpack(header)
                if magic != _MAGIC or length != self.page_nbytes:
                    return self._corrupt(path, f"header says {length} bytes")
                check = 0
                for piece in self.pieces(host_page):
                    view = _byte_view(piece)
                    if handle.readinto(view) != len(view):
                        return self._corrupt(path, "truncated")
                    check = zlib.crc32(view, check)
            if check != crc:
                return self._corrupt(path, "checksum mismatch")
            os.utime(path)  # NOTE: the LRU clock; reads keep a page young
        except FileNotFoundError:
            self.stats.read_failures += 1
            return False
        except OSError as exc:
            self._warn_once("read", exc)
            self.stats.read_failures += 1
            return False
        self.stats.pages_read += 1
        self.stats.bytes_read += self.page_nbytes
        return True

    def _corrupt(self, path: Path, why: str) -> bool:
        logger.warning("L3 file store: %s is corrupt (%s); removed, counted as a miss", path, why)
        path.unlink(missing_ok=True)
        self.stats.read_failures += 1
        return False

    def _write(self, key: str, host_page: int) -> bool:
        path = self._path(key)
        if path.is_file():
            return True  # content-addressed: the same key always holds the same bytes
        tmp = path.parent / f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            views = [_byte_view(piece) for piece in self.pieces(host_page)]
            crc = 0
            for view in views:
                crc = zlib.crc32(view, crc)
            with tmp.open("wb") as handle:
                handle.write(_HEADER.pack(_MAGIC, self.page_nbytes, crc))
                for view in views:
                    handle.write(view)
            os.replace(tmp, path)  # NOTE: the page becomes visible whole, or not at all
        except OSError as exc:  # disk full, read-only, gone
            tmp.unlink(missing_ok=True)
            self._warn_once("write", exc)
            self.stats.write_failures += 1
            return False
        self._used += _HEADER.size + self.page_nbytes
        self.stats.pages_written += 1
        self.stats.bytes_written += self.page_nbytes
        return True

    def _evict(self) -> None:
        """Remove least recently used pages until the directory is under its limit."""
        aged = []
        for path in self._files():
            try:
                stat = path.stat()
            except FileNotFoundError:  # another replica removed it
                continue
            aged.append((stat.st_mtime_ns, stat.st_size, path))
        aged.sort()
        used = sum(size for _, size, _ in aged)
        target = int(self.max_bytes * _EVICT_TO)
        for _, size, path in aged:
            if used <= target:
                break
            path.unlink(missing_ok=True)
            used -= size
            self.stats.pages_evicted += 1
        self._used = used

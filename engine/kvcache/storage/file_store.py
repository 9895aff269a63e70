"""The ``file`` L3 backend: one file per page in a directory, local or shared.

Each page is a file ``<dir>/<key[:2]>/<key>.kv``: a header (magic, flags, payload
length), an HMAC tag over the page's key, header and stored bytes (``page_seal``), then
the page's bytes (AES-GCM sealed with ``encrypt``). A page that is cut short, flipped,
moved to another key or written without the fleet secret fails its tag: a miss, counted
(``pages_rejected``) and removed, never loaded.

The directory and its subdirectories are 0700, page files 0600. Every path is opened
relative to a descriptor of the root, never following a link (``O_NOFOLLOW``): a link
planted in the store makes that page a miss or its write a failure, and a write never
lands outside the root. Writes go to a private temporary file that is renamed into place,
so a reader sees a page whole or not at all, even with several writers (replicas on a
shared volume) or a crash mid-write. ``file_space.DiskBudget`` bounds the directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import struct
import uuid
from collections.abc import Sequence
from io import BufferedReader
from pathlib import Path

from engine.kvcache.storage.base import KVStore, byte_view
from engine.kvcache.storage.file_space import DIR_FLAGS, PAGE_SUFFIX, DiskBudget, scan_pages
from engine.kvcache.storage.file_space import remove_page as _remove_page
from engine.kvcache.storage.page_seal import MIN_SECRET_BYTES, TAG_BYTES, PageSeal

logger = logging.getLogger(__name__)

_MAGIC = b"HSKV2\0"
_HEADER = struct.Struct("<6sBQ")  # magic, flags, payload bytes (before sealing)
_ENCRYPTED = 1
_FILE_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# NOTE: O_NONBLOCK: a FIFO planted as a page must not block the reader on open().
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _FILE_FLAGS
# Without a fleet secret, the store keeps its own here (0600): see docs/cache-security.md.
LOCAL_SECRET = ".hiserve-secret"
_HEX = frozenset("0123456789abcdef")


class FileStore(KVStore):
    """KV pages as files under ``root``, at most ``max_bytes`` of them."""

    name = "file"

    def __init__(
        self,
        root: Path,
        max_bytes: int = 16 * 10**9,
        secret: bytes | None = None,
        encrypt: bool = False,
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        # NOTE: the root itself may be a link the operator made; nothing below it may.
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        self._private(self._root_fd, str(self.root))
        self.seal = PageSeal(secret if secret is not None else self._local_secret(), encrypt)
        self.budget = DiskBudget(str(self.root), self._root_fd, max_bytes)
        self.budget.measure()
        self._warned: set[str] = set()

    @property
    def max_bytes(self) -> int:
        return self.budget.max_bytes

    # ------------------------------------------------------------ the directory

    @staticmethod
    def _private(fd: int, where: str) -> None:
        """Make a directory we own 0700 (an older store may have left it 0755)."""
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            try:
                os.fchmod(fd, 0o700)
            except OSError as exc:
                logger.warning("L3 file store: cannot make %s private (%s)", where, exc)

    def _local_secret(self) -> bytes:
        """The store's own secret, made once (0600) by whichever replica comes first."""
        logger.warning(
            "L3 file store %s: no fleet secret (%s or --hicache-storage-secret-file); pages "
            "are authenticated with a secret kept in the store directory, so anyone who can "
            "read that directory can also forge pages",
            self.root,
            "HISERVE_HICACHE_STORAGE_SECRET",
        )
        for _ in range(3):
            try:
                fd = os.open(LOCAL_SECRET, _READ_FLAGS, dir_fd=self._root_fd)
            except FileNotFoundError:
                self._make_local_secret()
                continue
            with os.fdopen(fd, "rb") as handle:
                regular = stat.S_ISREG(os.fstat(fd).st_mode)
                secret = handle.read(1024).strip() if regular else b""
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(f"{self.root / LOCAL_SECRET} is not a valid store secret")
            return secret
        raise ValueError(f"cannot create {self.root / LOCAL_SECRET}")

    def _make_local_secret(self) -> None:
        tmp = f".secret.{uuid.uuid4().hex}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=self._root_fd
        )
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_hex(32).encode())
        try:  # NOTE: link() publishes it whole and fails if another replica was first
            os.link(tmp, LOCAL_SECRET, src_dir_fd=self._root_fd, dst_dir_fd=self._root_fd)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp, dir_fd=self._root_fd)

    def _subdir(self, key: str, create: bool) -> int | None:
        """A descriptor of the page's subdirectory (None if absent); raises OSError for a
        link or anything but a directory."""
        if len(key) < 2 or not _HEX.issuperset(key):
            raise OSError(f"not a page key: {key!r}")
        try:
            return os.open(key[:2], DIR_FLAGS, dir_fd=self._root_fd)
        except FileNotFoundError:
            if not create:
                return None
        with contextlib.suppress(FileExistsError):
            os.mkdir(key[:2], 0o700, dir_fd=self._root_fd)
        return os.open(key[:2], DIR_FLAGS, dir_fd=self._root_fd)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{PAGE_SUFFIX}"

    def _warn_once(self, what: str, exc: BaseException | str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(
                "L3 file store %s: %s failed (%s); treating it as a miss", self.root, what, exc
            )

    # ------------------------------------------------------------ the interface

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for count, key in enumerate(keys):
            if not self._is_page(key):
                return count
        return len(keys)

    def _is_page(self, key: str) -> bool:
        try:
            sub = self._subdir(key, create=False)
        except OSError:
            return False
        if sub is None:
            return False
        try:
            info = os.stat(f"{key}{PAGE_SUFFIX}", dir_fd=sub, follow_symlinks=False)
            return stat.S_ISREG(info.st_mode)
        except OSError:
            return False
        finally:
            os.close(sub)

    def get_into(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        return [self._read(key, page) for key, page in zip(keys, host_pages)]

    def put_from(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        todo = [i for i, key in enumerate(keys) if not self._is_page(key)]
        done = [True] * len(keys)  # content-addressed: a stored key holds the same bytes
        allowed = self.budget.admit(len(todo), self._file_bytes) if todo else 0
        for n, i in enumerate(todo):
            done[i] = n < allowed and self._write(keys[i], host_pages[i])
        self.stats.write_failures += len(todo) - allowed
        self.stats.pages_evicted = self.budget.evicted
        self.stats.writes_refused = self.budget.refused
        self.stats.used_bytes = self.budget.used
        return done

    def clear(self) -> None:
        for page in scan_pages(self._root_fd):
            _remove_page(self._root_fd, page)
        self.budget.used = 0

    def close(self) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    @property
    def _file_bytes(self) -> int:
        body = PageSeal.sealed_len(self.page_nbytes) if self.seal.encrypt else self.page_nbytes
        return _HEADER.size + TAG_BYTES + body

    # ------------------------------------------------------------ one page

    def _read(self, key: str, host_page: int) -> bool:
        name = f"{key}{PAGE_SUFFIX}"
        sub = None
        try:
            sub = self._subdir(key, create=False)
            if sub is None:
                raise FileNotFoundError(name)
            fd = os.open(name, _READ_FLAGS, dir_fd=sub)
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return self._reject(sub, name, "not a regular file")
                why = self._read_page(handle, key, host_page)
                if why is not None:
                    return self._reject(sub, name, why)
                os.utime(fd)  # NOTE: the LRU clock; reads keep a page young
        except FileNotFoundError:
            self.stats.read_failures += 1
            return False
        except OSError as exc:  # a planted link (ELOOP), permissions, I/O
            self._warn_once("read", exc)
            self.stats.read_failures += 1
            return False
        finally:
            if sub is not None:
                os.close(sub)
        self.stats.pages_read += 1
        self.stats.bytes_read += self.page_nbytes
        return True

    def _read_page(self, handle: BufferedReader, key: str, host_page: int) -> str | None:
        """Read and authenticate one page into its host page; why it failed, or None."""
        head = handle.read(_HEADER.size + TAG_BYTES)
        if len(head) != _HEADER.size + TAG_BYTES:
            return "short header"
        header, tag = head[: _HEADER.size], head[_HEADER.size :]
        magic, flags, length = _HEADER.unpack(header)
        if magic != _MAGIC or flags not in (0, _ENCRYPTED) or length != self.page_nbytes:
            return f"header says {length} bytes, format {magic!r}/{flags}"
        views = [byte_view(piece) for piece in self.pieces(host_page)]
        if flags & _ENCRYPTED:
            body = handle.read(PageSeal.sealed_len(length) + 1)
            if len(body) != PageSeal.sealed_len(length):
                return "wrong length"
            if not self.seal.check(tag, key, header, [body]):
                return "authentication failed"
            plain = self.seal.open(key, body)
            if plain is None:
                return "cannot decrypt (is --hicache-storage-encrypt on everywhere?)"
            offset = 0
            for view in views:
                view[:] = plain[offset : offset + len(view)]
                offset += len(view)
            return None
        for view in views:
            if handle.readinto(view) != len(view):
                return "truncated"
        if handle.read(1):
            return "trailing bytes"
        if not self.seal.check(tag, key, header, views):
            return "authentication failed"
        return None

    def _reject(self, sub: int, name: str, why: str) -> bool:
        logger.warning(
            "L3 file store: page %s rejected (%s); removed, counted as a miss", name, why
        )
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=sub)
        self.stats.pages_rejected += 1
        self.stats.read_failures += 1
        return False

    def _write(self, key: str, host_page: int) -> bool:
        tmp = f".{key}.{uuid.uuid4().hex}.tmp"
        sub = None
        try:
            sub = self._subdir(key, create=True)
            assert sub is not None
            views: list[memoryview | bytes] = [byte_view(p) for p in self.pieces(host_page)]
            flags = _ENCRYPTED if self.seal.encrypt else 0
            header = _HEADER.pack(_MAGIC, flags, self.page_nbytes)
            if self.seal.encrypt:
                views = [self.seal.seal(key, b"".join(views))]
            tag = self.seal.tag(key, header, views)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=sub)
            with os.fdopen(fd, "wb") as handle:
                handle.write(header + tag)
                for view in views:
                    handle.write(view)
            # NOTE: the page becomes visible whole, or not at all
            os.replace(tmp, f"{key}{PAGE_SUFFIX}", src_dir_fd=sub, dst_dir_fd=sub)
        except OSError as exc:  # disk full, read-only, gone, a planted link
            if sub is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=sub)
            self._warn_once("write", exc)
            self.stats.write_failures += 1
            return False
        finally:
            if sub is not None:
                os.close(sub)
        self.budget.wrote(self._file_bytes)
        self.stats.pages_written += 1
        self.stats.bytes_written += self.page_nbytes
        return True

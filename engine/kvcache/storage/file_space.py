"""The file store's disk budget: the whole directory measured, not only our own writes.

Replicas sharing one directory each write pages, so a count of one's own writes says
little about the directory: it is measured for real (every page file, whoever wrote
it) at least every ``RESCAN_S`` seconds and before any eviction. Before a write, the
budget (``max_bytes``) and the volume's free space are checked: past the budget the
oldest pages go (modification time, which reads refresh); a write that would leave
less than ``MIN_FREE_SHARE`` of the volume free is refused.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass

# The real usage is measured again after this long (and before each eviction).
RESCAN_S = 10.0
# Eviction frees down to this share of the budget, so it does not run on every write.
EVICT_TO = 0.9
# Writes never take the volume's free space below this share of its size.
MIN_FREE_SHARE = 0.05
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
PAGE_SUFFIX = ".kv"


@dataclass(frozen=True)
class PageFile:
    subdir: str
    name: str
    size: int
    mtime_ns: int


def scan_pages(root_fd: int) -> list[PageFile]:
    """Every page file under the root (``<2 hex>/<key>.kv``), never following links."""
    pages: list[PageFile] = []
    with os.scandir(root_fd) as top:
        subdirs = [e.name for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    for subdir in subdirs:
        try:
            sub_fd = os.open(subdir, DIR_FLAGS, dir_fd=root_fd)
        except OSError:  # removed meanwhile, or a link planted in its place
            continue
        try:
            with os.scandir(sub_fd) as entries:
                for entry in entries:
                    if not entry.name.endswith(PAGE_SUFFIX):
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # another replica removed it
                        continue
                    if stat.S_ISREG(info.st_mode):
                        pages.append(PageFile(subdir, entry.name, info.st_size, info.st_mtime_ns))
        finally:
            os.close(sub_fd)
    return pages


def remove_page(root_fd: int, page: PageFile) -> bool:
    try:
        sub_fd = os.open(page.subdir, DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return False
    try:
        os.unlink(page.name, dir_fd=sub_fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(sub_fd)


class DiskBudget:
    """Bytes of page files in one store directory, kept under ``max_bytes``."""

    def __init__(self, root: str, root_fd: int, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(
                "the file L3 store needs a size: --hicache-storage-size GB (> 0); the volume "
                "fills up otherwise"
            )
        self.root, self.root_fd, self.max_bytes = root, root_fd, max_bytes
        self.used = 0
        self.evicted = 0  # pages removed to stay under the budget
        self.refused = 0  # pages not written: no room left on the volume
        self._measured_at = float("-inf")

    def measure(self) -> list[PageFile]:
        pages = scan_pages(self.root_fd)
        self.used = sum(p.size for p in pages)
        self._measured_at = time.monotonic()
        return pages

    def admit(self, count: int, file_bytes: int) -> int:
        """How many of ``count`` page files of ``file_bytes`` may be written now (evicting
        the oldest pages past the budget first)."""
        if time.monotonic() - self._measured_at >= RESCAN_S:
            self.measure()
        need = count * file_bytes
        if self.used + need > self.max_bytes:
            self._evict(need)
        room = max(0, self.max_bytes - self.used) // file_bytes
        disk = shutil.disk_usage(self.root)
        spare = disk.free - int(disk.total * MIN_FREE_SHARE)
        room = min(room, max(0, spare) // file_bytes)
        allowed = min(count, room)
        self.refused += count - allowed
        return allowed

    def wrote(self, file_bytes: int) -> None:
        self.used += file_bytes

    def _evict(self, need: int) -> None:
        """Remove the oldest pages (of every writer) until ``need`` more bytes fit under
        ``EVICT_TO`` of the budget (or nothing is left)."""
        pages = sorted(self.measure(), key=lambda p: p.mtime_ns)
        target = int(self.max_bytes * EVICT_TO) - need
        for page in pages:
            if self.used <= target:
                break
            if remove_page(self.root_fd, page):
                self.evicted += 1
            self.used -= page.size

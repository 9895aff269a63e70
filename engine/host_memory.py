"""Host-memory sizing: how many bytes this process may still allocate on the host.

Available host memory is the smaller of ``MemAvailable`` in /proc/meminfo and the
headroom (limit minus non-reclaimable usage) of every memory-limited cgroup, v1 or v2,
that the process sits in. The host KV tier is checked against it before allocating, so
a container gets a clear error naming the flag to lower instead of an OOM kill, and the
KV pool of a device that cannot report its own free memory (cpu) is sized from it.
How host memory is then allocated (pinned, host-registered or pageable) depends on the
device and lives in engine.platform.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MEMINFO_PATH = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP_PATH = "/proc/self/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


class HostMemoryError(RuntimeError):
    """The host tier asks for more memory than the host (or its cgroup) has available."""


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo_available(path: Path) -> int | None:
    for line in (_read_text(path) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def _stat_value(path: Path, key: str) -> int:
    for line in (_read_text(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_dirs(root: Path, own_path: str | None) -> list[Path]:
    """The process's cgroup directory and its ancestors up to ``root`` (those that exist)."""
    dirs = [root]
    if own_path:
        current = root / own_path.lstrip("/")
        while current != root and root in current.parents:
            dirs.append(current)
            current = current.parent
    return [d for d in dirs if d.is_dir()]


def _cgroup_headroom(root: Path, self_cgroup: Path) -> list[int]:
    """limit - usage (reclaimable page cache excluded) of every limited cgroup level."""
    v1_path = v2_path = None
    for line in (_read_text(self_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            v1_path = parts[2]
    headroom = []
    for d in _cgroup_dirs(root, v2_path):  # cgroup v2
        limit = (_read_text(d / "memory.max") or "max").strip()
        if limit.isdigit():
            used = int((_read_text(d / "memory.current") or "0").strip() or 0)
            used -= _stat_value(d / "memory.stat", "inactive_file")
            headroom.append(int(limit) - max(used, 0))
    for d in _cgroup_dirs(root / "memory", v1_path):  # cgroup v1
        limit_text = (_read_text(d / "memory.limit_in_bytes") or "").strip()
        if limit_text.isdigit() and int(limit_text) < _UNLIMITED:
            used = int((_read_text(d / "memory.usage_in_bytes") or "0").strip() or 0)
            used -= _stat_value(d / "memory.stat", "total_inactive_file")
            headroom.append(int(limit_text) - max(used, 0))
    return headroom


def available_host_memory(
    meminfo: str | Path | None = None,
    cgroup_root: str | Path | None = None,
    self_cgroup: str | Path | None = None,
) -> int:
    """Bytes this process can still allocate: min(MemAvailable, cgroup v1/v2 headroom)."""
    known = _cgroup_headroom(
        Path(cgroup_root or CGROUP_ROOT), Path(self_cgroup or SELF_CGROUP_PATH)
    )
    mem_available = _meminfo_available(Path(meminfo or MEMINFO_PATH))
    if mem_available is not None:
        known.append(mem_available)
    if not known and hasattr(os, "sysconf"):  # no /proc (macOS): free physical pages
        with contextlib.suppress(ValueError, OSError):
            known.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    return max(min(known), 0) if known else 1 << 62


def check_host_memory(
    requested_bytes: int, what: str, flag_hint: str, available: int | None = None
) -> None:
    """Raise HostMemoryError when ``requested_bytes`` exceed the available host memory."""
    free = available_host_memory() if available is None else available
    if requested_bytes > free:
        raise HostMemoryError(
            f"{what} needs {requested_bytes / 1e9:.2f} GB of host memory, but only "
            f"{free / 1e9:.2f} GB is available (MemAvailable and the cgroup memory limit); "
            f"lower {flag_hint}"
        )

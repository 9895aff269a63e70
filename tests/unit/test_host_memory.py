"""Host-memory sizing: MemAvailable and cgroup v1/v2 limits, from fake /proc and /sys trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import host_memory
from engine.host_memory import HostMemoryError, available_host_memory, check_host_memory

GB = 10**9


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_proc(tmp_path: Path, mem_available_kb: int, cgroup_line: str) -> tuple[Path, Path]:
    meminfo = write(
        tmp_path / "meminfo",
        f"MemTotal:       33554432 kB\nMemAvailable:   {mem_available_kb} kB\n",
    )
    self_cgroup = write(tmp_path / "self_cgroup", cgroup_line)
    return meminfo, self_cgroup


def test_available_memory_uses_cgroup_v2_limit(tmp_path: Path) -> None:
    meminfo, self_cgroup = fake_proc(tmp_path, 16 * 1024 * 1024, "0::/pod/app\n")
    root = tmp_path / "cgroup"
    write(root / "pod" / "app" / "memory.max", "max\n")
    write(root / "pod" / "memory.max", f"{4 * GB}\n")
    write(root / "pod" / "memory.current", f"{GB}\n")
    write(root / "pod" / "memory.stat", f"anon 1\ninactive_file {GB // 2}\n")
    available = available_host_memory(meminfo, root, self_cgroup)
    assert available == 4 * GB - (GB - GB // 2)


def test_available_memory_uses_cgroup_v1_limit(tmp_path: Path) -> None:
    meminfo, self_cgroup = fake_proc(tmp_path, 16 * 1024 * 1024, "4:memory:/docker/abc\n")
    group = tmp_path / "cgroup" / "memory" / "docker" / "abc"
    write(group / "memory.limit_in_bytes", f"{2 * GB}\n")
    write(group / "memory.usage_in_bytes", f"{GB // 2}\n")
    # Reclaimable page cache does not count as used (v1 names it total_inactive_file).
    write(group / "memory.stat", f"cache 5\ntotal_inactive_file {GB // 4}\n")
    write(tmp_path / "cgroup" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    available = available_host_memory(meminfo, tmp_path / "cgroup", self_cgroup)
    assert available == 2 * GB - (GB // 2 - GB // 4)


def test_available_memory_without_limits_is_mem_available(tmp_path: Path) -> None:
    meminfo, self_cgroup = fake_proc(tmp_path, 1024 * 1024, "0::/\n")
    write(tmp_path / "cgroup" / "memory.max", "max\n")
    assert available_host_memory(meminfo, tmp_path / "cgroup", self_cgroup) == 1024**3


def test_check_host_memory_names_numbers_and_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo, self_cgroup = fake_proc(tmp_path, 64 * 1024 * 1024, "0::/\n")
    write(tmp_path / "cgroup" / "memory.max", f"{3 * GB}\n")
    write(tmp_path / "cgroup" / "memory.current", "0\n")
    monkeypatch.setattr(host_memory, "MEMINFO_PATH", str(meminfo))
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(host_memory, "SELF_CGROUP_PATH", str(self_cgroup))
    check_host_memory(2 * GB, "the host pool", "--hicache-size")
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(12 * GB, "the host pool", "--hicache-size or --hicache-ratio")
    message = str(info.value)
    assert "12.00 GB" in message and "3.00 GB" in message
    assert "--hicache-size or --hicache-ratio" in message

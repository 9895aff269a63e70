"""The file store's disk budget: a size by default, the whole shared directory counted,
the volume's free space checked before each write."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.kvcache.storage import DEFAULT_STORE_BYTES, file_space
from engine.kvcache.storage.file_store import FileStore
from tests.unit.test_l3_storage import HostPages, attach, keys_for

SECRET = b"fleet-secret-0123456789abcdef"
DiskUsage = namedtuple("DiskUsage", "total used free")


def page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def test_the_store_has_a_size_by_default_and_refuses_none(tmp_path: Path) -> None:
    assert FileStore(tmp_path / "a", secret=SECRET).max_bytes == DEFAULT_STORE_BYTES
    with pytest.raises(ValueError, match="needs a size"):
        FileStore(tmp_path / "b", max_bytes=0, secret=SECRET)
    assert EngineConfig().hicache_storage_size == DEFAULT_STORE_BYTES / 1e9
    with pytest.raises(ValueError, match="hicache_storage_size"):
        EngineConfig(
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_dir=str(tmp_path),
            page_size=4,
            hicache_storage_size=0,
        )


def test_replicas_sharing_a_directory_keep_it_under_the_size_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_space, "RESCAN_S", 0.0)  # measure before every write
    pool = HostPages(6)
    probe = attach(FileStore(tmp_path / "probe", secret=SECRET), pool)
    file_bytes = probe._file_bytes
    limit = 4 * file_bytes
    replica_a = attach(FileStore(tmp_path / "l3", limit, secret=SECRET), pool)
    replica_b = attach(FileStore(tmp_path / "l3", limit, secret=SECRET), pool)
    keys = keys_for(list(range(24)))
    assert replica_a.put_from(keys[:3], [0, 1, 2]) == [True] * 3
    assert replica_b.put_from(keys[3:6], [3, 4, 5]) == [True] * 3  # B counts A's pages
    on_disk = page_files(tmp_path / "l3")
    assert sum(p.stat().st_size for p in on_disk) <= limit
    assert replica_b.stats.pages_evicted >= 2 and replica_b.stats.used_bytes <= limit
    assert replica_b.exists_prefix(keys[3:6]) == 3  # the newest pages stayed


def test_a_write_that_would_fill_the_volume_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = HostPages(3)
    store = attach(FileStore(tmp_path, secret=SECRET), pool)
    file_bytes = store._file_bytes
    # 100 pages' worth of volume, 6 free: the 5% reserve leaves room for one page.
    usage = DiskUsage(100 * file_bytes, 94 * file_bytes, 6 * file_bytes)
    monkeypatch.setattr(file_space.shutil, "disk_usage", lambda _: usage)
    keys = keys_for(list(range(12)))
    assert store.put_from(keys, [0, 1, 2]) == [True, False, False]
    assert store.stats.writes_refused == 2 and len(page_files(tmp_path)) == 1

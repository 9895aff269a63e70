"""The L3 stores under attack: private files, no links followed, pages bound to their key.

A page moved to another key, cut short, or written without the fleet secret must be a
miss (counted), never loaded; a link planted in the store must never carry a write
outside it. Pages come from the stand-in host pool of test_l3_storage.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.kvcache.hicache_setup import checkpoint_identity
from engine.kvcache.storage import keys as keys_module
from engine.kvcache.storage import make_store, model_digest
from engine.kvcache.storage.file_store import LOCAL_SECRET, FileStore
from engine.kvcache.storage.page_seal import SECRET_ENV, SecretError, load_secret
from tests.unit.mooncake_cluster import Mooncake, mooncake_cluster
from tests.unit.test_l3_storage import HostPages, attach, keys_for

SECRET = b"fleet-secret-0123456789abcdef"


def two_prompts(store: FileStore | object, pool: HostPages) -> tuple[list[str], list[str]]:
    """Store two prompts of two pages each (host pages 0-1 and 2-3); their keys."""
    france, italy = keys_for(list(range(8))), keys_for(list(range(100, 108)))
    assert store.put_from(france + italy, [0, 1, 2, 3]) == [True] * 4  # type: ignore[attr-defined]
    return france, italy


def test_directories_are_private_and_pages_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    store = attach(FileStore(root, secret=SECRET), HostPages(2))
    assert store.put_from(keys_for(list(range(8))), [0, 1]) == [True, True]
    modes = {p.relative_to(root): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert modes and all(
        mode == (0o700 if (root / p).is_dir() else 0o600) for p, mode in modes.items()
    )


def test_an_existing_open_directory_is_made_private(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    FileStore(root, secret=SECRET)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_linked_subdirectory_never_carries_a_write_outside(tmp_path: Path) -> None:
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    store = attach(FileStore(root, secret=SECRET), HostPages(2))
    keys = keys_for(list(range(8)))
    (root / keys[0][:2]).symlink_to(outside, target_is_directory=True)
    done = store.put_from(keys, [0, 1])
    assert done[0] is False and list(outside.iterdir()) == []
    assert store.exists_prefix(keys) == 0
    # A page file that is a link is a miss too, even to a valid page elsewhere.
    other = FileStore(tmp_path / "elsewhere", secret=SECRET)
    attach(other, HostPages(2))
    assert other.put_from(keys[1:], [1]) == [True]
    store._path(keys[1]).unlink(missing_ok=True)
    store._path(keys[1]).parent.mkdir(exist_ok=True)
    store._path(keys[1]).symlink_to(other._path(keys[1]))
    assert store.get_into(keys[1:], [0]) == [False]


def test_a_fifo_planted_as_a_page_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    store = attach(FileStore(tmp_path, secret=SECRET), HostPages(1))
    key = keys_for([1, 2, 3, 4])[0]
    store._path(key).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(store._path(key))
    assert store.get_into([key], [0]) == [False]  # open() would block without O_NONBLOCK
    assert store.stats.pages_rejected == 1 and not store._path(key).exists()


def test_swapped_pages_are_misses_never_the_other_prompt(tmp_path: Path) -> None:
    pool = HostPages(4, seed=1)
    store = attach(FileStore(tmp_path, secret=SECRET), pool)
    france, italy = two_prompts(store, pool)
    for a, b in zip(france, italy):  # the attack of issue 25: swap the page files
        pa, pb = store._path(a), store._path(b)
        data_a, data_b = pa.read_bytes(), pb.read_bytes()
        pa.write_bytes(data_b)
        pb.write_bytes(data_a)
    target = HostPages(4, seed=2)
    attach(store, target)
    assert store.get_into(france + italy, [0, 1, 2, 3]) == [False] * 4
    assert store.stats.pages_rejected == 4
    assert store.exists_prefix(france) == 0  # rejected pages are removed


def test_a_page_written_without_the_secret_is_a_miss(tmp_path: Path) -> None:
    pool = HostPages(2, seed=1)
    forger = attach(FileStore(tmp_path, secret=b"another-secret-entirely!"), pool)
    keys = keys_for(list(range(8)))
    assert forger.put_from(keys, [0, 1]) == [True, True]
    reader = attach(FileStore(tmp_path, secret=SECRET), HostPages(2))
    assert reader.exists_prefix(keys) == 2  # the files are there ...
    assert reader.get_into(keys, [0, 1]) == [False, False]  # ... and refused
    assert reader.stats.pages_rejected == 2


def test_without_a_secret_replicas_share_one_kept_in_the_store(tmp_path: Path) -> None:
    pool = HostPages(2, seed=1)
    writer = attach(FileStore(tmp_path), pool)
    keys = keys_for(list(range(8)))
    assert writer.put_from(keys, [0, 1]) == [True, True]
    secret_file = tmp_path / LOCAL_SECRET
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    target = HostPages(2, seed=2)
    reader = attach(FileStore(tmp_path), target)
    assert reader.get_into(keys, [0, 1]) == [True, True]
    assert torch.equal(target.page(1), pool.page(1))


def test_encrypted_pages_round_trip_and_hide_their_bytes(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    pool = HostPages(2, seed=1)
    store = attach(FileStore(tmp_path, secret=SECRET, encrypt=True), pool)
    keys = keys_for(list(range(8)))
    assert store.put_from(keys, [0, 1]) == [True, True]
    plain = pool.page(0).numpy().tobytes()
    stored = store._path(keys[0]).read_bytes()
    assert plain[:64] not in stored and plain[-64:] not in stored
    target = HostPages(2, seed=2)
    attach(store, target)
    assert store.get_into(keys, [0, 1]) == [True, True]
    assert torch.equal(target.page(0), pool.page(0)) and torch.equal(target.page(1), pool.page(1))
    wrong = attach(FileStore(tmp_path, secret=b"another-secret-entirely!", encrypt=True), target)
    assert wrong.get_into(keys, [0, 1]) == [False, False]


def test_the_secret_comes_from_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert load_secret(None) is None
    secret_file = tmp_path / "secret"
    secret_file.write_text("file-secret-0123456789\n")
    assert load_secret(str(secret_file)) == b"file-secret-0123456789"
    monkeypatch.setenv(SECRET_ENV, "env-secret-0123456789")
    assert load_secret(str(secret_file)) == b"env-secret-0123456789"
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(None)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


# ------------------------------------------------------------ Mooncake: the tag object


@pytest.fixture(scope="module")
def mooncake() -> Iterator[Mooncake]:
    yield from mooncake_cluster()


def test_mooncake_swapped_or_forged_pages_are_misses(mooncake: Mooncake) -> None:
    pool = HostPages(4, seed=1)
    store = make_store(
        "mooncake",
        mooncake_master=mooncake.master,
        mooncake_metadata_server=mooncake.metadata,
        secret=SECRET,
    )
    assert store is not None
    store.clear()
    attach(store, pool)
    france, italy = two_prompts(store, pool)
    raw = store._store  # type: ignore[attr-defined]
    for piece in ("0", "1"):  # France's first page now holds Italy's bytes
        italy_bytes = raw.get(f"{italy[0]}_{piece}")
        assert raw.remove(f"{france[0]}_{piece}", True) == 0
        assert raw.put(f"{france[0]}_{piece}", italy_bytes) == 0
    forger = make_store(
        "mooncake", mooncake_master=mooncake.master, mooncake_metadata_server=mooncake.metadata
    )
    assert forger is not None
    attach(forger, pool)
    forged = keys_for(list(range(200, 204)))
    assert forger.put_from(forged, [0]) == [True]  # no secret: a tag nobody else accepts
    target = HostPages(4, seed=2)
    attach(store, target)
    assert store.get_into(france + italy[:1] + forged, [0, 1, 2, 3]) == [False, True, True, False]
    assert store.stats.pages_rejected == 2
    assert torch.equal(target.page(1), pool.page(1))
    store.clear()
    for opened in (store, forger):
        opened.close()


def test_a_file_store_refuses_a_link_for_its_secret(tmp_path: Path) -> None:
    target = tmp_path / "planted"
    target.write_text("x" * 64)
    root = tmp_path / "l3"
    root.mkdir()
    os.symlink(target, root / LOCAL_SECRET)
    with pytest.raises(OSError):
        FileStore(root)


# ------------------------------------------------------------ the checkpoint's identity


def checkpoint(where: Path, late_byte: int) -> Path:
    """A model directory whose 3 MB weight file differs only in one byte in its middle
    (past the first and before the last MB)."""
    where.mkdir()
    (where / "config.json").write_text('{"hidden_size": 64}')
    weights = bytearray(3 << 20)
    weights[(3 << 20) // 2] = late_byte
    (where / "model.safetensors").write_bytes(bytes(weights))
    return where


def test_checkpoints_differing_in_one_middle_byte_get_other_namespaces(tmp_path: Path) -> None:
    first = model_digest(checkpoint(tmp_path / "a", 0))
    second = model_digest(checkpoint(tmp_path / "b", 1))
    assert first != second
    assert first == model_digest(checkpoint(tmp_path / "c", 0))  # same bytes elsewhere


def test_packed_gguf_weights_put_the_gguf_in_the_namespace(tmp_path: Path) -> None:
    # A packed model's converted directory holds only norms and first columns; the
    # blocks it multiplies by are the GGUF's, so two GGUFs differing past those share
    # the directory's bytes but must not share L3 pages.
    model = checkpoint(tmp_path / "m", 0)
    first, second = tmp_path / "a" / "x.gguf", tmp_path / "b" / "x.gguf"
    for path, byte in ((first, b"\0"), (second, b"\1")):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(byte * 4096)

    def identity(gguf: Path, tag: str) -> str:
        config = EngineConfig(model=str(gguf), cache_dir=str(tmp_path / "cache"))
        return checkpoint_identity(config, model, tag)

    assert identity(first, "packed-gguf") != identity(second, "packed-gguf")
    assert identity(first, "packed-gguf") == model_digest(model, None, (first,))
    # Dense weights come from the directory alone (the GGUF was converted into it).
    assert identity(first, "dense") == identity(second, "dense") == model_digest(model)


def test_checkpoint_digests_are_cached_until_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, cache = checkpoint(tmp_path / "m", 0), tmp_path / "digests.json"
    digest = model_digest(model, cache)
    assert digest == model_digest(model)  # the cache does not change the answer

    def no_reading(path: Path) -> str:
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(keys_module, "_file_digest", no_reading)
    assert model_digest(model, cache) == digest  # a restart reads no weights
    monkeypatch.undo()
    weights = model / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[(3 << 20) // 2] = 7  # rewritten in place, same size, mtime set back
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert model_digest(model, cache) != digest

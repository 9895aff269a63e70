"""The L3 stores: one conformance suite over the file backend and a real Mooncake Store.

Mooncake runs for real: a ``mooncake_master`` and a holder (``mooncake_client``) on
127.0.0.1, started once per module. Pages come from a stand-in host pool laid out like
the ``page_first`` host tier (``[2, N, L, H, D]``, a page = K and V pieces).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kvcache.storage import KVNamespace, KVStore, model_digest, page_keys
from engine.kvcache.storage.file_store import FileStore
from tests.unit.mooncake_cluster import Mooncake, mooncake_cluster

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8
NAMESPACE = KVNamespace("m" * 64, "float32", "page_first", PAGE, LAYERS, HEADS, DIM).digest()


class HostPages:
    """A page_first host buffer ``[2, N, L, H, D]`` handing out each page's K and V."""

    def __init__(self, pages: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.buffer = torch.randn(2, pages * PAGE, LAYERS, HEADS, DIM, generator=generator)

    def pieces(self, page: int) -> list[torch.Tensor]:
        rows = slice(page * PAGE, (page + 1) * PAGE)
        return [self.buffer[0, rows], self.buffer[1, rows]]

    @property
    def page_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pieces(0))

    def page(self, page: int) -> torch.Tensor:
        return torch.cat([p.flatten() for p in self.pieces(page)])


def attach(store: KVStore, pool: HostPages) -> KVStore:
    store.register_host_pool(pool.pieces, pool.page_nbytes)
    if hasattr(store, "register_buffer"):
        store.register_buffer(pool.buffer.data_ptr(), pool.buffer.numel() * 4)
    return store


def keys_for(tokens: list[int], namespace: str = NAMESPACE) -> list[str]:
    return page_keys(namespace, tokens, PAGE)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[Mooncake]:
    yield from mooncake_cluster()


@pytest.fixture(params=["file", "mooncake"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, object]]:
    if request.param == "file":
        yield "file", tmp_path / "l3"
    else:
        cluster: Mooncake = request.getfixturevalue("mooncake")
        yield "mooncake", cluster


def open_store(backend: tuple[str, object]) -> KVStore:
    name, where = backend
    if name == "file":
        assert isinstance(where, Path)
        return FileStore(where)
    assert isinstance(where, Mooncake)
    return where.store()


@pytest.fixture
def store(backend: tuple[str, object]) -> Iterator[KVStore]:
    opened = open_store(backend)
    opened.clear()
    yield opened
    opened.clear()
    opened.close()


# ------------------------------------------------------------ keys


def test_keys_cover_full_pages_and_chain_the_prefix() -> None:
    tokens = list(range(100, 111))  # 11 tokens: two full pages, a partial one
    keys = keys_for(tokens)
    assert len(keys) == 2
    # A key names the whole prefix: the same page after another first page differs.
    other = keys_for([7, 7, 7, 7, *tokens[4:8]])
    assert other[1] != keys[1] and keys_for(tokens[:8]) == keys
    # Extending a chain from its last key equals hashing from the start.
    assert page_keys(NAMESPACE, tokens[4:8], PAGE, prior=keys[0]) == keys[1:]


def test_namespace_separates_model_dtype_layout_and_shard(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "a" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "b" / "model.safetensors").write_bytes(b"\1" * 1000)  # same name, other weights
    digest_a, digest_b = model_digest(tmp_path / "a"), model_digest(tmp_path / "b")
    assert digest_a != digest_b and digest_a == model_digest(tmp_path / "a")
    base = KVNamespace(digest_a, "float32", "page_first", PAGE, LAYERS, HEADS, DIM)
    variants = [
        base,
        KVNamespace(digest_b, "float32", "page_first", PAGE, LAYERS, HEADS, DIM),
        KVNamespace(digest_a, "bfloat16", "page_first", PAGE, LAYERS, HEADS, DIM),
        KVNamespace(digest_a, "float32", "layer_first", PAGE, LAYERS, HEADS, DIM),
        KVNamespace(digest_a, "float32", "page_first", PAGE, LAYERS, HEADS, DIM, "tp1of2"),
    ]
    first_keys = {keys_for([1, 2, 3, 4], ns.digest())[0] for ns in variants}
    assert len(first_keys) == len(variants)


# ------------------------------------------------------------ conformance, both backends


def test_round_trip_is_byte_for_byte(store: KVStore) -> None:
    source, target = HostPages(4, seed=1), HostPages(4, seed=2)
    attach(store, source)
    keys = keys_for(list(range(16)))
    assert store.put_from(keys, [0, 1, 2, 3]) == [True] * 4
    attach(store, target)
    assert store.get_into(keys, [3, 2, 1, 0]) == [True] * 4
    for page in range(4):
        assert torch.equal(target.page(3 - page), source.page(page))
    assert store.stats.pages_written == 4 and store.stats.pages_read == 4


def test_lookup_answers_the_leading_run(store: KVStore) -> None:
    pool = HostPages(3)
    attach(store, pool)
    keys = keys_for(list(range(12)))
    assert store.exists_prefix(keys) == 0
    assert store.put_from([keys[0], keys[2]], [0, 2]) == [True, True]
    assert store.exists_prefix(keys) == 1
    assert store.exists_prefix(keys[2:]) == 1
    # A missing page reads as a miss, never as someone else's bytes.
    assert store.get_into(keys, [0, 1, 2]) == [True, False, True]


def test_another_namespace_misses(store: KVStore) -> None:
    attach(store, HostPages(1))
    tokens = [5, 6, 7, 8]
    assert store.put_from(keys_for(tokens), [0]) == [True]
    other = KVNamespace("m" * 64, "bfloat16", "page_first", PAGE, LAYERS, HEADS, DIM).digest()
    assert store.exists_prefix(keys_for(tokens, other)) == 0
    assert store.exists_prefix(keys_for(tokens)) == 1


def test_writing_again_is_harmless(store: KVStore) -> None:
    pool = HostPages(2)
    attach(store, pool)
    keys = keys_for(list(range(8)))
    assert store.put_from(keys, [0, 1]) == [True, True]
    written = store.stats.pages_written
    assert store.put_from(keys, [0, 1]) == [True, True]
    assert store.stats.pages_written == written  # already there: not sent again


def test_concurrent_writers_leave_every_page_intact(backend: tuple[str, object]) -> None:
    pool = HostPages(8, seed=3)
    keys = keys_for(list(range(32)))
    stores = [attach(open_store(backend), pool) for _ in range(3)]
    stores[0].clear()
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def write(store: KVStore) -> None:
        try:
            barrier.wait(timeout=30)
            assert all(store.put_from(keys, list(range(8))))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    target = HostPages(8, seed=4)
    reader = attach(open_store(backend), target)
    assert reader.get_into(keys, list(range(8))) == [True] * 8
    for page in range(8):
        assert torch.equal(target.page(page), pool.page(page))
    for store in [*stores, reader]:
        store.clear()
        store.close()


REPLICA = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from engine.kvcache.storage import make_store
    from test_l3_storage import HostPages, attach, keys_for
    role, name, where, seed = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    if name == "file":
        store = make_store("file", directory=where)
    else:
        master, metadata = where.split(" ")
        store = make_store("mooncake", mooncake_master=master, mooncake_metadata_server=metadata)
    pool = HostPages(2, seed=seed)
    attach(store, pool)
    keys = keys_for(list(range(8)))
    if role == "write":
        result = {"put": store.put_from(keys, [0, 1])}
    else:
        result = {"run": store.exists_prefix(keys), "got": store.get_into(keys, [1, 0]),
                  "page0": pool.page(0).tolist()}
    store.close()
    print(json.dumps(result))
    """
)


def test_a_second_process_reads_what_the_first_wrote_after_it_exited(
    backend: tuple[str, object],
) -> None:
    name, where = backend
    location = f"{where.master} {where.metadata}" if isinstance(where, Mooncake) else str(where)
    open_store(backend).clear()
    results = []
    for role, seed in (("write", 5), ("read", 6)):
        done = subprocess.run(
            [sys.executable, "-c", REPLICA, str(Path(__file__).parent), role, name, location,
             str(seed)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0] == {"put": [True, True]}
    assert results[1]["run"] == 2 and results[1]["got"] == [True, True]
    # The reader's page 0 now holds the writer's page 1 (seed 5), not its own bytes.
    assert torch.equal(torch.tensor(results[1]["page0"]), HostPages(2, seed=5).page(1))


# ------------------------------------------------------------ the file backend's faults


def test_a_corrupt_or_truncated_page_is_a_miss_and_removed(tmp_path: Path) -> None:
    pool = HostPages(2)
    store = attach(FileStore(tmp_path), pool)
    keys = keys_for(list(range(8)))
    assert store.put_from(keys, [0, 1]) == [True, True]
    first, second = (store._path(k) for k in keys)
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    second.write_bytes(second.read_bytes()[:-10])
    assert store.get_into(keys, [0, 1]) == [False, False]
    assert not first.exists() and not second.exists()
    assert store.exists_prefix(keys) == 0


def test_a_failed_write_is_not_acknowledged_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = attach(FileStore(tmp_path), HostPages(1))

    def disk_full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("engine.kvcache.storage.file_store.os.replace", disk_full)
    keys = keys_for([1, 2, 3, 4])
    assert store.put_from(keys, [0]) == [False]
    assert store.exists_prefix(keys) == 0 and store.stats.write_failures == 1
    assert not list(tmp_path.rglob("*.tmp")), "a temporary file was left behind"


def test_the_size_limit_evicts_least_recently_used_pages(tmp_path: Path) -> None:
    pool = HostPages(6)
    page_file = pool.page_nbytes + 15 + 32  # payload + header + tag
    store = attach(FileStore(tmp_path, max_bytes=4 * page_file), pool)
    keys = keys_for(list(range(24)))
    assert all(store.put_from(keys[:4], [0, 1, 2, 3]))
    for age, key in enumerate(keys[:4]):  # distinct ages, an hour back: page 0 oldest
        stamp = time.time() - 3600 + age
        os.utime(store._path(key), (stamp, stamp))
    assert store.get_into(keys[:1], [0]) == [True]  # page 0 becomes the newest
    assert all(store.put_from(keys[4:6], [4, 5]))
    # Over the limit by two pages: eviction drops the oldest until 90% of the limit.
    present = [store.exists_prefix([k]) == 1 for k in keys[:6]]
    assert present == [True, False, False, False, True, True]
    assert store.stats.pages_evicted == 3
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kv")) <= 4 * page_file

"""The swap attack of issue 25 through the engine: France's pages replaced by Italy's.

Two prompts of the same length are stored by one engine; on disk, each page file of the
first is swapped with the page file at the same position of the second. A restarted
engine must find no usable page (misses, counted) and answer each prompt exactly as an
engine without any cache does: never the other prompt's continuation.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from engine.kvcache.storage import page_keys
from engine.kvcache.storage.file_store import FileStore
from server.metrics import EngineCollector
from tests.integration.conftest import metric_value
from tests.unit.test_l3_engine import PAGE, PARAMS, make_engine, prompts, stored_len
from tests.unit.test_l3_engine import reference as reference  # the fixture


def test_swapped_page_files_are_misses_with_the_right_answer(
    tiny_llama_dir: Path, tmp_path: Path, reference: dict
) -> None:
    france, italy = prompts(3, 41)[:2]  # in `reference`: recomputed without a cache
    writer = make_engine(tiny_llama_dir, tmp_path)
    writer.generate([france, italy], PARAMS)
    writer.close()
    view = FileStore(tmp_path)
    namespace = writer.kv.manager.tree.storage.namespace
    keys_france = page_keys(namespace, france[: stored_len(france)], PAGE)
    keys_italy = page_keys(namespace, italy[: stored_len(italy)], PAGE)
    assert keys_france and all(view.exists_prefix([k]) for k in keys_france + keys_italy)
    for a, b in zip(keys_france, keys_italy):
        path_a, path_b = view._path(a), view._path(b)
        bytes_a, bytes_b = path_a.read_bytes(), path_b.read_bytes()
        path_a.write_bytes(bytes_b)
        path_b.write_bytes(bytes_a)
    reader = make_engine(tiny_llama_dir, tmp_path)
    outs = reader.generate([france, italy], PARAMS)
    assert [o.token_ids for o in outs] == [reference[tuple(france)], reference[tuple(italy)]]
    assert [o.cached_tokens_storage for o in outs] == [0, 0]
    assert reader.kv.host_stats()["storage_pages_rejected_total"] >= 2
    registry = CollectorRegistry()
    served = SimpleNamespace(is_alive=lambda: True, stats=reader.stats, health=reader.health)
    registry.register(EngineCollector(lambda: served))
    exposition = generate_latest(registry).decode()
    assert metric_value(exposition, "hiserve:hicache_storage_pages_rejected_total") >= 2
    reader.close()

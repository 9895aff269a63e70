"""Cache traces: one JSON line per finished request with what a cache simulator needs.

A trace holds no text and no token ids. A prompt appears as its *page-hash chain*: page
``i``'s hash is ``blake2b(hash of page i-1 || page i's token ids as u32 LE)`` (8 bytes,
written as an unsigned int), seeded from the request's ``cache_salt`` digest, so two
prompts share the first ``k`` hashes exactly when they share the first ``k`` pages (and
the salt). ``hiserve-bench whatif`` replays a trace through the real prefix tree.

File layout: a header line ``{"trace": "hiserve-cache-trace", "version": 1,
"page_size": P, "source": ...}``, then per request (in finishing order)::

    {"t": arrival s, "t_admit": first admission s (null: not known), "t_end": finish s
     (all from the trace start), "salt": digest or "",
     "prompt_len": n, "output_len": m, "prompt_pages": whole prompt pages,
     "pages": [chain over the whole pages the request leaves in KV: prompt, then output],
     "hit": {"device": d, "host": h, "storage": s} or null (no server measured it)}

The writer hashes and writes on its own thread: the engine thread only copies the ids
and queues them, and nothing at all happens while tracing is off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger("hiserve.cache_trace")

TRACE_KIND = "hiserve-cache-trace"
TRACE_VERSION = 1
_SEED = b"hiserve-cache-trace-v1"
# Records queued for the writer before the engine thread drops (and counts) new ones.
MAX_QUEUED = 4096


def trace_salt(digest: str | None) -> str:
    """What a trace keeps of a request's cache_salt digest (``engine.cache_salt.salt_digest``,
    which the engine holds instead of the salt): its first 16 hex digits; "" for none."""
    return (digest or "")[:16]


def page_chain(token_ids: Sequence[int], page_size: int, salt: str = "") -> list[int]:
    """Chain hashes of the whole pages of ``token_ids`` (a partial last page is left out).

    ``salt`` is a ``trace_salt``: requests with different salts share no hash."""
    previous = hashlib.blake2b(_SEED + salt.encode(), digest_size=8).digest()
    chain: list[int] = []
    ids = array("I", token_ids)  # u32; native order is little-endian on every target
    width = ids.itemsize * page_size
    data = ids.tobytes()
    for start in range(0, (len(ids) // page_size) * width, width):
        previous = hashlib.blake2b(previous + data[start : start + width], digest_size=8).digest()
        chain.append(int.from_bytes(previous, "little"))
    return chain


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace (see the module docstring for each field)."""

    t: float
    t_end: float
    salt: str
    prompt_len: int
    output_len: int
    prompt_pages: int
    pages: list[int]
    hit: dict[str, int] | None = None
    t_admit: float | None = None  # when its hits were decided (a server knows; else None)

    @property
    def start(self) -> float:
        """When the request took its cache hits: admission if known, else arrival."""
        return self.t if self.t_admit is None else self.t_admit

    def to_json(self) -> str:
        return json.dumps(
            {
                "t": round(self.t, 6),
                "t_admit": None if self.t_admit is None else round(self.t_admit, 6),
                "t_end": round(self.t_end, 6),
                "salt": self.salt,
                "prompt_len": self.prompt_len,
                "output_len": self.output_len,
                "prompt_pages": self.prompt_pages,
                "pages": self.pages,
                "hit": self.hit,
            },
            separators=(",", ":"),
        )


def header(page_size: int, source: str) -> dict[str, Any]:
    return {"trace": TRACE_KIND, "version": TRACE_VERSION, "page_size": page_size, "source": source}


def make_record(
    kv_ids: Sequence[int],
    prompt_len: int,
    output_len: int,
    page_size: int,
    t: float,
    t_end: float,
    salt: str = "",
    hit: dict[str, int] | None = None,
    t_admit: float | None = None,
) -> TraceRecord:
    """The record of a request whose KV covers ``kv_ids`` (at least its prompt)."""
    pages = page_chain(kv_ids, page_size, salt)
    prompt_pages = prompt_len // page_size
    return TraceRecord(t, t_end, salt, prompt_len, output_len, prompt_pages, pages, hit, t_admit)


@dataclass(frozen=True)
class Trace:
    """A trace read back: its header and records."""

    page_size: int
    source: str
    records: list[TraceRecord]


def read_trace(path: str | Path) -> Trace:
    """Parse a trace file; a wrong header or a broken line is a ValueError naming it."""
    with open(path, encoding="utf-8") as f:
        lines = iter(f)
        first = next(lines, "")
        try:
            head = json.loads(first)
        except json.JSONDecodeError:
            head = None
        if not isinstance(head, dict) or head.get("trace") != TRACE_KIND:
            raise ValueError(f"{path}: not a hiserve cache trace (no header line)")
        if head.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: trace version {head.get('version')}, expected 1")
        records = list(_records(lines, str(path)))
    return Trace(int(head["page_size"]), str(head.get("source", "")), records)


def _records(lines: Iterator[str], path: str) -> Iterator[TraceRecord]:
    for number, line in enumerate(lines, start=2):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            yield TraceRecord(
                float(raw["t"]),
                float(raw["t_end"]),
                str(raw["salt"]),
                int(raw["prompt_len"]),
                int(raw["output_len"]),
                int(raw["prompt_pages"]),
                [int(h) for h in raw["pages"]],
                raw.get("hit"),
                None if raw.get("t_admit") is None else float(raw["t_admit"]),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{number}: broken trace record ({e})") from e


def write_trace(path: str | Path, page_size: int, source: str, records: list[TraceRecord]) -> None:
    """Write a whole trace at once (the load tool)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header(page_size, source)) + "\n")
        for record in records:
            f.write(record.to_json() + "\n")


class CacheTracer:
    """The server's trace writer: ``record`` queues, a daemon thread hashes and writes.

    NOTE: bounded: at most ``MAX_QUEUED`` requests wait for the writer; past that new
    ones are dropped and counted (``dropped``), never blocking the engine thread.
    """

    def __init__(self, path: str | Path, page_size: int) -> None:
        self.path = Path(path)
        self.page_size = page_size
        self.start = time.monotonic()
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(MAX_QUEUED)
        self._file: IO[str] = open(self.path, "w", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        self._file.write(json.dumps(header(page_size, "server")) + "\n")
        self._thread = threading.Thread(target=self._run, name="cache-trace", daemon=True)
        self._thread.start()
        logger.info("cache trace: writing to %s (page size %d)", self.path, page_size)

    def record(
        self,
        kv_ids: list[int],
        prompt_len: int,
        output_len: int,
        arrival: float,
        salt: str | None,
        hit: dict[str, int],
        admitted: float | None = None,
    ) -> None:
        """Queue one finished request (``arrival``, ``admitted``: ``time.monotonic()``)."""
        item = (kv_ids, prompt_len, output_len, arrival, time.monotonic(), salt, hit, admitted)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            kv_ids, prompt_len, output_len, arrival, finish, salt, hit, admitted = item
            record = make_record(
                kv_ids,
                prompt_len,
                output_len,
                self.page_size,
                arrival - self.start,
                finish - self.start,
                trace_salt(salt),
                hit,
                None if admitted is None else admitted - self.start,
            )
            self._file.write(record.to_json() + "\n")
            self.written += 1
        self._file.flush()

    def close(self) -> None:
        """Write what is queued and close the file (engine shutdown)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._file.close()
        if self.dropped:
            logger.warning("cache trace: %d requests dropped (writer behind)", self.dropped)

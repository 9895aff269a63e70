"""Keys of the L3 storage tier: a hash chain over full pages inside a KV namespace.

A page's key is ``sha256(namespace-or-previous-key || token ids as u32 little-endian)``,
so equal prefixes give equal keys on every replica and a key names its whole prefix,
not only its own tokens. The chain starts from a namespace digest over everything that
changes the KV bytes of a page (model identity, dtype, layout, page size, shard); a
different model or dtype therefore never finds, and never loads, foreign KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Bumped whenever the bytes a key names change meaning (page format, key scheme).
SCHEMA_VERSION = 1
# Files whose bytes define a model directory: its config and its weights.
_IDENTITY_GLOBS = ("config.json", "*.safetensors", "*.gguf", "*.bin")
_MAX_CACHED_DIGESTS = 4096
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVNamespace:
    """Everything that makes the KV bytes of a page differ between two servers."""

    model_digest: str
    dtype: str
    layout: str
    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    shard: str = "tp0of1"
    # The weight format the KV was computed with: dense, packed-gguf or bf16-weights
    # (the same checkpoint read three ways gives three slightly different KVs).
    weights: str = "dense"

    def digest(self) -> str:
        fields = {"schema": SCHEMA_VERSION, **asdict(self)}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def model_digest(
    model_dir: Path, cache_file: Path | None = None, sources: tuple[Path, ...] = ()
) -> str:
    """A digest of a model directory's config and weight files: names, sizes, every byte.
    ``sources``: files the weights are read from besides the directory (the GGUF whose
    blocks a packed model multiplies by; its converted directory holds only the rest).

    Two checkpoints that differ in any one byte get different digests, so they never
    share L3 pages. Hashing reads the whole checkpoint once; the digest of each file is
    then kept in ``cache_file`` (JSON) under its device, inode, size and change times,
    so a restart over unchanged files reads nothing (ctime cannot be set back by a user,
    so weights rewritten in place and ``touch``-ed to their old mtime are hashed again).
    """
    files = sorted({p for pattern in _IDENTITY_GLOBS for p in model_dir.glob(pattern)})
    files += [Path(p) for p in sources]
    if not files:
        raise ValueError(f"{model_dir} has no config or weight files to identify the model")
    cached = _load_digests(cache_file)
    fresh: dict[str, str] = {}
    digest = hashlib.sha256()
    for path in files:
        info = path.stat()
        stamp = f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}"
        entry = f"{path.resolve()}|{stamp}"
        file_digest = cached.get(entry) or _file_digest(path)
        fresh[entry] = file_digest
        digest.update(f"{path.name}\0{info.st_size}\0{file_digest}\0".encode())
    if cache_file is not None and any(cached.get(k) != v for k, v in fresh.items()):
        _save_digests(cache_file, {**cached, **fresh})
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _load_digests(cache_file: Path | None) -> dict[str, str]:
    if cache_file is None:
        return {}
    try:
        loaded = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, str)}


def _save_digests(cache_file: Path, digests: dict[str, str]) -> None:
    """Best effort: a cache that cannot be written costs a rehash at the next start."""
    if len(digests) > _MAX_CACHED_DIGESTS:  # drop the oldest entries (insertion order)
        digests = dict(list(digests.items())[-_MAX_CACHED_DIGESTS:])
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    try:
        cache_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.write_text(json.dumps(digests))
        os.replace(tmp, cache_file)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.info("cannot keep checkpoint digests in %s (%s)", cache_file, exc)


def chain_start(namespace: str, salt: str) -> str | None:
    """The ``prior`` of a prompt's first page under cache_salt digest ``salt``: None
    (the chain starts from the namespace, as it always did) without a salt, else
    ``sha256(namespace || "cache-salt" || salt)``.

    NOTE: a salted chain shares no key with another salt's or the unsalted chain: its
    first key hashes a different prior, and a prior is never a page key (page keys hash
    32 + 4 * page_size bytes, this 32 + 10 + 32).
    """
    if not salt:
        return None
    seed = bytes.fromhex(namespace) + b"cache-salt" + bytes.fromhex(salt)
    return hashlib.sha256(seed).hexdigest()


def page_keys(
    namespace: str, token_ids: Sequence[int], page_size: int, prior: str | None = None
) -> list[str]:
    """Keys of every *full* page of ``token_ids``; a trailing partial page has none.

    ``prior`` is the key of the page before ``token_ids[0]`` (None: they start the
    prompt), so a caller can extend a chain without rehashing its start.
    """
    keys: list[str] = []
    previous = prior if prior is not None else namespace
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        digest = hashlib.sha256(bytes.fromhex(previous))
        page = token_ids[start : start + page_size]
        digest.update(b"".join(int(t).to_bytes(4, "little") for t in page))
        previous = digest.hexdigest()
        keys.append(previous)
    return keys

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Bumped whenever the bytes a key names change meaning (page format, key scheme).
SCHEMA_VERSION = 1
# Files whose bytes define a model directory: its config and its weights.
_IDENTITY_GLOBS = ("config.json", "*.safetensors", "*.gguf", "*.bin")


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

    def digest(self) -> str:
        fields = {"schema": SCHEMA_VERSION, **asdict(self)}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def model_digest(model_dir: Path, chunk_bytes: int = 1 << 20) -> str:
    """A digest of a model directory's config and weight files (names, sizes, contents).

    Two directories with the same served name but other weights get other digests.
    Weights are hashed by their first and last ``chunk_bytes`` plus their size, which
    tells apart any two real checkpoints without reading gigabytes at every start.
    """
    digest = hashlib.sha256()
    files = sorted({p for pattern in _IDENTITY_GLOBS for p in model_dir.glob(pattern)})
    if not files:
        raise ValueError(f"{model_dir} has no config or weight files to identify the model")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(chunk_bytes))
            if size > 2 * chunk_bytes:
                handle.seek(size - chunk_bytes)
                digest.update(handle.read(chunk_bytes))
            elif size > chunk_bytes:
                digest.update(handle.read())
    return digest.hexdigest()


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

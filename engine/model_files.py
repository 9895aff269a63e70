"""Where model files are: hiserve's cache directory and the weight files of a model
directory (shared by the loader, the GGUF packed path and the L3 tier's default
directory, none of which imports another for it)."""

from __future__ import annotations

import json
import os
from pathlib import Path


class ModelPathError(ValueError):
    """The ``--model`` argument does not name a usable local model."""


def default_cache_dir() -> Path:
    """``$HISERVE_CACHE_DIR``, else ``~/.cache/hiserve``."""
    env = os.environ.get("HISERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hiserve"


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """Weight files of a model directory: the index's shards, model.safetensors, or *.safetensors."""
    model_dir = Path(path)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelPathError(f"{index} names shards that are missing: {missing}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelPathError(
            f"no *.safetensors weights in {str(model_dir)!r} (.bin/.pt checkpoints are not "
            "supported; re-save the model with save_pretrained(safe_serialization=True))"
        )
    return files

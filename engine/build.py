"""Build an engine's collaborators and wire them through their constructors.

The one place that knows the order: tensor-parallel workers start first (they load their
shards while rank 0 loads its own), the KV size is agreed across ranks, the KV side is
built with the tensor-parallel journals, whether decode steps replay device graphs
settles mixed batches, and the model runner gets the grammar masker, the graphs and the
tensor-parallel step hook. Nothing is attached to an object after it is built.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import dtypes, loader, platform
from engine.config import EngineConfig, default_max_prefill_tokens
from engine.future_tokens import FutureTokens
from engine.grammar import EngineGrammars
from engine.graph_runner import DecodeGraphRunner
from engine.graph_setup import build_decode_graphs, build_mixed_graphs, mixed_batches_on
from engine.heap import keep_freed_memory, trim_heap
from engine.kv_setup import KVSetup, build_kv
from engine.kvcache.transfer import KVTransfer, TransferFactory
from engine.model_runner import ModelRunner
from engine.models import gguf_packed
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.tp.runtime import TPRuntime

logger = logging.getLogger("hiserve.engine")


@dataclass
class EngineParts:
    """What an ``Engine`` drives; made by ``build_engine_parts``."""

    device_spec: platform.DeviceSpec
    device: torch.device
    dtype: torch.dtype
    weights: dtypes.WeightFormat  # what --dtype chose: packed GGUF, bf16 weights, ...
    model_path: Path
    hf_config: Any
    tokenizer: Any
    tp: TPRuntime | None  # tensor parallel (rank 0), else None
    model: Any
    max_model_len: int
    served_model_name: str
    eos_token_ids: Any
    kv: KVSetup
    scheduler: Scheduler
    sampler: Sampler
    grammars: EngineGrammars
    runner: ModelRunner


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Resolve the device, load the tokenizer and config, start tensor-parallel workers
    (stopped again if anything after fails), and build the rest (``_build_on``)."""
    device_spec = platform.resolve_device(config.device)
    keep_freed_memory()  # a step's large tensors reused, not faulted in afresh (heap.py)
    # NOTE: calls without a device (event waits, current_stream) mean the current one;
    # AsyncEngine's loop thread sets it again, as a new thread starts on device 0.
    platform.set_device(device_spec)
    torch.manual_seed(config.seed)
    gguf_file = loader.gguf_file_of(config.model)
    weights = dtypes.choose_weights(
        config.dtype,
        device_spec,
        gguf=gguf_file is not None and gguf_packed.packing_enabled(),
        tp_size=config.tensor_parallel_size,
    )
    logger.info("weights: %s (%s)", str(weights.dtype)[6:], weights.reason)
    # Packed GGUF weights: the converted copy leaves out the dense blocks (gguf_convert).
    model_path = loader.resolve_model_path(config.model, config.cache_dir, weights.packed_gguf)
    # Tensor parallel: workers start now and load their shards while rank 0 does.
    tp = TPRuntime(config, device_spec, model_path) if config.tensor_parallel_size > 1 else None
    try:
        parts = _build_on(config, device_spec, model_path, tp, weights, gguf_file)
    except BaseException:
        if tp is not None:
            tp.stop(graceful=False)
        raise
    trim_heap()  # what loading freed goes back to the OS
    return parts


def _build_on(
    config: EngineConfig,
    device_spec: platform.DeviceSpec,
    model_path: Path,
    tp: TPRuntime | None,
    weights: dtypes.WeightFormat,
    gguf_file: Path | None,
) -> EngineParts:
    """Model, KV, scheduler, sampler, grammars and runner (this rank's shard under TP)."""
    device = platform.to_torch_device(device_spec)
    dtype = weights.dtype
    hf_config = loader.load_hf_config(model_path)
    tokenizer = loader.load_tokenizer(model_path, hf_config)
    model = loader.load_model(
        model_path,
        device,
        dtype,
        config.attention_backend,
        tp.shard if tp is not None else None,
        gguf_path=gguf_file if weights.packed_gguf else None,
        bf16_weights=weights.bf16_weights,
    )
    context: Any = config.max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
    max_model_len = int(context)
    eos_token_ids = loader.eos_token_ids_of(hf_config, tokenizer)

    shard_config = model.config  # the rank's heads and MLP share under TP
    kv_dtype = dtypes.kv_cache_dtype(config.kv_cache_dtype, dtype, device_spec)
    make_transfer: TransferFactory = KVTransfer
    if tp is not None:
        config = tp.agree_kv(config, shard_config, device_spec, kv_dtype)
        make_transfer = tp.make_transfer
    kv = build_kv(
        config,
        shard_config,
        device_spec,
        device,
        kv_dtype,
        max_model_len,
        model_path,
        table_journal=tp.table_journal if tp is not None else None,
        make_transfer=make_transfer,
        weights_tag=weights.tag,
    )
    if tp is not None:
        tp.share_geometry(kv)  # the workers build their KV, then capture with rank 0
    gather = tp.gather if tp is not None else None
    graphs: DecodeGraphRunner | None = build_decode_graphs(
        config, model, kv, device_spec, device, gather=gather
    )
    # Right after the decode graphs, on every tensor-parallel rank (engine/tp/worker.py).
    mixed_graphs = build_mixed_graphs(config, model, kv, graphs, device_spec, device, gather)
    if tp is not None:
        # The start-up replay checks' table writes: every rank made its own.
        tp.table_journal.clear()
    mixed = mixed_batches_on(config, graphs)
    if config.max_prefill_tokens is None:
        prefill_tokens = default_max_prefill_tokens(device.type)
        logger.info(
            "prefill: at most %d prompt tokens a step (%s default)", prefill_tokens, device.type
        )
        config = dataclasses.replace(config, max_prefill_tokens=prefill_tokens)
    scheduler = Scheduler(config, kv.manager, max_model_len, mixed=mixed)
    vocab_size = int(hf_config.vocab_size)
    sampler = Sampler(vocab_size, device, seed=config.seed)
    grammars = EngineGrammars(
        tokenizer,
        vocab_size,
        eos_token_ids,
        config.grammar_compile_timeout,
        device,
        step_budget_s=config.grammar_step_budget_ms / 1e3,
        cache_bytes=int(config.grammar_cache_mb * 1024 * 1024),
    )
    runner = ModelRunner(
        model,
        kv.device_pool,
        kv.req_table,
        sampler,
        device,
        eos_token_ids,
        masker=grammars.masker,
        graphs=graphs,
        on_step=tp.send_step if tp is not None else None,
        futures=FutureTokens(config.max_running_requests, device),
        mixed_graphs=mixed_graphs,
    )
    return EngineParts(
        device_spec=device_spec,
        device=device,
        dtype=dtype,
        weights=weights,
        model_path=model_path,
        hf_config=hf_config,
        tokenizer=tokenizer,
        tp=tp,
        model=model,
        max_model_len=max_model_len,
        served_model_name=config.served_model_name
        or loader.default_served_name(config.model, model_path),
        eos_token_ids=eos_token_ids,
        kv=kv,
        scheduler=scheduler,
        sampler=sampler,
        grammars=grammars,
        runner=runner,
    )

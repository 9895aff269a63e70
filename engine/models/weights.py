"""Copy HF-named checkpoint tensors into a model whose layers fuse several HF tensors.

A model maps each HF name to ``(our parameter name, shard)``. Parameters owned by a
module with ``load_param``/``shard_keys`` (FusedLinear, the MoE experts) are filled shard
by shard; every other parameter is copied whole. Anything unknown or missing is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from engine.layers.linear import ALL_SHARDS
from engine.layers.quant_cpu import QuantTensor

# HF name -> (our parameter name, shard); None to skip the tensor.
NameMapper = Callable[[str], "tuple[str, Any] | None"]
# (our parameter name, shard, full tensor) -> the part this process holds (tensor parallel).
TensorSlicer = Callable[[str, Any, torch.Tensor], torch.Tensor]


class ShardedModule(Protocol):
    def load_param(self, kind: str, shard: Any, weight: Any) -> None: ...

    def shard_keys(self, kind: str) -> list[Hashable]: ...


def _sharded_modules(model: nn.Module) -> dict[str, ShardedModule]:
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "load_param") and hasattr(module, "shard_keys")
    }


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
    map_name: NameMapper,
    slicer: TensorSlicer | None = None,
) -> None:
    """Load every tensor of ``weights``; raise on unknown names, shapes, or missing weights.

    ``slicer``: cut each checkpoint tensor to this tensor-parallel rank's part first.
    A ``QuantTensor`` (GGUF blocks kept packed) goes to its layer's ``load_param`` or the
    model's ``load_packed_param``; where neither takes it, it is dequantized here.
    """
    packed_hook = getattr(model, "load_packed_param", None)
    params = dict(model.named_parameters())
    sharded = _sharded_modules(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        target = map_name(name)
        if target is None:
            continue
        param_name, shard = target
        if isinstance(tensor, QuantTensor) and slicer is not None:
            tensor = tensor.dequantize()
        if slicer is not None:
            assert isinstance(tensor, torch.Tensor)
            tensor = slicer(param_name, shard, tensor)
        module_name, _, kind = param_name.rpartition(".")
        owner = sharded.get(module_name)
        if owner is not None and param_name in params:
            owner.load_param(kind, shard, tensor)
            keys = owner.shard_keys(kind) if shard == ALL_SHARDS else [shard]
            loaded.update(f"{param_name}#{key}" for key in keys)
            continue
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        if isinstance(tensor, QuantTensor):
            if callable(packed_hook) and packed_hook(param_name, tensor):
                loaded.add(param_name)
                continue
            tensor = tensor.dequantize()
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(param_name)
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {unexpected[:8]}")
    missing = sorted(_expected_keys(model, sharded) - loaded)
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:8]}")


def _expected_keys(model: nn.Module, sharded: dict[str, ShardedModule]) -> set[str]:
    keys: set[str] = set()
    for param_name, _ in model.named_parameters():
        module_name, _, kind = param_name.rpartition(".")
        owner = sharded.get(module_name)
        if owner is not None:
            keys.update(f"{param_name}#{key}" for key in owner.shard_keys(kind))
        else:
            keys.add(param_name)
    return keys

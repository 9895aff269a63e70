"""The interface every attention backend implements (attention.py chooses one by name;
each backend module imports only this, so the chooser may import them)."""

from __future__ import annotations

import abc

import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention_meta import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Writes the new tokens' K/V to the pool and attends each new query over its sequence."""

    name = "abstract"
    # Whether a pure decode step through this backend can be captured in a device graph
    # when the decode layout is precomputed in ``meta.cache`` (see engine/graph_runner.py):
    # no host reads of tensor values, no shapes taken from the per-step Python lists.
    graph_safe_decode = False
    # Whether decode reads K/V in place through the request table (no gather to a context
    # shape): a captured decode step then depends on the batch size only.
    decode_reads_pool_in_place = False

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, q_heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:  # [T, q_heads * head_dim]
        ...

    def with_options(
        self, sliding_window: int | None, softcap: float | None, scale: float | None
    ) -> AttentionBackend | None:
        """This backend for a layer with a sliding window, soft-capping or a custom scale;
        None where it cannot (the windowed PyTorch backend takes those layers)."""
        return None

    # Whether rope_forward exists: RoPE and the K/V store in one kernel.
    fuses_rope_store = False

    def rope_forward(
        self,
        qk: torch.Tensor,  # [T, q_heads + kv_heads, head_dim] before RoPE
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:  # [T, q_heads * head_dim]
        """RoPE, the K/V store and attention, for backends with ``fuses_rope_store``."""
        raise NotImplementedError(f"attention backend {self.name!r} does not fuse RoPE")

    def store_new_kv(
        self,
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> None:
        """Write the new tokens' K/V of ``layer_id`` into their pool slots, first thing in
        every backend's forward."""
        # NOTE: host-tier loads copy into this layer's pool buffers: wait for them before
        # writing or reading the layer.
        for load in meta.kv_loads:
            load.wait_layer(layer_id)
        self._store_kv(layer_id, meta, k, v, kv_pool)

    def _store_kv(
        self,
        layer_id: int,
        meta: AttentionMetadata,
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        kv_pool: DeviceKVPool,
    ) -> None:
        """Write the new tokens' K/V to their slots of layer ``layer_id`` (a backend with a
        faster write overrides this)."""
        kv_pool.write(layer_id, meta.out_slots, k, v)

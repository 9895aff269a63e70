"""Device KV pool: one K and one V buffer per layer, indexed by slot."""

from __future__ import annotations

import torch


class DeviceKVPool:
    """Per-layer K/V buffers of shape ``[num_slots, kv_heads, head_dim]`` (views of one tensor).

    NOTE: slot 0 is a dummy target for padded writes and is never handed out by the
    allocator; usable slots are ``1 .. num_slots - 1``.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device) if isinstance(device, str) else device
        # One [2, num_layers, num_slots, kv_heads, head_dim] tensor; per-layer K and V
        # buffers are views of it, so a host-tier copy of many slots is one gather over
        # all layers instead of 2 x num_layers small ones.
        self.kv_buffer = torch.zeros(
            2, num_layers, num_slots, kv_heads, head_dim, dtype=dtype, device=self.device
        )
        self.k_buffers = [self.kv_buffer[0, layer] for layer in range(num_layers)]
        self.v_buffers = [self.kv_buffer[1, layer] for layer in range(num_layers)]

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * elem

    @staticmethod
    def token_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * kv_heads * head_dim * elem

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[num_tokens, kv_heads, head_dim]`` at ``slots`` ``[num_tokens]``
        (rounded to the pool's dtype where it differs: --kv-cache-dtype)."""
        self.k_buffers[layer][slots] = k.to(self.dtype)
        self.v_buffers[layer][slots] = v.to(self.dtype)

"""Paged attention for layers the shared backends do not cover: a sliding window, tanh
soft-capping of the scores, or a scale other than ``head_dim ** -0.5`` (Mistral, Phi-3,
Gemma 2/3, windowed Qwen layers).

Pure PyTorch, per sequence, scores in float32. The KV pool still holds every token of the
sequence (the prefix cache and HiCache store whole sequences); a windowed layer only reads
the keys its window can see, so long contexts cost window-sized work per new token.
"""

from __future__ import annotations

import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention import AttentionBackend
from engine.layers.attention_meta import AttentionMetadata


class WindowedAttentionBackend(AttentionBackend):
    """Causal attention where query position ``p`` sees keys ``p - window < k <= p``
    (HF's sliding-window mask), with optional ``cap * tanh(score / cap)`` soft-capping."""

    name = "torch_windowed"

    def __init__(
        self,
        sliding_window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, q_heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:  # [T, q_heads * head_dim]
        self.store_new_kv(k, v, layer_id, meta, kv_pool)
        num_tokens, q_heads, head_dim = q.shape
        kv_heads = kv_pool.kv_heads
        scale = self.scale if self.scale is not None else head_dim**-0.5
        out = torch.empty(num_tokens, q_heads * head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for b, ext_len in enumerate(meta.extend_lens_list):
            end = start + ext_len
            prefix_len, seq_len = meta.prefix_lens_list[b], meta.seq_lens_list[b]
            # The first new query (position prefix_len) sees nothing older than this key.
            first_key = 0
            if self.sliding_window is not None:
                first_key = max(0, prefix_len - self.sliding_window + 1)
            slots = meta.req_table[meta.req_rows[b], first_key:seq_len].long()  # [S]
            k_seq = kv_pool.k_buffers[layer_id].index_select(0, slots).float()  # [S, kv_heads, D]
            v_seq = kv_pool.v_buffers[layer_id].index_select(0, slots).float()
            # GQA: the q heads that share a kv head form one group. [kv_heads, group, L, D]
            q_seq = q[start:end].float().view(ext_len, kv_heads, -1, head_dim).permute(1, 2, 0, 3)
            # [kv_heads, group, L, D] x [kv_heads, 1, D, S] -> [kv_heads, group, L, S]
            scores = torch.matmul(q_seq, k_seq.permute(1, 2, 0)[:, None]) * scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(
                ~self._visible(prefix_len, ext_len, first_key, seq_len, q.device), float("-inf")
            )
            probs = torch.softmax(scores, dim=-1)
            # [kv_heads, group, L, S] x [kv_heads, 1, S, D] -> [kv_heads, group, L, D]
            seq_out = torch.matmul(probs, v_seq.permute(1, 0, 2)[:, None])
            out[start:end] = seq_out.permute(2, 0, 1, 3).reshape(ext_len, q_heads * head_dim)
            start = end
        return out

    def _visible(
        self, prefix_len: int, ext_len: int, first_key: int, seq_len: int, device: torch.device
    ) -> torch.Tensor:
        """``[L, S]`` bool: which of keys ``first_key..seq_len-1`` each new query sees."""
        q_pos = torch.arange(prefix_len, prefix_len + ext_len, device=device)[:, None]  # [L, 1]
        k_pos = torch.arange(first_key, seq_len, device=device)[None, :]  # [1, S]
        visible = k_pos <= q_pos
        if self.sliding_window is not None:
            visible &= k_pos > q_pos - self.sliding_window
        return visible

"""Which attention each decoder layer runs: the shared backend, or the windowed one for
sliding-window, soft-capped or rescaled layers (read from the HF config as HF does)."""

from __future__ import annotations

from typing import Any

from engine.layers.attention import AttentionBackend
from engine.layers.windowed_attention import WindowedAttentionBackend

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_types(hf_config: Any) -> list[str]:
    """``sliding_attention`` or ``full_attention`` per layer.

    transformers 5 configs carry ``layer_types`` (Qwen2/3, Gemma 2/3); Mistral, Mixtral,
    Phi-3 and Qwen3-MoE apply ``sliding_window`` to every layer when it is set. Qwen2/3
    configs written by transformers 4.x have ``use_sliding_window`` and
    ``max_window_layers`` instead (layers from that index on are windowed).
    """
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown:
            raise ValueError(
                f"layer types {unknown} are not supported (only {SLIDING!r} and {FULL!r})"
            )
        return [t if window is not None else FULL for t in types]
    if window is None:
        return [FULL] * num_layers
    if getattr(hf_config, "use_sliding_window", True) is False:
        return [FULL] * num_layers
    if getattr(hf_config, "model_type", "") in ("qwen2", "qwen3"):
        first = int(getattr(hf_config, "max_window_layers", 0) or 0)
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    return [SLIDING] * num_layers


def layer_backends(
    hf_config: Any,
    shared: AttentionBackend,
    softcap: float | None = None,
    scale: float | None = None,
) -> list[AttentionBackend]:
    """One backend per layer: ``shared`` for plain causal layers; where a window,
    soft-capping or a custom scale applies, ``shared`` with those options if it takes them
    (the Triton kernel), else a WindowedAttentionBackend."""
    window = getattr(hf_config, "sliding_window", None)
    backends: list[AttentionBackend] = []
    for kind in layer_types(hf_config):
        layer_window = int(window) if kind == SLIDING and window is not None else None
        if layer_window is None and softcap is None and scale is None:
            backends.append(shared)
        else:
            own = shared.with_options(layer_window, softcap, scale)
            backends.append(own or WindowedAttentionBackend(layer_window, softcap, scale))
    return backends

"""Model classes by HF architecture name."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM

# Llama, SmolLM (a Llama), Qwen2 and Mistral share one implementation.
_ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config: Any) -> type:
    """Pick the implementation for ``hf_config`` by ``architectures[0]``, else ``model_type``."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if architectures and architectures[0] in _ARCHITECTURES:
        return _ARCHITECTURES[architectures[0]]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model (architectures={architectures}, model_type={model_type!r}); "
        f"supported architectures: {', '.join(supported_architectures())} "
        f"(model types: {', '.join(sorted(_MODEL_TYPES))})"
    )

"""Model classes by HF architecture name."""

from __future__ import annotations

from typing import Any

from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

# Llama, SmolLM (a Llama), Qwen2, Mistral and Phi-3 share one implementation.
_ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
_MODEL_TYPES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config: Any) -> type:
    """Pick the implementation for ``hf_config`` by ``architectures[0]``, else ``model_type``."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if architectures and architectures[0] in _ARCHITECTURES:
        return _ARCHITECTURES[architectures[0]]
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model (architectures={architectures}, model_type={model_type!r}); "
        f"supported architectures: {', '.join(supported_architectures())}. "
        "Serve a model of one of these families, or add its implementation under engine/models/"
    )

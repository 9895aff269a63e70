"""A model directory's HF config, read without importing what serving never uses.

``AutoConfig`` imports the family's configuration module. In transformers 5 Llama's
(``configuration_llama``), alone among the families the engine serves, imports
``utils.type_validators`` for one range check on ``initializer_range``, and that module
imports ``activations`` -> ``integrations.hub_kernels`` -> ``core_model_loading`` ->
``torch.distributed.tensor`` -> sympy, with accelerate, kernels and tvm_ffi: about 62 MiB
of resident memory, in a server that uses none of it (docs/weights.md, "A synthetic ~3B
Q4_K model"). The tokenizer pays it too: ``AutoTokenizer`` reads the config through
``AutoConfig`` to pick its class unless it is handed one.

So a Llama config is read through ``LlamaConfig`` below: transformers' own base class
(``PreTrainedConfig``: the RoPE standardisation, dtype, ``to_dict``, validation) with
the fields, defaults, ``__post_init__`` and checks of transformers' ``LlamaConfig``
declared here. It keeps that class's name, which is how transformers' auto mappings
(the tokenizer's included) look a config class up. Every other family goes through
``AutoConfig`` as before: their configuration modules import nothing heavy.
``tests/unit/test_hf_config.py`` checks both: this class against transformers' on the
same ``config.json`` files (every attribute, ``to_dict``, the declared fields and the
errors), and, in a fresh process, that reading any served family's config and tokenizer
imports none of the modules above.

NOTE: no ``from __future__ import annotations`` here: the ``@strict`` dataclass checks
each field against its annotation, which must be the type itself, not its text.
"""

import os
from typing import Any

from huggingface_hub.dataclasses import as_validated_field, strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


@as_validated_field
def _unit_interval(value: int | float) -> None:
    """transformers' ``interval(min=0.0, max=1.0)``: the only validator Llama's fields use."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"Value must be greater or equal to 0.0 and smaller or equal to 1.0, got {value}."
        )


@strict
class LlamaConfig(PreTrainedConfig):
    """transformers 5's ``LlamaConfig`` (``models/llama/configuration_llama.py``), field
    for field, without the module's imports."""

    model_type = "llama"
    base_model_tp_plan = {  # noqa: RUF012 - transformers' class attribute, as it declares it
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {  # noqa: RUF012
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = _unit_interval(default=0.02)
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """A ``@strict`` class check, as transformers' ``LlamaConfig`` has it."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"The hidden size ({self.hidden_size}) is not a multiple of the number of "
                f"attention heads ({self.num_attention_heads})."
            )


# model_type -> the class read here instead of the one AutoConfig would import.
LIGHT_CONFIGS: dict[str, type[PreTrainedConfig]] = {"llama": LlamaConfig}


def read_hf_config(path: str | os.PathLike[str]) -> Any:
    """The ``PreTrainedConfig`` of a local model directory, as ``AutoConfig.from_pretrained``
    builds it (the same steps: the same ``config.json`` reading, ``name_or_path`` and
    ``from_dict``), with the class of ``LIGHT_CONFIGS`` where the family has one. A
    config that brings its own code (``auto_map``) goes to ``AutoConfig`` unchanged."""
    name = str(path)
    config_dict, unused = PreTrainedConfig.get_config_dict(
        name, local_files_only=True, _from_auto=True, name_or_path=name
    )
    light = LIGHT_CONFIGS.get(config_dict.get("model_type", ""))
    if light is None or "auto_map" in config_dict:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    return light.from_dict(config_dict, **unused)

"""The model config read without transformers' Llama module (engine/hf_config.py) is the
one ``AutoConfig`` reads, and reading a config or tokenizer imports nothing heavy.

``LlamaConfig`` here re-declares transformers' class, so these tests hold the two to
each other on many ``config.json`` files (defaults, derived fields, legacy RoPE keys,
generation keys, dtypes, unknown keys, errors) and compare the declared fields
themselves; a transformers upgrade that changes its ``LlamaConfig`` fails them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers import AutoConfig, AutoTokenizer, Qwen2Config

from engine import hf_config
from engine.loader import load_hf_config, load_tokenizer
from engine.models.registry import _MODEL_TYPES
from tests.unit.model_configs import FAMILY_CASES, TINY

ROOT = Path(__file__).resolve().parents[2]

# What transformers' Llama configuration module drags in (about 62 MiB of a server's
# resident memory): none of it may be imported by reading a config or a tokenizer.
HEAVY_MODULES = (
    "sympy",
    "torch.distributed.tensor",
    "torch.fx.experimental.symbolic_shapes",
    "transformers.activations",
    "transformers.integrations.hub_kernels",
    "transformers.core_model_loading",
    "transformers.models.llama.configuration_llama",
)

_SMALL: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)
# Llama-3.2-3B's config.json as published (transformers 4.45), the shape the synthetic
# 3B GGUF copies: llama3 RoPE scaling under the legacy keys, a bf16 dtype.
_LLAMA32_3B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 24,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "defaults_only": {"model_type": "llama"},
    "small_no_kv_heads": {"model_type": "llama", **_SMALL},
    "small_gqa_head_dim": {
        "model_type": "llama",
        **_SMALL,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "architectures": ["LlamaForCausalLM"],
    },
    "llama32_3b": _LLAMA32_3B,
    "legacy_linear_rope": {
        "model_type": "llama",
        **_SMALL,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "rope_parameters_v5": {
        "model_type": "llama",
        **_SMALL,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "dtype": "float32",
    },
    "generation_and_unknown_keys": {
        "model_type": "llama",
        **_SMALL,
        "max_length": 4096,
        "temperature": 0.6,
        "top_p": 0.9,
        "do_sample": True,
        "some_future_field": [1, 2, 3],
        "_name_or_path": "somewhere/else",
        "eos_token_id": [128001, 128008, 128009],
        "pad_token_id": None,
    },
    "biases_tp_untied": {
        "model_type": "llama",
        **_SMALL,
        "attention_bias": True,
        "mlp_bias": True,
        "pretraining_tp": 2,
        "tie_word_embeddings": False,
        "use_cache": False,
        "hidden_act": "gelu",
        "id2label": {"0": "NO", "1": "YES", "2": "MAYBE"},
        "torch_dtype": "float16",
    },
}
# Configs transformers refuses: the light class must refuse them the same way.
BAD_LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "heads_do_not_divide": {"model_type": "llama", **_SMALL, "num_attention_heads": 3},
    "initializer_range_above_1": {"model_type": "llama", **_SMALL, "initializer_range": 1.5},
    "initializer_range_negative": {"model_type": "llama", **_SMALL, "initializer_range": -0.1},
    "hidden_size_not_int": {"model_type": "llama", **_SMALL, "hidden_size": "64"},
}


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def assert_same_config(ours: Any, theirs: Any) -> None:
    """Every attribute, the serialized form and the class-level tables agree."""
    assert type(ours).__name__ == type(theirs).__name__
    assert ours.model_type == theirs.model_type
    assert vars(ours) == vars(theirs)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.to_json_string() == theirs.to_json_string()
    for name in ("attribute_map", "base_model_tp_plan", "base_model_pp_plan", "base_config_key"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.sub_configs_defaults == theirs.sub_configs_defaults


def test_light_llama_class_declares_what_transformers_declares() -> None:
    ours = {f.name: f for f in dataclasses.fields(hf_config.LlamaConfig)}
    theirs = {f.name: f for f in dataclasses.fields(transformers.LlamaConfig)}
    assert list(ours) == list(theirs)  # the same fields, in the same order
    for name, field in theirs.items():
        mine = ours[name]
        assert (mine.type, mine.default, mine.default_factory, mine.kw_only) == (
            field.type,
            field.default,
            field.default_factory,
            field.kw_only,
        ), name
        assert ("validator" in mine.metadata) == ("validator" in field.metadata), name
    assert hf_config.LlamaConfig.model_type == transformers.LlamaConfig.model_type
    class_checks = sorted(c.__name__ for c in hf_config.LlamaConfig.__class_validators__)  # type: ignore[attr-defined]
    assert class_checks == sorted(
        c.__name__
        for c in transformers.LlamaConfig.__class_validators__  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize("case", sorted(LLAMA_CONFIGS))
def test_light_llama_config_equals_autoconfig(case: str, tmp_path: Path) -> None:
    model_dir = _write(tmp_path, LLAMA_CONFIGS[case])
    ours = load_hf_config(model_dir)
    assert isinstance(ours, hf_config.LlamaConfig)
    assert_same_config(ours, AutoConfig.from_pretrained(str(model_dir), local_files_only=True))


def test_default_model_config_equals_autoconfig(default_model_dir: Path) -> None:
    ours = load_hf_config(default_model_dir)
    assert isinstance(ours, hf_config.LlamaConfig)
    theirs = AutoConfig.from_pretrained(str(default_model_dir), local_files_only=True)
    assert_same_config(ours, theirs)


@pytest.mark.parametrize("case", sorted(BAD_LLAMA_CONFIGS))
def test_light_llama_config_refuses_what_transformers_refuses(case: str, tmp_path: Path) -> None:
    model_dir = _write(tmp_path, BAD_LLAMA_CONFIGS[case])
    with pytest.raises(Exception) as theirs:
        AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with pytest.raises(type(theirs.value)) as ours:
        load_hf_config(model_dir)
    assert str(ours.value) == str(theirs.value)


def _family_configs() -> dict[str, Any]:
    """A config of every model type the engine serves, written by transformers."""
    cases = {name: make for name, make in FAMILY_CASES.items()}
    cases["llama"] = lambda: transformers.LlamaConfig(**TINY)
    cases["qwen2_window"] = lambda: Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    return cases


def test_every_served_family_is_covered() -> None:
    covered = {make().model_type for make in _family_configs().values()}
    assert set(_MODEL_TYPES) <= covered


@pytest.mark.parametrize("case", sorted(_family_configs()))
def test_every_family_reads_as_autoconfig(case: str, tmp_path: Path) -> None:
    _family_configs()[case]().save_pretrained(str(tmp_path))
    theirs = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    ours = load_hf_config(tmp_path)
    assert_same_config(ours, theirs)
    light = theirs.model_type in hf_config.LIGHT_CONFIGS
    assert isinstance(ours, hf_config.LlamaConfig) == light
    if not light:  # read by AutoConfig itself: transformers' own class
        assert type(ours) is type(theirs)


def test_config_with_its_own_code_goes_to_autoconfig(tmp_path: Path) -> None:
    """A config naming its own class (``auto_map``) is AutoConfig's to resolve: here,
    untrusted, it falls back to transformers' own class, and the reader gives the same."""
    config = {"model_type": "llama", **_SMALL, "auto_map": {"AutoConfig": "custom.Config"}}
    model_dir = _write(tmp_path, config)
    theirs = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    ours = load_hf_config(model_dir)
    assert type(ours) is type(theirs)
    assert vars(ours) == vars(theirs)


@pytest.mark.parametrize("drop_class", [False, True])
def test_tokenizer_is_the_one_autotokenizer_picks(
    drop_class: bool, default_model_dir: Path, tmp_path: Path
) -> None:
    """``AutoTokenizer`` given the light config picks the class it picks on its own, also
    when ``tokenizer_config.json`` names no class and the config's class decides."""
    for file in default_model_dir.iterdir():
        if file.suffix in (".json", ".jinja") and "safetensors" not in file.name:
            shutil.copy(file, tmp_path / file.name)
    if drop_class:
        path = tmp_path / "tokenizer_config.json"
        tokenizer_config = json.loads(path.read_text())
        tokenizer_config.pop("tokenizer_class", None)
        path.write_text(json.dumps(tokenizer_config))
    ours = load_tokenizer(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert type(ours) is type(theirs)
    text = "<|im_start|>user\nThe capital of France is<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.all_special_ids == theirs.all_special_ids


_READ_IN_FRESH_PROCESS = """
import json, sys
from engine.loader import load_hf_config, load_tokenizer
for path, with_tokenizer in json.loads(sys.argv[1]):
    load_hf_config(path)
    if with_tokenizer:
        load_tokenizer(path)
print(json.dumps(sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)))
"""


def heavy_modules_after(code: str, *args: str) -> list[str]:
    """Which of ``HEAVY_MODULES`` a fresh interpreter has imported after ``code``, which
    prints them as its last line of output."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reading_configs_and_tokenizer_imports_nothing_heavy(
    default_model_dir: Path, tmp_path: Path
) -> None:
    dirs: list[tuple[str, bool]] = [(str(default_model_dir), True)]
    for case, make in _family_configs().items():
        make().save_pretrained(str(tmp_path / case))
        dirs.append((str(tmp_path / case), False))
    found = heavy_modules_after(_READ_IN_FRESH_PROCESS, json.dumps(dirs), json.dumps(HEAVY_MODULES))
    assert found == []

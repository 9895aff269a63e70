"""Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3, Mixtral and Qwen3-MoE against HF transformers.

Each family is a tiny random-weight model built from transformers' own config class and
saved with save_pretrained (Mixtral as a sharded checkpoint with its index file). Windows
are small (6-7 tokens) so the 3..21-token prompts and 10 new tokens cross them. Greedy
tokens must equal HF ``generate`` exactly for batched prompts of different lengths,
chunked prefill and prefix-cache hits; logits and top-N logprobs must match HF's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers import Gemma3TextConfig, Phi3Config, Qwen3Config

from engine.layers.windowed_attention import WindowedAttentionBackend
from engine.loader import load_model
from tests.unit.hf_reference import (
    assert_batched_greedy_matches_hf,
    hf_greedy,
    random_hf_model,
    randomize,
)
from tests.unit.model_configs import (
    FAMILY_CASES,
    LOGIT_ATOL,
    LOGIT_RTOL,
    TINY,
    random_prompts,
)
from tests.unit.model_driver import GreedyDriver

MAX_NEW_TOKENS = 10
PROMPT_LENS = (3, 11, 21)
TOP_N = 5
SHARED_PREFIX = 8  # prefix-hit test: prompts share this many leading tokens
BACKENDS = ("torch", "cpu_native")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(
    scope="module",
    params=[(case, backend) for case in FAMILY_CASES for backend in BACKENDS],
    ids=lambda param: f"{param[0]}-{param[1]}",
)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, engine model, prompts) for one family and attention backend."""
    name, backend = request.param
    config = FAMILY_CASES[name]()
    # Eager attention: the reference definition of soft-capping and windows.
    hf_model = random_hf_model(config, seed=len(name), attn_implementation="eager")
    path = tmp_path_factory.mktemp(name)
    if name.endswith("_sharded"):
        hf_model.save_pretrained(path, max_shard_size="100KB")
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    else:
        hf_model.save_pretrained(path)
    model = load_model(path, torch.device("cpu"), torch.float32, attention_backend=backend)
    assert model.attn_backend.name == backend
    return hf_model, model, random_prompts(PROMPT_LENS)


def test_batched_greedy_matches_hf(tiny: Any) -> None:
    hf_model, model, prompts = tiny
    assert_batched_greedy_matches_hf(hf_model, model, prompts, MAX_NEW_TOKENS)


def test_chunked_prefill_matches_hf(tiny: Any) -> None:
    hf_model, model, prompts = tiny
    # Chunks of 4: later chunks attend to a prefix already in the pool, across the window.
    ours = GreedyDriver(model, seed=1).generate(prompts, MAX_NEW_TOKENS, prefill_chunk=4)
    for prompt, gen in zip(prompts, ours):
        assert gen.tokens == hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)


def test_prefix_hit_matches_hf(tiny: Any) -> None:
    hf_model, model, prompts = tiny
    shared = prompts[-1][:SHARED_PREFIX]
    hit_prompts = [shared + p for p in prompts]
    ours = GreedyDriver(model, seed=2).generate(
        hit_prompts, MAX_NEW_TOKENS, prefill_chunk=5, cached_prefix_len=SHARED_PREFIX
    )
    for prompt, gen in zip(hit_prompts, ours):
        assert gen.tokens == hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)


@torch.inference_mode()
def test_logits_and_top_logprobs_close_to_hf(tiny: Any) -> None:
    hf_model, model, prompts = tiny
    driver = GreedyDriver(model, seed=3)
    prompt = prompts[-1]
    expected = hf_model(torch.tensor([prompt])).logits[0]  # [L, vocab]
    torch.testing.assert_close(
        driver.prefill_logits(prompt), expected, atol=LOGIT_ATOL, rtol=LOGIT_RTOL
    )
    gen = driver.generate([prompt], MAX_NEW_TOKENS)[0]
    full = torch.tensor([prompt + gen.tokens[:-1]])
    hf_logprobs = torch.log_softmax(hf_model(full).logits[0, len(prompt) - 1 :], dim=-1)
    our_logprobs = torch.log_softmax(torch.stack(gen.logits), dim=-1)  # [steps, vocab]
    hf_top = hf_logprobs.topk(TOP_N, dim=-1)
    our_top = our_logprobs.topk(TOP_N, dim=-1)
    assert torch.equal(our_top.indices, hf_top.indices)
    torch.testing.assert_close(our_top.values, hf_top.values, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def test_layers_use_the_windowed_backend_where_the_config_asks(tiny: Any) -> None:
    _, model, _ = tiny
    backends = [layer.self_attn.attn_backend for layer in model.model.layers]
    windows = [getattr(b, "sliding_window", None) for b in backends]
    config = model.config
    if config.model_type in ("gemma2", "gemma3_text"):
        # Every Gemma layer has a custom scale; layer 0 is local, layer 1 global.
        assert all(isinstance(b, WindowedAttentionBackend) for b in backends)
        assert windows == [config.sliding_window, None]
    elif getattr(config, "sliding_window", None) is None:
        assert all(b is model.attn_backend for b in backends)
    elif config.model_type == "qwen3":
        assert backends[0] is model.attn_backend and windows[1] == config.sliding_window
    else:
        assert windows == [config.sliding_window] * 2


@pytest.mark.parametrize("case", ["mixtral_sharded", "qwen3_moe", "phi3_window", "gemma3"])
@torch.inference_mode()
def test_transformers_state_dict_layout_loads(case: str, tmp_path: Any) -> None:
    # A GGUF model is converted by saving transformers' in-memory state dict (see
    # loader.convert_gguf), where MoE experts are already stacked [E, 2I, H] / [E, H, I].
    from safetensors.torch import save_file

    config = FAMILY_CASES[case]()
    hf_model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    randomize(hf_model, seed=11)
    state = hf_model.state_dict()
    if "moe" in case or "mixtral" in case:
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
    config.architectures = [type(hf_model).__name__]
    config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(tmp_path, torch.device("cpu"), torch.float32, attention_backend="torch")
    prompt = list(range(5, 40, 3))
    expected = hf_model(torch.tensor([prompt])).logits[0]
    ours = GreedyDriver(model).prefill_logits(prompt)
    torch.testing.assert_close(ours, expected, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def test_configs_hiserve_cannot_serve_are_refused_clearly() -> None:
    from engine.models.gemma import GemmaForCausalLM
    from engine.models.layer_attention import layer_types

    encoder = Gemma3TextConfig(**TINY, head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM(encoder)
    chunked = Qwen3Config(**TINY, head_dim=16, sliding_window=4)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_types(chunked)
    longrope = Phi3Config(**TINY)
    longrope.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="longrope"):
        _build_on_meta(longrope)


def _build_on_meta(config: Any) -> Any:
    from engine.models.registry import get_model_class

    with torch.device("meta"):
        return get_model_class(config)(config)

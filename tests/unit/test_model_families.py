"""Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3, Mixtral and Qwen3-MoE against HF transformers.

Each family is a tiny random-weight model built from transformers' own config class and
saved with save_pretrained (Mixtral as a sharded checkpoint with its index file). Windows
are small (6-7 tokens) so the 3..21-token prompts and 10 new tokens cross them. Greedy
tokens must equal HF ``generate`` exactly for batched prompts of different lengths,
chunked prefill and prefix-cache hits; logits and top-N logprobs must match HF's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.layers.windowed_attention import WindowedAttentionBackend
from engine.loader import load_model
from tests.unit.hf_reference import hf_greedy, randomize
from tests.unit.model_driver import GreedyDriver

LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4
MAX_NEW_TOKENS = 10
PROMPT_LENS = (3, 11, 21)
TOP_N = 5
SHARED_PREFIX = 8  # prefix-hit test: prompts share this many leading tokens

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

CASES: dict[str, Callable[[], Any]] = {
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False),
    # Layer 0 full, layer 1 windowed (max_window_layers=1).
    "qwen3_window": lambda: Qwen3Config(
        **_COMMON,
        head_dim=32,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "mistral_window": lambda: MistralConfig(**_COMMON, sliding_window=6),
    "phi3_window": lambda: Phi3Config(**_COMMON, sliding_window=7),
    "gemma2": lambda: Gemma2Config(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,  # != head_dim: the scale must come from here
        sliding_window=6,
        attn_logit_softcapping=4.0,  # small, so capping changes the scores
        final_logit_softcapping=15.0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "mixtral_sharded": lambda: MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    ),
    # Layer 0 routed (without renormalising the top-k weights), layer 1 dense.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
}
BACKENDS = ("torch", "cpu_native")


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    # One thread keeps a shared 2-core box predictable (see test_model_hf_parity).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(
    scope="module",
    params=[(case, backend) for case in CASES for backend in BACKENDS],
    ids=lambda param: f"{param[0]}-{param[1]}",
)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, engine model, prompts) for one family and attention backend."""
    name, backend = request.param
    config = CASES[name]()
    # Eager attention: the reference definition of soft-capping and windows.
    hf_model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    randomize(hf_model, seed=len(name))
    if config.model_type.startswith("gemma"):
        # Gemma multiplies embeddings by sqrt(hidden_size): undo that in the random weights,
        # or each token's own embedding dominates the residual and greedy output repeats.
        with torch.no_grad():
            hf_model.model.embed_tokens.weight.div_(config.hidden_size**0.5)
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp(name)
    if name.endswith("_sharded"):
        hf_model.save_pretrained(path, max_shard_size="100KB")
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    else:
        hf_model.save_pretrained(path)
    model = load_model(path, torch.device("cpu"), torch.float32, attention_backend=backend)
    assert model.attn_backend.name == backend
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return hf_model, model, prompts


def test_batched_greedy_matches_hf(tiny: Any) -> None:
    hf_model, model, prompts = tiny
    ours = GreedyDriver(model).generate(prompts, MAX_NEW_TOKENS)
    for prompt, gen in zip(prompts, ours):
        expected = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        assert len(set(expected)) > 2, "degenerate reference; the check would be weak"
        assert gen.tokens == expected


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

    config = CASES[case]()
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

    encoder = Gemma3TextConfig(**_COMMON, head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM(encoder)
    chunked = Qwen3Config(**_COMMON, head_dim=16, sliding_window=4)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_types(chunked)
    longrope = Phi3Config(**_COMMON)
    longrope.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="longrope"):
        _build_on_meta(longrope)


def _build_on_meta(config: Any) -> Any:
    from engine.models.registry import get_model_class

    with torch.device("meta"):
        return get_model_class(config)(config)

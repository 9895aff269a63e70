"""HF transformers as the oracle for the model tests: random weights and greedy output."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from tests.unit.model_driver import GreedyDriver


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Large weights give well-separated logits, so greedy choices are not float noise;
    random norm weights and biases make forgetting any of them visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.15 * noise)


def random_hf_model(config: Any, seed: int, attn_implementation: str | None = None) -> Any:
    """The HF model of ``config`` with ``randomize``d weights, in eval mode, generating
    exactly as many tokens as asked (no EOS)."""
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf_model = transformers.AutoModelForCausalLM.from_config(config, **options).eval()
    randomize(hf_model, seed)
    if config.model_type.startswith("gemma"):
        # Gemma multiplies embeddings by sqrt(hidden_size): undo that in the random weights,
        # or each token's own embedding dominates the residual and greedy output repeats.
        with torch.no_grad():
            hf_model.model.embed_tokens.weight.div_(config.hidden_size**0.5)
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    return hf_model


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate(do_sample=False)`` on one prompt; the new tokens only."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def assert_batched_greedy_matches_hf(
    hf_model: Any, model: Any, prompts: list[list[int]], max_new_tokens: int
) -> None:
    """``model`` run greedily on ``prompts`` as one batch gives HF ``generate``'s tokens for
    each; a reference with two or fewer distinct tokens is refused (the check would be weak)."""
    ours = GreedyDriver(model).generate(prompts, max_new_tokens)
    for prompt, gen in zip(prompts, ours, strict=True):
        expected = hf_greedy(hf_model, prompt, max_new_tokens)
        assert len(set(expected)) > 2, "degenerate reference; the check would be weak"
        assert gen.tokens == expected

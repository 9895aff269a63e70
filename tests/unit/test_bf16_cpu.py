"""bfloat16 on the CPU against HF transformers in float32, teacher-forced.

The default model with bf16 weights (float32 activations, norms and KV; a batch's
products take the activations rounded to bf16 and sum in float32) reads
each parity prompt followed by HF float32's own greedy continuation; at every position
its top-1 token must agree with HF float32's top-1 for at least ``MIN_AGREEMENT`` of the
positions. (Free-running greedy text may drift after one near-tie; teacher forcing
measures each step on the same context.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from engine.loader import load_model, load_tokenizer
from tests.unit.hf_reference import hf_greedy
from tests.unit.model_driver import GreedyDriver
from tests.unit.parity_prompts import parity_prompts

MIN_AGREEMENT = 0.99
CONTINUATION = 32


def teacher_forced_agreement(default_model_dir: Path) -> tuple[int, int]:
    """(positions whose top-1 agrees with HF float32, positions) over the parity prompts."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_dir), local_files_only=True, dtype=torch.float32
    ).eval()
    model = load_model(default_model_dir, torch.device("cpu"), torch.float32, bf16_weights=True)
    assert model.model.layers[0].mlp.down_proj.packed.type_names() == ["BF16"]
    assert model.lm_head.packed is model.packed_embedding  # tied: one bf16 table
    driver = GreedyDriver(model, max_rows=2, max_context=160)
    agree = total = 0
    for prompt in parity_prompts(load_tokenizer(default_model_dir)):
        sequence = prompt + hf_greedy(hf_model, prompt, CONTINUATION)
        want = hf_model(torch.tensor([sequence])).logits[0].argmax(-1)  # [len]
        got = driver.prefill_logits(sequence).argmax(-1)  # [len]
        agree += int((got == want).sum())
        total += len(sequence)
    return agree, total


@pytest.mark.slow
@torch.inference_mode()
def test_bf16_top1_agrees_with_hf_float32(default_model_dir: Path) -> None:
    agree, total = teacher_forced_agreement(default_model_dir)
    assert agree / total >= MIN_AGREEMENT, f"{agree}/{total} positions agree"


if __name__ == "__main__":  # prints the figure quoted in docs/weights.md
    from engine.loader import resolve_model_path

    torch.set_grad_enabled(False)
    agree, total = teacher_forced_agreement(resolve_model_path("default"))
    print(f"bf16 teacher-forced top-1 agreement with HF float32: {agree}/{total}")

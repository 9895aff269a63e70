"""The parity prompts: chat questions the default model is checked on against references."""

from __future__ import annotations

from typing import Any

PARITY_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from 1 to 20.",
)


def parity_prompts(tokenizer: Any) -> list[list[int]]:
    """Token ids of each parity question in the model's chat template."""
    prompts = []
    for question in PARITY_QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts

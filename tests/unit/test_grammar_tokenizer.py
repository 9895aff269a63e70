"""The grammar's view of the default model's tokenizer (SmolLM2, no weights needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

from engine.grammar import GrammarBackend, build_tokenizer_info
from engine.grammar_spec import GrammarSpec
from engine.loader import eos_token_ids_of, load_hf_config, load_tokenizer


@pytest.fixture(scope="module")
def model(default_model_dir: Path) -> tuple[Any, Any]:
    return load_tokenizer(default_model_dir), load_hf_config(default_model_dir)


@pytest.fixture(scope="module")
def backend(model: tuple[Any, Any]) -> GrammarBackend:
    tokenizer, config = model
    info = build_tokenizer_info(tokenizer, config.vocab_size, eos_token_ids_of(config, tokenizer))
    return GrammarBackend(info)


def allowed_after(backend: GrammarBackend, spec: GrammarSpec, prefix: str) -> set[int]:
    matcher = xgr.GrammarMatcher(backend.submit(spec).result(timeout=120))
    assert matcher.accept_string(prefix)
    bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=backend.vocab_size)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_width_and_stop_set_are_the_engines(
    model: tuple[Any, Any], backend: GrammarBackend
) -> None:
    tokenizer, config = model
    assert backend.vocab_size == config.vocab_size == 49152
    assert sorted(backend.stop_token_ids) == sorted(eos_token_ids_of(config, tokenizer))
    # After a complete object only the engine's stop tokens may follow.
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}}}, "x")
    assert allowed_after(backend, spec, '{"s": "a"}') == set(backend.stop_token_ids)


def test_no_special_token_inside_a_string(model: tuple[Any, Any], backend: GrammarBackend) -> None:
    tokenizer, _ = model
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert {0, 1, 2} <= special  # <|endoftext|>, <|im_start|>, <|im_end|>
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}, "x"
    )
    inside = allowed_after(backend, spec, '{"s": "ab')
    assert not inside & special
    # Ordinary text tokens stay allowed there.
    word = tokenizer.encode(" hello", add_special_tokens=False)
    assert len(word) == 1 and word[0] in inside
    # The same holds for a free-form regex, where only a stop token may end the text.
    anything = allowed_after(backend, GrammarSpec.regex(r"[\s\S]{1,50}", "regex"), "x")
    assert anything & special == set(backend.stop_token_ids)

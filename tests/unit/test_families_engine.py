"""The new families through the whole engine with HiCache on: a sliding-window,
soft-capped model (Gemma 2) and an MoE model (Mixtral) give HF's greedy tokens while
their KV is evicted to the host tier and loaded back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import Gemma2Config, MixtralConfig

from engine import Engine, EngineConfig, SamplingParams
from tests.conftest import TOKENIZER_FILES
from tests.unit.cpu_engine import returning_conversations
from tests.unit.hf_reference import hf_greedy, random_hf_model
from tests.unit.model_configs import TOKENIZER_SIZED

MAX_TOKENS = 6
CONFIGS = {
    # Windows of 16 against conversations of 40..100 tokens.
    "gemma2": lambda: Gemma2Config(
        **TOKENIZER_SIZED, head_dim=16, query_pre_attn_scalar=24, sliding_window=16
    ),
    "mixtral": lambda: MixtralConfig(
        **TOKENIZER_SIZED, num_local_experts=4, num_experts_per_tok=2, sliding_window=16
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> tuple[Any, Path]:
    config = CONFIGS[request.param]()
    hf_model = random_hf_model(config, seed=5, attn_implementation="eager")
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            (path / name).write_bytes((default_model_dir / name).read_bytes())
    return hf_model, path


@pytest.mark.slow  # 6-12 s alone, up to 27 s next to the rest of the suite on 2 cores
def test_hicache_load_back_keeps_hf_greedy_output(family: tuple[Any, Path]) -> None:
    hf_model, path = family
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            kv_cache_tokens=128,  # a few conversations' worth: the rest goes to the host
            hicache_load_threshold=4,
            enable_hierarchical_cache=True,
            hicache_ratio=8,
        )
    )
    engine.check_invariants = True
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    host_hits = 0
    for turn, c, convo, out in returning_conversations(engine, params, 4, 40, 8):
        host_hits += out.cached_tokens_host
        assert out.token_ids == hf_greedy(hf_model, convo, MAX_TOKENS), (turn, c)
    assert host_hits > 0, "the workload never loaded KV back from the host tier"

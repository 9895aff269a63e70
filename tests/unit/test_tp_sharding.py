"""Tensor-parallel sharding: each rank's shapes, the checkpoint slices, clear errors for
counts that do not split, and every family's sharded model against HF transformers.

The ranks run as threads of this process (tests/unit/tp_threads.py) so that every family
is covered in seconds; tests/unit/test_tp_engine.py runs real processes over gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from engine.layers.linear import ALL_SHARDS
from engine.layers.moe import SparseMoE
from engine.layers.parallel_linear import RowParallelLinear, TPShard, kv_heads_of_rank
from engine.loader import load_model
from engine.models.tp_shard import CheckpointSlicer, shard_config
from tests.unit.hf_reference import hf_greedy, random_hf_model
from tests.unit.model_configs import FAMILY_CASES, TINY, random_prompts
from tests.unit.model_driver import GreedyDriver
from tests.unit.tp_threads import run_ranks, thread_shards

MAX_NEW_TOKENS = 6
PROMPT_LENS = (3, 11, 21)
TP_CASES = {
    **FAMILY_CASES,
    # Row-parallel biases (o_proj, down_proj) must be added once, not once per rank.
    "llama_bias": lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
}
# (case, ranks, attention backend); 4 ranks over 2 KV heads replicate each on 2 ranks.
PARAMS = [(name, 2, "torch") for name in TP_CASES] + [
    ("llama_bias", 4, "torch"),
    ("llama_bias", 2, "cpu_native"),
    ("gemma2", 2, "cpu_native"),
]


# ---------------------------------------------------------------- shapes and errors


def test_rank_config_holds_its_share() -> None:
    config = LlamaConfig(**TINY)  # 4 heads, 2 KV heads, hidden 64, intermediate 128
    shard = shard_config(config, 2)
    assert (shard.num_attention_heads, shard.num_key_value_heads) == (2, 1)
    assert shard.intermediate_size == 64
    assert shard.head_dim == 16  # kept, although hidden_size // heads is now 32
    assert (config.num_attention_heads, config.intermediate_size) == (4, 128)  # untouched
    assert shard_config(config, 1) is config


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    assert [list(kv_heads_of_rank(2, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads_of_rank(4, r, 2)) for r in range(2)] == [[0, 1], [2, 3]]
    assert shard_config(LlamaConfig(**TINY), 4).num_key_value_heads == 1


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        (
            {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 72},
            2,
            r"num_attention_heads=9 is not divisible by tensor_parallel_size=2",
        ),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 96},
            4,
            r"tensor_parallel_size=4 is not a multiple of num_key_value_heads=3",
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96},
            4,
            r"num_attention_heads=6 is not divisible by tensor_parallel_size=4",
        ),
        (
            {
                "intermediate_size": 100,
                "num_attention_heads": 6,
                "num_key_value_heads": 3,
                "hidden_size": 96,
            },
            3,
            r"intermediate_size=100 is not divisible by tensor_parallel_size=3",
        ),
    ],
)
def test_uneven_counts_are_rejected_naming_the_numbers(
    overrides: dict[str, int], size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shard_config(LlamaConfig(**{**TINY, **overrides}), size)


def test_slices_of_a_checkpoint() -> None:
    config = LlamaConfig(**TINY)  # q rows 64, k/v rows 32 (2 heads of 16)
    q = torch.arange(64 * 3).view(64, 3).float()
    k = 1000 + torch.arange(32 * 3).view(32, 3).float()
    v = 2000 + torch.arange(32 * 3).view(32, 3).float()
    fused = torch.cat([q, k, v])
    for rank in range(2):
        cut = CheckpointSlicer(config, TPShard(rank, 2))
        name = "model.layers.0.self_attn.qkv_proj.weight"
        parts = [cut(name, i, t) for i, t in enumerate((q, k, v))]
        assert torch.equal(parts[0], q[32 * rank : 32 * (rank + 1)])
        assert torch.equal(parts[1], k[16 * rank : 16 * (rank + 1)])  # KV head `rank`
        # Phi-3's fused checkpoint gives the same rows as the separate tensors.
        assert torch.equal(cut(name, ALL_SHARDS, fused), torch.cat(parts))
        o = torch.arange(3 * 64).view(3, 64).float()
        o_cut = cut("model.layers.0.self_attn.o_proj.weight", 0, o)
        assert torch.equal(o_cut, o[:, 32 * rank : 32 * (rank + 1)])
        bias = torch.ones(3)
        expected_bias = bias if rank == 0 else torch.zeros(3)
        assert torch.equal(cut("model.layers.0.mlp.down_proj.bias", 0, bias), expected_bias)
        norm = torch.ones(64)
        assert cut("model.layers.0.input_layernorm.weight", 0, norm) is norm  # replicated
    # Four ranks over two KV heads: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
    heads = [CheckpointSlicer(config, TPShard(r, 4))("x.qkv_proj.weight", 1, k) for r in range(4)]
    assert torch.equal(heads[1], k[:16]) and torch.equal(heads[2], k[16:])


# ---------------------------------------------------------------- sharded models vs HF


@pytest.fixture(scope="module", params=PARAMS, ids=lambda p: f"{p[0]}-tp{p[1]}-{p[2]}")
def sharded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, full engine model, the ranks' models, their hub, prompts)."""
    name, size, backend = request.param
    config = TP_CASES[name]()
    hf_model = random_hf_model(config, seed=len(name), attn_implementation="eager")
    path: Path = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(path, max_shard_size="100KB" if name.endswith("_sharded") else "5GB")
    full = load_model(path, torch.device("cpu"), torch.float32, attention_backend=backend)
    shards = thread_shards(size)
    ranks = [
        load_model(path, torch.device("cpu"), torch.float32, attention_backend=backend, tp=s)
        for s in shards
    ]
    return hf_model, full, ranks, shards[0].hub, random_prompts(PROMPT_LENS)


def test_rank_models_hold_their_share(sharded: Any) -> None:
    _, full, ranks, _, _ = sharded
    size = len(ranks)
    for rank_model in ranks:
        for ours, whole in zip(rank_model.model.layers, full.model.layers):
            attn, whole_attn = ours.self_attn, whole.self_attn
            assert attn.q_heads * size == whole_attn.q_heads
            assert attn.kv_heads == max(1, whole_attn.kv_heads // size)
            assert isinstance(attn.o_proj, RowParallelLinear)
            assert attn.o_proj.in_features * size == whole_attn.o_proj.in_features
            if isinstance(ours.mlp, SparseMoE):
                assert ours.mlp.output_reduce is not None
                assert ours.mlp.w2.shape[2] * size == whole.mlp.w2.shape[2]
            else:
                assert isinstance(ours.mlp.down_proj, RowParallelLinear)


def test_sharded_greedy_matches_hf_and_logits_match_one_rank(sharded: Any) -> None:
    hf_model, full, ranks, hub, prompts = sharded
    chunk = 4  # chunked prefill: later chunks read KV the ranks wrote before
    calls_before = hub.calls
    outputs = run_ranks(
        [
            lambda m=m: GreedyDriver(m, seed=1).generate(prompts, MAX_NEW_TOKENS, chunk)
            for m in ranks
        ]
    )
    reference = GreedyDriver(full, seed=1).generate(prompts, MAX_NEW_TOKENS, chunk)
    forwards = -(-max(PROMPT_LENS) // chunk) + MAX_NEW_TOKENS - 1
    layers = len(full.model.layers)
    assert hub.calls - calls_before == forwards * 2 * layers  # one all-reduce per row layer
    for p, prompt in enumerate(prompts):
        expected = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        for rank_out in outputs:
            assert rank_out[p].tokens == expected
        torch.testing.assert_close(
            torch.stack(outputs[0][p].logits),
            torch.stack(reference[p].logits),
            atol=1e-4,
            rtol=1e-4,
        )

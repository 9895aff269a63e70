"""The Triton paged attention kernel under Triton's interpreter against a dense float64
reference: ragged lengths, prefix hits, windows, soft-capping, GQA ratios, page sizes,
empty and one-token sequences, split decode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.layers.triton_ops.paged_attention import paged_attention
from tests.unit.triton_reference import PagedBatch, make_batch, reference_attention, work_list


def _run(batch: PagedBatch, decode: bool, **kwargs: object) -> torch.Tensor:
    if decode:
        return paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.req_table,
            batch.req_rows,
            batch.seq_lens,
            **kwargs,  # type: ignore[arg-type]
        )
    return paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.req_table,
        batch.req_rows,
        batch.seq_lens,
        q_starts=batch.q_starts,
        q_lens=batch.q_lens,
        work=work_list(batch),
        **kwargs,  # type: ignore[arg-type]
    )


def _check(out: torch.Tensor, batch: PagedBatch, atol: float = 2e-5, **kwargs: object) -> None:
    expected = reference_attention(batch, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "page_size"),
    [(2, 2, 1), (4, 1, 16), (6, 2, 4), (8, 2, 16)],
)
def test_extend_with_prefix_hits_matches_reference(
    q_heads: int, kv_heads: int, page_size: int
) -> None:
    # Ragged: a fresh prompt, a prefix hit, a one-token extend, a sequence with no new
    # tokens (its output rows do not exist) and a long extend over several blocks.
    batch = make_batch(
        prefix_lens=[0, 13, 30, 5, 3],
        q_lens=[9, 7, 1, 0, 21],
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=8,
        page_size=page_size,
    )
    _check(_run(batch, decode=False), batch)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_reference(num_splits: int, page_size: int) -> None:
    batch = make_batch(
        prefix_lens=[0, 40, 6, 70],  # a one-token sequence, and rows of ragged lengths
        q_lens=[1, 1, 1, 1],
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        page_size=page_size,
        seed=1,
    )
    _check(_run(batch, decode=True, num_splits=num_splits), batch)


@pytest.mark.parametrize("decode", [True, False])
def test_sliding_window_softcap_and_scale(decode: bool) -> None:
    q_lens = [1, 1, 1] if decode else [5, 17, 2]
    batch = make_batch(
        prefix_lens=[3, 40, 20],
        q_lens=q_lens,
        q_heads=4,
        kv_heads=2,
        head_dim=8,
        page_size=16,
        seed=2,
    )
    options = {"window": 7, "softcap": 5.0, "scale": 0.3}
    out = _run(batch, decode=decode, **({"num_splits": 2} if decode else {}), **options)
    _check(out, batch, **options)
    # The window matters here: without it the output differs.
    with pytest.raises(AssertionError):
        _check(out, batch, softcap=5.0, scale=0.3)


def test_head_dim_not_a_power_of_two_and_fp16() -> None:
    batch = make_batch(
        prefix_lens=[4, 0],
        q_lens=[3, 6],
        q_heads=3,
        kv_heads=1,
        head_dim=12,
        page_size=1,
        dtype=torch.float16,
        seed=3,
    )
    out = _run(batch, decode=False)
    assert out.dtype == torch.float16
    _check(out, batch, atol=2e-3)


def test_bf16_decode_stays_in_bf16() -> None:
    batch = make_batch(
        [9, 2], [1, 1], q_heads=2, kv_heads=1, head_dim=8, page_size=4, dtype=torch.bfloat16
    )
    out = _run(batch, decode=True, num_splits=2)
    assert out.dtype == torch.bfloat16
    _check(out, batch, atol=2e-2)


def test_empty_batch_returns_empty() -> None:
    batch = make_batch([], [], q_heads=2, kv_heads=1, head_dim=8, page_size=1)
    assert _run(batch, decode=True).shape == (0, 2, 8)


def test_split_count_must_be_a_power_of_two() -> None:
    batch = make_batch([2], [1], q_heads=2, kv_heads=1, head_dim=8, page_size=1)
    with pytest.raises(ValueError, match="power of two"):
        _run(batch, decode=True, num_splits=3)


def test_extend_work_list_padded_to_a_fixed_grid() -> None:
    # A captured mixed step: the work list padded past its programs, q with rows that no
    # sequence owns, sequences past the step's (q_len 0): the step's rows as unpadded,
    # the padding rows untouched.
    batch = make_batch(
        prefix_lens=[30, 0, 4, 2, 0],
        q_lens=[1, 19, 1, 0, 0],
        q_heads=4,
        kv_heads=1,
        head_dim=8,
        page_size=16,
        seed=4,
    )
    real = int(batch.q_lens.sum())
    padded_q = torch.cat([batch.q, torch.randn(5, 4, 8)])  # [T + 5, heads, D]
    out = torch.full_like(padded_q, 7.0)
    work = work_list(batch, size=40)
    assert work.shape == (2, 40)
    got = paged_attention(
        padded_q,
        batch.k_cache,
        batch.v_cache,
        batch.req_table,
        batch.req_rows,
        batch.seq_lens,
        q_starts=batch.q_starts,
        q_lens=batch.q_lens,
        work=work,
        out=out,
    )
    _check(got[:real], batch)
    assert bool((got[real:] == 7.0).all())


def test_extend_work_list() -> None:
    from engine.layers.triton_ops.paged_attention import PAD_BLOCK, extend_work, max_extend_work

    # Three tokens a program: 7 tokens take 3 programs, 0 none, 3 one.
    assert extend_work([7, 0, 3], 3) == [0, 0, 0, 2, 0, 1, 2, 0]
    assert extend_work([2], 3, size=3) == [0, 0, 0, 0, PAD_BLOCK, PAD_BLOCK]
    # The bound holds for any split of the tokens over the sequences.
    for lens in ([1] * 8, [8], [3, 3, 2], [4, 1, 1, 1, 1]):
        assert len(extend_work(lens, 3)) // 2 <= max_extend_work(8, len(lens), 3)
    with pytest.raises(ValueError, match="do not fit"):
        extend_work([7], 3, size=2)

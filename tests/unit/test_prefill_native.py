"""The native CPU prefill / extend attention kernel (prefill_attention.h) against a float64
softmax over the same keys: ragged lengths, cached prefixes, GQA ratios, head dims, a
bfloat16 pool, skipped sequences, strided inputs, threads, and its input checks."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernels.paged_decode_kernel()
    # This machine has a C++ compiler: a failed build is a bug, not a reason to skip.
    assert module is not None, cpu_kernels.build_error()
    return module


class Case:
    """Sequences of (prefix, new tokens): their prefixes at scattered pool slots, the new
    tokens' q/k/v as row-strided views of one fused projection, as the model makes them."""

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        kv_heads: int,
        group: int,
        head_dim: int,
        pool_dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.prefixes = [p for p, _ in seqs]
        self.lens = [n for _, n in seqs]
        self.kv_heads, self.q_heads, self.head_dim = kv_heads, kv_heads * group, head_dim
        tokens = sum(self.lens)
        slots = sum(self.prefixes) + 16
        shape = (slots, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(pool_dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(pool_dtype)
        self.table = torch.full(
            (len(seqs) + 2, max(p + n for p, n in seqs) + 5), 9999, dtype=torch.int32
        )
        self.rows = torch.randperm(len(seqs) + 2, generator=gen)[: len(seqs)].tolist()
        free = torch.randperm(slots, generator=gen)
        used = 0
        for row, p in zip(self.rows, self.prefixes):
            self.table[row, :p] = free[used : used + p].int()
            used += p
        width = (self.q_heads + 2 * kv_heads) * head_dim
        fused = torch.randn(tokens, width, generator=gen)
        q_end, k_end = self.q_heads * head_dim, (self.q_heads + kv_heads) * head_dim
        self.q = fused[:, :q_end].view(tokens, self.q_heads, head_dim)
        self.k = fused[:, q_end:k_end].view(tokens, kv_heads, head_dim)
        self.v = fused[:, k_end:].view(tokens, kv_heads, head_dim)

    def run(self, kernel, seqs: list[int] | None = None) -> torch.Tensor:
        out = torch.full((self.q.shape[0], self.q_heads * self.head_dim), float("nan"))
        kernel.prefill_attention(
            self.q, self.k, self.v, self.k_cache, self.v_cache, self.table, self.rows,
            self.prefixes, self.lens,
            list(range(len(self.lens))) if seqs is None else seqs,
            self.head_dim**-0.5, out,
        )  # fmt: skip
        return out

    def reference(self) -> torch.Tensor:
        """float64 softmax(q K^T * scale) V per sequence, position p seeing keys 0..p."""
        out = torch.empty(self.q.shape[0], self.q_heads * self.head_dim, dtype=torch.float64)
        start = 0
        group = self.q_heads // self.kv_heads
        for row, p, n in zip(self.rows, self.prefixes, self.lens):
            slots = self.table[row, :p].long()
            keys = torch.cat([self.k_cache[slots].double(), self.k[start : start + n].double()])
            values = torch.cat([self.v_cache[slots].double(), self.v[start : start + n].double()])
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            q = self.q[start : start + n].double().transpose(0, 1)  # [Hq, n, D]
            scores = q @ keys.transpose(1, 2) * self.head_dim**-0.5  # [Hq, n, S]
            seen = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            out[start : start + n] = (probs @ values).transpose(0, 1).reshape(n, out.shape[1])
            start += n
        return out


SEQUENCES = [
    [(0, 1)],  # one token, nothing before it
    [(0, 5), (3, 17), (40, 33)],  # partial lanes, a prefix, a second key block
    [(0, 64), (0, 65), (100, 130), (5, 0)],  # several work items per head; an empty one
    [(7, 1), (0, 16), (31, 32)],  # a one-token extend after a prefix; block edges
]


@pytest.mark.parametrize(("kv_heads", "group"), [(1, 1), (2, 1), (3, 3), (1, 4), (2, 4), (1, 8)])
@pytest.mark.parametrize("seqs", SEQUENCES)
def test_matches_float64_attention(kernel, kv_heads: int, group: int, seqs) -> None:
    case = Case(seqs, kv_heads, group, head_dim=64, seed=kv_heads * 10 + group)
    torch.testing.assert_close(case.run(kernel).double(), case.reference(), atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 48, 128, 256])
def test_head_dims(kernel, head_dim: int) -> None:
    assert kernel.prefill_takes(head_dim)
    case = Case([(0, 20), (37, 45)], 2, 2, head_dim, seed=head_dim)
    torch.testing.assert_close(case.run(kernel).double(), case.reference(), atol=4e-6, rtol=1e-5)


def test_bfloat16_pool(kernel) -> None:
    # The prefix is read from a bfloat16 pool as float32; the new tokens stay float32.
    case = Case([(0, 9), (50, 40)], 3, 3, 64, pool_dtype=torch.bfloat16, seed=4)
    torch.testing.assert_close(case.run(kernel).double(), case.reference(), atol=4e-6, rtol=1e-5)


def test_long_context_scores_stay_stable(kernel) -> None:
    # Scores in the hundreds (queries scaled up) must not overflow the running softmax.
    # float32 scores of that size carry errors of ~1e-5 into the probabilities, the
    # tolerance here (float32 SDPA's own error on this case is the same size).
    case = Case([(300, 200)], 1, 3, 64, seed=5)
    case.q.mul_(30.0)
    got = case.run(kernel)
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), case.reference(), atol=1e-4, rtol=1e-3)


def test_only_the_named_sequences_are_written(kernel) -> None:
    case = Case([(0, 6), (4, 3), (0, 10)], 2, 2, 64, seed=6)
    got = case.run(kernel, seqs=[0, 2])
    want = case.reference()
    torch.testing.assert_close(got[:6].double(), want[:6], atol=4e-6, rtol=1e-5)
    torch.testing.assert_close(got[9:].double(), want[9:], atol=4e-6, rtol=1e-5)
    assert got[6:9].isnan().all()


def test_result_does_not_depend_on_threads(kernel) -> None:
    case = Case([(0, 70), (20, 90), (0, 3)], 2, 3, 64, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.run(kernel)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(case.run(kernel), one)


def test_contiguous_inputs_give_the_same_bits(kernel) -> None:
    case = Case([(5, 30)], 2, 2, 64, seed=8)
    strided = case.run(kernel)
    case.q, case.k, case.v = case.q.contiguous(), case.k.contiguous(), case.v.contiguous()
    assert torch.equal(case.run(kernel), strided)


def test_bad_inputs_raise_clear_errors(kernel) -> None:
    assert not kernel.prefill_takes(8) and not kernel.prefill_takes(0)
    case = Case([(4, 5)], 1, 2, 64, seed=9)
    with pytest.raises(RuntimeError, match="extend_lens sum"):
        case.lens = [4]
        case.run(kernel)
    case.lens = [5]
    case.table[case.rows[0], 0] = 10_000
    with pytest.raises(RuntimeError, match="out of range"):
        case.run(kernel)
    case = Case([(4, 5)], 1, 2, 64, seed=9)
    with pytest.raises(RuntimeError, match="sequence index"):
        case.run(kernel, seqs=[1])
    case.rows = [99]
    with pytest.raises(RuntimeError, match="request-table row"):
        case.run(kernel)
    case = Case([(0, 3)], 1, 1, 8, seed=9)
    with pytest.raises(RuntimeError, match="head_dim 8"):
        case.run(kernel)

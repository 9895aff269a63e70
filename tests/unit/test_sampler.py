"""Sampler: greedy, filters, penalties, min_tokens, seeds and logprobs against references."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import sampler as sampler_module
from engine.penalties import Penalties
from engine.request import Req, SamplingParams
from engine.sampler import Sampler, filter_logits, make_generator

CPU = torch.device("cpu")
EOS = 2


def make_req(
    prompt: list[int] | None = None, output: list[int] | None = None, **params: Any
) -> Req:
    req = Req(request_id="r", prompt_ids=list(prompt or [5, 6]), params=SamplingParams(**params))
    req.output_ids = list(output or [])
    if req.params.seed is not None:
        req.generator = make_generator(req.params.seed, CPU)
    return req


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale  # [rows, vocab]


def test_greedy_equals_argmax() -> None:
    logits = random_logits(16, 300)
    out = Sampler(300, CPU)(logits, [make_req(temperature=0.0) for _ in range(16)], [EOS])
    assert out.token_ids == np.argmax(logits.numpy(), axis=1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_greedy_rows_at_model_vocab_equal_numpy_argmax(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.layers import fused_cpu

    monkeypatch.setenv(fused_cpu.ENV_SWITCH, "1" if fused else "0")
    vocab = 49152
    sampler = Sampler(vocab - 5, CPU)  # a padded LM head: a row-strided view inside
    assert (sampler.argmax is not sampler_module._torch_argmax) == fused
    logits = random_logits(32, vocab, seed=4)
    logits[3, [10, 2000]] = 40.0  # a tie: the first index, as numpy
    expected = np.argmax(logits[:, : vocab - 5].numpy(), axis=1).tolist()
    assert sampler(logits, [make_req(temperature=0.0)] * 32, [EOS]).token_ids == expected
    # Mixed with sampled rows: the greedy rows go through the same argmax.
    reqs = [make_req(temperature=0.0 if b % 2 else 1.0) for b in range(32)]
    got = sampler(logits, reqs, [EOS]).token_ids
    assert got[1::2] == expected[1::2]


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = random_logits(8, 200, seed=1, scale=1.0)
    expected = np.argmax(logits.numpy(), axis=1).tolist()
    sampler = Sampler(200, CPU, seed=3)
    for _ in range(5):
        reqs = [make_req(temperature=1.3, top_p=1e-6) for _ in range(8)]
        assert sampler(logits, reqs, [EOS]).token_ids == expected
        reqs = [make_req(temperature=1.3, top_k=1) for _ in range(8)]
        assert sampler(logits, reqs, [EOS]).token_ids == expected
    # top_k=1 through the filter itself (not the greedy shortcut) leaves only the argmax.
    ones = torch.ones(8)
    kept = filter_logits(logits, ones, torch.ones(8, dtype=torch.long), ones, ones * 0)
    assert (torch.isfinite(kept).sum(dim=1) == 1).all()
    assert kept.argmax(dim=1).tolist() == expected


@pytest.mark.parametrize("partial_sort", [False, True])
@pytest.mark.parametrize("case", range(10))
def test_filter_matches_hf_warpers(case: int, partial_sort: bool) -> None:
    vocab = 64
    rng = np.random.default_rng(case)
    logits = random_logits(4, vocab, seed=case, scale=2.0)
    temps = rng.uniform(0.3, 1.5, 4).tolist()
    # partial_sort: every row has top-k, so the filter may sort only the largest few.
    top_ks = rng.choice([1, 5, 20] if partial_sort else [vocab, 1, 5, 20], 4).tolist()
    top_ps = rng.choice([1.0, 0.9, 0.5, 0.2], 4).tolist()
    min_ps = rng.choice([0.0, 0.05, 0.3], 4).tolist()
    ours = filter_logits(
        logits,
        torch.tensor(temps),
        torch.tensor(top_ks),
        torch.tensor(top_ps),
        torch.tensor(min_ps),
        max_top_k=max(top_ks) if partial_sort else None,
    )
    for row in range(4):
        ref = logits[row : row + 1].clone()
        ids: Any = torch.zeros(1, 1, dtype=torch.long)  # input ids: unused by warpers
        ref = TemperatureLogitsWarper(temps[row])(ids, ref)
        if top_ks[row] < vocab:
            ref = TopKLogitsWarper(top_ks[row])(ids, ref)
        if top_ps[row] < 1.0:
            ref = TopPLogitsWarper(top_ps[row])(ids, ref)
        if min_ps[row] > 0.0:
            ref = MinPLogitsWarper(min_ps[row])(ids, ref)
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(ref[0]))
        torch.testing.assert_close(ours[row].softmax(-1), ref[0].softmax(-1))


@pytest.mark.parametrize("peaked", [True, False])
def test_large_vocab_top_p_matches_hf(peaked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Large enough for the CPU partial sort; peaked logits let it apply, flat ones make
    # it fall back to the full sort.
    used_partial: list[bool] = []
    real_partial_sort = sampler_module._partial_sort

    def spy(*args: Any) -> Any:
        result = real_partial_sort(*args)
        used_partial.append(result is not None)
        return result

    monkeypatch.setattr(sampler_module, "_partial_sort", spy)
    vocab = 8192
    logits = random_logits(4, vocab, seed=31, scale=1.0)
    if peaked:
        logits[:, :40] += 9.0
    top_ps = [0.9, 0.5, 0.95, 1.0]
    top_ks = [vocab, vocab, 30, 500]
    ours = filter_logits(
        logits, torch.ones(4), torch.tensor(top_ks), torch.tensor(top_ps), torch.zeros(4)
    )
    for row in range(4):
        ids: Any = torch.zeros(1, 1, dtype=torch.long)
        ref = logits[row : row + 1].clone()
        if top_ks[row] < vocab:
            ref = TopKLogitsWarper(top_ks[row])(ids, ref)
        if top_ps[row] < 1.0:
            ref = TopPLogitsWarper(top_ps[row])(ids, ref)
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(ref[0]))
        torch.testing.assert_close(ours[row].softmax(-1), ref[0].softmax(-1))
    assert used_partial == [peaked]


def _chi_square(counts: Counter[int], probs: np.ndarray, total: int) -> float:
    stat = 0.0
    for token, p in enumerate(probs):
        if p > 0:
            stat += (counts.get(token, 0) - total * p) ** 2 / (total * p)
        else:
            assert counts.get(token, 0) == 0, f"token {token} has probability 0 but was sampled"
    return stat


def test_temperature_sampling_follows_softmax() -> None:
    vocab, draws = 8, 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    logits = row.expand(draws, vocab).contiguous()  # [draws, vocab]
    temperature = 0.7
    reqs = [make_req(temperature=temperature) for _ in range(draws)]
    out = Sampler(vocab, CPU, seed=11)(logits, reqs, [EOS])
    scaled = row.double().numpy() / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    # chi-square with 7 degrees of freedom: 0.9999 quantile is about 29.9
    assert _chi_square(Counter(out.token_ids), probs, draws) < 30.0


def test_top_k_top_p_sampling_follows_truncated_softmax() -> None:
    vocab, draws = 10, 20000
    row = torch.tensor([3.0, 2.5, 2.0, 1.8, 1.0, 0.0, -1.0, 0.5, 2.2, -2.0])
    logits = row.expand(draws, vocab).contiguous()
    reqs = [make_req(temperature=1.0, top_k=5, top_p=0.8) for _ in range(draws)]
    out = Sampler(vocab, CPU, seed=5)(logits, reqs, [EOS])
    # Reference by hand: keep the 5 largest, renormalise, keep the shortest prefix
    # reaching 0.8, renormalise again.
    probs = np.exp(row.double().numpy())
    order = np.argsort(-probs)
    keep = np.zeros(vocab, dtype=bool)
    top5 = order[:5]
    p5 = probs[top5] / probs[top5].sum()
    mass = 0.0
    for token, p in zip(top5, p5, strict=True):
        keep[token] = True
        mass += p
        if mass >= 0.8:
            break
    ref = np.where(keep, probs, 0.0)
    ref /= ref.sum()
    kept = int(keep.sum())
    assert _chi_square(Counter(out.token_ids), ref, draws) < 30.0 + 3 * kept


def test_min_p_removes_unlikely_tokens() -> None:
    vocab, draws = 6, 4000
    row = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01]))
    logits = row.expand(draws, vocab).contiguous()
    reqs = [make_req(temperature=1.0, min_p=0.3) for _ in range(draws)]
    counts = Counter(Sampler(vocab, CPU, seed=2)(logits, reqs, [EOS]).token_ids)
    # Probabilities below 0.3 * 0.4 = 0.12 are gone; the rest keeps its proportions.
    ref = np.array([0.4, 0.3, 0.15, 0.0, 0.0, 0.0]) / 0.85
    assert _chi_square(counts, ref, draws) < 25.0


def test_seed_is_independent_of_batch_neighbours() -> None:
    vocab, steps = 500, 6
    step_logits = [random_logits(1, vocab, seed=100 + s, scale=1.0) for s in range(steps)]

    def run(neighbours: int, position: int, seed: int) -> list[int]:
        sampler = Sampler(vocab, CPU, seed=neighbours)
        target = make_req(temperature=1.0, top_p=0.95, seed=seed)
        others = [
            make_req(temperature=0.9, seed=7 + i) if i % 2 else make_req(temperature=1.0)
            for i in range(neighbours)
        ]
        tokens = []
        for s in range(steps):
            batch = [*others[:position], target, *others[position:]]
            noise = random_logits(len(batch), vocab, seed=1000 + s + neighbours)
            noise[position] = step_logits[s][0]
            token = sampler(noise, batch, [EOS]).token_ids[position]
            target.output_ids.append(token)
            tokens.append(token)
        return tokens

    alone = run(0, 0, seed=1234)
    assert run(3, 1, seed=1234) == alone
    assert run(6, 6, seed=1234) == alone
    assert run(0, 0, seed=4321) != alone


def reference_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    rep: float,
    presence: float,
    frequency: float,
) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token, count in Counter(output).items():
        out[token] -= presence + frequency * count
    return out


def test_penalties_match_reference_formula() -> None:
    vocab = 12
    logits = random_logits(4, vocab, seed=9)
    cases = [
        ([1, 2, 3], [3, 3, 4], 1.3, 0.0, 0.0),
        ([0, 5], [5, 6, 6, 6], 1.0, 0.5, 0.25),
        ([7, 8], [8, 9, 9, 1], 0.8, -0.4, 1.5),
        ([10, 11], [], 1.0, 1.0, 1.0),  # nothing generated yet: no presence/frequency
    ]
    reqs = [
        make_req(
            prompt,
            output,
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            temperature=0.0,
        )
        for prompt, output, rep, pres, freq in cases
    ]
    ours = Penalties(CPU).apply(logits, reqs)
    for row, (prompt, output, rep, pres, freq) in enumerate(cases):
        ref = reference_penalties(logits[row].tolist(), prompt, output, rep, pres, freq)
        torch.testing.assert_close(ours[row], torch.tensor(ref))
    # Repetition penalty against HF's processor too.
    seen_ids: Any = torch.tensor([[1, 2, 3, 3, 3, 4]])  # prompt + output
    hf = RepetitionPenaltyLogitsProcessor(1.3)(seen_ids, logits[:1].clone())
    torch.testing.assert_close(ours[0], hf[0])


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.5, 1.0]] * 2)
    plain = make_req(output=[1, 1], temperature=0.0)
    penalised = make_req(output=[1, 1], temperature=0.0, frequency_penalty=0.5)
    sampler = Sampler(4, CPU)
    assert sampler(logits, [plain, penalised], [EOS]).token_ids == [1, 2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 3.0]])  # EOS=2 best, then the stop id 3
    sampler = Sampler(5, CPU)

    def pick(output: list[int], **params: Any) -> int:
        return sampler(logits, [make_req(output=output, **params)], [EOS]).token_ids[0]

    assert pick([1], temperature=0.0, min_tokens=3, stop_token_ids=[3]) == 4
    assert pick([1, 1, 1], temperature=0.0, min_tokens=3, stop_token_ids=[3]) == EOS
    # ignore_eos: EOS is not a stop, so it is not banned; the stop id still is.
    assert pick([1], temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True) == EOS
    sampled = sampler(
        logits.expand(200, 5).contiguous(),
        [make_req(output=[1], temperature=1.0, min_tokens=2) for _ in range(200)],
        [EOS],
    ).token_ids
    assert EOS not in sampled


def test_logprobs_come_from_raw_logits() -> None:
    vocab = 50
    logits = random_logits(3, vocab, seed=21)
    reqs = [
        make_req(output=[4, 4], temperature=0.8, top_k=10, repetition_penalty=1.5, logprobs=5),
        make_req(temperature=0.0, logprobs=0),
        make_req(temperature=0.0),
    ]
    out = Sampler(vocab, CPU, seed=1)(logits, reqs, [EOS])
    raw = torch.log_softmax(logits.double(), dim=-1)
    for row in (0, 1):
        entry = out.logprobs[row]
        assert entry is not None
        assert entry.token_id == out.token_ids[row]
        assert math.isclose(entry.logprob, raw[row, entry.token_id].item(), abs_tol=1e-5)
    first = out.logprobs[0]
    assert first is not None
    _, ref_ids = raw[0].topk(5)
    assert list(first.top) == ref_ids.tolist()
    for token, lp in first.top.items():
        assert math.isclose(lp, raw[0, token].item(), abs_tol=1e-5)
    assert out.logprobs[1] is not None and out.logprobs[1].top == {}
    assert out.logprobs[2] is None
    assert out.token_ids[1:] == logits[1:].argmax(dim=1).tolist()
    # Every row asking (no row gather on the way).
    every = Sampler(vocab, CPU)(logits, [make_req(temperature=0.0, logprobs=3)] * 3, [EOS])
    for row, entry in enumerate(every.logprobs):
        assert entry is not None and entry.token_id == every.token_ids[row]
        assert math.isclose(entry.logprob, raw[row].max().item(), abs_tol=1e-5)
        assert list(entry.top) == raw[row].topk(3).indices.tolist()


def test_padded_vocab_columns_are_never_chosen() -> None:
    logits = torch.zeros(64, 12)
    logits[:, 10:] = 50.0  # lm_head padding beyond the real vocabulary
    sampler = Sampler(10, CPU)
    greedy = sampler(logits, [make_req(temperature=0.0)] * 64, [EOS]).token_ids
    sampled = sampler(logits, [make_req(temperature=1.0) for _ in range(64)], [EOS]).token_ids
    assert max(greedy + sampled) < 10


def test_make_generator_is_reproducible() -> None:
    a = torch.rand(5, generator=make_generator(42, CPU))
    b = torch.rand(5, generator=make_generator(42, CPU))
    assert torch.equal(a, b)


def test_cdf_draws_at_the_edges_never_pick_a_zero_probability_token() -> None:
    # Zero-probability tokens at the start, the middle and the end of the vocabulary (a
    # grammar mask, top-k, padding), with draws at 0, just below 1 and at every interval
    # boundary: each picks the token whose interval holds it, never a zero.
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.5, 0.25, 0.0]])
    edges = [0.0, 0.25, 0.7499999, 0.75, math.nextafter(1.0, 0.0)]
    picked = [sampler_module.sample_from_cdf(probs, torch.tensor([[u]])).item() for u in edges]
    assert picked == [1, 4, 4, 5, 5]
    # Rows whose mass is not exactly 1 (float32 softmax) scale the draw by their total.
    scaled = probs * 0.999
    assert (
        sampler_module.sample_from_cdf(scaled, torch.tensor([[math.nextafter(1.0, 0.0)]])).item()
        == 5
    )

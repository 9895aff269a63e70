"""bench/micro/int8_activations.py, the probe of issue 32's open decision: its int8
rounding of the activations, and its Q4_K x int8 sums against their exact float64
value (the bench itself asserts that on every shape it times)."""

from __future__ import annotations

import pytest
import torch

from bench.micro import int8_activations as probe


def test_activations_round_like_q8_k_in_the_probes_order() -> None:
    x = torch.randn(512, generator=torch.Generator().manual_seed(0))
    x[300] = 0.0
    q8, scale, sums = probe.quantize_activations(x)
    assert q8.dtype == torch.int8 and q8.shape == (512,)
    assert torch.allclose(scale, x.view(2, 256).abs().amax(dim=1) / 127)
    natural = q8.view(2, 8, 32)[:, torch.tensor(probe.SUB_ORDER).argsort()].reshape(2, 256)
    back = natural.double() * scale.double()[:, None]
    assert torch.equal(back.reshape(-1), probe.dequantized_activations(x))
    assert (back.reshape(-1) - x.double()).abs().max() <= scale.max() / 2 + 1e-6  # nearest
    assert int(natural.abs().max()) == 127  # each block's largest value keeps full range
    torch.testing.assert_close(sums, (natural.view(2, 8, 32).sum(2) * scale[:, None]).reshape(-1))
    # A block of zeros has scale 0 and rounds to zeros, not NaN.
    q8, scale, sums = probe.quantize_activations(torch.zeros(256))
    assert not q8.any() and float(scale[0]) == 0.0 and not sums.any()


@pytest.mark.slow  # builds the probe (~30 s the first time)
def test_the_probe_times_q4_k_and_its_sums_are_exact(capsys: pytest.CaptureFixture[str]) -> None:
    why = probe.probe_available()
    if why is not None:
        pytest.skip(why)
    probe.main(["--shapes", "64x256", "32x768", "--working-set-mb", "1", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "Q4_K, one token" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["64x256", "32x768"]
    for r in rows:
        assert float(r[1]) > 0 and float(r[3]) > 0  # GB/s of each path
        assert 0 < float(r[6]) < 0.05  # int8 rounding moves the result, but little

"""MoE routing without host syncs: the sort-and-group path against the per-expert loop
(today's output), the host reads it avoids, and which path a step takes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.layers import moe as moe_module
from engine.layers.moe import DEVICE_ROUTING_MAX_TOKENS, SparseMoE
from tests.unit.test_graph_runner import HostReads


def make_moe(num_experts: int, top_k: int, renormalize: bool, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    layer = SparseMoE(16, 12, num_experts, top_k, renormalize)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    return layer


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 2), (8, 1), (6, 6), (16, 3)])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_grouped_on_device_matches_the_per_expert_loop(
    num_experts: int, top_k: int, num_tokens: int
) -> None:
    layer = make_moe(num_experts, top_k, renormalize=top_k > 1, seed=num_tokens)
    x = torch.randn(num_tokens, 16)
    experts, weights = layer.route(x)
    expected = layer.per_expert(x, experts, weights)
    got = layer.grouped_on_device(x, experts, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert got.abs().sum() > 0


def test_unused_experts_and_skewed_routing() -> None:
    layer = make_moe(8, 2, renormalize=True)
    x = torch.randn(9, 16)
    experts = torch.tensor([[3, 5]] * 8 + [[0, 3]])  # six experts get nothing
    weights = torch.rand(9, 2)
    torch.testing.assert_close(
        layer.grouped_on_device(x, experts, weights), layer.per_expert(x, experts, weights)
    )


def test_grouped_path_reads_nothing_on_the_host() -> None:
    layer = make_moe(8, 2, renormalize=True)
    x = torch.randn(7, 16)
    experts, weights = layer.route(x)
    with HostReads() as trace:
        layer.grouped_on_device(x, experts, weights)
    assert trace.host_reads == []
    with HostReads() as trace:
        layer.per_expert(x, experts, weights)
    assert "tolist" in trace.host_reads  # what the grouped path removes


def test_which_path_a_step_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_moe(4, 2, renormalize=True)
    taken: list[str] = []

    def record(name: str) -> Any:
        real = getattr(layer, name)

        def wrapper(*args: Any) -> torch.Tensor:
            taken.append(name)
            return real(*args)  # type: ignore[no-any-return]

        return wrapper

    monkeypatch.setattr(layer, "grouped_on_device", record("grouped_on_device"))
    monkeypatch.setattr(layer, "per_expert", record("per_expert"))
    layer(torch.randn(3, 16))
    assert taken == ["per_expert"]  # the CPU keeps the loop: no device to sync with

    monkeypatch.setattr(moe_module, "routes_on_device", lambda kind, n: kind == "cpu")
    layer(torch.randn(3, 16))
    assert taken == ["per_expert", "grouped_on_device"]


def test_routes_on_device_for_small_accelerator_steps() -> None:
    assert moe_module.routes_on_device("cuda", 1)
    assert moe_module.routes_on_device("musa", DEVICE_ROUTING_MAX_TOKENS)
    assert not moe_module.routes_on_device("musa", DEVICE_ROUTING_MAX_TOKENS + 1)  # prefill
    assert not moe_module.routes_on_device("cpu", 1)

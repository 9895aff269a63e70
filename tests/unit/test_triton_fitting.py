"""Launch options that fit the device (engine/layers/triton_ops/fitting.py): the choice
rule, and the paged attention and MoE kernels falling back to their smaller options
under Triton's interpreter (a device refusing the larger ones as Triton does, with
``OutOfResources`` before anything runs) with results unchanged; and a model whose
attention no option fits, found at load (engine/loader.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import triton

from engine import loader
from engine.layers.moe import SparseMoE
from engine.layers.triton_attention import TritonAttentionBackend
from engine.layers.triton_ops import fitting, fused, fused_moe, paged_attention
from engine.loader import load_model
from tests.unit.fake_backends import UnbuildableKernel
from tests.unit.hf_reference import random_hf_model
from tests.unit.model_configs import FAMILY_CASES
from tests.unit.triton_reference import make_batch, reference_attention, work_list

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _fresh_choices() -> Iterator[None]:
    fitting.forget()
    yield
    fitting.forget()


def _refusing(limit: int) -> Callable[[int], None]:
    """A launch needing ``size`` of a resource the device has ``limit`` of."""

    def launch(size: int) -> None:
        if size > limit:
            raise triton.OutOfResources(size, limit, "shared memory")

    return launch


def test_the_first_option_that_fits_is_taken_and_remembered() -> None:
    tried: list[int] = []
    fits = _refusing(64)

    def launch(size: int) -> None:
        tried.append(size)
        fits(size)

    assert fitting.launch_fitting("k", [256, 128, 64, 32], launch, "") == 64
    assert tried == [256, 128, 64]
    # The next launch of the same key starts at the option that fitted.
    assert fitting.launch_fitting("k", [256, 128, 64, 32], launch, "") == 64
    assert tried == [256, 128, 64, 64]
    # Another key chooses on its own.
    assert fitting.launch_fitting("other", [32, 16], launch, "") == 32


def test_no_option_that_fits_is_an_error_naming_each_refusal_and_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="no launch option of k fits") as info:
        fitting.launch_fitting("k", [256, 128], _refusing(64), "start with --smaller")
    message = str(info.value)
    assert "256" in message and "128" in message and message.endswith("start with --smaller")


def test_the_kernels_advice_names_real_switches() -> None:
    from engine.layers.triton_ops import FUSED_ENV_SWITCH
    from server.args import parse_args

    assert "--attention-backend torch" in paged_attention.NO_FIT_ADVICE
    assert (
        parse_args(["--attention-backend", "torch"], environ={}).engine.attention_backend == "torch"
    )
    assert f"{FUSED_ENV_SWITCH}=0" in fused_moe.NO_FIT_ADVICE


def test_other_launch_errors_are_not_taken_for_a_refusal() -> None:
    def broken(size: int) -> None:
        raise ValueError("bad argument")

    with pytest.raises(ValueError, match="bad argument"):
        fitting.launch_fitting("k", [2, 1], broken, "")


class _Device:
    """A kernel's launches through a device that refuses the options ``refuse`` picks;
    the options of every launch are kept."""

    def __init__(self, kernel: Any, option: Callable[[dict[str, Any]], tuple[Any, ...]]) -> None:
        self.kernel, self.option = kernel, option
        self.refuse: Callable[[tuple[Any, ...]], bool] = lambda o: False
        self.launches: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            option = self.option(kwargs)
            self.launches.append(option)
            if self.refuse(option):
                raise triton.OutOfResources(1 << 20, 1 << 16, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("decode", [True, False])
def test_paged_attention_on_a_device_refusing_its_first_option(
    decode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = _Device(
        paged_attention._paged_attention_kernel,
        lambda kw: (kw["BLOCK_N"], kw.get("num_stages")),
    )
    device.refuse = lambda option: option[1] is None  # only unpipelined launches fit
    monkeypatch.setattr(paged_attention, "_paged_attention_kernel", device)
    q_lens = [1, 1, 1] if decode else [5, 1, 17]
    batch = make_batch([9, 0, 30], q_lens, q_heads=4, kv_heads=2, head_dim=16, page_size=4)
    expected = reference_attention(batch, window=8)

    def run() -> torch.Tensor:
        if decode:
            return paged_attention.paged_attention(
                batch.q, batch.k_cache, batch.v_cache, batch.req_table, batch.req_rows,
                batch.seq_lens, window=8,
            )  # fmt: skip
        return paged_attention.paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.req_table, batch.req_rows,
            batch.seq_lens, q_starts=batch.q_starts, q_lens=batch.q_lens,
            work=work_list(batch), window=8,
        )  # fmt: skip

    torch.testing.assert_close(run().double(), expected, atol=1e-5, rtol=1e-5)
    first = device.launches[0]
    assert device.launches == [first, (first[0], 1)]  # refused, then its unpipelined twin
    torch.testing.assert_close(run().double(), expected, atol=1e-5, rtol=1e-5)
    assert device.launches[2:] == [(first[0], 1)]  # remembered: no second refusal


def test_fused_experts_on_a_device_refusing_their_first_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = _Device(
        fused_moe._expert_matmul_kernel,
        lambda kw: (kw["GATE_UP"], kw["BLOCK_N"], kw["BLOCK_K"], kw.get("num_stages")),
    )
    largest = {gate_up: fused_moe._smaller_tiles(32, 32)[0] for gate_up in (True, False)}
    device.refuse = lambda option: option[1:] == largest[option[0]]
    monkeypatch.setattr(fused_moe, "_expert_matmul_kernel", device)
    torch.manual_seed(0)
    moe = SparseMoE(40, 24, 4, 2, renormalize=True)
    moe.gate.weight.data = torch.randn_like(moe.gate.weight)
    moe.w13.data = torch.randn_like(moe.w13) * 0.2
    moe.w2.data = torch.randn_like(moe.w2) * 0.2
    x = torch.randn(11, 40)
    chosen, weights = moe.route(x)
    got = fused_moe.fused_experts(x, moe.w13, moe.w2, chosen, weights)
    torch.testing.assert_close(got, moe.per_expert(x, chosen, weights), atol=1e-5, rtol=1e-5)
    taken = [option for option in device.launches if not device.refuse(option)]
    assert len(device.launches) == 4 and len(taken) == 2  # one refusal per kernel
    assert all(option[2] < largest[option[0]][1] for option in taken)  # a smaller K tile


# ---- a model the device cannot take, known at load ---------------------------------------


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2: windowed and global layers, so two layer shapes to try."""
    hf_model = random_hf_model(FAMILY_CASES["gemma2"](), seed=5, attn_implementation="eager")
    path = tmp_path_factory.mktemp("gemma2_fitting")
    hf_model.save_pretrained(path)
    return path


def _windowed_layers_never_fit(monkeypatch: pytest.MonkeyPatch) -> _Device:
    device = _Device(paged_attention._paged_attention_kernel, lambda kw: (kw["USE_WINDOW"],))
    device.refuse = lambda option: bool(option[0])
    monkeypatch.setattr(paged_attention, "_paged_attention_kernel", device)
    return device


def test_a_model_that_fits_keeps_the_kernel_after_one_launch_per_layer_shape(
    gemma2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = _Device(paged_attention._paged_attention_kernel, lambda kw: (kw["USE_WINDOW"],))
    monkeypatch.setattr(paged_attention, "_paged_attention_kernel", device)
    model = load_model(gemma2_dir, torch.device("cpu"), torch.float32, attention_backend="triton")
    layers = [layer.self_attn.attn_backend for layer in model.model.layers]
    assert all(isinstance(b, TritonAttentionBackend) for b in layers)
    # A decode and an extend for the windowed shape and for the global one, whatever the
    # number of layers.
    assert sorted(device.launches) == [(False,), (False,), (True,), (True,)]


def test_asked_for_by_name_a_kernel_that_does_not_fit_fails_the_load(
    gemma2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _windowed_layers_never_fit(monkeypatch)
    with pytest.raises(RuntimeError, match="cannot serve this model") as info:
        load_model(gemma2_dir, torch.device("cpu"), torch.float32, attention_backend="triton")
    assert "--attention-backend torch" in str(info.value)


@pytest.mark.parametrize(
    "failure", ["no option fits", "the kernel does not build", "the K/V store does not build"]
)
def test_under_auto_a_kernel_that_cannot_run_leaves_the_model_on_pytorch_attention(
    failure: str,
    gemma2_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if failure == "no option fits":
        _windowed_layers_never_fit(monkeypatch)
        said = "no launch option"
    elif failure == "the kernel does not build":
        monkeypatch.setattr(paged_attention, "_paged_attention_kernel", UnbuildableKernel())
        said = "RuntimeError: PassManager::run failed"
    else:
        monkeypatch.setattr(fused, "_rotary_store_kernel", UnbuildableKernel())
        said = "RuntimeError: PassManager::run failed"
    # What auto picks on a GPU with a working Triton (on the CPU it never picks Triton).
    monkeypatch.setattr(loader, "get_attention_backend", lambda *args: TritonAttentionBackend())
    with caplog.at_level(logging.WARNING):
        model = load_model(gemma2_dir, torch.device("cpu"), torch.float32, attention_backend="auto")
    layers = [layer.self_attn.attn_backend for layer in model.model.layers]
    assert not any(isinstance(b, TritonAttentionBackend) for b in layers)
    assert "falling back to the PyTorch backend" in caplog.text and said in caplog.text
    # Asked for by name, the same device fails the load, saying why.
    with pytest.raises(RuntimeError, match="cannot serve this model") as info:
        load_model(gemma2_dir, torch.device("cpu"), torch.float32, attention_backend="triton")
    assert said in str(info.value)

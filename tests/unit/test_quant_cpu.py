"""The packed-GGUF kernel (csrc/quant_cpu.cpp) against the ``gguf`` library.

Random blocks of every packed type (Q8_0/Q4_0/Q4_1 quantized by ``gguf.quants.quantize``;
the K-quants, which gguf-py cannot quantize, as random bytes with sane scales), checked
against ``gguf.quants.dequantize`` followed by a float64 matmul: the register path (1-4
tokens), the FMA tiles (5-128 tokens without AMX), the chunked path (more), odd row
counts, K not a multiple of the FMA tiles' slice, strided outputs. Tolerance: each output
within 1e-5 of the sum of |w * x| over its row (float32 summation error, order aside).
The same checks run on the build this CPU picks (AVX-512 here), with batches on its AMX
tiles where the CPU has them (bf16 hi/lo split, csrc/quant_amx.h: the same tolerance;
bf16 weights take the tokens rounded to bf16 there, and so does their reference),
without them, and with every batch pinned to the chunked path, and on an AVX2 build
forced by reporting an AVX2 CPU to the build flags.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch

from engine.layers import cpu_kernels, quant_cpu
from engine.layers.quant_cpu import PACKED_TYPES, PackedWeight, QuantTensor
from tests.unit.quant_blocks import placed, random_blocks

REL_TOL = 1e-5


def reference(
    blocks: np.ndarray, qtype: int, x: torch.Tensor, kernel: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T in float64 with W from gguf's dequantize, |x| @ |W|^T: the error scale).
    Where ``kernel`` takes x on its AMX tiles against bf16 weights, x is first rounded to
    bf16 as the kernel rounds it (quant_amx.h's rounds_tokens): the rest is float32."""
    w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)))
    if rounds_tokens(kernel, qtype, x.shape[0]):
        x = x.bfloat16()
    w64, x64 = w.double(), x.double()
    return (x64 @ w64.T).float(), (x64.abs() @ w64.abs().T).float()


def rounds_tokens(kernel: Any, qtype: int, tokens: int) -> bool:
    """Whether ``kernel`` multiplies ``tokens`` tokens by a ``qtype`` weight on its AMX
    tiles with the tokens rounded to bf16 (bf16 weights, more than the register path's)."""
    on_amx = isinstance(kernel, _Path) and kernel.amx and kernel.AMX
    return on_amx and qtype == quant_cpu.BF16 and tokens > kernel.GEMV_MAX_TOKENS


def _avx2_build(monkeypatch: pytest.MonkeyPatch) -> Any:
    # The flags come from the CPU capability torch reports: report AVX2 to get the
    # fallback build (a different extension name, so both builds live side by side).
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    ext = cpu_kernels.NativeExtension(
        "quant_cpu.cpp", "hiserve_quant_cpu", "packed kernel (AVX2)", "-", quant_cpu.logger, True
    )
    return ext.load()


class _Path:
    """The native module with its batched path pinned for each call: ``amx`` on the AMX
    tiles, or without them; ``fma_max`` tokens at most on the FMA tiles (0: every batch on
    the chunked path). The module's switches are process-wide, and the tests of this file
    run in random order."""

    def __init__(self, module: Any, amx: bool, fma_max: int | None = None) -> None:
        self.module, self.amx = module, amx
        self.fma_max = module.FMA_MAX_TOKENS if fma_max is None else fma_max

    def qmatmul(self, *args: Any) -> None:
        before = self.module.set_amx(self.amx)
        fma_before = self.module.set_fma_max_tokens(self.fma_max)
        try:
            self.module.qmatmul(*args)
        finally:
            self.module.set_amx(before)
            self.module.set_fma_max_tokens(fma_before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


@pytest.fixture(scope="module", params=["native", "amx", "chunked", "avx2"])
def kernel(request: pytest.FixtureRequest) -> Any:
    if request.param in ("native", "amx", "chunked"):
        module = quant_cpu.quant_kernel()
        assert module is not None, quant_cpu.build_error()
        if torch.backends.cpu.get_cpu_capability() == "AVX512":
            assert module.ISA == "avx512"
        if request.param == "amx" and not module.AMX:
            pytest.skip("this CPU has no AMX (or the kernel refused its use)")
        if request.param == "chunked":
            return _Path(module, amx=False, fma_max=0)
        return _Path(module, amx=request.param == "amx")
    with pytest.MonkeyPatch.context() as monkeypatch:
        module = _avx2_build(monkeypatch)
    assert module is not None
    assert module.ISA == "avx2" and not module.AMX
    return module


def test_amx_is_found_where_the_cpu_has_it() -> None:
    # The AMX path must not silently go missing on a CPU that has it (Linux reports the
    # flags in /proc/cpuinfo; the kernel also needs the OS to grant the tile state).
    module = quant_cpu.quant_kernel()
    assert module is not None
    flags = set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    has_amx = {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags and module.ISA == "avx512"
    assert has_amx == module.AMX


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda q: PACKED_TYPES[q][0])
def test_kernel_matches_gguf_dequantize_then_matmul(kernel: Any, qtype: int) -> None:
    block = PACKED_TYPES[qtype][1]
    rows, cols = 67, 2 * max(block, 256)
    blocks = random_blocks(qtype, rows, cols, seed=qtype)
    data = torch.from_numpy(blocks)
    expected_w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    torch.testing.assert_close(
        kernel.dequantize(data, qtype, cols), torch.from_numpy(expected_w), rtol=1e-6, atol=1e-7
    )
    gen = torch.Generator().manual_seed(qtype)
    # 1-4: the register path; 5-128: the FMA tiles without AMX; 129 and 300: the chunked
    # at::mm path without AMX (300: AMX in two groups of tokens)
    fma_max = kernel.FMA_MAX_TOKENS
    for tokens in (1, 2, 3, 4, 5, 16, 33, fma_max, fma_max + 1, 300):
        x = torch.randn(tokens, cols, generator=gen)
        want, scale = reference(blocks, qtype, x, kernel)
        wide = torch.full((tokens, rows + 9), float("nan"))
        out = wide[:, 4 : 4 + rows]  # a strided view: the kernel writes only its columns
        kernel.qmatmul(x, data, qtype, out)
        assert (out - want).abs().le(REL_TOL * scale + 1e-6).all(), (
            tokens,
            (out - want).abs().max(),
        )
        assert wide[:, :4].isnan().all() and wide[:, 4 + rows :].isnan().all()


@pytest.mark.parametrize("qtype", [q for q in sorted(PACKED_TYPES) if PACKED_TYPES[q][1] == 32])
def test_kernel_takes_k_past_a_whole_slice(kernel: Any, qtype: int) -> None:
    # K = 9 blocks of 32: the FMA tiles' 256-weight slices end on a partial one; 13 rows:
    # one full tile of 12 and one row alone.
    rows, cols = 13, 9 * 32
    blocks = random_blocks(qtype, rows, cols, seed=qtype + 1)
    gen = torch.Generator().manual_seed(qtype + 1)
    for tokens in (5, 17, 64):
        x = torch.randn(tokens, cols, generator=gen)
        want, scale = reference(blocks, qtype, x, kernel)
        out = torch.empty(tokens, rows)
        kernel.qmatmul(x, torch.from_numpy(blocks), qtype, out)
        assert (out - want).abs().le(REL_TOL * scale + 1e-6).all(), (tokens, qtype)


@pytest.mark.parametrize("qtype", [q for q in sorted(PACKED_TYPES) if PACKED_TYPES[q][1] == 32])
@pytest.mark.parametrize("blocks", [1, 9, 16, 18, 33])
def test_register_path_takes_any_block_count_and_row_count(
    kernel: Any, qtype: int, blocks: int
) -> None:
    # The register path converts the scales of 16 blocks at a time (a shorter run at a
    # row's end) and takes 4 rows at a time (2 for 3-4 tokens), one at a time at the end:
    # 13 rows leave one over either way; K=576 (18 blocks) is the default model's.
    rows, cols = 13, blocks * 32
    data = random_blocks(qtype, rows, cols, seed=qtype + blocks)
    gen = torch.Generator().manual_seed(blocks)
    for tokens in (1, 2, 3, 4):
        x = torch.randn(tokens, cols, generator=gen)
        want, scale = reference(data, qtype, x, kernel)
        out = torch.empty(tokens, rows)
        kernel.qmatmul(x, torch.from_numpy(data), qtype, out)
        assert (out - want).abs().le(REL_TOL * scale + 1e-6).all(), (tokens, qtype, blocks)


@pytest.mark.parametrize("qtype", [12, 14], ids=["Q4_K", "Q6_K"])
def test_wide_rows_in_panels_and_token_groups(kernel: Any, qtype: int) -> None:
    # K=8192 (a 3B model's FFN down projection): on AMX each 32-row chunk's tiles fill a
    # row panel alone and 32 tokens fill a token group, so 99 rows and 33-80 tokens take
    # several panels per thread and several groups per panel (quant_amx.h's amx_rows).
    rows, cols = 99, 8192
    data = random_blocks(qtype, rows, cols, seed=qtype + 7)
    gen = torch.Generator().manual_seed(qtype + 7)
    for tokens in (33, 80):
        x = torch.randn(tokens, cols, generator=gen)
        want, scale = reference(data, qtype, x, kernel)
        out = torch.empty(tokens, rows)
        kernel.qmatmul(x, torch.from_numpy(data), qtype, out)
        assert (out - want).abs().le(REL_TOL * scale + 1e-6).all(), (tokens, qtype)


@pytest.mark.parametrize("qtype", [30, 8], ids=["BF16", "Q8_0"])
def test_large_outputs_streamed_past_the_caches(kernel: Any, qtype: int) -> None:
    # On AMX an output of AMX_STREAM_OUTPUT_BYTES or more, on a 64-byte line with a row
    # stride of whole lines, is written with non-temporal stores, transposed in registers a
    # chunk of 32 rows at a time: 4,112 rows end on a partial chunk (written the other way)
    # and 261 tokens on a partial block of 16. The wider buffer's other columns must stay.
    if not kernel.AMX:
        pytest.skip(f"no AMX path in this build ({kernel.ISA}) or on this CPU")
    rows, cols, tokens = 4112, 64, 261
    assert tokens * rows * 4 >= kernel.AMX_STREAM_OUTPUT_BYTES
    blocks = random_blocks(qtype, rows, cols, seed=qtype + 11)
    gen = torch.Generator().manual_seed(qtype + 11)
    x = torch.randn(tokens, cols, generator=gen)
    want, scale = reference(blocks, qtype, x, kernel)
    whole = torch.empty(tokens, rows)
    wide = torch.full((tokens, rows + 32), float("nan"))
    view = wide[:, 16 : 16 + rows]  # starts on a line (16 floats in), stride 4,144 floats
    for out in (whole, view):
        kernel.qmatmul(x, torch.from_numpy(blocks), qtype, out)
        assert (out - want).abs().le(REL_TOL * scale + 1e-6).all(), (qtype, out.stride())
    assert wide[:, :16].isnan().all() and wide[:, 16 + rows :].isnan().all()


@pytest.mark.parametrize("offset", [0, 16], ids=["on a line", "off a line"])
def test_bf16_weights_on_and_off_a_cache_line(kernel: Any, offset: int) -> None:
    # On AMX, bf16 rows whose weight starts on a 64-byte line are read in place, whole
    # chunks of 32 at a time; elsewhere (and the last, partial chunk) they are copied.
    rows, cols = 67, 256
    blocks = random_blocks(30, rows, cols, seed=31)
    weight = placed(blocks, offset)
    gen = torch.Generator().manual_seed(31)
    for tokens in (5, 40):
        x = torch.randn(tokens, cols, generator=gen)
        want, scale = reference(blocks, 30, x, kernel)
        out = torch.empty(tokens, rows)
        kernel.qmatmul(x, weight, 30, out)
        assert (out - want).abs().le(REL_TOL * scale + 1e-6).all(), (tokens, offset)


def test_amx_rounds_the_tokens_for_bf16_weights_only(kernel: Any) -> None:
    # 1 + 2^-10 is no bf16 value (8-bit mantissa): rounded to nearest even it is 1. A bf16
    # weight of ones on the AMX tiles then sums exactly K; a Q8_0 weight keeps the split.
    if not rounds_tokens(kernel, quant_cpu.BF16, 16):
        pytest.skip("no AMX path in this build or on this CPU")
    rows, cols = 32, 64
    x = torch.full((16, cols), 1 + 2**-10)
    for qtype in (quant_cpu.BF16, 8):
        blocks = gguf.quants.quantize(
            np.ones((rows, cols), dtype=np.float32), gguf.GGMLQuantizationType(qtype)
        )
        out = torch.empty(16, rows)
        kernel.qmatmul(x, torch.from_numpy(blocks), qtype, out)
        want, scale = reference(blocks, qtype, x)  # x as it is
        if qtype == quant_cpu.BF16:
            assert out.eq(cols).all()
        else:
            assert (out - want).abs().le(REL_TOL * scale).all()


def test_bad_arguments_are_refused(kernel: Any) -> None:
    data = torch.from_numpy(random_blocks(3, 4, 64, seed=1))  # Q4_1, row_bytes 40
    out = torch.empty(1, 4)
    with pytest.raises(RuntimeError, match="not supported packed"):
        kernel.qmatmul(torch.randn(1, 64), data, 6, out)
    with pytest.raises(RuntimeError, match="not a multiple of the block length"):
        kernel.qmatmul(torch.randn(1, 48), data, 3, out)
    with pytest.raises(RuntimeError, match="weight rows hold 40 bytes"):
        kernel.qmatmul(torch.randn(1, 96), data, 3, out)
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernel.qmatmul(torch.randn(1, 64).double(), data, 3, out)


def test_packed_weight_merges_segments_and_adds_bias() -> None:
    cols = 64
    parts = [
        random_blocks(qtype, rows, cols, seed=rows) for qtype, rows in ((3, 8), (3, 4), (8, 5))
    ]
    packed = PackedWeight(17, cols)
    start = 0
    for qtype, blocks in zip((3, 3, 8), parts):
        packed.put(start, QuantTensor(qtype, torch.from_numpy(blocks), cols))
        start += blocks.shape[0]
    packed.finish()
    assert packed.type_names() == ["Q4_1", "Q8_0"]  # the two Q4_1 shards are one segment
    dense = torch.cat(
        [
            torch.from_numpy(gguf.quants.dequantize(b, gguf.GGMLQuantizationType(q)))
            for q, b in zip((3, 3, 8), parts)
        ]
    )
    torch.testing.assert_close(packed.dequantize(), dense)
    x, bias = torch.randn(3, cols), torch.randn(17)
    torch.testing.assert_close(packed.matmul(x, bias), x @ dense.T + bias, rtol=1e-4, atol=1e-4)
    got_bf16 = packed.matmul(x.bfloat16(), None)
    assert got_bf16.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="one type"):
        packed.rows_float(torch.tensor([0]))
    table = PackedWeight(12, cols)
    table.put(0, QuantTensor(3, torch.from_numpy(np.concatenate(parts[:2])), cols))
    ids = torch.tensor([11, 0, 9])
    torch.testing.assert_close(table.rows_float(ids), dense[ids])


def test_packed_weight_refuses_gaps() -> None:
    packed = PackedWeight(16, 32)
    packed.put(8, QuantTensor(8, torch.from_numpy(random_blocks(8, 8, 32, seed=0)), 32))
    with pytest.raises(ValueError, match=r"rows 0\.\.8 are missing"):
        packed.finish()
    with pytest.raises(ValueError, match="does not fit"):
        packed.put(12, QuantTensor(8, torch.from_numpy(random_blocks(8, 8, 32, seed=0)), 32))


def test_batched_path_under_inference_mode(kernel: Any) -> None:
    # The engine runs in inference mode; threads the kernel starts must not touch its
    # tensors through ATen ops (their own mode is off, so an in-place op raises).
    blocks = random_blocks(3, 300, 64, seed=2)
    with torch.inference_mode():
        x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
        out = torch.empty(9, 300)
        kernel.qmatmul(x, torch.from_numpy(blocks), 3, out)
    want, scale = reference(blocks, 3, x)
    assert (out - want).abs().le(REL_TOL * scale + 1e-6).all()

"""What int8 activations would buy the K-quants: issue 32's open decision, measured.

The packed kernels multiply the unpacked weights by float32 activations, so a result
equals the dequantized float32 model up to summation order (the issue's rule); for
Q4_K that unpacking, not memory, bounds a single token on a 2-core machine
(docs/weights.md). llama.cpp instead rounds each 256 activations to int8 with one scale
(its Q8_K) and multiplies the 4-bit quants by them with integer dot products
(``vpdpbusd``, 64 products an instruction). This probe is such a Q4_K x int8 product,
one token, written for AVX512-VNNI, timed against the engine's own register path on the
same weights from memory:

    python -m bench.micro.int8_activations [--shapes 5120x3072 3072x3072 16384x3072 3072x8192]
                                           [--working-set-mb 1024] [--rounds 3]

It is a measurement, not an engine path: nothing serves through it. Its result is
checked against the float64 product of the dequantized weights and the dequantized int8
activations (what the integer sums compute exactly), and its distance from the float32
activations' product is printed: the rounding int8 activations add.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.micro.bandwidth import read_bandwidth
from bench.micro.packed_gemv import random_weight
from engine.layers.cpu_kernels import build_lock
from engine.layers.quant_cpu import PACKED_TYPES, quant_kernel

Q4_K_BYTES = 144  # ggml's block_q4_K: d, dmin (fp16), 12 bytes of scales, 128 of quants
# The 32-value sub-blocks of a 256-value block in the order the probe reads activations:
# a 64-byte load of quants holds sub-blocks 2u, 2u + 2 in its low nibbles and 2u + 1,
# 2u + 3 in its high ones.
SUB_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

// y[n] = sum_k dequant(w[n])[k] * d8[k / 256] * q8[k] for Q4_K rows w [N, K / 256 * 144];
// q8 [K] int8 with each 256-value block's 32-value sub-blocks in SUB_ORDER; d8 [K / 256];
// bsum [K / 32] float: d8 times the sum of each sub-block's q8 (sub-blocks in order).
void q4k_int8_gemv(torch::Tensor q8, torch::Tensor d8, torch::Tensor bsum, torch::Tensor w,
                   torch::Tensor y) {
  const int64_t n_rows = w.size(0), row_bytes = w.size(1), blocks = row_bytes / 144;
  const int8_t* qa = q8.data_ptr<int8_t>();
  const float* da = d8.data_ptr<float>();
  const float* ba = bsum.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, n_rows, 8, [&](int64_t begin, int64_t end) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i pick[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
        _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
        _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)};
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = wp + n * row_bytes;
      const char* ahead = n + 8 < end ? reinterpret_cast<const char*>(row + 8 * row_bytes) : nullptr;
      __m512 acc = _mm512_setzero_ps();
      __m256 mins = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * 144;
        if (ahead != nullptr)
          for (int off = 0; off < 144; off += 64)
            asm volatile("prefetcht0 (%0)" : : "r"(ahead + b * 144 + off));
        // The 8 six-bit scales and mins of scale_min_k4 from three 32-bit words.
        uint32_t s[3];
        std::memcpy(s, blk + 4, 12);
        const uint32_t six = 0x3F3F3F3Fu, four = 0x0F0F0F0Fu, two = 0x03030303u;
        const uint64_t sc = (s[0] & six) | uint64_t((s[2] & four) | (((s[0] >> 6) & two) << 4)) << 32;
        const uint64_t mn = (s[1] & six) | uint64_t(((s[2] >> 4) & four) | (((s[1] >> 6) & two) << 4)) << 32;
        const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)) * da[b];
        const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc))));
        const __m512 scales = _mm512_castps256_ps512(_mm256_mul_ps(scf, _mm256_set1_ps(d)));
        const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn))));
        mins = _mm256_fmadd_ps(_mm256_mul_ps(mnf, _mm256_set1_ps(dmin)), _mm256_loadu_ps(ba + 8 * b), mins);
        const int8_t* a = qa + 256 * b;
        for (int half = 0; half < 2; ++half) {
          const __m512i q = _mm512_loadu_si512(blk + 16 + 64 * half);
          const __m512i lo = _mm512_and_si512(q, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
          const __m512i dlo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(a + 128 * half));
          const __m512i dhi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(a + 128 * half + 64));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo), _mm512_permutexvar_ps(pick[2 * half], scales), acc);
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), _mm512_permutexvar_ps(pick[2 * half + 1], scales), acc);
        }
      }
      alignas(32) float m8[8];
      _mm256_store_ps(m8, mins);
      float m = 0.f;
      for (float v : m8) m += v;
      out[n] = _mm512_reduce_add_ps(acc) - m;
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("q4k_int8_gemv", &q4k_int8_gemv); }
"""

_FLAGS = [
    "-O3",
    "-fopenmp",
    "-mavx2",
    "-mfma",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mf16c",
]


def probe_available() -> str | None:
    """Why the probe cannot run here (None: it can): it needs AVX512-VNNI."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        return "no /proc/cpuinfo to find AVX512-VNNI in"
    if " avx512_vnni" not in flags:
        return "this CPU has no AVX512-VNNI"
    return None


def load_probe() -> Any:
    """The probe's extension, built once (cached like the engine's kernels)."""
    from torch.utils import cpp_extension

    name = "hiserve_int8_probe"
    with build_lock(name):
        return cpp_extension.load_inline(
            name=name,
            cpp_sources=[_SOURCE],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [K]`` -> (int8 ``[K]`` in the probe's order, scales ``[K / 256]``, sub-block sums
    times their block's scale ``[K / 32]``): llama.cpp's Q8_K rounding (scale amax / 127,
    round to nearest)."""
    blocks = x.float().view(-1, 256)
    scale = blocks.abs().amax(dim=1) / 127  # [K / 256]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp(-127, 127).to(torch.int8)  # [K / 256, 256]
    sums = q.view(-1, 8, 32).sum(dim=2, dtype=torch.int32).float() * scale[:, None]  # [B, 8]
    ordered = q.view(-1, 8, 32)[:, list(SUB_ORDER)].reshape(-1).contiguous()
    return ordered, scale.contiguous(), sums.reshape(-1).contiguous()


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations the probe multiplies by (its int8 values times their float32
    scale), as float64 in the natural order."""
    q8, scale, _ = quantize_activations(x)
    natural = q8.view(-1, 8, 32)[:, torch.tensor(SUB_ORDER).argsort()].reshape(-1, 256)
    return (natural.double() * scale.double()[:, None]).reshape(-1)


def _timed(fn: Any, weights: list[torch.Tensor], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds + 1):  # the first pass warms up
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, time.perf_counter() - start)
    return sum(w.numel() for w in weights) / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["5120x3072", "3072x3072", "16384x3072", "3072x8192"]
    )
    parser.add_argument("--working-set-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    why = probe_available()
    if why is not None:
        raise SystemExit(f"the int8 probe cannot run here: {why}")
    kernel = quant_kernel()
    if kernel is None:
        raise SystemExit("the packed CPU kernel is not available here")
    torch.set_grad_enabled(False)
    probe = load_probe()
    qtype = next(q for q, (name, _, _) in PACKED_TYPES.items() if name == "Q4_K")
    read = read_bandwidth()
    print(
        f"Q4_K, one token, working set {args.working_set_mb} MB; read-only bandwidth "
        f"{read.best / 1e9:.1f} GB/s"
    )
    print(
        f"{'N x K':>11} {'float32 acts':>13} {'int8 acts':>10} {'int8/float':>10} "
        f"{'int8 vs float32 result':>23}"
    )
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        gen = torch.Generator().manual_seed(n * 7 + k)
        first = random_weight(qtype, n, k, gen)
        count = max(1, (args.working_set_mb << 20) // first.numel())
        weights = [first] + [random_weight(qtype, n, k, gen) for _ in range(count - 1)]
        x = torch.randn(1, k, generator=gen)
        q8, d8, bsum = quantize_activations(x[0])
        out_f, out_q = torch.empty(1, n), torch.empty(n)

        def float_call(w: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out_f) -> None:
            kernel.qmatmul(x, w, qtype, out)

        def int8_call(w: torch.Tensor, acts: Any = (q8, d8, bsum), out: Any = out_q) -> None:
            probe.q4k_int8_gemv(*acts, w, out)

        float_rate = _timed(float_call, weights, args.rounds)
        int8_rate = _timed(int8_call, weights, args.rounds)
        # The last weight's results: the probe against its exact product, then against
        # the float32 activations' product.
        dense = kernel.dequantize(weights[-1], qtype, k).double()  # [n, k]
        exact = dense @ dequantized_activations(x[0])
        error = float((out_q.double() - exact).abs().max() / exact.abs().max())
        assert error < 1e-4, f"{shape}: the probe's sums are off by {error:.2e}"
        gap = float((out_q - out_f[0]).abs().max() / out_f.abs().max())
        print(
            f"{shape:>11} {float_rate / 1e9:8.1f} GB/s {int8_rate / 1e9:5.1f} GB/s "
            f"{int8_rate / float_rate:9.2f}x {gap:22.1e}"
        )


if __name__ == "__main__":
    main()

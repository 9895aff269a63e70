// The register path of quant_cpu.cpp's qmatmul, for up to kGemvMax tokens (a decode
// step): each row's blocks dequantized in registers and multiplied into float32
// accumulators, rows split over the threads. Included by quant_cpu.cpp, not built alone.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "quant_unpack.h"

namespace hiserve_quant {

constexpr int kGemvMax = 4;           // the most tokens the register path takes
constexpr int64_t kPrefetchRows = 8;  // how far ahead the register path asks for rows

#if defined(__AVX512F__)
// Rows [n, n + R) of gemv_rows with AVX-512: each run of sub-blocks' scales converted
// once (run_scales: 16 blocks of the 32-weight types, one K-quant block), then each
// unit of sub-blocks (unpack_unit) unpacked into registers and multiplied into float32
// accumulators.
// R rows at a time: a row alone is bound by latencies (the scales at its start, its FMA
// chains, the sum across lanes at its end), which R independent rows hide from one
// another.
template <int Q, int M, int R>
inline void rows_in_registers(const float* x, int64_t xs, const uint8_t* w, int64_t row_bytes,
                              int64_t k_len, float* y, int64_t ys, int64_t n, int64_t n_end) {
  const int64_t blocks = k_len / block_len<Q>();
  const int64_t runs = (blocks * (block_len<Q>() / 32) + run_subs<Q>() - 1) / run_subs<Q>();
  SubScales scales[R];
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + (n + r) * row_bytes;
  // NOTE: the rows stream from memory once per step; the hardware prefetcher alone left
  // this loop waiting on them (5 GB/s of a 25 GB/s stream). Ask for the rows
  // kPrefetchRows ahead while these are unpacked, a run's bytes of each with each run:
  // asking for all of their lines at once (R x 27 for a 3072-wide Q4_K row) outran the
  // line fill buffers.
  const int64_t run_bytes = row_bytes / runs;
  const int ahead_rows = static_cast<int>(std::clamp<int64_t>(n_end - n - kPrefetchRows, 0, R));
  const char* ahead = ahead_rows > 0
                          ? reinterpret_cast<const char*>(w + (n + kPrefetchRows) * row_bytes)
                          : nullptr;
  __m512 acc[R][M][2];
  for (auto& row : acc)
    for (auto& token : row) token[0] = token[1] = _mm512_setzero_ps();
  for (int64_t run = 0; run < runs; ++run) {
    for (int r = 0; r < ahead_rows; ++r) {
      const char* p = ahead + r * row_bytes + run * run_bytes;
      prefetch_lines(p, 0, run_bytes);
    }
    int count = 0;
    for (int r = 0; r < R; ++r) count = run_scales<Q>(rows[r], run, blocks, scales[r]);
    for (int j = 0; j < count; j += unit_subs<Q>()) {
      const float* xk = x + (run * run_subs<Q>() + j) * 32;
      for (int r = 0; r < R; ++r) {
        __m512 v[2 * unit_subs<Q>()];
        run_unpack<Q>(rows[r], run, j, scales[r], v);
        for (int m = 0; m < M; ++m)
          for (int i = 0; i < 2 * unit_subs<Q>(); ++i)
            acc[r][m][i % 2] =
                _mm512_fmadd_ps(v[i], _mm512_loadu_ps(xk + m * xs + 16 * i), acc[r][m][i % 2]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      y[m * ys + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
}
#endif

// y[m, n] for tokens m < M and rows n in [n_begin, n_end): dequantized in registers.
template <int Q, int M>
void gemv_rows(const float* x, int64_t xs, const uint8_t* w, int64_t row_bytes, int64_t k_len,
               float* y, int64_t ys, int64_t n_begin, int64_t n_end) {
#if defined(__AVX512F__)
  constexpr int R = M <= 2 ? 4 : 2;  // rows at a time: R x M x 2 accumulators in registers
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R)
    rows_in_registers<Q, M, R>(x, xs, w, row_bytes, k_len, y, ys, n, n_end);
  for (; n < n_end; ++n) rows_in_registers<Q, M, 1>(x, xs, w, row_bytes, k_len, y, ys, n, n_end);
#else
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>();
  const int64_t blocks = k_len / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * row_bytes;
#if defined(__AVX2__) && defined(__FMA__)
    // NOTE: the rows stream from memory once per step; the hardware prefetcher alone
    // left this loop waiting on them (5 GB/s of a 25 GB/s stream). Ask for the row
    // kPrefetchRows ahead while this one is unpacked, a block's bytes with each block
    // (all of its lines at once outran the line fill buffers, as in rows_in_registers).
    const char* ahead = n + kPrefetchRows < n_end
                            ? reinterpret_cast<const char*>(row + kPrefetchRows * row_bytes)
                            : nullptr;
    {  // dequantized in registers, 32 weights at a time
      __m256 acc0[M], acc1[M];
      for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
      for (int64_t bi = 0; bi < blocks; ++bi) {
        if (ahead != nullptr) prefetch_lines(ahead, bi * kBytes, (bi + 1) * kBytes);
        for (int sub = 0; sub < kBlock / 32; ++sub) {
          __m256 v[4];
          dequant32_avx2<Q>(row + bi * kBytes, sub, v);
          const float* xk = x + bi * kBlock + sub * 32;
          for (int m = 0; m < M; ++m) {
            const float* xm = xk + m * xs;
            acc0[m] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xm), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xm + 8), acc1[m]);
            acc0[m] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xm + 16), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xm + 24), acc1[m]);
          }
        }
      }
      for (int m = 0; m < M; ++m) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_add_ps(acc0[m], acc1[m]));
        float s = 0.f;
        for (float lane : lanes) s += lane;
        y[m * ys + n] = s;
      }
    }
#else
    float buf[kBlock];
    float sum[M] = {};
    for (int64_t bi = 0; bi < blocks; ++bi) {
      dequant_block<Q>(row + bi * kBytes, buf);
      for (int m = 0; m < M; ++m) {
        const float* xk = x + m * xs + bi * kBlock;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < kBlock; ++i) s += buf[i] * xk[i];
        sum[m] += s;
      }
    }
    for (int m = 0; m < M; ++m) y[m * ys + n] = sum[m];
#endif
  }
#endif
}

template <int Q, int M>
void gemv(const float* x, int64_t xs, const uint8_t* w, int64_t row_bytes, int64_t n_len,
          int64_t k_len, float* y, int64_t ys) {
  // Grain: a call too small to pay for waking the other threads stays on this one.
  const int64_t grain = n_len * k_len < 65536 ? n_len : 8;
  at::parallel_for(0, n_len, grain, [&](int64_t begin, int64_t end) {
    gemv_rows<Q, M>(x, xs, w, row_bytes, k_len, y, ys, begin, end);
  });
}

}  // namespace hiserve_quant

// The packed matmul for a decode batch (5 to kFmaMaxTokens tokens) on AVX-512 CPUs
// without AMX (or with it switched off) and on AVX2 CPUs: y[M, N] = x[M, K] @ W[N, K]^T
// in float32.
// Included by quant_cpu.cpp, not built alone.
//
// Why: the chunked path (dequantize ~1 MB of rows to float32, then at::mm) writes and
// reads back every weight as float32 in every call, which at a batch of 8-64 costs more
// than the matmul itself (a 1536 x 576 Q4_1 weight: 0.6 ms at 8 tokens where a dense
// float32 matmul takes 0.23 ms). Here the dequantized rows never leave L1: each thread
// takes tiles of kFmaRows weight rows, dequantizes a K slice of them (12 rows x 256
// weights, 12 KB) with the register path's dequantize, and multiplies it into the
// tokens, a vector of them at a time (16 with AVX-512, 8 with AVX2): for each k, one load
// of x^T[k, those tokens] and one FMA per row with the row's weight broadcast. An
// accumulator holds y^T for one row and a vector of tokens, so no horizontal sums; each
// slice is summed apart and then added (float32, order aside the same as
// dequantize-then-matmul). The tokens pass once per slice per tile, so x^T ([K, M rounded
// up to a vector], zero-padded) is built once per call.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HISERVE_HAVE_FMA_TILES 1

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "quant_unpack.h"

namespace hiserve_quant {

constexpr int kFmaRows = 12;          // weight rows per tile: 12 accumulators + x's vector
constexpr int64_t kFmaSliceK = 256;   // weights per row per slice: 12 KB of rows in L1
constexpr int64_t kFmaMaxTokens = 128;  // beyond, the chunked at::mm path is about as fast

// The most tokens this path takes (kFmaMaxTokens; 0 turns it off): for comparisons.
inline std::atomic<int64_t>& fma_max_tokens() {
  static std::atomic<int64_t> limit{kFmaMaxTokens};
  return limit;
}

// One vector of tokens: 16 with AVX-512, 8 with AVX2.
#if defined(__AVX512F__)
using FmaVec = __m512;
constexpr int kFmaLanes = 16;
inline FmaVec fma_load(const float* p) { return _mm512_loadu_ps(p); }
inline void fma_store(float* p, FmaVec v) { _mm512_storeu_ps(p, v); }
inline FmaVec fma_zero() { return _mm512_setzero_ps(); }
inline FmaVec fma_splat(float v) { return _mm512_set1_ps(v); }
inline FmaVec fma_madd(FmaVec a, FmaVec b, FmaVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FmaVec fma_add(FmaVec a, FmaVec b) { return _mm512_add_ps(a, b); }
#else
using FmaVec = __m256;
constexpr int kFmaLanes = 8;
inline FmaVec fma_load(const float* p) { return _mm256_loadu_ps(p); }
inline void fma_store(float* p, FmaVec v) { _mm256_storeu_ps(p, v); }
inline FmaVec fma_zero() { return _mm256_setzero_ps(); }
inline FmaVec fma_splat(float v) { return _mm256_set1_ps(v); }
inline FmaVec fma_madd(FmaVec a, FmaVec b, FmaVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FmaVec fma_add(FmaVec a, FmaVec b) { return _mm256_add_ps(a, b); }
#endif

template <int Q>
void fma_matmul(const float* x, int64_t xs, int64_t m_len, const uint8_t* w, int64_t row_bytes,
                int64_t n_len, int64_t k_len, float* y, int64_t ys) {
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>(), kL = kFmaLanes;
  const int64_t m_pad = (m_len + kL - 1) / kL * kL, groups = m_pad / kL;
  const int64_t slice = std::max<int64_t>(kBlock, kFmaSliceK / kBlock * kBlock);
  std::vector<float> xt(static_cast<size_t>(k_len * m_pad), 0.f);  // [K, m_pad]
  for (int64_t m = 0; m < m_len; ++m)
    for (int64_t k = 0; k < k_len; ++k) xt[k * m_pad + m] = x[m * xs + k];
  const int64_t tiles = (n_len + kFmaRows - 1) / kFmaRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> rows_buf(static_cast<size_t>(kFmaRows * slice));
    std::vector<float> sums(static_cast<size_t>(groups * kFmaRows * kL));  // y^T per group
    float* buf = rows_buf.data();
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * kFmaRows, rows = std::min<int64_t>(kFmaRows, n_len - n0);
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t k0 = 0; k0 < k_len; k0 += slice) {
        const int64_t k_n = std::min(slice, k_len - k0);
        for (int r = 0; r < kFmaRows; ++r) {  // rows past the end multiply as zeros
          if (r < rows) {
            const uint8_t* row = w + (n0 + r) * row_bytes;
            for (int64_t bi = k0 / kBlock; bi < (k0 + k_n) / kBlock; ++bi)
              dequant_block_to<Q>(row + bi * kBytes, buf + r * slice + bi * kBlock - k0);
          } else {
            std::fill(buf + r * slice, buf + r * slice + k_n, 0.f);
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          FmaVec acc[kFmaRows];
          for (int r = 0; r < kFmaRows; ++r) acc[r] = fma_zero();
          const float* xg = xt.data() + k0 * m_pad + g * kL;
          for (int64_t kk = 0; kk < k_n; ++kk) {
            const FmaVec xv = fma_load(xg + kk * m_pad);
            for (int r = 0; r < kFmaRows; ++r)
              acc[r] = fma_madd(fma_splat(buf[r * slice + kk]), xv, acc[r]);
          }
          float* s = sums.data() + g * kFmaRows * kL;
          for (int r = 0; r < kFmaRows; ++r)
            fma_store(s + r * kL, fma_add(fma_load(s + r * kL), acc[r]));
        }
      }
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t lane = 0; lane < kL && g * kL + lane < m_len; ++lane)
            y[(g * kL + lane) * ys + n0 + r] = sums[(g * kFmaRows + r) * kL + lane];
    }
  });
}

}  // namespace hiserve_quant

#endif  // HISERVE_HAVE_FMA_TILES

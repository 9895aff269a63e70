// The packed matmul for a decode batch (5 to kFmaMaxTokens tokens) on AVX-512 CPUs
// without AMX, or with it switched off: y[M, N] = x[M, K] @ W[N, K]^T in float32.
// Included by quant_cpu.cpp, not built alone.
//
// Why: the chunked path (dequantize ~1 MB of rows to float32, then at::mm) writes and
// reads back every weight as float32 in every call, which at a batch of 8-64 costs more
// than the matmul itself (a 1536 x 576 Q4_1 weight: 0.6 ms at 8 tokens where a dense
// float32 matmul takes 0.23 ms). Here the dequantized rows never leave L1: each thread
// takes tiles of kFmaRows weight rows, dequantizes a K slice of them (12 rows x 256
// weights, 12 KB) with the register path's dequant32, and multiplies it into the tokens,
// 16 tokens a vector: for each k, one load of x^T[k, 16 tokens] and one FMA per row with
// the row's weight broadcast. An accumulator holds y^T for one row and 16 tokens, so no
// horizontal sums; each slice is summed apart and then added (float32, order aside the
// same as dequantize-then-matmul). The tokens pass once per slice per tile, so x^T
// ([K, M rounded up to 16], zero-padded) is built once per call.
#pragma once

#if defined(__AVX512F__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"

namespace hiserve_quant {

constexpr int kFmaRows = 12;          // weight rows per tile: 12 accumulators + x's vector
constexpr int64_t kFmaSliceK = 256;   // weights per row per slice: 12 KB of rows in L1
constexpr int64_t kFmaMaxTokens = 128;  // beyond, the chunked at::mm path is about as fast

// The most tokens this path takes (kFmaMaxTokens; 0 turns it off): for comparisons.
inline std::atomic<int64_t>& fma_max_tokens() {
  static std::atomic<int64_t> limit{kFmaMaxTokens};
  return limit;
}

template <int Q>
void fma_matmul(const float* x, int64_t xs, int64_t m_len, const uint8_t* w, int64_t row_bytes,
                int64_t n_len, int64_t k_len, float* y, int64_t ys) {
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>();
  const int64_t m_pad = (m_len + 15) / 16 * 16, groups = m_pad / 16;
  const int64_t slice = std::max<int64_t>(kBlock, kFmaSliceK / kBlock * kBlock);
  std::vector<float> xt(static_cast<size_t>(k_len * m_pad), 0.f);  // [K, m_pad]
  for (int64_t m = 0; m < m_len; ++m)
    for (int64_t k = 0; k < k_len; ++k) xt[k * m_pad + m] = x[m * xs + k];
  const int64_t tiles = (n_len + kFmaRows - 1) / kFmaRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> rows_buf(static_cast<size_t>(kFmaRows * slice));
    std::vector<float> sums(static_cast<size_t>(groups * kFmaRows * 16));  // y^T per group
    float* buf = rows_buf.data();
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * kFmaRows, rows = std::min<int64_t>(kFmaRows, n_len - n0);
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t k0 = 0; k0 < k_len; k0 += slice) {
        const int64_t k_n = std::min(slice, k_len - k0);
        for (int r = 0; r < kFmaRows; ++r) {  // rows past the end multiply as zeros
          float* dst = buf + r * slice;
          if (r >= rows) {
            std::fill(dst, dst + k_n, 0.f);
            continue;
          }
          const uint8_t* row = w + (n0 + r) * row_bytes;
          for (int64_t bi = k0 / kBlock; bi < (k0 + k_n) / kBlock; ++bi)
            for (int sub = 0; sub < kBlock / 32; ++sub) {
              __m512 lo, hi;
              dequant32<Q>(row + bi * kBytes, sub, lo, hi);
              float* out = dst + bi * kBlock - k0 + sub * 32;
              _mm512_storeu_ps(out, lo);
              _mm512_storeu_ps(out + 16, hi);
            }
        }
        for (int64_t g = 0; g < groups; ++g) {
          __m512 acc[kFmaRows];
          for (int r = 0; r < kFmaRows; ++r) acc[r] = _mm512_setzero_ps();
          const float* xg = xt.data() + k0 * m_pad + g * 16;
          for (int64_t kk = 0; kk < k_n; ++kk) {
            const __m512 xv = _mm512_loadu_ps(xg + kk * m_pad);
            for (int r = 0; r < kFmaRows; ++r)
              acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(buf[r * slice + kk]), xv, acc[r]);
          }
          float* s = sums.data() + g * kFmaRows * 16;
          for (int r = 0; r < kFmaRows; ++r)
            _mm512_storeu_ps(s + r * 16, _mm512_add_ps(_mm512_loadu_ps(s + r * 16), acc[r]));
        }
      }
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t lane = 0; lane < 16 && g * 16 + lane < m_len; ++lane)
            y[(g * 16 + lane) * ys + n0 + r] = sums[(g * kFmaRows + r) * 16 + lane];
    }
  });
}

}  // namespace hiserve_quant

#endif  // __AVX512F__

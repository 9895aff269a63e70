// Values into and out of the layouts of the AMX tiles, for quant_amx.h's matmul: float32
// tokens split into high and low bf16 parts in the tiles' (k, k+1) pair layout, and a
// chunk's float32 results out to y (plain, or through SwiGLU), both by 16 x 16 dword
// transposes in registers. Included by quant_amx.h, not built alone.
#pragma once

#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) || __GNUC__ >= 11)
#define HISERVE_HAVE_AMX 1

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

#define HISERVE_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

namespace hiserve_quant {

// 16 floats -> (their bf16, the bf16 of what that leaves), round to nearest even.
HISERVE_AMX_TARGET inline void split_bf16(__m512 v, __m256i& hi, __m256i& lo) {
  hi = (__m256i)_mm512_cvtneps_pbh(v);
  const __m512 back = bf16x16_to_ps(hi);
  lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
}

// Token blocks [b0, b1) of x [M, K] (row stride xs) -> hi and lo B tiles: for each block
// of 16 tokens, K/2 rows of 16 (token) x 2 (k, k+1) bf16; tokens past M are zero. With
// ``lo`` null the tokens are only rounded to bf16 (to nearest even) into ``hi``.
// A (k, k+1) pair is one dword, so 16 tokens x 32 k is a 16 x 16 dword transpose.
// NOTE: scattering each token's 16 dwords into their rows instead was 13% of a bf16
// prefill of 4,096 tokens (perf, 2026-12-06).
HISERVE_AMX_TARGET inline void pack_tokens(const float* x, int64_t xs, int64_t m_len,
                                           int64_t k_len, int64_t b0, int64_t b1,
                                           uint16_t* hi, uint16_t* lo) {
  for (int64_t mb = b0; mb < b1; ++mb) {
    uint16_t* hb = hi + mb * (k_len / 2) * 32;
    uint16_t* lb = lo == nullptr ? nullptr : lo + mb * (k_len / 2) * 32;
    for (int64_t k = 0; k < k_len; k += 32) {
      __m512i h[16], l[16];
      for (int t = 0; t < 16; ++t) {
        const int64_t m = mb * 16 + t;
        if (m >= m_len) {
          h[t] = l[t] = _mm512_setzero_si512();
          continue;
        }
        const __m512 x0 = _mm512_loadu_ps(x + m * xs + k);
        const __m512 x1 = _mm512_loadu_ps(x + m * xs + k + 16);
        if (lo == nullptr) {  // rounded only: the pair of halves is one conversion
          h[t] = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
          continue;
        }
        __m256i h0, l0, h1, l1;
        split_bf16(x0, h0, l0);
        split_bf16(x1, h1, l1);
        h[t] = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
        l[t] = _mm512_inserti64x4(_mm512_castsi256_si512(l0), l1, 1);
      }
      transpose16_epi32(h);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(hb + (k / 2 + j) * 32, h[j]);
      if (lo == nullptr) continue;
      transpose16_epi32(l);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(lb + (k / 2 + j) * 32, l[j]);
    }
  }
}

// One chunk's results for a block of tokens, c ([row block][16 rows][16 tokens]), to
// y[token][32 rows] (row stride ys): each row block is transposed in registers. With
// ``stream`` the lines go straight to memory (non-temporal stores): a large output
// would leave the caches anyway, and a normal store first reads every line it writes.
// NOTE: streaming made a 4,096-token bf16 prefill 8% faster (1.39 -> 1.28 s, 2026-12-06).
HISERVE_AMX_TARGET inline void store_chunk(const float* c, int64_t toks, float* y, int64_t ys,
                                           bool stream) {
  for (int rb = 0; rb < 2; ++rb) {
    __m512i v[16];
    for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(c + rb * 256 + r * 16);
    transpose16_epi32(v);
    for (int64_t t = 0; t < toks; ++t) {
      float* out = y + t * ys + rb * 16;
      if (stream)
        _mm512_stream_ps(out, _mm512_castsi512_ps(v[t]));
      else
        _mm512_storeu_ps(out, _mm512_castsi512_ps(v[t]));
    }
  }
}

// A SwiGLU chunk's results for a block of tokens, c ([gate, up][16 rows][16 tokens]), to
// y[token][cols] (cols <= 16) as silu(gate) * up, the arithmetic of fused_ops.h's
// silu_mul (the same floats as multiplying, then applying it).
HISERVE_AMX_TARGET inline void store_swiglu(const float* c, int64_t toks, int64_t cols,
                                            float* y, int64_t ys, bool stream) {
  __m512i g[16], u[16];
  for (int r = 0; r < 16; ++r) {
    g[r] = _mm512_load_si512(c + r * 16);
    u[r] = _mm512_load_si512(c + 256 + r * 16);
  }
  transpose16_epi32(g);
  transpose16_epi32(u);
  for (int64_t t = 0; t < toks; ++t) {
    float* out = y + t * ys;
    if (cols == 16) {
      const __m512 v = silu_mul16(_mm512_castsi512_ps(g[t]), _mm512_castsi512_ps(u[t]));
      if (stream)
        _mm512_stream_ps(out, v);
      else
        _mm512_storeu_ps(out, v);
      continue;
    }
    alignas(64) float gs[16], us[16];
    _mm512_store_si512(gs, g[t]);
    _mm512_store_si512(us, u[t]);
    for (int64_t r = 0; r < cols; ++r) out[r] = gs[r] / (1.f + std::exp(-gs[r])) * us[r];
  }
}

// A swiglu chunk's results for token block mb (c as in store_swiglu; 16 full columns,
// n0 the first) straight into the next product's token tiles: th (and tl, the low parts,
// unless null) in pack_tokens' layout for K = i_len, so silu(gate) * up never goes to
// memory as float32. A column pair (k, k+1) of 16 tokens is one tile row of 16 dwords, the
// two bf16 in each dword, rounded as pack_tokens rounds; the bits equal packing the
// float32 result (tokens past M come out zero: their products are).
HISERVE_AMX_TARGET inline void store_swiglu_tiles(const float* c, int64_t n0, int64_t i_len,
                                                  int64_t mb, uint16_t* th, uint16_t* tl) {
  const int64_t at = mb * (i_len / 2) * 32 + (n0 / 2) * 32;
  const auto pair = [](__m256i a, __m256i b) {  // bf16 a[t] | b[t] << 16, per token
    return _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  };
  for (int r = 0; r < 16; r += 2) {
    const __m512 v0 = silu_mul16(_mm512_load_ps(c + r * 16), _mm512_load_ps(c + 256 + r * 16));
    const __m512 v1 =
        silu_mul16(_mm512_load_ps(c + (r + 1) * 16), _mm512_load_ps(c + 256 + (r + 1) * 16));
    if (tl == nullptr) {
      const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(v0), h1 = (__m256i)_mm512_cvtneps_pbh(v1);
      _mm512_store_si512(th + at + (r / 2) * 32, pair(h0, h1));
      continue;
    }
    __m256i h0, l0, h1, l1;
    split_bf16(v0, h0, l0);
    split_bf16(v1, h1, l1);
    _mm512_store_si512(th + at + (r / 2) * 32, pair(h0, h1));
    _mm512_store_si512(tl + at + (r / 2) * 32, pair(l0, l1));
  }
}

}  // namespace hiserve_quant

#endif

// Vector math and memory hints shared by the CPU kernels in this directory (included,
// not built alone).
// NOTE: cpu_kernels.NativeExtension hashes every header here into each extension's name,
// so a change to this file rebuilds the kernels that include it.
#pragma once

#include <cstdint>

// Ask for the lines of bytes [begin, end) of p, into L1 or (kToL2) only as far as L2.
// NOTE: inline asm, not _mm_prefetch: GCC deleted a loop of nothing but prefetch
// builtins as one with no effect (amx_rows' weight prefetch was absent from the built
// kernel, and measured as no change, until it was written this way).
template <bool kToL2 = false>
static inline void prefetch_lines(const void* p, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  for (int64_t off = begin; off < end; off += 64) {
    if constexpr (kToL2)
      asm volatile("prefetcht1 (%0)" : : "r"(static_cast<const char*>(p) + off));
    else
      asm volatile("prefetcht0 (%0)" : : "r"(static_cast<const char*>(p) + off));
  }
#else  // the builtin, which the compiler may drop from a loop of nothing else
  for (int64_t off = begin; off < end; off += 64)
    __builtin_prefetch(static_cast<const char*>(p) + off, 0, kToL2 ? 2 : 3);
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>

// The first min(n, 16) of 16 lanes (n >= 0): a row's tail of fewer than 16 values.
static inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 bf16 values (their bits) as float32: a bf16 is the top half of a float32.
static inline __m512 bf16x16_to_ps(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 Taylor
// polynomial (relative error < 2e-7 there), times 2^n built in the exponent bits.
// Inputs are clamped to [-87, 88], where 2^n stays a normal float.
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts (Cody-Waite) so r keeps its low bits.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// SwiGLU for 16 lanes: silu(g) * u = g / (1 + exp(-g)) * u.
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

// The sums of the 16 lanes of each of a[0..7], in order: three rounds of pairwise adds
// across registers instead of eight separate reductions.
static inline __m256 sum_lanes8(const __m512 a[8]) {
  __m512 p[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  // per 128-bit lane l: lane l's sums of a0..a3 (q0) and of a4..a7 (q1)
  const __m512 q0 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(
                                      _mm512_castps_pd(p[0]), _mm512_castps_pd(p[1]))),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(
                                      _mm512_castps_pd(p[0]), _mm512_castps_pd(p[1]))));
  const __m512 q1 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(
                                      _mm512_castps_pd(p[2]), _mm512_castps_pd(p[3]))),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(
                                      _mm512_castps_pd(p[2]), _mm512_castps_pd(p[3]))));
  // [q0 L0+L2, q0 L1+L3, q1 L0+L2, q1 L1+L3], then lanes 0+1 and 2+3
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_castps512_ps256(w);
}

// r[0..15], 16 rows of 16 dwords -> their transpose: within 128-bit lanes, then the lanes.
static inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c], 128-bit lane l: column 4l + c of rows 4g..4g+3.
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i lo01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i hi01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i lo23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(lo01, hi01, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(lo01, hi01, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(lo23, hi23, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(lo23, hi23, 0xDD);
  }
}

// The same for 16 rows of 16 floats.
static inline void transpose16_ps(__m512 r[16]) {
  __m512i* bits = reinterpret_cast<__m512i*>(r);
  transpose16_epi32(bits);
}
#endif

// GGUF block formats (ggml's block_q4_0 ... block_q6_K, and plain bf16 taken 32 weights
// at a time): sizes, the scalar reference of a block to float32, and a 32-weight
// sub-block to float32 with AVX2 (AVX-512's unpacking is in quant_unpack.h). Included
// through quant_unpack.h by the packed-weight kernels, not built alone.
// NOTE: cpu_kernels.NativeExtension hashes every header here into each extension's name.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace hiserve_quant {

// ggml type ids (GGMLQuantizationType).
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kBF16 = 30;  // plain bfloat16 weights, taken 32 at a time as one "block"

template <int Q>
constexpr int block_len() {  // weights per block
  return (Q == kQ4_K || Q == kQ5_K || Q == kQ6_K) ? 256 : 32;
}

template <int Q>
constexpr int block_bytes() {
  return Q == kQ4_0 ? 18 : Q == kQ4_1 ? 20 : Q == kQ8_0 ? 34 : Q == kQ4_K ? 144
       : Q == kQ5_K ? 176 : Q == kBF16 ? 64 : 210;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the portable form is a dozen per block scale
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block, from its 12 packed bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One block -> block_len<Q>() floats (the scalar reference, and the fallback path).
template <int Q>
void dequant_block(const uint8_t* b, float* out) {
  if constexpr (Q == kBF16) {
    for (int i = 0; i < 32; ++i) {
      uint16_t bits;
      std::memcpy(&bits, b + 2 * i, 2);
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;
      std::memcpy(out + i, &wide, 4);
    }
  } else if constexpr (Q == kQ8_0) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const float d = half_at(b);
    const float m = Q == kQ4_1 ? half_at(b + 2) : -8.f * d;
    const uint8_t* qs = b + (Q == kQ4_1 ? 4 : 2);
    for (int l = 0; l < 16; ++l) {
      out[l] = d * static_cast<float>(qs[l] & 15) + m;
      out[l + 16] = d * static_cast<float>(qs[l] >> 4) + m;
    }
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K only: the fifth bit of each weight
    const uint8_t* qs = b + (Q == kQ5_K ? 48 : 16);
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      scale_min_k4(scales, s, sc, mn);
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + 32 * (s / 2);
      const int shift = (s & 1) * 4;
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 15;
        if constexpr (Q == kQ5_K) v |= ((qh[l] >> s) & 1) << 4;
        out[32 * s + l] = ds * static_cast<float>(v) - dm;
      }
    }
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int t = 0; t < 8; ++t) {
      const int h = t / 4, u = t % 4;
      const uint8_t* lo = ql + 64 * h + 32 * (u % 2);
      const uint8_t* hi = qh + 32 * h;
      for (int l = 0; l < 32; ++l) {
        const int v = ((lo[l] >> (4 * (u / 2))) & 15) | (((hi[l] >> (2 * u)) & 3) << 4);
        out[32 * t + l] = d * static_cast<float>(sc[2 * t + l / 16]) * static_cast<float>(v - 32);
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 builds: sub-block ``sub`` (32 weights) of block ``b`` into v[0..3] (8 weights each),
// the same arithmetic as unpack_unit (quant_unpack.h).
inline __m256i widen8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Where a whole block goes to memory (the FMA tiles, the chunked path), Q4_K and Q5_K
// are faster through dequant_block, which the compiler vectorizes with its shifts
// unrolled (3072 x 1024, 32 tokens: 1.7 against 2.5 ms); into registers, this is faster.
template <int Q>
constexpr bool avx2_whole_block() {
  return Q == kQ4_K || Q == kQ5_K;
}

template <int Q>
inline void dequant32_avx2(const uint8_t* b, int sub, __m256 v[4]) {
  const __m256i low4 = _mm256_set1_epi32(15);
  if constexpr (Q == kBF16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(b);
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + i)), 16));
  } else if constexpr (Q == kQ8_0) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const float df = half_at(b);
    const __m256 d = _mm256_set1_ps(df);
    const __m256 m = _mm256_set1_ps(Q == kQ4_1 ? half_at(b + 2) : -8.f * df);
    const uint8_t* qs = b + (Q == kQ4_1 ? 4 : 2);
    const __m256i q0 = widen8_u8(qs), q1 = widen8_u8(qs + 8);
    v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low4)), d, m);
    v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low4)), d, m);
    v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), d, m);
    v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), d, m);
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    int sc, mn;
    scale_min_k4(b + 4, sub, sc, mn);
    const __m256 ds = _mm256_set1_ps(half_at(b) * static_cast<float>(sc));
    const __m256 neg_dm = _mm256_set1_ps(-half_at(b + 2) * static_cast<float>(mn));
    const uint8_t* q = b + (Q == kQ5_K ? 48 : 16) + 32 * (sub / 2);
    const __m128i shift = _mm_cvtsi32_si128((sub & 1) * 4);
    for (int i = 0; i < 4; ++i) {
      __m256i vi = _mm256_and_si256(_mm256_srl_epi32(widen8_u8(q + 8 * i), shift), low4);
      if constexpr (Q == kQ5_K) {
        const __m256i bit = _mm256_and_si256(
            _mm256_srl_epi32(widen8_u8(b + 16 + 8 * i), _mm_cvtsi32_si128(sub)), _mm256_set1_epi32(1));
        vi = _mm256_or_si256(vi, _mm256_slli_epi32(bit, 4));
      }
      v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vi), ds, neg_dm);
    }
  } else {  // Q6_K
    const int h = sub / 4, u = sub % 4;
    const uint8_t* ql = b + 64 * h + 32 * (u % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    const __m128i lshift = _mm_cvtsi32_si128(4 * (u / 2)), hshift = _mm_cvtsi32_si128(2 * u);
    for (int i = 0; i < 4; ++i) {
      const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(widen8_u8(ql + 8 * i), lshift), low4);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(widen8_u8(qh + 8 * i), hshift), three);
      const __m256i vi = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
      const float scale = d * static_cast<float>(sc[2 * sub + i / 2]);
      v[i] = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(vi));
    }
  }
}
#endif

}  // namespace hiserve_quant

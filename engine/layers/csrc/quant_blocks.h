// GGUF block formats (ggml's block_q4_0 ... block_q6_K, and plain bf16 taken 32 weights
// at a time): sizes, and a block (or a 32-weight sub-block, with AVX-512 or AVX2) to
// float32. Included by the packed-weight kernels (quant_cpu.cpp, quant_amx.h,
// quant_fma.h), not built alone.
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
// the same arithmetic as unpack32 below.
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

#if defined(__AVX512F__)
// 16 bytes -> 16 int32 lanes.
inline __m512i widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512 to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }

// 0, 1, ..., 15 as floats.
inline __m512 iota16() {
  return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                        14.f, 15.f);
}

// The 16 values a 4-bit quant can dequantize to, scale * q + offset for q = 0..15: the
// same fused multiply-add as converting each quant and scaling it, so the same floats.
// NOTE: a block's (or sub-block's) weights are then picked from this table by vpermps,
// which reads only the low 4 bits of each lane: no mask and no int-to-float conversion
// per weight (two of the five vector instructions that unpacked 16 weights).
inline __m512 nibble_table(__m512 scale, __m512 offset) {
  return _mm512_fmadd_ps(iota16(), scale, offset);
}

// Weights 0..15 (the low nibbles of 16 bytes widened to lanes) and 16..31 (the high ones).
inline void nibbles_from_table(__m512i bytes, __m512 table, __m512& lo, __m512& hi) {
  lo = _mm512_permutexvar_ps(bytes, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

// The scales of a run of sub-blocks, as floats: for Q4_0/Q4_1/Q8_0 (a run is up to 16
// blocks), scale[j] = d and offset[j] = what is added to each weight (Q4_1's m, Q4_0's
// -8d) of block j; for Q4_K/Q5_K (a run is one block), scale[s] = d * sc and offset[s] =
// -dmin * m of sub-block s; for Q6_K, scale[t] = d * sc[t] of each 16 weights.
struct SubScales {
  alignas(64) float scale[16];
  alignas(64) float offset[16];
};

// 32-weight sub-blocks per run: the 32-weight types' scales are gathered 16 blocks at a
// time; a K-quant block's 8 sub-blocks share one set of scale bytes.
template <int Q>
constexpr int run_subs() {
  return block_len<Q>() == 32 ? 16 : 8;
}

// The scales of ``count`` (1..16) consecutive 32-weight blocks from ``blk``.
// NOTE: one gather of each block's first four bytes and one 16-wide conversion replace a
// scalar fp16 load, conversion and broadcast per scale per block, which were half of the
// register path's vector instructions for these types.
template <int Q>
inline void block_scales16(const uint8_t* blk, int count, SubScales& s) {
  if constexpr (Q == kBF16) return;  // no scales
  constexpr int kBytes = block_bytes<Q>();
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(kBytes));
  const __mmask16 live = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, blk, 1);
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
  _mm512_store_ps(s.scale, d);
  if constexpr (Q == kQ4_1)
    _mm512_store_ps(s.offset, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))));
  else if constexpr (Q == kQ4_0)
    _mm512_store_ps(s.offset, _mm512_mul_ps(_mm512_set1_ps(-8.f), d));
}

// The scales of one K-quant block.
template <int Q>
inline void kquant_scales(const uint8_t* b, SubScales& s) {
  if constexpr (Q == kQ6_K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    _mm512_store_ps(s.scale, _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)),
                                           to_float(_mm512_cvtepi8_epi32(sc))));
  } else {
    // The 8 six-bit scales and mins (scale_min_k4's layout) from the 12 bytes as three
    // 32-bit words a, b, c (bytes 0-3, 4-7, 8-11), four sub-blocks a word:
    //   scales 0-3 = a & 63, scales 4-7 = (c & 15) | (a >> 6) << 4 (byte by byte),
    //   mins   0-3 = b & 63, mins   4-7 = (c >> 4 & 15) | (b >> 6) << 4.
    // NOTE: the loop over scale_min_k4 was about half of a Q4_K row's instructions (9.6
    // GB/s against Q4_1's 16.7 from memory); these are a dozen word operations.
    uint32_t w[3];
    std::memcpy(w, b + 4, 12);
    constexpr uint32_t kSix = 0x3F3F3F3Fu, kFour = 0x0F0F0F0Fu, kTwo = 0x03030303u;
    const uint64_t sc = (w[0] & kSix) |
                        uint64_t((w[2] & kFour) | (((w[0] >> 6) & kTwo) << 4)) << 32;
    const uint64_t mn = (w[1] & kSix) |
                        uint64_t(((w[2] >> 4) & kFour) | (((w[1] >> 6) & kTwo) << 4)) << 32;
    const auto widen8 = [](uint64_t bytes) {  // 8 bytes -> 8 float lanes
      const __m128i v = _mm_cvtsi64_si128(static_cast<int64_t>(bytes));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    };
    _mm256_store_ps(s.scale, _mm256_mul_ps(_mm256_set1_ps(half_at(b)), widen8(sc)));
    _mm256_store_ps(s.offset, _mm256_mul_ps(_mm256_set1_ps(-half_at(b + 2)), widen8(mn)));
  }
}

// Sub-block ``sub`` (32 weights) of block ``b`` into lo (weights 0..15) and hi (16..31),
// with its scales at scale[i] and offset[i] (i = sub for the K-quants; the 32-weight
// types' caller points them at the block's own).
template <int Q>
inline void unpack32(const uint8_t* b, int sub, const float* scale, const float* offset,
                     __m512& lo, __m512& hi) {
  const __m512i low4 = _mm512_set1_epi32(15);
  if constexpr (Q == kBF16) {  // bf16 is the top half of a float32
    const __m256i* p = reinterpret_cast<const __m256i*>(b);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1)), 16));
  } else if constexpr (Q == kQ8_0) {
    const __m512 d = _mm512_set1_ps(scale[0]);
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    lo = _mm512_mul_ps(d, to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const __m512 table = nibble_table(_mm512_set1_ps(scale[0]), _mm512_set1_ps(offset[0]));
    nibbles_from_table(widen_u8(b + (Q == kQ4_1 ? 4 : 2)), table, lo, hi);
  } else if constexpr (Q == kQ4_K) {
    const __m512 table = nibble_table(_mm512_set1_ps(scale[sub]), _mm512_set1_ps(offset[sub]));
    const uint8_t* q = b + 16 + 32 * (sub / 2);
    const int shift = (sub & 1) * 4;  // vpermps reads the 4 bits this brings down
    lo = _mm512_permutexvar_ps(_mm512_srli_epi32(widen_u8(q), shift), table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(widen_u8(q + 16), shift), table);
  } else if constexpr (Q == kQ5_K) {
    const __m512 ds = _mm512_set1_ps(scale[sub]), neg_dm = _mm512_set1_ps(offset[sub]);
    // The 32 values of a 5-bit quant in two tables; vpermt2ps reads 5 index bits: the
    // nibble (bits 0-3) and the fifth bit from qh, rotated from bit ``sub`` to bit 4.
    const __m512 t0 = nibble_table(ds, neg_dm);
    const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(iota16(), _mm512_set1_ps(16.f)), ds, neg_dm);
    const uint8_t* q = b + 48 + 32 * (sub / 2);
    const uint8_t* qh = b + 16;
    const int shift = (sub & 1) * 4;
    const __m512i rot = _mm512_set1_epi32((4 - sub) & 31);
    const auto index = [&](int half) {  // (nibble & 15) | (fifth bit at bit 4), bits above ignored
      return _mm512_ternarylogic_epi32(_mm512_srli_epi32(widen_u8(q + 16 * half), shift),
                                       _mm512_rolv_epi32(widen_u8(qh + 16 * half), rot), low4,
                                       0xE4);  // (a & c) | (b & ~c)
    };
    lo = _mm512_permutex2var_ps(t0, index(0), t1);
    hi = _mm512_permutex2var_ps(t0, index(1), t1);
  } else {  // Q6_K
    const int h = sub / 4, u = sub % 4;
    const uint8_t* ql = b + 64 * h + 32 * (u % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const __m512i three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
    const int lshift = 4 * (u / 2), hshift = 2 * u;
    const __m512i v0 = _mm512_sub_epi32(_mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(widen_u8(ql), lshift), low4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen_u8(qh), hshift), three), 4)), bias);
    const __m512i v1 = _mm512_sub_epi32(_mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(widen_u8(ql + 16), lshift), low4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen_u8(qh + 16), hshift), three), 4)), bias);
    lo = _mm512_mul_ps(_mm512_set1_ps(scale[2 * sub]), to_float(v0));
    hi = _mm512_mul_ps(_mm512_set1_ps(scale[2 * sub + 1]), to_float(v1));
  }
}

// The scales of run ``run`` of a row (see run_subs) into s; returns its sub-blocks.
template <int Q>
inline int run_scales(const uint8_t* row, int64_t run, int64_t blocks, SubScales& s) {
  if constexpr (block_len<Q>() == 32) {
    const int count = static_cast<int>(blocks - run * 16 < 16 ? blocks - run * 16 : 16);
    block_scales16<Q>(row + run * 16 * block_bytes<Q>(), count, s);
    return count;
  } else {
    kquant_scales<Q>(row + run * block_bytes<Q>(), s);
    return 8;
  }
}

// Sub-block j of run ``run`` of a row, with the run's scales.
template <int Q>
inline void run_unpack(const uint8_t* row, int64_t run, int j, const SubScales& s, __m512& lo,
                       __m512& hi) {
  if constexpr (block_len<Q>() == 32) {
    unpack32<Q>(row + (run * 16 + j) * block_bytes<Q>(), 0, s.scale + j, s.offset + j, lo, hi);
  } else {
    unpack32<Q>(row + run * block_bytes<Q>(), j, s.scale, s.offset, lo, hi);
  }
}

// The scales of one block of any type, for unpack32(b, sub, s.scale, s.offset, ...) of
// each of its sub-blocks.
template <int Q>
inline void block_scales(const uint8_t* b, SubScales& s) {
  if constexpr (block_len<Q>() != 32) {
    kquant_scales<Q>(b, s);
  } else if constexpr (Q != kBF16) {
    s.scale[0] = half_at(b);
    s.offset[0] = Q == kQ4_1 ? half_at(b + 2) : -8.f * s.scale[0];
  }
}
#endif

// One block to float32 at out, by the fastest code this build has for a block headed
// for memory (the chunked path's rows, the FMA tiles' slices).
template <int Q>
inline void dequant_block_to(const uint8_t* b, float* out) {
#if defined(__AVX512F__)
  SubScales s;
  block_scales<Q>(b, s);
  for (int sub = 0; sub < block_len<Q>() / 32; ++sub) {
    __m512 lo, hi;
    unpack32<Q>(b, sub, s.scale, s.offset, lo, hi);
    _mm512_storeu_ps(out + sub * 32, lo);
    _mm512_storeu_ps(out + sub * 32 + 16, hi);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (avx2_whole_block<Q>()) {
    dequant_block<Q>(b, out);
  } else {
    for (int sub = 0; sub < block_len<Q>() / 32; ++sub) {
      __m256 v[4];
      dequant32_avx2<Q>(b, sub, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + sub * 32 + 8 * i, v[i]);
    }
  }
#else
  dequant_block<Q>(b, out);
#endif
}

}  // namespace hiserve_quant

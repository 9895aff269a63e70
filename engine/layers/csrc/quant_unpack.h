// GGUF blocks into float32 vectors. With AVX-512: a unit of sub-blocks into registers
// (unpack_unit: the register path, the FMA tiles and the AMX rows all unpack through
// it) and the scales of a run of them. For every build: dequant_block_to, one block to
// memory by the fastest code the build has. Included by the packed-weight kernels
// (quant_cpu.cpp, quant_amx.h, quant_fma.h), not built alone.
// NOTE: cpu_kernels.NativeExtension hashes every header here into each extension's name.
#pragma once

#include "quant_blocks.h"
#include "vec_math.h"

namespace hiserve_quant {

#if defined(__AVX512F__)
// 16 bytes -> 16 int32 lanes.
inline __m512i widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 32 bytes into both halves of a vector.
inline __m512i twice_32(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One 16-bit lane value in the low half of a vector (words 0-15), another in the high.
inline __m512i halves_epi16(int16_t low, int16_t high) {
  return _mm512_inserti64x4(_mm512_set1_epi16(low), _mm256_set1_epi16(high), 1);
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

// The scales of a run of sub-blocks, as floats: for Q4_0/Q4_1/Q8_0 (a run is up to 16
// blocks), scale[j] = d and offset[j] = what is added to each weight (Q4_1's m, Q4_0's
// -8d) of block j; for Q4_K/Q5_K (a run is one block), scale[s] = d * sc and offset[s] =
// -dmin * m of sub-block s; for Q6_K, scale[t] = d * sc[t] of each 16 weights and
// offset[t] = -32 * scale[t] (the quants are stored plus 32).
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
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)),
                                       to_float(_mm512_cvtepi8_epi32(sc)));
    _mm512_store_ps(s.scale, scale);
    _mm512_store_ps(s.offset, _mm512_mul_ps(scale, _mm512_set1_ps(-32.f)));  // exact
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

// 32-weight sub-blocks unpacked together: those whose quants share bytes. A Q4_K or
// Q5_K byte holds a weight of sub-block 2u and one of 2u + 1; a Q6_K block's ql and qh
// bytes hold four sub-blocks' bits each.
// NOTE: unpacking one sub-block at a time widened each shared byte two or four times;
// the widening and the int-to-float work were the K-quants' bound (a 3072 x 8192 row
// from memory: Q4_K 17 GB/s, Q6_K 13, against Q8_0's 25-28).
template <int Q>
constexpr int unit_subs() {
  return Q == kQ6_K ? 4 : (Q == kQ4_K || Q == kQ5_K) ? 2 : 1;
}

// Unit ``unit`` of block ``b`` (32 * unit_subs<Q>() weights, in order) into v[0..2 *
// unit_subs<Q>()), 16 weights a vector; scale and offset as in SubScales (for the
// 32-weight types, the caller points them at the block's own).
template <int Q>
inline void unpack_unit(const uint8_t* b, int unit, const float* scale, const float* offset,
                        __m512* v) {
  if constexpr (Q == kBF16) {
    const __m256i* p = reinterpret_cast<const __m256i*>(b);
    for (int i = 0; i < 2; ++i) v[i] = bf16x16_to_ps(_mm256_loadu_si256(p + i));
  } else if constexpr (Q == kQ8_0) {
    const __m512 d = _mm512_set1_ps(scale[0]);
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    for (int i = 0; i < 2; ++i)
      v[i] = _mm512_mul_ps(d, to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + i))));
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {  // weights 0-15 low nibbles, 16-31 high
    const __m512 table = nibble_table(_mm512_set1_ps(scale[0]), _mm512_set1_ps(offset[0]));
    const __m512i bytes = widen_u8(b + (Q == kQ4_1 ? 4 : 2));
    v[0] = _mm512_permutexvar_ps(bytes, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else if constexpr (Q == kQ4_K) {  // 32 bytes: sub-block 2u in low nibbles, 2u + 1 high
    const int s = 2 * unit;
    const __m512 even = nibble_table(_mm512_set1_ps(scale[s]), _mm512_set1_ps(offset[s]));
    const __m512 odd = nibble_table(_mm512_set1_ps(scale[s + 1]), _mm512_set1_ps(offset[s + 1]));
    const uint8_t* q = b + 16 + 32 * unit;
    const __m512i q0 = widen_u8(q), q1 = widen_u8(q + 16);
    v[0] = _mm512_permutexvar_ps(q0, even);  // vpermps reads the low 4 bits of each lane
    v[1] = _mm512_permutexvar_ps(q1, even);
    v[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), odd);
    v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), odd);
  } else if constexpr (Q == kQ5_K) {
    // The 32 values of a 5-bit quant in two tables; vpermt2ps reads 5 index bits. The
    // indexes of the pair are made as bytes, sub-block 2u in bytes 0-31 and 2u + 1 in
    // 32-63: the nibble (low or high, so shifted by 0 or 4) in bits 0-3, and qh's bit
    // of the sub-block rotated to bit 4 (bits 5-7 are left as they fall; unread).
    const int s = 2 * unit;
    const __m512i nib = _mm512_srlv_epi16(twice_32(b + 48 + 32 * unit), halves_epi16(0, 4));
    const __m512i rot = _mm512_inserti64x4(_mm512_set1_epi32((4 - s) & 31),
                                           _mm256_set1_epi32((3 - s) & 31), 1);
    const __m512i fifth = _mm512_rolv_epi32(twice_32(b + 16), rot);
    alignas(64) uint8_t index[64];
    _mm512_store_si512(index, _mm512_ternarylogic_epi32(nib, fifth, _mm512_set1_epi8(15),
                                                        0xE4));  // (a & c) | (b & ~c)
    for (int half = 0; half < 2; ++half) {
      const __m512 ds = _mm512_set1_ps(scale[s + half]), neg_dm = _mm512_set1_ps(offset[s + half]);
      const __m512 t0 = nibble_table(ds, neg_dm);
      const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(iota16(), _mm512_set1_ps(16.f)), ds, neg_dm);
      for (int i = 0; i < 2; ++i)
        v[2 * half + i] = _mm512_permutex2var_ps(t0, widen_u8(index + 32 * half + 16 * i), t1);
    }
  } else {  // Q6_K, unit h: ql[64h, 64h + 64) and qh[32h, 32h + 32) hold sub-blocks 4h..4h+3
    // Sub-block 4h + u, weight l: (ql[64h + 32 (u % 2) + l] >> 4 (u / 2)) & 15 in bits 0-3
    // and (qh[32h + l] >> 2u) & 3 in bits 4-5, made as bytes 64 weights at a time: u = 0
    // and 1 from the low nibbles, 2 and 3 from the high ones, qh's two bits moved to bits
    // 4-5 by a 16-bit shift per half (left 4 and 2; right 0 and 2).
    const __m512i ql = _mm512_loadu_si512(b + 64 * unit);
    const __m512i qh = twice_32(b + 128 + 32 * unit);
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    alignas(64) uint8_t q6[128];
    _mm512_store_si512(q6, _mm512_ternarylogic_epi32(
        ql, _mm512_and_si512(_mm512_sllv_epi16(qh, halves_epi16(4, 2)), bits45), low4, 0xE4));
    _mm512_store_si512(q6 + 64, _mm512_ternarylogic_epi32(
        _mm512_srli_epi16(ql, 4), _mm512_and_si512(_mm512_srlv_epi16(qh, halves_epi16(0, 2)), bits45),
        low4, 0xE4));
    for (int i = 0; i < 8; ++i)  // 16 weights each, scale index 8h + i
      v[i] = _mm512_fmadd_ps(to_float(widen_u8(q6 + 16 * i)), _mm512_set1_ps(scale[8 * unit + i]),
                             _mm512_set1_ps(offset[8 * unit + i]));
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

// The unit of run ``run`` of a row that starts at sub-block j, with the run's scales.
template <int Q>
inline void run_unpack(const uint8_t* row, int64_t run, int j, const SubScales& s, __m512* v) {
  if constexpr (block_len<Q>() == 32) {
    unpack_unit<Q>(row + (run * 16 + j) * block_bytes<Q>(), 0, s.scale + j, s.offset + j, v);
  } else {
    unpack_unit<Q>(row + run * block_bytes<Q>(), j / unit_subs<Q>(), s.scale, s.offset, v);
  }
}

// The scales of one block of any type, for unpack_unit(b, unit, s.scale, s.offset, ...)
// of each of its units.
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
  constexpr int kVecs = 2 * unit_subs<Q>();
  SubScales s;
  block_scales<Q>(b, s);
  for (int unit = 0; unit < block_len<Q>() / (16 * kVecs); ++unit) {
    __m512 v[kVecs];
    unpack_unit<Q>(b, unit, s.scale, s.offset, v);
    for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(out + (unit * kVecs + i) * 16, v[i]);
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

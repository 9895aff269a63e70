// The paged KV pool's rows on the CPU, float32 or bfloat16 (--kv-cache-dtype): their
// elements loaded as float32, a row prefetched, and store_kv, which writes a layer's new
// float32 K/V rows into their slots (rounded to nearest even for a bfloat16 pool, as
// torch's .to(torch.bfloat16)).
//
// Included by paged_attention.h, not built alone.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>

#include "vec_math.h"

namespace hiserve_paged {

using bf16 = c10::BFloat16;

inline void check_input(const torch::Tensor& t, const char* name, torch::ScalarType dtype,
                        int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype: ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The pool's K and V: both float32 or both bfloat16, [S, Hkv, D], contiguous.
inline bool kv_is_bf16(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "the KV cache must be float32 or bfloat16, got ", dtype);
  check_input(k_cache, "k_cache", dtype, 3);
  check_input(v_cache, "v_cache", dtype, 3);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  return dtype == torch::kBFloat16;
}

inline float kv_float(float v) { return v; }
inline float kv_float(bf16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// 16 elements from p as float32.
inline __m512 load_kv16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_kv16(const bf16* p) {
  return bf16x16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// Into the cache, one line at a time: the K or V row (every KV head of one token) of
// ``slot``, which may lie anywhere in the pool.
template <typename KV>
inline void prefetch_row(const KV* data, int64_t slot, int64_t row_size) {
  prefetch_lines(data + slot * row_size, 0, row_size * static_cast<int64_t>(sizeof(KV)));
}

// k, v [T, Hkv, D] float32 (heads and dims contiguous, rows may be strided: views of the
// fused projection); k_cache, v_cache [S, Hkv, D] contiguous, float32 or bfloat16; slots
// [T] int64. Writes k[t] to k_cache[slots[t]] and v[t] to v_cache[slots[t]]: the pool
// write of one layer as one call instead of two index_put_.
inline void store_kv(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v) {
  const bool bf16_pool = kv_is_bf16(k_cache, v_cache);
  check_input(slots, "slots", torch::kInt64, 1);
  const int64_t tokens = slots.size(0), num_slots = k_cache.size(0);
  const int64_t row_size = k_cache.size(1) * k_cache.size(2);
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->dim() == 3,
                "k and v must be float32 CPU tensors [T, Hkv, D]");
    TORCH_CHECK(t->size(0) == tokens && t->size(1) == k_cache.size(1) &&
                    t->size(2) == k_cache.size(2),
                "k and v must be [T, Hkv, D] matching slots and the cache");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "k and v must have contiguous heads and dims (any row stride)");
  }
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_data[t] >= 0 && slot_data[t] < num_slots, "KV slot ", slot_data[t],
                " out of range [0, ", num_slots, ")");
  }
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  // Rows are a few hundred bytes: threads would cost more than the copy, except for a
  // long prefill.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_size));
  if (bf16_pool) {
    bf16* kc = k_cache.data_ptr<bf16>();
    bf16* vc = v_cache.data_ptr<bf16>();
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        bf16* kr = kc + slot_data[t] * row_size;
        bf16* vr = vc + slot_data[t] * row_size;
        const float* ks = k_data + t * k_stride;
        const float* vs = v_data + t * v_stride;
        for (int64_t i = 0; i < row_size; ++i) {
          kr[i] = bf16(ks[i]);
          vr[i] = bf16(vs[i]);
        }
      }
    });
    return;
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const auto bytes = static_cast<size_t>(row_size) * sizeof(float);
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot_data[t] * row_size, k_data + t * k_stride, bytes);
      std::memcpy(vc + slot_data[t] * row_size, v_data + t * v_stride, bytes);
    }
  });
}

}  // namespace hiserve_paged

// Prefill / extend attention on the CPU, float32: each new token of a sequence attends
// over its cached prefix (read where it lies in the paged pool, through the request
// table) and over the step's new tokens up to its own (read from the step's K/V), causally.
//
// SDPA per sequence cost 6 ms a layer for 32 prompts of 128 tokens on the default model,
// about 18% of the prefill (2026-12-06): its flash kernel's small blocks and per-call setup
// dominate at these lengths. Here a work item is one KV head of one sequence for up to 64
// query positions; it copies the keys those positions see into float32 rows once, then
// takes its query heads 16 positions at a time, one position per vector lane: the scores
// of a key for 16 positions are one register (the queries transposed, the key's values
// broadcast), so the online softmax's running max and sum are per-lane vector operations,
// and the outputs accumulate transposed ([D][16]) until they are divided and written back.
//
// Included by paged_decode_cpu.cpp, not built alone.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_rows.h"
#include "vec_math.h"

namespace hiserve_paged {

constexpr int64_t kPrefillMaxDim = 256;  // the per-pass query and output scratch's bound

// Whether prefill_attention takes heads of ``dim`` on this build: AVX-512, a multiple of
// 16 up to kPrefillMaxDim.
inline bool prefill_takes(int64_t dim) {
#if defined(__AVX512F__)
  return dim > 0 && dim % 16 == 0 && dim <= kPrefillMaxDim;
#else
  (void)dim;
  return false;
#endif
}

#if defined(__AVX512F__)
namespace prefill_detail {

constexpr int64_t kLanes = 16;      // query positions per pass: one vector lane each
constexpr int64_t kKeys = 32;       // keys per softmax block
constexpr int64_t kPositions = 64;  // query positions per work item
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Item {
  int64_t seq, head, i0, i1, cost;
};

struct Layout {
  const float* q;
  int64_t q_stride;  // [T, Hq, D], heads and dims contiguous
  const float* k;
  int64_t k_stride;  // [T, Hkv, D]
  const float* v;
  int64_t v_stride;
  float* out;  // [T, Hq * D], contiguous
  int64_t dim, kv_heads, group;
  float scale;
};

// Keys [0, n) of KV head h of one sequence as float32 rows [n, D] in kb and vb: the first
// ``prefix`` from the pool at ``slots``, the rest the step's new rows from ``first_new``.
template <typename KV>
void gather_keys(const Layout& in, const KV* k_cache, const KV* v_cache, const int32_t* slots,
                 int64_t prefix, int64_t first_new, int64_t h, int64_t n, float* kb,
                 float* vb) {
  const int64_t dim = in.dim, row_size = in.kv_heads * dim;
  for (int64_t j = 0; j < n; ++j) {
    float* kd = kb + j * dim;
    float* vd = vb + j * dim;
    if (j < prefix) {
      const KV* ks = k_cache + slots[j] * row_size + h * dim;
      const KV* vs = v_cache + slots[j] * row_size + h * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        _mm512_storeu_ps(kd + d, load_kv16(ks + d));
        _mm512_storeu_ps(vd + d, load_kv16(vs + d));
      }
    } else {
      const int64_t t = first_new + j - prefix;
      std::memcpy(kd, in.k + t * in.k_stride + h * dim, dim * sizeof(float));
      std::memcpy(vd, in.v + t * in.v_stride + h * dim, dim * sizeof(float));
    }
  }
}

// Query head qh at positions i0 .. i0 + n - 1 (n <= 16) of a sequence whose new tokens
// start at token ``first_new`` and at position ``prefix``, over keys kb / vb [i0 + n +
// prefix, D] (the keys the last of them sees). Position p sees keys 0..p.
inline void attend_lanes(const Layout& in, const float* kb, const float* vb, int64_t prefix,
                         int64_t first_new, int64_t qh, int64_t i0, int64_t n) {
  const int64_t dim = in.dim;
  alignas(64) float qt[kPrefillMaxDim * kLanes];  // queries * scale, [D][lane]
  alignas(64) float ot[kPrefillMaxDim * kLanes];  // unnormalized outputs, [D][lane]
  alignas(64) float pr[kKeys * kLanes];    // a block's scores, then probabilities [key][lane]
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    __m512 r[16];
    for (int64_t l = 0; l < kLanes; ++l) {
      const float* src = in.q + (first_new + i0 + l) * in.q_stride + qh * dim + d0;
      r[l] = l < n ? _mm512_mul_ps(_mm512_loadu_ps(src), _mm512_set1_ps(in.scale))
                   : _mm512_setzero_ps();
    }
    transpose16_ps(r);
    for (int64_t c = 0; c < 16; ++c) _mm512_store_ps(qt + (d0 + c) * kLanes, r[c]);
  }
  std::fill(ot, ot + dim * kLanes, 0.f);
  __m512 peak = _mm512_set1_ps(-1e30f);  // finite: exp(peak - new peak) is 0, never NaN
  __m512 denom = _mm512_setzero_ps();
  const int64_t keys = prefix + i0 + n;
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const int64_t kn = std::min(kKeys, keys - j0);
    // Scores, 8 keys at a time: lane l of key j is q_l . k_j.
    for (int64_t t0 = 0; t0 < kn; t0 += 8) {
      const float* kr[8];
      for (int t = 0; t < 8; ++t) kr[t] = kb + std::min(j0 + t0 + t, keys - 1) * dim;
      __m512 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int64_t d = 0; d < dim; ++d) {
        const __m512 qv = _mm512_load_ps(qt + d * kLanes);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kr[t][d]), acc[t]);
      }
      for (int t = 0; t < 8 && t0 + t < kn; ++t) {
        // Key j is seen by the lanes at positions >= j: lanes >= j - (prefix + i0).
        const int64_t past = j0 + t0 + t - prefix - i0;
        const __mmask16 seen =
            past <= 0 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0xFFFFu << past);
        _mm512_store_ps(pr + (t0 + t) * kLanes,
                        _mm512_mask_mov_ps(_mm512_set1_ps(-kInf), seen, acc[t]));
      }
    }
    // Online softmax per lane. Every lane sees key 0, so the peak is finite after the
    // first block; a lane that sees none of a later block keeps its peak (factor 1).
    __m512 top = _mm512_load_ps(pr);
    for (int64_t t = 1; t < kn; ++t) top = _mm512_max_ps(top, _mm512_load_ps(pr + t * kLanes));
    const __m512 next = _mm512_max_ps(peak, top);
    const __m512 factor = exp512(_mm512_sub_ps(peak, next));
    peak = next;
    denom = _mm512_mul_ps(denom, factor);
    for (int64_t t = 0; t < kn; ++t) {
      const __m512 s = _mm512_load_ps(pr + t * kLanes);
      const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-kInf), _CMP_NEQ_OQ);
      const __m512 p = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(s, peak)));
      _mm512_store_ps(pr + t * kLanes, p);
      denom = _mm512_add_ps(denom, p);
    }
    // Values, 16 dims at a time: out_l[d] += p_l(j) v_j[d], the dims in registers.
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      __m512 o[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c)
        o[c] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + c) * kLanes), factor);
      for (int64_t t = 0; t < kn; ++t) {
        const __m512 p = _mm512_load_ps(pr + t * kLanes);
        const float* vr = vb + (j0 + t) * dim + d0;
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_set1_ps(vr[c]), o[c]);
      }
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) _mm512_store_ps(ot + (d0 + c) * kLanes, o[c]);
    }
  }
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), denom);
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    __m512 r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + c) * kLanes), inv);
    transpose16_ps(r);  // r[l]: dims d0.. of lane l
    const int64_t out_stride = in.kv_heads * in.group * dim;
    for (int64_t l = 0; l < n; ++l)
      _mm512_storeu_ps(in.out + (first_new + i0 + l) * out_stride + qh * dim + d0, r[l]);
  }
}

}  // namespace prefill_detail

template <typename KV>
void prefill_attention_as(const prefill_detail::Layout& in, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const int32_t* table, int64_t columns,
                          const std::vector<int64_t>& rows, const std::vector<int64_t>& prefix,
                          const std::vector<int64_t>& starts,
                          const std::vector<prefill_detail::Item>& items) {
  using namespace prefill_detail;
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  // One index per thread; each takes the next item until none is left (items come
  // costliest first, so the threads finish together).
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> kb, vb;
    for (int64_t i = next++; i < total; i = next++) {
      const Item& it = items[static_cast<size_t>(i)];
      const int64_t b = it.seq, keys = prefix[b] + it.i1;
      kb.resize(static_cast<size_t>(keys * in.dim));
      vb.resize(static_cast<size_t>(keys * in.dim));
      gather_keys(in, kc, vc, table + rows[b] * columns, prefix[b], starts[b], it.head, keys,
                  kb.data(), vb.data());
      for (int64_t g = 0; g < in.group; ++g) {
        for (int64_t i0 = it.i0; i0 < it.i1; i0 += kLanes) {
          attend_lanes(in, kb.data(), vb.data(), prefix[b], starts[b], it.head * in.group + g,
                       i0, std::min(kLanes, it.i1 - i0));
        }
      }
    }
  });
}
#endif

// q [T, Hq, D], k and v [T, Hkv, D]: the step's new tokens, float32 (heads and dims
// contiguous; rows may be strided, as views of the fused projection); k_cache, v_cache
// [S, Hkv, D] float32 or bfloat16; table [R, C] int32. Sequence b has extend_lens[b] new
// tokens (after those of the sequences before it) at positions prefix_lens[b] onwards;
// its first prefix_lens[b] keys are in the pool at table[rows[b], :prefix_lens[b]].
// Writes softmax(q . K^T * scale) . V of every new token of the sequences in ``seqs`` to
// its row of out [T, Hq * D] float32; other rows are left as they are.
inline void prefill_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& table,
                              const std::vector<int64_t>& rows,
                              const std::vector<int64_t>& prefix_lens,
                              const std::vector<int64_t>& extend_lens,
                              const std::vector<int64_t>& seqs, double scale,
                              const torch::Tensor& out) {
  const bool bf16_pool = kv_is_bf16(k_cache, v_cache);
  check_input(table, "table", torch::kInt32, 2);
  check_input(out, "out", torch::kFloat32, 2);
  const int64_t tokens = q.size(0), q_heads = q.dim() == 3 ? q.size(1) : 0;
  const int64_t dim = k_cache.size(2), kv_heads = k_cache.size(1);
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->dim() == 3,
                "q, k and v must be float32 CPU tensors [T, heads, D]");
    TORCH_CHECK(t->size(0) == tokens && t->size(2) == dim,
                "q, k and v must have T rows and the cache's head_dim");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == dim,
                "q, k and v must have contiguous heads and dims (any row stride)");
  }
  TORCH_CHECK(k.size(1) == kv_heads && v.size(1) == kv_heads, "k and v must have Hkv heads");
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "q heads must be a multiple of KV heads");
  TORCH_CHECK(out.size(0) == tokens && out.size(1) == q_heads * dim, "out must be [T, Hq * D]");
  TORCH_CHECK(prefill_takes(dim), "prefill_attention does not take head_dim ", dim,
              " on this build (prefill_takes)");
  const int64_t batch = static_cast<int64_t>(extend_lens.size());
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == batch &&
                  static_cast<int64_t>(prefix_lens.size()) == batch,
              "rows, prefix_lens and extend_lens must have one entry per sequence");
#if defined(__AVX512F__)
  using namespace prefill_detail;
  const int64_t columns = table.size(1), num_slots = k_cache.size(0);
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  int64_t start = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(extend_lens[b] >= 0 && prefix_lens[b] >= 0 &&
                    prefix_lens[b] + extend_lens[b] <= columns,
                "sequence ", b, " does not fit its request-table row");
    starts[b] = start;
    start += extend_lens[b];
  }
  TORCH_CHECK(start == tokens, "extend_lens sum to ", start, ", not the ", tokens, " tokens");
  const int32_t* table_data = table.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t b : seqs) {
    TORCH_CHECK(b >= 0 && b < batch, "sequence index ", b, " out of range");
    TORCH_CHECK(rows[b] >= 0 && rows[b] < table.size(0), "sequence ", b,
                " has a request-table row out of range");
    const int32_t* slots = table_data + rows[b] * columns;
    for (int64_t j = 0; j < prefix_lens[b]; ++j) {
      TORCH_CHECK(slots[j] >= 0 && slots[j] < num_slots, "KV slot ", slots[j],
                  " out of range [0, ", num_slots, ")");
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t i0 = 0; i0 < extend_lens[b]; i0 += kPositions) {
        const int64_t i1 = std::min(extend_lens[b], i0 + kPositions);
        // Work: positions x the keys they see, on average.
        items.push_back({b, h, i0, i1, (i1 - i0) * (prefix_lens[b] + (i0 + i1) / 2)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const Layout in{q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0),
                  v.data_ptr<float>(), v.stride(0), out.data_ptr<float>(), dim, kv_heads,
                  q_heads / kv_heads, static_cast<float>(scale)};
  if (bf16_pool) {
    prefill_attention_as<bf16>(in, k_cache, v_cache, table_data, columns, rows, prefix_lens,
                               starts, items);
  } else {
    prefill_attention_as<float>(in, k_cache, v_cache, table_data, columns, rows, prefix_lens,
                                starts, items);
  }
#else
  (void)bf16_pool;
  (void)seqs;
  (void)scale;
#endif
}

}  // namespace hiserve_paged

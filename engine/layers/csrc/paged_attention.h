// Decode attention straight from the paged KV pool, on the CPU.
//
// One new query token per sequence attends over the keys and values at its request-table
// slots. The pure-PyTorch backend has to gather every sequence's K/V into a padded dense
// tensor before SDPA (writing and re-reading all of it, every layer, every step); this
// kernel reads each cached row once, where it lies. Work items are sequences (or, with
// fewer sequences than threads, parts of at least 128 tokens of each, merged after); each
// K/V row (all KV heads of one token, contiguous) is read once for all query heads. Head dims
// 64 and 128 take an AVX-512 path where the build has it (vector dot products, a
// vectorized exp for the softmax): at 32 sequences of 20-200 tokens it measured 2.5-4x
// faster with the KV in cache and 1.1-1.3x from DRAM, where reading the rows dominates.
// The pool holds float32 or bfloat16 (--kv-cache-dtype; kv_rows.h), read as float32.
//
// Included by paged_decode_cpu.cpp (their Python binding) and by decode_layers.h, not
// built alone.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_rows.h"
#include "vec_math.h"

namespace hiserve_paged {

namespace {

struct SeqView {
  const int32_t* slots;  // [len] KV slot of each token
  int64_t len;
  int64_t row_size;  // floats per K (or V) row: every KV head of one token
  int64_t dim;
  int64_t group;
  float scale;
};

// What attending over some of a sequence's tokens leaves, per query head: the largest
// score (peak), the sum of exp(score - peak) (denom), and sum_j exp(score_j - peak) v_j in
// out [q_heads, dim], not yet divided by denom.
struct PartState {
  float* peak;   // [q_heads]
  float* denom;  // [q_heads]
  float* out;    // [q_heads, dim]
};

constexpr int64_t kAhead = 4;  // K/V rows prefetched ahead (portable path): slots may be scattered

#if defined(__AVX512F__)
constexpr int64_t kBlock = 32;  // tokens whose K (or V) rows stay in L1 while every head passes

// Tokens [j0, j1) of one sequence, all query heads, head_dim = 16 * kChunks, AVX-512, in
// blocks of kBlock tokens whose rows stay in L1 while each KV head's query heads pass
// over them (the first pass over a block prefetches the next block's rows, one row per
// token: slots may be scattered). Scores: 8 tokens x kGs query heads of one KV head at
// a time, their 16-lane products summed across registers (sum_lanes8), into scores
// [q_heads, j1 - j0]; softmax numerators per head in place (vectorized exp); then the
// values, kGv query heads at a time, their outputs in registers across the block, into
// st.out.
// NOTE: against one score at a time (a horizontal sum each) with the outputs loaded and
// stored per token, a decode step of 32 sequences (bf16 KV) is 0.5-1.2 ms shorter
// (18.1-19.7 against 19.3-20.2 ms, 2026-12-06): the rows' reads bound this kernel, not
// its arithmetic. Prefetching a whole block at once instead was slower than either.
template <int kChunks, typename KV>
void attend_part(const SeqView& seq, int64_t j0, int64_t j1, const float* q_seq,
                 const KV* k_data, const KV* v_data, float* scores, PartState st) {
  constexpr int kGs = kChunks == 4 ? 3 : 2;  // 8 x kGs sums + kChunks keys in registers
  constexpr int kGv = 16 / kChunks;          // kGv x kChunks outputs in registers
  const int32_t* slots = seq.slots + j0;
  const int64_t len = j1 - j0, dim = seq.dim, group = seq.group, row_size = seq.row_size;
  const int64_t kv_heads = row_size / dim, q_heads = kv_heads * group;
  const __m256 scale = _mm256_set1_ps(seq.scale);
  const auto prefetch_block = [&](const KV* data, int64_t b) {
    for (int64_t j = b; j < std::min(len, b + kBlock); ++j) prefetch_row(data, slots[j], row_size);
  };
  prefetch_block(k_data, 0);
  for (int64_t b0 = 0; b0 < len; b0 += kBlock) {
    const int64_t b1 = std::min(len, b0 + kBlock);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += kGs) {
        const int64_t gn = std::min<int64_t>(kGs, group - g0);
        const float* query = q_seq + (h * group + g0) * dim;
        for (int64_t t0 = b0; t0 < b1; t0 += 8) {
          __m512 acc[kGs][8];
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) {  // past b1: the last token again (not stored)
            if (h == 0 && g0 == 0 && t0 + t + kBlock < len)
              prefetch_row(k_data, slots[t0 + t + kBlock], row_size);
            const KV* key_row =
                k_data + slots[std::min<int64_t>(t0 + t, b1 - 1)] * row_size + h * dim;
            __m512 key[kChunks];
#pragma GCC unroll 8
            for (int c = 0; c < kChunks; ++c) key[c] = load_kv16(key_row + 16 * c);
#pragma GCC unroll 4
            for (int gi = 0; gi < kGs; ++gi) {
              const float* qg = query + std::min<int64_t>(gi, gn - 1) * dim;  // in bounds
              __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), key[0]);
#pragma GCC unroll 8
              for (int c = 1; c < kChunks; ++c)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), key[c], a);
              acc[gi][t] = a;  // past gn: a repeat, unused
            }
          }
          const __mmask8 m = static_cast<__mmask8>((1u << std::min<int64_t>(8, b1 - t0)) - 1);
          for (int gi = 0; gi < gn; ++gi) {
            float* dst = scores + (h * group + g0 + gi) * len + t0;
            _mm256_mask_storeu_ps(dst, m, _mm256_mul_ps(sum_lanes8(acc[gi]), scale));
          }
        }
      }
    }
  }
  // Each head's row over [0, len): max, then exp and sum 16 at a time, tail masked.
  prefetch_block(v_data, 0);
  for (int64_t qh = 0; qh < q_heads; ++qh) {
    float* row = scores + qh * len;
    __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = lanes16(len - j);
      peak = _mm512_mask_max_ps(peak, m, peak, _mm512_maskz_loadu_ps(m, row + j));
    }
    st.peak[qh] = _mm512_reduce_max_ps(peak);
    const __m512 max_v = _mm512_set1_ps(st.peak[qh]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = lanes16(len - j);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), max_v));
      sum = _mm512_mask_add_ps(sum, m, sum, e);
      _mm512_mask_storeu_ps(row + j, m, e);
    }
    st.denom[qh] = _mm512_reduce_add_ps(sum);
  }
  std::fill(st.out, st.out + q_heads * dim, 0.f);
  for (int64_t b0 = 0; b0 < len; b0 += kBlock) {
    const int64_t b1 = std::min(len, b0 + kBlock);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += kGv) {
        const int64_t gn = std::min<int64_t>(kGv, group - g0);
        float* out = st.out + (h * group + g0) * dim;
        const float* weights = scores + (h * group + g0) * len;
        __m512 acc[kGv][kChunks];
        for (int gi = 0; gi < kGv; ++gi)
          for (int c = 0; c < kChunks; ++c)
            acc[gi][c] = gi < gn ? _mm512_loadu_ps(out + gi * dim + 16 * c) : _mm512_setzero_ps();
        for (int64_t j = b0; j < b1; ++j) {
          if (h == 0 && g0 == 0 && j + kBlock < len)
            prefetch_row(v_data, slots[j + kBlock], row_size);
          const KV* value_row = v_data + slots[j] * row_size + h * dim;
          __m512 value[kChunks];
          for (int c = 0; c < kChunks; ++c) value[c] = load_kv16(value_row + 16 * c);
          for (int gi = 0; gi < kGv; ++gi) {
            if (gi >= gn) break;
            const __m512 w = _mm512_set1_ps(weights[gi * len + j]);
            for (int c = 0; c < kChunks; ++c) acc[gi][c] = _mm512_fmadd_ps(w, value[c], acc[gi][c]);
          }
        }
        for (int gi = 0; gi < gn; ++gi)
          for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(out + gi * dim + 16 * c, acc[gi][c]);
      }
    }
  }
}
#endif

// The same for any head_dim, in portable code.
template <typename KV>
void attend_part_portable(const SeqView& seq, int64_t j0, int64_t j1, const float* q_seq,
                          const KV* k_data, const KV* v_data, float* scores, PartState st) {
  const int32_t* slots = seq.slots + j0;
  const int64_t len = j1 - j0, dim = seq.dim, group = seq.group, row_size = seq.row_size;
  const int64_t q_heads = row_size / dim * group;
  std::fill(st.peak, st.peak + q_heads, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) prefetch_row(k_data, slots[j + kAhead], row_size);
    const KV* key_row = k_data + static_cast<int64_t>(slots[j]) * row_size;
    for (int64_t qh = 0; qh < q_heads; ++qh) {
      const float* query = q_seq + qh * dim;
      const KV* key = key_row + (qh / group) * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[d] * kv_float(key[d]);
      dot *= seq.scale;
      scores[qh * len + j] = dot;
      st.peak[qh] = std::max(st.peak[qh], dot);
    }
  }
  for (int64_t qh = 0; qh < q_heads; ++qh) {
    float sum = 0.f;
    float* row = scores + qh * len;
    for (int64_t j = 0; j < len; ++j) {
      row[j] = std::exp(row[j] - st.peak[qh]);
      sum += row[j];
    }
    st.denom[qh] = sum;
  }
  std::fill(st.out, st.out + q_heads * dim, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) prefetch_row(v_data, slots[j + kAhead], row_size);
    const KV* value_row = v_data + static_cast<int64_t>(slots[j]) * row_size;
    for (int64_t qh = 0; qh < q_heads; ++qh) {
      const float weight = scores[qh * len + j];
      const KV* value = value_row + (qh / group) * dim;
      float* acc = st.out + qh * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] += weight * kv_float(value[d]);
    }
  }
}

// Tokens [j0, j1) of one sequence (j0 < j1) into st, by the fastest path for its head_dim.
template <typename KV>
void attend(const SeqView& seq, int64_t j0, int64_t j1, const float* q_seq, const KV* k_data,
            const KV* v_data, int64_t num_slots, std::vector<float>& scores, PartState st) {
  for (int64_t j = j0; j < j1; ++j) {
    TORCH_CHECK(seq.slots[j] >= 0 && seq.slots[j] < num_slots, "KV slot ", seq.slots[j],
                " out of range");
  }
  const int64_t q_heads = seq.row_size / seq.dim * seq.group;
  scores.resize(static_cast<size_t>(q_heads * (j1 - j0)));
#if defined(__AVX512F__)
  if (q_heads <= 64 && seq.dim == 64) {
    attend_part<4>(seq, j0, j1, q_seq, k_data, v_data, scores.data(), st);
    return;
  }
  if (q_heads <= 64 && seq.dim == 128) {
    attend_part<8>(seq, j0, j1, q_seq, k_data, v_data, scores.data(), st);
    return;
  }
#endif
  attend_part_portable(seq, j0, j1, q_seq, k_data, v_data, scores.data(), st);
}

// Parts each sequence's tokens are split into: one, unless there are fewer sequences than
// threads (one stream would leave the other cores idle); never parts shorter than
// kMinPartTokens, since each part costs a merge.
constexpr int64_t kMinPartTokens = 128;

int64_t parts_per_sequence(int64_t batch, int64_t longest) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (batch >= threads) return 1;
  const int64_t want = (threads + batch - 1) / batch;
  return std::max<int64_t>(1, std::min(want, longest / kMinPartTokens));
}

}  // namespace

// paged_decode over a pool of KV elements (float or bf16); the inputs are checked.
template <typename KV>
torch::Tensor paged_decode_as(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& table,
                              const torch::Tensor& rows, const torch::Tensor& lens,
                              double scale) {
  check_input(table, "table", torch::kInt32, 2);
  check_input(rows, "rows", torch::kInt64, 1);
  check_input(lens, "lens", torch::kInt64, 1);
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t num_slots = k_cache.size(0), kv_heads = k_cache.size(1);
  const int64_t columns = table.size(1);
  TORCH_CHECK(k_cache.size(2) == dim, "head_dim of q and the KV cache differ");
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "q heads must be a multiple of KV heads");
  TORCH_CHECK(rows.size(0) == batch && lens.size(0) == batch, "rows/lens must have B entries");
  const int64_t group = q_heads / kv_heads;

  const float* q_data = q.data_ptr<float>();
  const KV* k_data = k_cache.data_ptr<KV>();
  const KV* v_data = v_cache.data_ptr<KV>();
  const int32_t* table_data = table.data_ptr<int32_t>();
  const int64_t* row_data = rows.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_data[b] >= 1 && len_data[b] <= columns, "sequence ", b, " has length ",
                len_data[b], " outside [1, ", columns, "]");
    TORCH_CHECK(row_data[b] >= 0 && row_data[b] < table.size(0), "sequence ", b,
                " has a request-table row out of range");
  }
  const int64_t q_row_stride = q.stride(0);
  auto out = torch::empty({batch, q_heads, dim}, q.options());
  float* out_data = out.data_ptr<float>();
  const int64_t row_size = kv_heads * dim;  // one token's K (or V): every head
  const auto seq_at = [&](int64_t b) {
    return SeqView{table_data + row_data[b] * columns, len_data[b], row_size, dim, group,
                   static_cast<float>(scale)};
  };
  const auto divide = [&](float* dst, const float* denom) {  // [q_heads, dim] by denom
    for (int64_t qh = 0; qh < q_heads; ++qh) {
      const float inv = 1.f / denom[qh];
      for (int64_t d = 0; d < dim; ++d) dst[qh * dim + d] *= inv;
    }
  };
  const int64_t parts = parts_per_sequence(batch, *std::max_element(len_data, len_data + batch));
  if (parts == 1) {  // a sequence per work item, into its output rows
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, peak(q_heads), denom(q_heads);
      for (int64_t b = begin; b < end; ++b) {
        float* out_seq = out_data + b * q_heads * dim;
        attend(seq_at(b), 0, len_data[b], q_data + b * q_row_stride, k_data, v_data, num_slots,
               scores, {peak.data(), denom.data(), out_seq});
        divide(out_seq, denom.data());
      }
    });
    return out;
  }
  // Split-K: each (sequence, part) is a work item with its own softmax state; then each
  // sequence's parts are merged, each weighted by exp(its peak - the largest peak).
  const int64_t items = batch * parts;
  std::vector<float> part_out(static_cast<size_t>(items * q_heads * dim));
  std::vector<float> part_peak(static_cast<size_t>(items * q_heads));
  std::vector<float> part_denom(static_cast<size_t>(items * q_heads));
  const auto state = [&](int64_t item) {
    return PartState{part_peak.data() + item * q_heads, part_denom.data() + item * q_heads,
                     part_out.data() + item * q_heads * dim};
  };
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / parts, p = item % parts, len = len_data[b];
      const int64_t j0 = len * p / parts, j1 = len * (p + 1) / parts;
      const PartState st = state(item);
      if (j0 == j1) {  // a sequence shorter than its parts: nothing to add
        std::fill(st.peak, st.peak + q_heads, -std::numeric_limits<float>::infinity());
        std::fill(st.denom, st.denom + q_heads, 0.f);
        std::fill(st.out, st.out + q_heads * dim, 0.f);
        continue;
      }
      attend(seq_at(b), j0, j1, q_data + b * q_row_stride, k_data, v_data, num_slots, scores, st);
    }
  });
  std::vector<float> denom(q_heads);
  for (int64_t b = 0; b < batch; ++b) {
    float* out_seq = out_data + b * q_heads * dim;
    std::fill(out_seq, out_seq + q_heads * dim, 0.f);
    for (int64_t qh = 0; qh < q_heads; ++qh) {
      float peak = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) peak = std::max(peak, state(b * parts + p).peak[qh]);
      denom[qh] = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const PartState st = state(b * parts + p);
        const float w = std::exp(st.peak[qh] - peak);
        denom[qh] += w * st.denom[qh];
        for (int64_t d = 0; d < dim; ++d) out_seq[qh * dim + d] += w * st.out[qh * dim + d];
      }
    }
    divide(out_seq, denom.data());
  }
  return out;
}

// q [B, Hq, D] float32 (heads and dims contiguous; rows may be strided, as in a view of
// the fused q/k/v projection); k_cache, v_cache [S, Hkv, D] float32 or bfloat16; table
// [R, C] int32; rows [B] int64 (table row of each sequence); lens [B] int64 (context
// length, >= 1). Returns [B, Hq, D] float32: softmax(q . K^T * scale) . V per query head.
inline torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                                  const torch::Tensor& v_cache, const torch::Tensor& table,
                                  const torch::Tensor& rows, const torch::Tensor& lens,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu(), "q must be a CPU tensor");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "q has the wrong dtype: ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3, "q must have 3 dimensions, got ", q.dim());
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must have contiguous heads and dims (any row stride)");
  if (kv_is_bf16(k_cache, v_cache))
    return paged_decode_as<bf16>(q, k_cache, v_cache, table, rows, lens, scale);
  return paged_decode_as<float>(q, k_cache, v_cache, table, rows, lens, scale);
}

// How many intra-op threads took part in a parallel_for over ``items`` work items: a
// build without OpenMP would silently run every kernel on one thread.
inline int64_t parallel_threads(int64_t items) {
  std::vector<int> seen(static_cast<size_t>(std::max(1, at::get_num_threads())), 0);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const auto id = static_cast<size_t>(at::get_thread_num());
    if (id < seen.size() && begin < end) seen[id] = 1;
  });
  return std::count(seen.begin(), seen.end(), 1);
}

}  // namespace hiserve_paged

// Matmul against GGUF block-quantized weights kept packed: y[M, N] = x[M, K] @ W[N, K]^T
// where each row of W is a run of ggml blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), or
// plain bfloat16 (ggml's BF16, taken 32 weights at a time): --dtype bfloat16 on the CPU.
//
// - qmatmul, M <= kGemvMax: each row's blocks are dequantized 32 weights at a time into
//   two 16-float vectors (registers only) and multiplied into one float32 accumulator
//   per token; rows are split over the threads. The bytes read per call are the packed
//   bytes, 3.5-8.5 bits a weight instead of 32.
// - qmatmul, larger M: the threads dequantize a chunk of kTileRows rows each into a
//   float32 buffer (L2-sized per thread), then at::mm multiplies the chunk by all tokens;
//   the dequantize cost is paid once per call, not once per token.
// - dequantize: rows to float32 (the embedding lookup of a packed table, and tests).
//
// With AVX-512 the dequantize is vector code per 32-weight sub-block; without it (AVX2 or
// scalar builds, see cpu_kernels._cflags) each block is dequantized to a float buffer by
// the scalar code below and the dot products are left to the compiler's vectorizer.
// Both accumulate in float32; they differ from "dequantize, then float32 matmul" only in
// the order of the sums. Layouts follow ggml's block structs (block_q4_0 ... block_q6_K).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// ggml type ids (GGMLQuantizationType).
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kBF16 = 30;  // plain bfloat16 weights, taken 32 at a time as one "block"
constexpr int kGemvMax = 4;     // the most tokens the register path takes
constexpr int kTileRows = 64;   // rows per dequantized tile on the batched path

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

#if defined(__AVX512F__)
// 16 bytes -> 16 int32 lanes.
inline __m512i widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512 to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }

// Sub-block ``sub`` (32 weights) of block ``b`` into lo (weights 0..15) and hi (16..31).
template <int Q>
inline void dequant32(const uint8_t* b, int sub, __m512& lo, __m512& hi) {
  const __m512i low4 = _mm512_set1_epi32(15);
  if constexpr (Q == kBF16) {  // bf16 is the top half of a float32
    const __m256i* p = reinterpret_cast<const __m256i*>(b);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1)), 16));
  } else if constexpr (Q == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    lo = _mm512_mul_ps(d, to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const float df = half_at(b);
    const __m512 d = _mm512_set1_ps(df);
    const __m512 m = _mm512_set1_ps(Q == kQ4_1 ? half_at(b + 2) : -8.f * df);
    const __m512i v = widen_u8(b + (Q == kQ4_1 ? 4 : 2));
    lo = _mm512_fmadd_ps(to_float(_mm512_and_si512(v, low4)), d, m);
    hi = _mm512_fmadd_ps(to_float(_mm512_srli_epi32(v, 4)), d, m);
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    int sc, mn;
    scale_min_k4(b + 4, sub, sc, mn);
    const __m512 ds = _mm512_set1_ps(half_at(b) * static_cast<float>(sc));
    const __m512 neg_dm = _mm512_set1_ps(-half_at(b + 2) * static_cast<float>(mn));
    const uint8_t* q = b + (Q == kQ5_K ? 48 : 16) + 32 * (sub / 2);
    const int shift = (sub & 1) * 4;
    __m512i v0 = _mm512_and_si512(_mm512_srli_epi32(widen_u8(q), shift), low4);
    __m512i v1 = _mm512_and_si512(_mm512_srli_epi32(widen_u8(q + 16), shift), low4);
    if constexpr (Q == kQ5_K) {
      const __m512i bit = _mm512_set1_epi32(1);
      const uint8_t* qh = b + 16;
      v0 = _mm512_or_si512(v0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen_u8(qh), sub), bit), 4));
      v1 = _mm512_or_si512(v1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen_u8(qh + 16), sub), bit), 4));
    }
    lo = _mm512_fmadd_ps(to_float(v0), ds, neg_dm);
    hi = _mm512_fmadd_ps(to_float(v1), ds, neg_dm);
  } else {  // Q6_K
    const int h = sub / 4, u = sub % 4;
    const uint8_t* ql = b + 64 * h + 32 * (u % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    const __m512i three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
    const int lshift = 4 * (u / 2), hshift = 2 * u;
    const __m512i v0 = _mm512_sub_epi32(_mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(widen_u8(ql), lshift), low4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen_u8(qh), hshift), three), 4)), bias);
    const __m512i v1 = _mm512_sub_epi32(_mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(widen_u8(ql + 16), lshift), low4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen_u8(qh + 16), hshift), three), 4)), bias);
    lo = _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(sc[2 * sub])), to_float(v0));
    hi = _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(sc[2 * sub + 1])), to_float(v1));
  }
}
#endif

// Rows [n_begin, n_end) of W into dst (row stride k_len), as float32.
template <int Q>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t k_len, int64_t n_begin,
                  int64_t n_end, float* dst) {
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>();
  const int64_t blocks = k_len / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* out = dst + (n - n_begin) * k_len;
    for (int64_t bi = 0; bi < blocks; ++bi) {
#if defined(__AVX512F__)
      for (int sub = 0; sub < kBlock / 32; ++sub) {
        __m512 lo, hi;
        dequant32<Q>(row + bi * kBytes, sub, lo, hi);
        _mm512_storeu_ps(out + bi * kBlock + sub * 32, lo);
        _mm512_storeu_ps(out + bi * kBlock + sub * 32 + 16, hi);
      }
#else
      dequant_block<Q>(row + bi * kBytes, out + bi * kBlock);
#endif
    }
  }
}

// y[m, n] for tokens m < M and rows n in [n_begin, n_end): dequantized in registers.
template <int Q, int M>
void gemv_rows(const float* x, int64_t xs, const uint8_t* w, int64_t row_bytes, int64_t k_len,
               float* y, int64_t ys, int64_t n_begin, int64_t n_end) {
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>();
  const int64_t blocks = k_len / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * row_bytes;
#if defined(__AVX512F__)
    // Two accumulators per token (low and high half of each sub-block): two FMA chains.
    __m512 acc_lo[M], acc_hi[M];
    for (int m = 0; m < M; ++m) acc_lo[m] = acc_hi[m] = _mm512_setzero_ps();
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const uint8_t* blk = row + bi * kBytes;
      for (int sub = 0; sub < kBlock / 32; ++sub) {
        __m512 lo, hi;
        dequant32<Q>(blk, sub, lo, hi);
        const float* xk = x + bi * kBlock + sub * 32;
        for (int m = 0; m < M; ++m) {
          acc_lo[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xk + m * xs), acc_lo[m]);
          acc_hi[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xk + m * xs + 16), acc_hi[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      y[m * ys + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[m], acc_hi[m]));
#else
    float buf[kBlock];
    float sum[M] = {};
    for (int64_t bi = 0; bi < blocks; ++bi) {
      dequant_block<Q>(row + bi * kBytes, buf);
      for (int m = 0; m < M; ++m) {
        const float* xk = x + m * xs + bi * kBlock;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < kBlock; ++i) s += buf[i] * xk[i];
        sum[m] += s;
      }
    }
    for (int m = 0; m < M; ++m) y[m * ys + n] = sum[m];
#endif
  }
}

template <int Q, int M>
void gemv(const float* x, int64_t xs, const uint8_t* w, int64_t row_bytes, int64_t n_len,
          int64_t k_len, float* y, int64_t ys) {
  // Grain: a call too small to pay for waking the other threads stays on this one.
  const int64_t grain = n_len * k_len < 65536 ? n_len : 8;
  at::parallel_for(0, n_len, grain, [&](int64_t begin, int64_t end) {
    gemv_rows<Q, M>(x, xs, w, row_bytes, k_len, y, ys, begin, end);
  });
}

template <int Q>
void tiled(const torch::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n_len,
           int64_t k_len, torch::Tensor& y) {
  // NOTE: tensor ops stay on this thread (the worker threads do not carry its inference
  // mode): the threads only dequantize, then one at::mm per chunk of rows.
  const int64_t chunk = kTileRows * std::max<int64_t>(1, at::get_num_threads());
  std::vector<float> buf(static_cast<size_t>(std::min(chunk, n_len) * k_len));
  for (int64_t n0 = 0; n0 < n_len; n0 += chunk) {
    const int64_t rows = std::min<int64_t>(chunk, n_len - n0);
    at::parallel_for(0, rows, kTileRows / 4, [&](int64_t begin, int64_t end) {
      dequant_rows<Q>(w, row_bytes, k_len, n0 + begin, n0 + end, buf.data() + begin * k_len);
    });
    const auto tile = torch::from_blob(buf.data(), {rows, k_len}, torch::kFloat32);
    y.narrow(1, n0, rows).copy_(at::mm(x, tile.t()));  // [M, rows]
  }
}

template <int Q>
void run(const torch::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n_len,
         int64_t k_len, torch::Tensor& y) {
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  switch (x.size(0)) {
    case 1: gemv<Q, 1>(xp, xs, w, row_bytes, n_len, k_len, yp, ys); break;
    case 2: gemv<Q, 2>(xp, xs, w, row_bytes, n_len, k_len, yp, ys); break;
    case 3: gemv<Q, 3>(xp, xs, w, row_bytes, n_len, k_len, yp, ys); break;
    case 4: gemv<Q, 4>(xp, xs, w, row_bytes, n_len, k_len, yp, ys); break;
    default: tiled<Q>(x, w, row_bytes, n_len, k_len, y); break;
  }
}

template <template <int> class F, typename... Args>
void dispatch(int qtype, Args&&... args) {
  switch (qtype) {
    case kQ8_0: F<kQ8_0>{}(args...); break;
    case kQ4_0: F<kQ4_0>{}(args...); break;
    case kQ4_1: F<kQ4_1>{}(args...); break;
    case kQ4_K: F<kQ4_K>{}(args...); break;
    case kQ5_K: F<kQ5_K>{}(args...); break;
    case kQ6_K: F<kQ6_K>{}(args...); break;
    case kBF16: F<kBF16>{}(args...); break;
    default: TORCH_CHECK(false, "ggml type ", qtype, " is not supported packed");
  }
}

template <int Q>
struct Shape {  // (block_len, block_bytes)
  void operator()(int64_t& len, int64_t& bytes) const {
    len = block_len<Q>();
    bytes = block_bytes<Q>();
  }
};

template <int Q>
struct Run {
  void operator()(const torch::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n,
                  int64_t k, torch::Tensor& y) const {
    run<Q>(x, w, row_bytes, n, k, y);
  }
};

template <int Q>
struct Dequant {
  void operator()(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, float* dst) const {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      dequant_rows<Q>(w, row_bytes, k, begin, end, dst + begin * k);
    });
  }
};

// Checks a packed weight [N, row_bytes] uint8 of ggml type ``qtype`` holding K columns.
void check_weight(const torch::Tensor& w, int64_t qtype, int64_t k_len) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8,
              "weight must be a CPU uint8 tensor of packed blocks");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous [N, row_bytes]");
  int64_t len = 0, bytes = 0;
  dispatch<Shape>(static_cast<int>(qtype), len, bytes);
  TORCH_CHECK(k_len % len == 0, "K=", k_len, " is not a multiple of the block length ", len);
  TORCH_CHECK(w.size(1) == k_len / len * bytes, "weight rows hold ", w.size(1),
              " bytes, K=", k_len, " needs ", k_len / len * bytes);
}

}  // namespace

// Writes x [M, K] @ W^T into out [M, N] (a view: unit column stride, any row stride).
void qmatmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t qtype,
             torch::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be float32 CPU");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2, "out must be float32 [M, N]");
  const int64_t k_len = x.size(1), n_len = weight.size(0);
  check_weight(weight, qtype, k_len);
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n_len && out.stride(1) == 1,
              "out must be [M, N] with unit column stride");
  if (x.size(0) == 0 || n_len == 0) return;
  const auto xc = x.is_contiguous() ? x : x.contiguous();
  dispatch<Run>(static_cast<int>(qtype), xc, weight.data_ptr<uint8_t>(), weight.size(1), n_len,
                k_len, out);
}

// Rows of W as float32 [N, K].
torch::Tensor dequantize(const torch::Tensor& weight, int64_t qtype, int64_t k_len) {
  check_weight(weight, qtype, k_len);
  auto out = torch::empty({weight.size(0), k_len}, torch::kFloat32);
  dispatch<Dequant>(static_cast<int>(qtype), weight.data_ptr<uint8_t>(), weight.size(1),
                    weight.size(0), k_len, out.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "out[M, N] = x[M, K] @ dequant(weight)[N, K]^T, float32");
  m.def("dequantize", &dequantize, "packed rows [N, row_bytes] -> float32 [N, K]");
  m.attr("GEMV_MAX_TOKENS") = kGemvMax;
#if defined(__AVX512F__)
  m.attr("ISA") = "avx512";
#elif defined(__AVX2__)
  m.attr("ISA") = "avx2";
#else
  m.attr("ISA") = "scalar";
#endif
}

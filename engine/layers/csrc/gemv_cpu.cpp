// Small-M float32 matmul for the CPU decode path: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// At decode M is 1..8 tokens, so each weight element is used M times at most: the call
// is bound by how fast W streams from memory, not by arithmetic. The kernel reads the
// dense [N, K] rows once, ROWS output rows at a time (their K-strips are adjacent in
// memory, so a block of ROWS rows is one contiguous stretch the hardware prefetcher
// follows), keeps x (M * K floats, a few KiB) in L1, and splits N over the threads.
// Each (token, row) pair has its own vector accumulator; the horizontal sum happens once
// per output element, after the K loop. Software prefetch (64-512 floats ahead in each
// row) was tried and measured no better than the hardware prefetcher, so there is none.
//
// Measured against oneDNN's packed GEMM streaming from DRAM (bench/micro/gemv.py): faster at
// M = 1 and 2, slower from M = 3 on (oneDNN's packed layout is one sequential stream,
// which keeps more reads in flight once the FMAs per byte grow); the Python side picks
// the threshold. The kernel itself takes M up to kMaxTokens.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

constexpr int kMaxTokens = 8;  // the largest M the kernel takes; larger M is oneDNN's

// y[m, n0 .. n0 + ROWS) for every token m < M: ROWS weight rows against M tokens.
template <int M, int ROWS>
inline void rows_block(const float* x, int64_t x_stride, const float* w, int64_t k_len,
                       const float* bias, float* y, int64_t y_stride, int64_t n0) {
  const float* wr = w + n0 * k_len;
#if defined(__AVX512F__)
  __m512 acc[M][ROWS];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_len; k += 16) {
    __m512 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = _mm512_loadu_ps(wr + r * k_len + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * x_stride + k);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  if (k < k_len) {  // K tail: masked loads read nothing past the row
    const __mmask16 mask = lanes16(k_len - k);
    __m512 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, wr + r * k_len + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * x_stride + k);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[m][r]);
      y[m * y_stride + n0 + r] = bias ? sum + bias[n0 + r] : sum;
    }
#else
  // Without AVX-512 the compiler vectorizes each dot product (AVX2 where torch found it).
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) {
      const float* xm = x + m * x_stride;
      const float* wrow = wr + r * k_len;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < k_len; ++k) sum += xm[k] * wrow[k];
      y[m * y_stride + n0 + r] = bias ? sum + bias[n0 + r] : sum;
    }
#endif
}

// Rows per block for M tokens: M * ROWS accumulators stay in the 32 vector registers
// with room for the ROWS weight vectors and one x vector.
template <int M>
constexpr int rows_for() {
  return M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : 2;
}

template <int M>
void gemv_tokens(const float* x, int64_t x_stride, const float* w, int64_t n_len,
                 int64_t k_len, const float* bias, float* y) {
  constexpr int kRows = rows_for<M>();
  const int64_t blocks = n_len / kRows;
  // One task per thread (grain 1 splits the blocks evenly); a call too small to pay for
  // waking the other threads (< ~64 KiB of weights) stays on this one.
  const int64_t grain = n_len * k_len < 16384 ? std::max<int64_t>(blocks, 1) : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      rows_block<M, kRows>(x, x_stride, w, k_len, bias, y, n_len, b * kRows);
  });
  for (int64_t n = blocks * kRows; n < n_len; ++n)  // the N % ROWS rows left over
    rows_block<M, 1>(x, x_stride, w, k_len, bias, y, n_len, n);
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ",
              t.scalar_type());
}

}  // namespace

// x [M, K] float32 (any row stride; copied if its last dim is strided), weight [N, K]
// contiguous, bias [N] or None. Returns a new contiguous y [M, N].
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight,
                   const std::optional<torch::Tensor>& bias) {
  check_float(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K]");
  const int64_t tokens = x.size(0), k_len = x.size(1), n_len = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_len, "x has K=", k_len, " but weight is [", n_len, ", ",
              weight.size(1), "]");
  TORCH_CHECK(tokens <= kMaxTokens, "gemv takes at most ", kMaxTokens, " rows, got ", tokens,
              "; use a GEMM for more");
  const float* bias_ptr = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    check_float(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_len, "bias must be [N]");
    bias_c = bias->contiguous();
    bias_ptr = bias_c.data_ptr<float>();
  }
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  auto y = torch::empty({tokens, n_len}, x.options());
  if (tokens == 0 || n_len == 0) return y;
  if (k_len == 0) return bias_ptr ? bias_c.unsqueeze(0).expand({tokens, n_len}).contiguous() : y.zero_();
  const float* xp = xc.data_ptr<float>();
  const int64_t xs = xc.stride(0);
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (tokens) {
    case 1: gemv_tokens<1>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    case 2: gemv_tokens<2>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    case 3: gemv_tokens<3>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    case 4: gemv_tokens<4>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    case 5: gemv_tokens<5>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    case 6: gemv_tokens<6>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    case 7: gemv_tokens<7>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
    default: gemv_tokens<8>(xp, xs, wp, n_len, k_len, bias_ptr, yp); break;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops (see quant_cpu.cpp).
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("gemv", &gemv, no_gil, "y[M, N] = x[M, K] @ weight[N, K]^T (+ bias), M <= 8, float32",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.attr("MAX_TOKENS") = kMaxTokens;
}

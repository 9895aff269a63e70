// Fused element-wise kernels for the CPU decoder (float32): each replaces two to three
// PyTorch ops, so one pass over the activations instead of several, and one dispatch.
//
// - add_rms_norm: summed = x + residual; normed = rms_norm(summed) * weight
// - rotary:       NeoX rotate-half RoPE of [T, H, D] with cos/sin [T, D] (sign in sin)
//
// SwiGLU (silu(gate) * up) was tried too and left out: even vectorized (a polynomial exp)
// it measured 1.5x slower than PyTorch's two ops, whose exp runs AVX-512 wide.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ",
              t.scalar_type());
}

// Rows per parallel_for task: small batches (decode) stay on one thread, where waking the
// others costs more than the work.
int64_t grain_for(int64_t row_elems) {
  constexpr int64_t kElemsPerTask = 32768;
  return std::max<int64_t>(1, kElemsPerTask / std::max<int64_t>(1, row_elems));
}

}  // namespace

// x, residual [T, N] float32 (last dim contiguous); weight [N]. Returns (normed, summed).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(residual, "residual");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes(), "x and residual must be [T, N]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [N]");
  const auto xc = x.contiguous();
  const auto rc = residual.contiguous();
  const auto wc = weight.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto normed = torch::empty_like(xc);
  auto summed = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* rp = rc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* np_ = normed.data_ptr<float>();
  float* sp = summed.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * n;
      const float* rr = rp + t * n;
      float* sr = sp + t * n;
      float* nr = np_ + t * n;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) {
        const float s = xr[i] + rr[i];
        sr[i] = s;
        squares += s * s;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + feps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) nr[i] = sr[i] * inv * wp[i];
    }
  });
  return {normed, summed};
}

// x [T, H, D] float32 with a contiguous last dim (any row/head strides); cos, sin [T, D]
// contiguous (sin carries the rotate-half sign). Returns a new contiguous [T, H, D]:
// out[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin[d].
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_float(x, "x");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with a contiguous last dim");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even, got ", dim);
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim,
              "cos and sin must hold [T, head_dim] values");
  const auto cc = cos.contiguous();
  const auto sc = sin.contiguous();
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* snp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1), half = dim / 2;
  at::parallel_for(0, tokens, grain_for(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = snp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + t * row_stride + h * head_stride;
        float* o = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) o[d] = in[d] * c[d] + in[d + half] * s[d];
#pragma omp simd
        for (int64_t d = half; d < dim; ++d) o[d] = in[d] * c[d] + in[d - half] * s[d];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual) * weight, x + residual)");
  m.def("rotary", &rotary, "NeoX rotate-half RoPE of [T, H, D] (cos/sin [T, D])");
}

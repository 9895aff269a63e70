// Fused element-wise kernels for the CPU decoder (float32): each replaces two to three
// PyTorch ops, so one pass over the activations instead of several, and one dispatch.
//
// - add_rms_norm: summed = x + residual; normed = rms_norm(summed) * weight
// - rotary:       NeoX rotate-half RoPE of [T, H, D] with cos/sin [T, D] (sign in sin)
// - silu_mul:     SwiGLU, silu(gate) * up of gate_up [T, 2I] into [T, I]
// - argmax_rows:  greedy sampling, the first index of each row's maximum (torch's
//                 argmax on the CPU is a scalar loop, ~50x slower than its amax)
//
// An earlier SwiGLU measured 1.5x slower than PyTorch's two ops: it was built for AVX2
// only and ran on one thread. This one is AVX-512 wide where the build has it (see
// cpu_kernels._cflags) and splits rows and columns over the threads.
//
// Included by fused_cpu.cpp (their Python binding) and by decode_layers.h, not built alone.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace hiserve_fused {

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


// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for i in [0, n).
void silu_mul_span(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, silu_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// Index of the first maximum of row[0, n) (n >= 1); the first NaN if there is one, as
// torch.argmax.
int64_t argmax_span(const float* row, int64_t n) {
  int64_t i = 0;
  float best = row[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 peak = _mm512_loadu_ps(row);
    __mmask16 nan_seen = _mm512_cmp_ps_mask(peak, peak, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      nan_seen |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      peak = _mm512_max_ps(peak, v);
    }
    if (nan_seen) {
      i = 0;  // rare: fall through to the scalar scan, which finds the first NaN
    } else {
      best = _mm512_reduce_max_ps(peak);
      for (; i < n; ++i) best = std::max(best, row[i]);  // the tail
      const __m512 target = _mm512_set1_ps(best);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
      }
      for (; j < n; ++j) {
        if (row[j] == best) return j;
      }
    }
  }
#endif
  int64_t at = 0;
  best = row[0];
  if (std::isnan(best)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    if (std::isnan(row[j])) return j;
    if (row[j] > best) {
      best = row[j];
      at = j;
    }
  }
  return at;
}

}  // namespace

// x, residual [T, N] float32 (last dim contiguous); weight [N]. Returns (normed, summed).
inline std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(
    const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
    double eps) {
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
inline torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin) {
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

// gate_up [T, 2I] float32 (rows may be strided, last dim contiguous): gate in columns
// [0, I), up in [I, 2I). Returns silu(gate) * up as a new contiguous [T, I].
inline torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1,
              "gate_up must be [T, 2 * intermediate] with a contiguous last dim");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns, got ",
              gate_up.size(1));
  const int64_t rows = gate_up.size(0), cols = gate_up.size(1) / 2;
  auto out = torch::empty({rows, cols}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t in_stride = gate_up.stride(0);
  // Work items are column blocks of every row, so a single decode row is split too; a
  // block is a multiple of 16 floats (one AVX-512 vector).
  constexpr int64_t kBlock = 512;
  const int64_t blocks_per_row = (cols + kBlock - 1) / kBlock;
  // About 8K elements per task: fewer and the thread wake-up costs more than the work.
  const int64_t grain = std::max<int64_t>(1, 8192 / kBlock);
  at::parallel_for(0, rows * blocks_per_row, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / blocks_per_row;
      const int64_t c0 = (item % blocks_per_row) * kBlock;
      const int64_t n = std::min(kBlock, cols - c0);
      const float* gate = in + t * in_stride + c0;
      silu_mul_span(gate, gate + cols, op + t * cols + c0, n);
    }
  });
  return out;
}

// logits [B, V] float32 (rows may be strided, last dim contiguous). Returns [B] int64:
// torch.argmax(logits, dim=-1), the first index of each row's maximum.
inline torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_float(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be [B, V] with a contiguous last dim");
  TORCH_CHECK(logits.size(1) >= 1, "logits must have at least one column");
  const int64_t rows = logits.size(0), cols = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* in = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = argmax_span(in + b * stride, cols);
  });
  return out;
}

}  // namespace hiserve_fused

// A pure decode step through every decoder layer of a Llama-style model whose linear
// layers are packed (qmatmul), as one native call.
//
// Why: at decode a layer is ~10 small native calls (RMSNorm, the packed matmuls, RoPE,
// the K/V store, attention, SwiGLU: on AMX in the gate/up product's pass, as GatedMLP's)
// and ~25 Python-level tensor operations between them; for the default model that Python
// came to ~1.5 ms of a ~7 ms single-stream step. Here the same kernels run in the same
// order on the same tensors (at::rms_norm for the first norm as F.rms_norm, fused_ops.h,
// paged_attention.h, qmatmul), so the hidden states equal LlamaForCausalLM.forward's bit
// for bit (engine/models/native_decode.py checks which models qualify and calls it;
// tests/unit/test_native_decode.py compares them).
//
// Included by quant_cpu.cpp, which defines qmatmul and binds these classes; not built
// alone.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "fused_ops.h"
#include "paged_attention.h"

// out[M, N] = x[M, K] @ dequant(weight)^T (quant_cpu.cpp).
void qmatmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t qtype,
             torch::Tensor out);
// out[M, N / 2] = silu(x @ gate^T) * (x @ up^T) for weight = [gate; up] in one pass over
// the AMX tiles; false (nothing written) where qmatmul would not take them (quant_cpu.cpp).
bool qmatmul_swiglu(const torch::Tensor& x, const torch::Tensor& weight, int64_t qtype,
                    torch::Tensor out);
// Whether qmatmul_swiglu's pass runs for a batch of ``tokens`` (quant_cpu.cpp).
bool swiglu_pass_taken(int64_t tokens);

namespace hiserve_decode {

// (first output row, [rows, row_bytes] uint8 blocks, ggml type): one row segment.
using Segment = std::tuple<int64_t, torch::Tensor, int64_t>;

// A FusedLinear holding a PackedWeight: x [T, in] -> [T, out], as PackedWeight.matmul.
class PackedLinear {
 public:
  PackedLinear(int64_t out_features, std::vector<Segment> segments,
               std::optional<torch::Tensor> bias)
      : out_features_(out_features), segments_(std::move(segments)), bias_(std::move(bias)) {
    int64_t rows = 0;
    for (const auto& [start, data, qtype] : segments_) {
      TORCH_CHECK(start == rows, "packed segments must cover the rows in order");
      rows += data.size(0);
    }
    TORCH_CHECK(rows == out_features_, "packed segments hold ", rows, " rows, not ",
                out_features_);
    TORCH_CHECK(!bias_ || (bias_->dim() == 1 && bias_->size(0) == out_features_),
                "bias must be [out_features]");
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto out = torch::empty({x.size(0), out_features_}, x.options());
    for (const auto& [start, data, qtype] : segments_) {
      qmatmul(x, data, qtype, out.narrow(1, start, data.size(0)));
    }
    if (bias_) out.add_(*bias_);
    return out;
  }

  // For a [gate; up] weight of one segment and no bias: silu(gate) * up in the product's
  // own pass, as PackedWeight.swiglu (the same bits as multiplying, then silu_mul); none
  // where that pass is not taken.
  std::optional<torch::Tensor> swiglu(const torch::Tensor& x) const {
    // NOTE: asked first, so a single stream's step allocates no output it would not use
    if (segments_.size() != 1 || bias_ || !swiglu_pass_taken(x.size(0))) return std::nullopt;
    const auto& [start, data, qtype] = segments_.front();
    auto out = torch::empty({x.size(0), out_features_ / 2}, x.options());
    if (!qmatmul_swiglu(x, data, qtype, out)) return std::nullopt;
    return out;
  }

 private:
  int64_t out_features_;
  std::vector<Segment> segments_;
  std::optional<torch::Tensor> bias_;
};

// RMSNorm weight [hidden] and its eps.
using Norm = std::pair<torch::Tensor, double>;

struct DecoderLayer {
  Norm input_norm, post_attention_norm;
  PackedLinear qkv, o, gate_up, down;
};

class DecodeLayers {
 public:
  DecodeLayers(int64_t q_heads, int64_t kv_heads, int64_t head_dim, Norm final_norm)
      : q_heads_(q_heads), kv_heads_(kv_heads), head_dim_(head_dim),
        final_norm_(std::move(final_norm)) {}

  void add_layer(Norm input_norm, Norm post_attention_norm, PackedLinear qkv, PackedLinear o,
                 PackedLinear gate_up, PackedLinear down) {
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv),
                       std::move(o), std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [B, hidden]: the embedded new tokens, one per sequence; cos, sin [B, 1, D];
  // k_buffers, v_buffers: each layer's [slots, kv_heads, D] pool; out_slots [B] int64:
  // where each new token's K/V goes; table [R, C] int32, rows [B] int64, lens [B] int64
  // (the new token included). Returns the final norm's output [B, hidden].
  torch::Tensor run(const torch::Tensor& hidden, const torch::Tensor& cos,
                    const torch::Tensor& sin, const std::vector<torch::Tensor>& k_buffers,
                    const std::vector<torch::Tensor>& v_buffers, const torch::Tensor& out_slots,
                    const torch::Tensor& table, const torch::Tensor& rows,
                    const torch::Tensor& lens) const {
    const auto layers = static_cast<size_t>(num_layers());
    TORCH_CHECK(k_buffers.size() == layers && v_buffers.size() == layers,
                "one K and one V buffer per layer");
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32,
                "hidden must be float32 [B, hidden]");
    const int64_t batch = hidden.size(0), qk_heads = q_heads_ + kv_heads_;
    // As CpuNativeAttentionBackend's head_dim ** -0.5 (C's pow, like Python's).
    const double scale = std::pow(static_cast<double>(head_dim_), -0.5);
    torch::Tensor x = hidden, residual;
    for (size_t l = 0; l < layers; ++l) {
      const DecoderLayer& layer = layers_[l];
      torch::Tensor normed;
      if (l == 0) {  // LlamaDecoderLayer: the first layer's residual is its input
        residual = x;
        normed = at::rms_norm(x, {x.size(1)}, layer.input_norm.first, layer.input_norm.second);
      } else {
        std::tie(normed, residual) = hiserve_fused::add_rms_norm(
            x, residual, layer.input_norm.first, layer.input_norm.second);
      }
      // [B, q_heads + 2 * kv_heads, D]
      const auto qkv = layer.qkv(normed).view({batch, qk_heads + kv_heads_, head_dim_});
      const auto qk = hiserve_fused::rotary(qkv.narrow(1, 0, qk_heads), cos, sin);
      hiserve_paged::store_kv(k_buffers[l], v_buffers[l], out_slots,
                              qk.narrow(1, q_heads_, kv_heads_),
                              qkv.narrow(1, qk_heads, kv_heads_));
      const auto attn = hiserve_paged::paged_decode(qk.narrow(1, 0, q_heads_), k_buffers[l],
                                                    v_buffers[l], table, rows, lens, scale);
      std::tie(normed, residual) =
          hiserve_fused::add_rms_norm(layer.o(attn.view({batch, q_heads_ * head_dim_})),
                                      residual, layer.post_attention_norm.first,
                                      layer.post_attention_norm.second);
      auto act = layer.gate_up.swiglu(normed);
      x = layer.down(act ? *act : hiserve_fused::silu_mul(layer.gate_up(normed)));
    }
    if (layers == 0) return at::rms_norm(x, {x.size(1)}, final_norm_.first, final_norm_.second);
    return std::get<0>(
        hiserve_fused::add_rms_norm(x, residual, final_norm_.first, final_norm_.second));
  }

 private:
  int64_t q_heads_, kv_heads_, head_dim_;
  Norm final_norm_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace hiserve_decode

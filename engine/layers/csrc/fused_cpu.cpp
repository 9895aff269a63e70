// Python binding of the fused element-wise kernels (fused_ops.h).
#include "fused_ops.h"

using hiserve_fused::add_rms_norm;
using hiserve_fused::argmax_rows;
using hiserve_fused::rotary;
using hiserve_fused::silu_mul;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual) * weight, x + residual)");
  m.def("rotary", &rotary, "NeoX rotate-half RoPE of [T, H, D] (cos/sin [T, D])");
  m.def("argmax_rows", &argmax_rows, "argmax over the last dim of [B, V] (first maximum)");
  m.def("silu_mul", &silu_mul, "SwiGLU: silu(gate) * up of gate_up [T, 2I] into [T, I]");
}

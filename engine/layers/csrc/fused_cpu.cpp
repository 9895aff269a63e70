// Python binding of the fused element-wise kernels (fused_ops.h).
#include "fused_ops.h"

using hiserve_fused::add_rms_norm;
using hiserve_fused::argmax_rows;
using hiserve_fused::rotary;
using hiserve_fused::silu_mul;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops (see quant_cpu.cpp).
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("add_rms_norm", &add_rms_norm, no_gil, "(rms_norm(x + residual) * weight, x + residual)");
  m.def("rotary", &rotary, no_gil, "NeoX rotate-half RoPE of [T, H, D] (cos/sin [T, D])");
  m.def("argmax_rows", &argmax_rows, no_gil, "argmax over the last dim of [B, V] (first maximum)");
  m.def("silu_mul", &silu_mul, no_gil, "SwiGLU: silu(gate) * up of gate_up [T, 2I] into [T, I]");
}

// Python binding of the paged attention kernels: decode (paged_attention.h) and
// prefill / extend (prefill_attention.h).
#include "paged_attention.h"
#include "prefill_attention.h"

using hiserve_paged::paged_decode;
using hiserve_paged::parallel_threads;
using hiserve_paged::prefill_attention;
using hiserve_paged::prefill_takes;
using hiserve_paged::store_kv;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops (see quant_cpu.cpp).
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, no_gil, "Decode attention over a paged KV pool (CPU; float32 or bfloat16 K/V)");
  m.def("prefill_attention", &prefill_attention, no_gil, "Causal prefill / extend attention, float32 (CPU; AVX-512)");
  m.def("prefill_takes", &prefill_takes, "Whether prefill_attention takes this head_dim here");
  m.def("store_kv", &store_kv, no_gil, "Write one layer's new K/V rows to their pool slots (CPU)");
  m.def("parallel_threads", &parallel_threads, "Threads used by a parallel_for (a self-check)");
}

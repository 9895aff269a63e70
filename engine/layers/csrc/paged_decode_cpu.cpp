// Python binding of the paged decode attention kernels (paged_attention.h).
#include "paged_attention.h"

using hiserve_paged::paged_decode;
using hiserve_paged::parallel_threads;
using hiserve_paged::store_kv;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Decode attention over a paged KV pool (CPU; float32 or bfloat16 K/V)");
  m.def("store_kv", &store_kv, "Write one layer's new K/V rows to their pool slots (CPU)");
  m.def("parallel_threads", &parallel_threads, "Threads used by a parallel_for (a self-check)");
}

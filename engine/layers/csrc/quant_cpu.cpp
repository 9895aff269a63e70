// Matmul against GGUF block-quantized weights kept packed: y[M, N] = x[M, K] @ W[N, K]^T
// where each row of W is a run of ggml blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), or
// plain bfloat16 (ggml's BF16, taken 32 weights at a time): --dtype bfloat16 on the CPU.
//
// - qmatmul, M <= kGemvMax (quant_gemv.h): each row's blocks are dequantized 32 weights
//   at a time into two 16-float vectors (registers only) and multiplied into one float32
//   accumulator per token; rows are split over the threads. The bytes read per call are the packed
//   bytes, 3.5-8.5 bits a weight instead of 32. With AVX-512 rows go 4 at a time (2 at
//   3-4 tokens; rows_in_registers), each run of scales converted once: 16 blocks' of
//   the 32-weight types by one gather, a K-quant block's 8 or 16.
// - qmatmul, larger M, on a CPU with AMX: bf16 tiles with a hi/lo split of both operands,
//   float32 sums (quant_amx.h); the dequantize cost is paid once per call.
// - qmatmul, up to kFmaMaxTokens (128) tokens elsewhere (AVX-512 or AVX2): tiles of 12
//   rows dequantized into L1 a K slice at a time and multiplied into a vector of tokens
//   at a time (quant_fma.h).
// - qmatmul, more tokens, elsewhere: the threads dequantize chunks of kTileRows rows each
//   into a float32 buffer (about 1 MB a chunk), then at::mm multiplies the chunk by all
//   tokens, writing in place into the output's columns.
// - qmatmul_swiglu: a [gate; up] weight's product and SwiGLU in one pass on AMX.
// - qmatmul_swiglu_down: that pass writing the down product's token tiles, then the down
//   product from them (the MLP of a batch on AMX, no float32 [M, I] in memory).
// - dequantize: rows to float32 (the embedding lookup of a packed table, and tests).
//
// With AVX-512 the dequantize is vector code per unit of sub-blocks that share bytes
// (quant_unpack.h), 16 weights a vector (4- and 5-bit quants picked from a table of
// their 16 or 32 values); AVX2 builds (see cpu_kernels._cflags) run the same per
// 32-weight sub-block at 8 a vector. Scalar builds dequantize a block
// at a time to a float buffer by the scalar code (quant_blocks.h) and leave the dot
// products to the compiler.
// Both accumulate in float32; they differ from "dequantize, then float32 matmul" only in
// the order of the sums. Layouts follow ggml's block structs (block_q4_0 ... block_q6_K).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "quant_amx.h"
#include "quant_fma.h"
#include "quant_gemv.h"
#include "quant_unpack.h"

namespace {

using namespace hiserve_quant;  // NOLINT: the block formats, one namespace per header

constexpr int kTileRows = 64;   // rows per dequantized tile on the batched path
// Floats of dequantized rows per at::mm on the batched path (1 MB): fewer, larger calls.
constexpr int64_t kChunkFloats = 256 * 1024;

// Rows [n_begin, n_end) of W into dst (row stride k_len), as float32.
template <int Q>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t k_len, int64_t n_begin,
                  int64_t n_end, float* dst) {
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>();
  const int64_t blocks = k_len / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* out = dst + (n - n_begin) * k_len;
    for (int64_t bi = 0; bi < blocks; ++bi)
      dequant_block_to<Q>(row + bi * kBytes, out + bi * kBlock);
  }
}

template <int Q>
void tiled(const torch::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n_len,
           int64_t k_len, torch::Tensor& y) {
  // NOTE: tensor ops stay on this thread (the worker threads do not carry its inference
  // mode): the threads only dequantize, then one at::mm per chunk of rows.
  const int64_t step = kTileRows * std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, kChunkFloats / (k_len * step)) * step;
  std::vector<float> buf(static_cast<size_t>(std::min(chunk, n_len) * k_len));
  for (int64_t n0 = 0; n0 < n_len; n0 += chunk) {
    const int64_t rows = std::min<int64_t>(chunk, n_len - n0);
    at::parallel_for(0, rows, kTileRows / 4, [&](int64_t begin, int64_t end) {
      dequant_rows<Q>(w, row_bytes, k_len, n0 + begin, n0 + end, buf.data() + begin * k_len);
    });
    const auto tile = torch::from_blob(buf.data(), {rows, k_len}, torch::kFloat32);
    auto out = y.narrow(1, n0, rows);  // [M, rows], row stride N: BLAS writes it in place
    at::mm_out(out, x, tile.t());
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
    default:
#if defined(HISERVE_HAVE_AMX)
      if (amx_available() && amx_enabled().load()) {
        amx_matmul<Q>(xp, xs, x.size(0), w, row_bytes, n_len, k_len, yp, ys);
        break;
      }
#endif
#if defined(HISERVE_HAVE_FMA_TILES)
      if (x.size(0) <= fma_max_tokens().load()) {
        fma_matmul<Q>(xp, xs, x.size(0), w, row_bytes, n_len, k_len, yp, ys);
        break;
      }
#endif
      tiled<Q>(x, w, row_bytes, n_len, k_len, y);
      break;
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

#if defined(HISERVE_HAVE_AMX)
template <int Q>
struct RunSwiglu {  // y [M, N] from a [gate; up] weight of 2N rows
  void operator()(const torch::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n,
                  int64_t k, torch::Tensor& y) const {
    amx_matmul<Q>(x.data_ptr<float>(), x.stride(0), x.size(0), w, row_bytes, n, k,
                  y.data_ptr<float>(), y.stride(0), /*swiglu=*/true);
  }
};

// The SwiGLU result of a [gate; up] weight of 2I rows into token tiles (th, and tl unless
// null) for a product with K = I.
template <int Q>
struct RunSwigluTiles {
  void operator()(const torch::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t i_len,
                  int64_t k, uint16_t* th, uint16_t* tl) const {
    amx_matmul<Q>(x.data_ptr<float>(), x.stride(0), x.size(0), w, row_bytes, i_len, k,
                  nullptr, 0, /*swiglu=*/true, th, tl);
  }
};

// y [M, N] = tokens (tile layout: th, and tl unless Q rounds them) @ W^T.
template <int Q>
struct RunTiles {
  void operator()(const uint16_t* th, const uint16_t* tl, int64_t m, const uint8_t* w,
                  int64_t row_bytes, int64_t n, int64_t k, torch::Tensor& y) const {
    amx_run<Q>(th, tl, m, w, row_bytes, n, k, y.data_ptr<float>(), y.stride(0), false);
  }
};

template <int Q>
struct Rounds {
  void operator()(bool& rounds) const { rounds = rounds_tokens<Q>(); }
};
#endif

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

// Whether qmatmul_swiglu's pass runs for a batch of ``tokens``: where qmatmul takes the AMX
// path (more than GEMV_MAX_TOKENS tokens, AMX present and on).
bool swiglu_pass_taken(int64_t tokens) {
#if defined(HISERVE_HAVE_AMX)
  return tokens > kGemvMax && amx_available() && amx_enabled().load();
#else
  (void)tokens;
  return false;
#endif
}

// out [M, I] = silu(x @ gate^T) * (x @ up^T) for weight = [gate; up], [2I, row_bytes], in
// one pass over the AMX tiles. Returns false, having written nothing, where qmatmul would
// not take the AMX path (GEMV_MAX_TOKENS tokens or fewer, no AMX): multiply, then SwiGLU.
bool qmatmul_swiglu(const torch::Tensor& x, const torch::Tensor& weight, int64_t qtype,
                    torch::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be float32 CPU");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2, "out must be float32 [M, I]");
  const int64_t k_len = x.size(1), half = weight.size(0) / 2;
  check_weight(weight, qtype, k_len);
  TORCH_CHECK(weight.size(0) % 2 == 0, "a [gate; up] weight has an even number of rows");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == half && out.stride(1) == 1,
              "out must be [M, I] with unit column stride");
#if defined(HISERVE_HAVE_AMX)
  if (!swiglu_pass_taken(x.size(0))) return false;
  const auto xc = x.is_contiguous() ? x : x.contiguous();
  if (half > 0)
    dispatch<RunSwiglu>(static_cast<int>(qtype), xc, weight.data_ptr<uint8_t>(), weight.size(1),
                        half, k_len, out);
  return true;
#else
  return false;
#endif
}

// out [M, H] = (silu(x @ gate^T) * (x @ up^T)) @ down^T for gate_up = [gate; up] ([2I,
// ..]) and down ([H, ..], K = I): the SwiGLU result goes from the tiles into the down
// product's token tiles, bf16 as that product would round it (with the low part where
// down's type keeps it), never to memory as float32. The same floats as qmatmul_swiglu,
// then qmatmul. Returns false, having written nothing, where that pass is not taken (as
// qmatmul_swiglu). I is a whole number of down's blocks, so a multiple of 32, as the
// tiles need.
bool qmatmul_swiglu_down(const torch::Tensor& x, const torch::Tensor& gate_up,
                         int64_t gate_up_qtype, const torch::Tensor& down, int64_t down_qtype,
                         torch::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be float32 CPU");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2, "out must be float32 [M, H]");
  const int64_t k_len = x.size(1), i_len = gate_up.size(0) / 2, h_len = down.size(0);
  check_weight(gate_up, gate_up_qtype, k_len);
  TORCH_CHECK(gate_up.size(0) % 2 == 0, "a [gate; up] weight has an even number of rows");
  check_weight(down, down_qtype, i_len);
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == h_len && out.stride(1) == 1,
              "out must be [M, H] with unit column stride");
#if defined(HISERVE_HAVE_AMX)
  if (!swiglu_pass_taken(x.size(0))) return false;
  if (i_len == 0) out.zero_();  // an empty sum
  if (x.size(0) == 0 || i_len == 0 || h_len == 0) return true;
  const auto xc = x.is_contiguous() ? x : x.contiguous();
  bool rounds = false;
  dispatch<Rounds>(static_cast<int>(down_qtype), rounds);
  const int64_t m_pad = (x.size(0) + 15) / 16 * 16;
  LineBuffer<uint16_t> th(m_pad * i_len), tl(rounds ? 0 : m_pad * i_len);
  uint16_t* lo = rounds ? nullptr : tl.data;
  dispatch<RunSwigluTiles>(static_cast<int>(gate_up_qtype), xc, gate_up.data_ptr<uint8_t>(),
                           gate_up.size(1), i_len, k_len, th.data, lo);
  dispatch<RunTiles>(static_cast<int>(down_qtype), th.data, lo, x.size(0),
                     down.data_ptr<uint8_t>(), down.size(1), h_len, i_len, out);
  return true;
#else
  return false;
#endif
}

// Rows of W as float32 [N, K].
torch::Tensor dequantize(const torch::Tensor& weight, int64_t qtype, int64_t k_len) {
  check_weight(weight, qtype, k_len);
  auto out = torch::empty({weight.size(0), k_len}, torch::kFloat32);
  dispatch<Dequant>(static_cast<int>(qtype), weight.data_ptr<uint8_t>(), weight.size(1),
                    weight.size(0), k_len, out.data_ptr<float>());
  return out;
}

#include "decode_layers.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using hiserve_decode::DecodeLayers;
  using hiserve_decode::PackedLinear;
  // NOTE: every kernel runs without the GIL, as torch's own ops do: a prefill's products
  // take milliseconds each, during which the server's event loop and tokenizer threads
  // would otherwise wait (they hold no tensor these touch).
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("qmatmul", &qmatmul, no_gil, "out[M, N] = x[M, K] @ dequant(weight)[N, K]^T, float32");
  // NOTE: module_local: a process may load two builds of this module (the tests load the
  // AVX2 build beside the native one), and pybind11 registers a global type once.
  py::class_<PackedLinear>(m, "PackedLinear", py::module_local())
      .def(py::init<int64_t, std::vector<hiserve_decode::Segment>, std::optional<torch::Tensor>>(),
           py::arg("out_features"), py::arg("segments"), py::arg("bias"),
           "a packed linear layer: (first row, blocks, ggml type) segments and a bias")
      .def("__call__", &PackedLinear::operator(), no_gil, "x [T, in] -> [T, out] float32");
  py::class_<DecodeLayers>(m, "DecodeLayers", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, hiserve_decode::Norm>(), py::arg("q_heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("final_norm"))
      .def("add_layer", &DecodeLayers::add_layer, "append a decoder layer (norms, linears)")
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      // NOTE: the whole step runs without the GIL: the server's event loop and tokenizer
      // threads go on meanwhile (it touches tensors only).
      .def("run", &DecodeLayers::run, no_gil,
           "a pure decode step through every layer -> the final norm's output [B, hidden]");
  m.def("qmatmul_swiglu", &qmatmul_swiglu, no_gil,
        "out[M, I] = silu(x @ gate^T) * (x @ up^T), weight [gate; up]; false: not done here");
  m.def("qmatmul_swiglu_down", &qmatmul_swiglu_down, no_gil,
        "out[M, H] = (silu(x @ gate^T) * (x @ up^T)) @ down^T, the SwiGLU result kept in "
        "tiles; false where that pass is not taken");
  m.def("dequantize", &dequantize, no_gil, "packed rows [N, row_bytes] -> float32 [N, K]");
  m.attr("GEMV_MAX_TOKENS") = kGemvMax;
#if defined(HISERVE_HAVE_AMX)
  m.attr("AMX") = amx_available();
  m.attr("AMX_STREAM_OUTPUT_BYTES") = kStreamOutputBytes;
  m.def("set_amx", [](bool on) { return amx_enabled().exchange(on); },
        "use the AMX path for more than GEMV_MAX_TOKENS tokens where the CPU has it; "
        "returns the previous setting");
#else
  m.attr("AMX") = false;
  m.attr("AMX_STREAM_OUTPUT_BYTES") = 0;
  m.def("set_amx", [](bool) { return false; }, "no AMX in this build");
#endif
#if defined(HISERVE_HAVE_FMA_TILES)
  m.attr("FMA_MAX_TOKENS") = kFmaMaxTokens;
  m.def("set_fma_max_tokens", [](int64_t n) { return fma_max_tokens().exchange(n); },
        "the most tokens the FMA tiles take without AMX (0: off); returns the previous one");
#else
  m.attr("FMA_MAX_TOKENS") = 0;
  m.def("set_fma_max_tokens", [](int64_t) { return int64_t{0}; }, "no FMA tiles in this build");
#endif
#if defined(__AVX512F__)
  m.attr("ISA") = "avx512";
#elif defined(__AVX2__)
  m.attr("ISA") = "avx2";
#else
  m.attr("ISA") = "scalar";
#endif
}

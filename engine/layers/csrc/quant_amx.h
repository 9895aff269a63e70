// The batched packed matmul on Intel AMX (tiles of bf16 multiplied into float32), for
// CPUs that have it (Sapphire Rapids and later): y[M, N] = x[M, K] @ W[N, K]^T.
// Included by quant_cpu.cpp, not built alone.
//
// Precision: bf16 has an 8-bit mantissa, so each operand is split into a high and a low
// bf16 part (v = hi + lo, exact to about 2^-17 of |v|) and each tile product takes the
// three terms that matter, x_hi w_hi + x_hi w_lo + x_lo w_hi, accumulated in float32 by
// the tiles. The dropped x_lo w_lo and the split's residue bound each output's error by
// about 1.1e-5 of the sum of |w x| over its row; measured on random blocks, 3e-6 (float32
// summation: 1e-6), and tests/unit/test_quant_cpu.py holds both paths to 1e-5. That is
// far below the block quantization's own error, but not float32's: --dtype float32 (or
// HISERVE_PACKED_AMX=0) is the exact mode. bf16 weights are their own high part (w_lo is
// zero), and they take the tokens rounded to bf16 (rounds_tokens): one tile product.
//
// Layout, per thread and chunk of 32 weight rows: the rows are dequantized (the same
// unpack_unit as the register path) into hi and lo bf16 rows, which are the A tiles as they
// are (16 rows x 32 values). The tokens are the B tiles: x split once per call into hi
// and lo, stored as ggml/oneDNN's "VNNI" pairs (for each pair of k, 16 tokens x 2 values).
// A tile product then gives y^T for 16 rows x 16 tokens, which is written out transposed
// (amx_io.h moves values into and out of the tiles' layouts). A [gate; up] weight can
// instead give silu(gate) * up directly (``swiglu``, amx_rows).
// What bounds the speed is feeding the tiles, not their arithmetic: buffers start on a
// cache line, K goes in slices whose weight tiles stay in L1 while the tokens pass, and
// the tokens pass in groups whose tiles stay in L2 beside a panel of rows (a prefill of
// 1,000 tokens: 585 -> 305 ms for the default model's layers; a decode batch of 32: 24.8
// -> 18.9 ms; 128 tokens through a 3072 x 8192 Q4_K weight: 27.4 -> 13.2 ms).
//
// The CPU's AMX state needs the kernel's permission (arch_prctl XCOMP_PERM): asked once;
// where it is refused, or the CPU has no AMX, ``amx_available()`` is false and callers
// keep the float32 path.
#pragma once

#include "amx_io.h"

#if defined(HISERVE_HAVE_AMX)

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_unpack.h"

namespace hiserve_quant {

constexpr int kAmxRows = 32;  // weight rows per chunk: two A tiles of 16
constexpr int64_t kSliceBytes = 16 * 1024;  // a chunk's weight tiles per pass over the tokens (L1)
constexpr int64_t kTokenGroupBytes = 512 * 1024;  // tokens' tiles per pass (hi + lo, L2)
constexpr int64_t kRowPanelBytes = 1024 * 1024;   // weight rows' tiles per pass (hi + lo, L2)
constexpr int64_t kStreamOutputBytes = 4 << 20;   // outputs from here on bypass the caches

inline bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
  if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return false;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline bool amx_available() {
  static const bool ok = amx_permitted();
  return ok;
}

// Whether qmatmul takes the AMX path for more than kGemvMax tokens (tests turn it off to
// check the float32 path on the same CPU).
inline std::atomic<bool>& amx_enabled() {
  static std::atomic<bool> on{true};
  return on;
}

// A buffer of n elements, not initialized (every user writes it whole before reading),
// whose start is on a 64-byte line: a tile row that straddles two lines costs two loads
// (unaligned tiles ran the multiply at a quarter of its speed).
// NOTE: zeroing them (a std::vector) was 7% of a decode step at a batch of 32 (perf).
template <typename T>
struct LineBuffer {
  explicit LineBuffer(int64_t n) : raw(new T[static_cast<size_t>(n) + 64 / sizeof(T)]) {
    const auto at = reinterpret_cast<uintptr_t>(raw.get());
    data = raw.get() + ((64 - at % 64) % 64) / sizeof(T);
  }
  std::unique_ptr<T[]> raw;
  T* data;
};

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: 0-3 the float32 outputs (2 row blocks x 2 token
// blocks), 4-5 weights (two row blocks, hi or lo), 6-7 tokens (two blocks, hi or lo).
HISERVE_AMX_TARGET inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Rows [n0, n0 + rows) of W (rows past n_len are zero) -> hi and lo bf16 rows of k_len.
template <int Q>
HISERVE_AMX_TARGET inline void pack_rows(const uint8_t* w, int64_t row_bytes, int64_t n0,
                                         int64_t n_len, int64_t k_len, int rows, uint16_t* hi,
                                         uint16_t* lo) {
  constexpr int kBlock = block_len<Q>(), kBytes = block_bytes<Q>();
  for (int r = 0; r < rows; ++r) {
    __m256i* h = reinterpret_cast<__m256i*>(hi + r * k_len);
    __m256i* l = reinterpret_cast<__m256i*>(lo + r * k_len);
    if (n0 + r >= n_len) {
      for (int64_t i = 0; i < k_len / 16; ++i) {
        _mm256_storeu_si256(h + i, _mm256_setzero_si256());
        _mm256_storeu_si256(l + i, _mm256_setzero_si256());
      }
      continue;
    }
    const uint8_t* row = w + (n0 + r) * row_bytes;
    if constexpr (Q == kBF16) {  // already its own high part; the low part goes unread
      std::memcpy(hi + r * k_len, row, static_cast<size_t>(k_len) * 2);
      continue;
    }
    // The same row of the next chunk, a block's bytes with each block (as Ahead does for
    // bf16 weights; all of a row's lines at once outran the line fill buffers in gemv).
    const uint8_t* ahead = n0 + r + rows < n_len ? row + rows * row_bytes : nullptr;
    for (int64_t bi = 0; bi < k_len / kBlock; ++bi) {
      if (ahead != nullptr) prefetch_lines(ahead + bi * kBytes, 0, kBytes);
      SubScales s;
      block_scales<Q>(row + bi * kBytes, s);
      constexpr int kVecs = 2 * unit_subs<Q>();
      for (int unit = 0; unit < kBlock / (16 * kVecs); ++unit) {
        __m512 v[kVecs];
        unpack_unit<Q>(row + bi * kBytes, unit, s.scale, s.offset, v);
        const int64_t at = bi * kBlock / 16 + unit * kVecs;
        for (int i = 0; i < kVecs; ++i) {
          __m256i hv, lv;
          split_bf16(v[i], hv, lv);
          _mm256_storeu_si256(h + at + i, hv);
          _mm256_storeu_si256(l + at + i, lv);
        }
      }
    }
  }
}

// bf16 weights multiply tokens rounded to bf16: one tile product a value, as oneDNN's bf16
// matmul (vLLM's bf16 on CPUs) does, with float32 sums and outputs still. Norms, residuals
// and attention stay float32, so this rounds only what enters a product; measured on the
// parity prompts and five more texts (1,118 positions, teacher-forced, HF float32's
// greedy continuation), top-1 agreement with HF float32 is the split's, 1,114 of 1,118,
// and the largest logit error 0.54 against 0.29 (2026-12-06). The packed block types keep
// the split of the tokens too (their parity is with the dequantized float32 model).
template <int Q>
constexpr bool rounds_tokens() {
  return Q == kBF16;
}

// K per pass over the tokens: kSliceBytes of a chunk's tiles, 256 of bf16 weights (their
// own tiles), 128 of the others (hi and lo). NOTE: 128 for bf16 too was 10% slower at
// 4,096 tokens (15.2-15.6 against 13.8-14.0 ms a layer), 256 for Q4_1 no faster
// (2026-12-06).
template <int Q>
constexpr int64_t slice_k() {
  return kSliceBytes / (kAmxRows * 2 * (Q == kBF16 ? 1 : 2));
}

// The next chunk's bf16 weights (read where they lie), asked for while this chunk's tiles
// run: lines [step * per, (step + 1) * per) of each of its (up to two) row blocks at K
// step ``step`` of the first token pair. Only where the tokens are one group: a prefill's
// groups pass over each chunk many times, which hides its loads' latency already.
// NOTE: a tile load takes 16 rows 1,152 bytes apart (the default model's K), rows the
// hardware prefetcher did not follow: at a decode batch of 32 the products waited on
// those loads (three quarters of amx_rows' samples in `perf`), and the layers' bf16
// products read their weights at 15 GB/s. Asking for the next chunk (into L2): a decode
// step of 32 sequences 30.6-31.1 -> 27.5-28.1 ms (2026-12-06; into L1, or two chunks
// ahead, no better).
struct Ahead {
  const char* block[2] = {nullptr, nullptr};
  int64_t bytes = 0;  // of each block
  int64_t per = 0;    // lines of each block per K step
  inline void step(int64_t k_step) const {
    for (const char* b : block)
      if (b != nullptr)
        prefetch_lines<true>(b, k_step * per * 64, std::min(bytes, (k_step + 1) * per * 64));
  }
};

// Token blocks x K slice of one chunk of 32 rows: the results of token blocks [mb0, mb1)
// accumulate in c ([token block - mb0][row block][16 rows][16 tokens]) across K slices.
// The chunk's second row block starts ``second`` values after its first (ah and al).
// Two token blocks at a time: four accumulators (2 row blocks x 2 token blocks), so four
// independent tile products are in flight, each after one tile load. The three terms are
// three passes over the slice: hi x hi, lo x hi, hi x lo; ``exact_weights`` (bf16
// weights, whose low part is zero) skips the second, rounded tokens (``xl`` null) the third.
HISERVE_AMX_TARGET inline void amx_slice(const uint16_t* ah, const uint16_t* al,
                                         const uint16_t* xh, const uint16_t* xl,
                                         int64_t second, int64_t k_len, int64_t k0,
                                         int64_t k1, int64_t mb0, int64_t mb1, float* c,
                                         bool exact_weights, const Ahead& ahead) {
  const int64_t stride = k_len * 2;  // bytes per packed weight row
  for (int64_t mb = mb0; mb < mb1; mb += 2) {
    const bool pair = mb + 1 < mb1;
    float* c0 = c + (mb - mb0) * 512;  // token block mb: row blocks 0 and 1
    float* c1 = c0 + 512;              // token block mb + 1
    if (k0 == 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, c0, 64);
      _tile_loadd(1, c0 + 256, 64);
      if (pair) {
        _tile_loadd(2, c1, 64);
        _tile_loadd(3, c1 + 256, 64);
      }
    }
    for (int term = 0; term < 3; ++term) {
      if ((term == 1 && exact_weights) || (term == 2 && xl == nullptr)) continue;
      const uint16_t* a = term == 1 ? al : ah;
      const uint16_t* b = (term == 2 ? xl : xh) + mb * (k_len / 2) * 32;
      const bool first = mb == mb0 && term == 0;
      for (int64_t k = k0; k < k1; k += 32) {
        if (first) ahead.step(k / 32);
        _tile_loadd(4, a + k, stride);
        _tile_loadd(5, a + second + k, stride);
        _tile_loadd(6, b + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (pair) {
          _tile_loadd(7, b + (k_len / 2) * 32 + k * 16, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
    _tile_stored(0, c0, 64);
    _tile_stored(1, c0 + 256, 64);
    if (pair) {
      _tile_stored(2, c1, 64);
      _tile_stored(3, c1 + 256, 64);
    }
  }
}

// One thread's output columns [n_begin, n_end) (whole chunks apart, but for the last).
// NOTE: the rows go in panels of chunks whose packed tiles stay in L2 (kRowPanelBytes),
// each dequantized once; the tokens pass over a panel in groups whose tiles stay in L2
// beside it (kTokenGroupBytes). Packing every chunk of the thread's rows before the first
// group (up to 2026-12-06) kept 50 MB of tiles per thread for a 3072 x 8192 weight, read
// back from memory by each group: 48 tokens took 4x as long as 32.
// ``swiglu``: W is [gate; up], 2 n_len rows, and y[M, n_len] = silu(x gate^T) * x up^T.
// A chunk is then 16 columns: 16 gate rows and the 16 up rows n_len below them are its
// two row blocks, so the [M, 2 n_len] product never goes to memory. With ``th`` set, that
// result goes to token tiles for a next product (store_swiglu_tiles), not to y.
template <int Q>
HISERVE_AMX_TARGET void amx_rows(const uint16_t* xh, const uint16_t* xl, int64_t m_len,
                                 const uint8_t* w, int64_t row_bytes, int64_t n_begin,
                                 int64_t n_end, int64_t n_len, int64_t k_len, float* y,
                                 int64_t ys, bool stream, bool swiglu, uint16_t* th,
                                 uint16_t* tl) {
  const int64_t cols = swiglu ? 16 : kAmxRows;  // output columns per chunk
  const int64_t m_blocks = (m_len + 15) / 16;
  const int64_t token_bytes = rounds_tokens<Q>() ? 2 : 4;  // bf16 values a token's k takes
  const int64_t group =
      std::max<int64_t>(2, kTokenGroupBytes / (k_len * token_bytes * 16) / 2 * 2);
  const int64_t chunks = (n_end - n_begin + cols - 1) / cols;
  const int64_t chunk_elems = kAmxRows * k_len;  // bf16 values of one chunk's hi (or lo) tiles
  const int64_t panel = std::clamp<int64_t>(kRowPanelBytes / (chunk_elems * 4), 1, chunks);
  LineBuffer<uint16_t> wh(panel * chunk_elems), wl(panel * chunk_elems);
  LineBuffer<float> c(std::min(m_blocks, group) * 512);
  amx_configure();
  // bf16 weights are their own high tiles: a whole chunk is read where it lies (rows of
  // K * 2 bytes, a multiple of 64, so lines stay aligned where the weight starts on one).
  // NOTE: copying every chunk instead was a quarter of a decode step at a batch of 32.
  const bool in_place = Q == kBF16 && reinterpret_cast<uintptr_t>(w) % 64 == 0;
  const auto direct = [&](int64_t n0) { return in_place && n0 + cols <= n_len; };
  const auto pack = [&](int64_t n0, uint16_t* hi, uint16_t* lo) {
    if (!swiglu) return pack_rows<Q>(w, row_bytes, n0, n_len, k_len, kAmxRows, hi, lo);
    pack_rows<Q>(w, row_bytes, n0, n_len, k_len, 16, hi, lo);
    pack_rows<Q>(w, row_bytes, n_len + n0, 2 * n_len, k_len, 16, hi + 16 * k_len,
                 lo + 16 * k_len);
  };
  for (int64_t p0 = 0; p0 < chunks; p0 += panel) {
    const int64_t p1 = std::min(chunks, p0 + panel);
    for (int64_t ci = p0; ci < p1; ++ci) {
      const int64_t n0 = n_begin + ci * cols;
      if (!direct(n0))
        pack(n0, wh.data + (ci - p0) * chunk_elems, wl.data + (ci - p0) * chunk_elems);
    }
    for (int64_t mb0 = 0; mb0 < m_blocks; mb0 += group) {
      const int64_t mb1 = std::min(m_blocks, mb0 + group);
      for (int64_t ci = p0; ci < p1; ++ci) {
        const int64_t n0 = n_begin + ci * cols;
        const bool here = direct(n0);
        const uint16_t* ah = here ? reinterpret_cast<const uint16_t*>(w + n0 * row_bytes)
                                  : wh.data + (ci - p0) * chunk_elems;
        const uint16_t* al = wl.data + (ci - p0) * chunk_elems;
        const int64_t second = (here && swiglu ? n_len : 16) * k_len;
        Ahead ahead;  // where the tokens pass over the weights once (a decode batch)
        if (m_blocks <= group && ci + 1 < chunks && direct(n0 + cols)) {
          const char* next = reinterpret_cast<const char*>(w + (n0 + cols) * row_bytes);
          ahead.block[0] = next;
          ahead.block[1] = swiglu ? next + n_len * row_bytes : nullptr;
          ahead.bytes = (swiglu ? 16 : kAmxRows) * row_bytes;
          ahead.per = (ahead.bytes / 64 + k_len / 32 - 1) / (k_len / 32);
        }
        for (int64_t k0 = 0; k0 < k_len; k0 += slice_k<Q>()) {
          amx_slice(ah, al, xh, xl, second, k_len, k0, std::min(k_len, k0 + slice_k<Q>()),
                    mb0, mb1, c.data, Q == kBF16, ahead);
        }
        const int64_t rows = std::min<int64_t>(cols, n_len - n0);
        for (int64_t mb = mb0; mb < mb1; ++mb) {
          const float* cb = c.data + (mb - mb0) * 512;  // [row block][row][token]
          const int64_t toks = std::min<int64_t>(16, m_len - mb * 16);
          if (th != nullptr) {
            store_swiglu_tiles(cb, n0, n_len, mb, th, tl);
            continue;
          }
          float* out = y + mb * 16 * ys + n0;
          if (swiglu) {
            store_swiglu(cb, toks, rows, out, ys, stream);
          } else if (rows == kAmxRows) {
            store_chunk(cb, toks, out, ys, stream);
          } else {
            for (int64_t t = 0; t < toks; ++t)
              for (int64_t r = 0; r < rows; ++r)
                out[t * ys + r] = cb[(r / 16) * 256 + (r % 16) * 16 + t];
          }
        }
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed lines are in memory before the caller reads y
  _tile_release();
}

// Tokens already in tile layout (xh, and xl unless the weights round them), M of them:
// y[M, N] (row stride ys) = x @ W^T, or with ``swiglu`` as amx_rows; with ``th`` the
// swiglu result goes to token tiles for K = N instead of y.
template <int Q>
void amx_run(const uint16_t* xh, const uint16_t* xl, int64_t m_len, const uint8_t* w,
             int64_t row_bytes, int64_t n_len, int64_t k_len, float* y, int64_t ys,
             bool swiglu, uint16_t* th = nullptr, uint16_t* tl = nullptr) {
  const int64_t cols = swiglu ? 16 : kAmxRows;
  const int64_t chunks = (n_len + cols - 1) / cols;
  const bool stream = th == nullptr && m_len * n_len * 4 >= kStreamOutputBytes &&
                      ys % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 64 == 0;
  // NOTE: the lambdas only call: code in them is not built for the AMX target.
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    amx_rows<Q>(xh, xl, m_len, w, row_bytes, begin * cols, std::min(end * cols, n_len), n_len,
                k_len, y, ys, stream, swiglu, th, tl);
  });
}

// Token tiles for x [M, K] (row stride xs): hi in xh, lo in xl unless the weights Q
// round the tokens (then xl is left empty and null is returned for it).
template <int Q>
const uint16_t* amx_pack(const float* x, int64_t xs, int64_t m_len, int64_t k_len,
                         LineBuffer<uint16_t>& xh, LineBuffer<uint16_t>& xl) {
  uint16_t* const lo = rounds_tokens<Q>() ? nullptr : xl.data;
  at::parallel_for(0, (m_len + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    pack_tokens(x, xs, m_len, k_len, begin, end, xh.data, lo);
  });
  return lo;
}

// y[M, N] (row stride ys) = x[M, K] (row stride xs) @ W^T on the tiles; K % 32 == 0.
// ``swiglu``: W has 2N rows, [gate; up], and y = silu(x gate^T) * x up^T (amx_rows);
// with ``th`` that result goes to token tiles for K = N instead of y (amx_run).
template <int Q>
void amx_matmul(const float* x, int64_t xs, int64_t m_len, const uint8_t* w,
                int64_t row_bytes, int64_t n_len, int64_t k_len, float* y, int64_t ys,
                bool swiglu = false, uint16_t* th = nullptr, uint16_t* tl = nullptr) {
  const int64_t m_pad = (m_len + 15) / 16 * 16;
  LineBuffer<uint16_t> xh(m_pad * k_len), xl(rounds_tokens<Q>() ? 0 : m_pad * k_len);
  const uint16_t* lo = amx_pack<Q>(x, xs, m_len, k_len, xh, xl);
  amx_run<Q>(xh.data, lo, m_len, w, row_bytes, n_len, k_len, y, ys, swiglu, th, tl);
}

}  // namespace hiserve_quant

#endif

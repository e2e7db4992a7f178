// y = x W^T (+ bias) on CPU, float32 or bfloat16, with W packed once into panels of 64 output columns.
//
// A float32 panel is [K][64]: row k holds W[n0..n0+64][k], so one k step is four 16-lane loads shared by up
// to six rows of x (24 accumulators in registers). A bfloat16 panel is [K/2][64][2]: one step takes two k
// at once, the pairs multiplied and added into float32 by AVX-512 BF16's dot product, and the results
// rounded to bfloat16 once, at the end. Every output is one fused multiply-add chain over k in order,
// whatever the batch: a token's result does not depend on how many rows the step has or where it sits
// (batch-invariant, as seeded sampling wants). The threads split the panels (and, when there are few,
// the rows), so each panel streams from memory once per step; at decode sizes (1-64 rows) that stream
// is what the step waits on, and this kernel keeps it 1.1-1.5x faster than oneDNN's packed matmul
// (measured: SmolLM2's 30 layers and lm_head, weights from DRAM).
// With AVX2 and FMA (no AVX-512), the same panels are read by 8-lane tiles, 16 columns of a panel at a time
// (sixteen registers hold six rows' accumulators for 16 columns, not for 64), or 64 / rows at a time for one or
// two rows (eight chains in flight): each output is the same chain of fused multiply-adds over k in the same
// order, so the results equal the AVX-512 kernel's bit for bit.
// Not torch/extension.h (torch's whole C++ API) nor torch/types.h (every ATen op's declaration): the pybind11
// bindings of at::Tensor, whose methods are all a kernel calls, parse in a third of the time.
#include <torch/csrc/utils/pybind.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_table.h"
#include "vec_math.h"

namespace {

#if defined(__AVX512F__)
using epdserve::first_lanes;
#define EPDSERVE_PANEL_KERNEL 1
#elif defined(__AVX2__) && defined(__FMA__)
using epdserve::first_lanes8;
#define EPDSERVE_PANEL_KERNEL 1
#endif

constexpr int64_t VECTORS = 4;             // 16-lane vectors per panel row
constexpr int64_t PANEL = 16 * VECTORS;    // output columns per panel
constexpr int64_t ROWS = 6;                // rows of x per register tile
constexpr int64_t PREFETCH_AHEAD = 32;     // k steps (cache lines) a quantized panel is fetched ahead

#ifdef __AVX512F__
// One k step of a float32 tile: acc[r] += w * x[r][k], a fused multiply-add per lane. The float32 and the
// quantized tiles both take this step, which is what makes their results equal bit for bit.
template <int R>
inline void fma_step(__m512 (&acc)[R][VECTORS], const __m512 (&wv)[VECTORS], const float* x, int64_t x_stride) {
  for (int r = 0; r < R; ++r) {
    const __m512 xr = _mm512_set1_ps(x[r * x_stride]);
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xr, acc[r][v]);
  }
}

// y[0..R)[0..cols) = acc, cols <= PANEL (the last panel may be narrower: masked stores).
template <int R>
inline void store(const __m512 (&acc)[R][VECTORS], float* y, int64_t y_stride, int64_t cols) {
  for (int v = 0; v < VECTORS; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = first_lanes(left);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride + 16 * v, mask, acc[r][v]);
  }
}

// y[0..R)[0..cols) = x[0..R) . panel.
template <int R>
inline void tile(const float* x, int64_t x_stride, const float* panel, int64_t K, float* y, int64_t y_stride,
                 int64_t cols) {
  __m512 acc[R][VECTORS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * PANEL;
    __m512 wv[VECTORS];
    for (int v = 0; v < VECTORS; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    fma_step<R>(acc, wv, x + k, x_stride);
  }
  store<R>(acc, y, y_stride, cols);
}

#ifdef __AVX512BF16__
// The bfloat16 tile: x rows of K (even, zero-padded by the caller's packing) bfloat16 values; y rounded to
// bfloat16 (nearest even) after the float32 bias.
template <int R>
inline void tile(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* panel, int64_t K, c10::BFloat16* y,
                 int64_t y_stride, int64_t cols, const float* bias) {
  __m512 acc[R][VECTORS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k + 1 < K; k += 2) {
    const c10::BFloat16* w = panel + k * PANEL;
    __m512bh wv[VECTORS];
    for (int v = 0; v < VECTORS; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + k, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xr);
    }
  }
  if (K % 2) {  // the last k alone: its pair partner is zero
    const c10::BFloat16* w = panel + (K - 1) * PANEL;
    for (int r = 0; r < R; ++r) {
      const int32_t pair = static_cast<int32_t>(x[r * x_stride + K - 1].x);
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < VECTORS; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)_mm512_loadu_si512(w + 32 * v), xr);
    }
  }
  for (int v = 0; v < VECTORS; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = first_lanes(left);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(y + r * y_stride + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b)));
  }
}
#endif

// The quantized tile (quantized panels, below): each weight unpacked in registers as scale * q, or with an
// offset as one fused multiply-add q * scale + offset - the value of the reference dequantizer's multiply then
// add, since pack_quantized's caller holds every such product exact in float32 (or its offset zero) - then the
// float32 tile's own fma_step over k: y equals the float32 kernel's on the dequantized weight, bit for bit. q is
// a byte per weight, or (nibbles) two weights per byte, k even in the low nibble and k + 1 in the high one, each
// q + zero (zero 8 for signed values, 0 for unsigned ones).
template <int R, bool has_offset, bool nibbles>
inline void qtile(const float* x, int64_t x_stride, const uint8_t* panel, int64_t K, int64_t G, int zero, float* y,
                  int64_t y_stride, int64_t cols) {
  __m512 acc[R][VECTORS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t floats = (has_offset ? 2 : 1) * PANEL, q_bytes = (nibbles ? G / 2 : G) * PANEL;
  const int64_t group_bytes = floats * 4 + q_bytes;
  // A nibble's value as a float: lane n of `values` is n - zero, picked by the nibble itself (a permute reads
  // an index's low 4 bits only, so the low nibble needs no mask) - exactly what converting q would give.
  __m512 values = _mm512_setzero_ps();
  if constexpr (nibbles) {
    alignas(64) float table[16];
    for (int n = 0; n < 16; ++n) table[n] = static_cast<float>(n - zero);
    values = _mm512_load_ps(table);
  }
  for (int64_t g0 = 0; g0 < K; g0 += G, panel += group_bytes) {
    const float* scale = reinterpret_cast<const float*>(panel);
    const uint8_t* q = panel + floats * 4;
    __m512 sc[VECTORS], off[VECTORS];
    for (int v = 0; v < VECTORS; ++v) {
      sc[v] = _mm512_loadu_ps(scale + 16 * v);
      off[v] = has_offset ? _mm512_loadu_ps(scale + PANEL + 16 * v) : _mm512_setzero_ps();
    }
    const auto weights = [&](const __m512 (&qf)[VECTORS], __m512 (&wv)[VECTORS]) {
      for (int v = 0; v < VECTORS; ++v)
        wv[v] = has_offset ? _mm512_fmadd_ps(qf[v], sc[v], off[v]) : _mm512_mul_ps(qf[v], sc[v]);
    };
    // A step reads one cache line (64 columns of one k, or of two as nibbles); the hardware prefetcher alone
    // keeps too few in flight for the unpacking to hide DRAM's latency: ask for the line PREFETCH_AHEAD on.
    for (int64_t k = 0; k < G; k += nibbles ? 2 : 1, q += PANEL) {
      _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH_AHEAD * PANEL), _MM_HINT_T0);
      __m512 qf[VECTORS], wv[VECTORS];
      if constexpr (nibbles) {
        __m512 hi[VECTORS];
        for (int v = 0; v < VECTORS; ++v) {
          const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * v)));
          qf[v] = _mm512_permutexvar_ps(bytes, values);
          hi[v] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
        }
        weights(qf, wv);
        fma_step<R>(acc, wv, x + g0 + k, x_stride);
        weights(hi, wv);
        fma_step<R>(acc, wv, x + g0 + k + 1, x_stride);
      } else {
        for (int v = 0; v < VECTORS; ++v)
          qf[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * v))));
        weights(qf, wv);
        fma_step<R>(acc, wv, x + g0 + k, x_stride);
      }
    }
  }
  store<R>(acc, y, y_stride, cols);
}

#elif defined(EPDSERVE_PANEL_KERNEL)
// AVX2: a tile covers STRIP 8-lane vectors (16 columns) of the panel, its strips one after another; each
// strip reads its own cache line of every k row, so the panel is still read once.
constexpr int64_t STRIP = 2;
constexpr int64_t STRIPS = PANEL / (8 * STRIP);

template <int R>
inline void fma_step(__m256 (&acc)[R][STRIP], const __m256 (&wv)[STRIP], const float* x, int64_t x_stride) {
  for (int r = 0; r < R; ++r) {
    const __m256 xr = _mm256_set1_ps(x[r * x_stride]);
    for (int v = 0; v < STRIP; ++v) acc[r][v] = _mm256_fmadd_ps(wv[v], xr, acc[r][v]);
  }
}

// y[0..R)[0..cols) = acc, for V vectors' columns (cols counted from the first, maybe fewer than 8 V).
template <int R, int V>
inline void store(const __m256 (&acc)[R][V], float* y, int64_t y_stride, int64_t cols) {
  for (int v = 0; v < V; ++v) {
    const int64_t left = cols - 8 * v;
    if (left <= 0) break;
    const __m256i mask = first_lanes8(left);
    for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * y_stride + 8 * v, mask, acc[r][v]);
  }
}

template <int R, int V>
inline void zero(__m256 (&acc)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
}

// One or two rows: 64 / R columns at a time (R passes), so that eight chains of fused multiply-adds are in flight
// (a strip has two a row, each waiting out the latency of the last); each column's chain is the strip's.
// V: vectors of 8 columns a pass (half as many for half a panel: half_tile); columns [first, cols).
template <int R, int V = 8 / R>
inline void tile_wide(const float* x, int64_t x_stride, const float* panel, int64_t K, float* y, int64_t y_stride,
                      int64_t cols, int64_t first = 0) {
  static_assert(R == 1 || R == 2);
  for (int64_t c0 = first; c0 < cols; c0 += 8 * V) {
    __m256 acc[R][V];
    zero(acc);
    for (int64_t k = 0; k < K; ++k) {
      if (c0 == first)
        for (int64_t line = 0; line < PANEL; line += 16)
          _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PREFETCH_AHEAD) * PANEL + line), _MM_HINT_T0);
      const float* w = panel + k * PANEL + c0;
      for (int v = 0; v < V; ++v) {
        const __m256 wv = _mm256_loadu_ps(w + 8 * v);
        for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(wv, _mm256_set1_ps(x[r * x_stride + k]), acc[r][v]);
      }
    }
    store(acc, y + c0, y_stride, cols - c0);
  }
}

template <int R>
inline void tile(const float* x, int64_t x_stride, const float* panel, int64_t K, float* y, int64_t y_stride,
                 int64_t cols) {
  if constexpr (R <= 2) {
    tile_wide<R>(x, x_stride, panel, K, y, y_stride, cols);
    return;
  }
  for (int64_t s = 0; s < STRIPS && 16 * s < cols; ++s) {
    __m256 acc[R][STRIP];
    zero(acc);
    for (int64_t k = 0; k < K; ++k) {
      // The first strip reads one line of each row, 256 bytes apart, which the hardware prefetcher streams
      // poorly: it fetches each row's four lines ahead, and the later strips find them in the cache.
      if (s == 0)
        for (int64_t line = 0; line < PANEL; line += 16)
          _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PREFETCH_AHEAD) * PANEL + line), _MM_HINT_T0);
      const float* w = panel + k * PANEL + 16 * s;
      __m256 wv[STRIP];
      for (int v = 0; v < STRIP; ++v) wv[v] = _mm256_loadu_ps(w + 8 * v);
      fma_step<R>(acc, wv, x + k, x_stride);
    }
    store(acc, y + 16 * s, y_stride, cols - 16 * s);
  }
}

// One or two rows of x on AVX2: the quantized tile over 64 / R columns of the panel at a time (R passes). A strip's
// accumulators (two a row) would each wait out a fused multiply-add's latency before the next k; eight chains
// keep the units busy. Each column's chain is a strip's, in the same order over k: the same results, bit for bit.
// Unpacking is most of the work here, so nibbles stored unsigned (zero point 0: Q4_1, Q4_K) skip the subtraction.
template <int R, bool has_offset, bool nibbles, bool centered, int V = 8 / R>  // V, first: as tile_wide's
inline void qtile_wide(const float* x, int64_t x_stride, const uint8_t* panel, int64_t K, int64_t G, int zero_point,
                       float* y, int64_t y_stride, int64_t cols, int64_t first = 0) {
  static_assert(R == 1 || R == 2);
  const int64_t floats = (has_offset ? 2 : 1) * PANEL, q_bytes = (nibbles ? G / 2 : G) * PANEL;
  const int64_t group_bytes = floats * 4 + q_bytes;
  const __m256i low_bits = _mm256_set1_epi32(15), zero_v = _mm256_set1_epi32(zero_point);
  for (int64_t c0 = first; c0 < cols; c0 += 8 * V) {
    __m256 acc[R][V];
    zero(acc);
    const uint8_t* group = panel;
    for (int64_t g0 = 0; g0 < K; g0 += G, group += group_bytes) {
      const float* scale = reinterpret_cast<const float*>(group) + c0;
      const uint8_t* q = group + floats * 4 + c0;
      // A column's scale (and offset) from L1 at each use, as memory operands: the registers hold the chains.
      const auto weight = [&](__m256 qf, int v) {
        const __m256 sc = _mm256_loadu_ps(scale + 8 * v);
        if constexpr (has_offset) return _mm256_fmadd_ps(qf, sc, _mm256_loadu_ps(scale + PANEL + 8 * v));
        return _mm256_mul_ps(qf, sc);
      };
      const auto value = [&](__m256i nibble) {  // q - zero as a float
        return _mm256_cvtepi32_ps(centered ? _mm256_sub_epi32(nibble, zero_v) : nibble);
      };
      const auto step = [&](__m256 w, int v, int64_t k) {
        for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(w, _mm256_set1_ps(x[r * x_stride + k]), acc[r][v]);
      };
      for (int64_t k = 0; k < G; k += nibbles ? 2 : 1, q += PANEL) {
        if (c0 == first) _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH_AHEAD * PANEL), _MM_HINT_T0);
        for (int v = 0; v < V; ++v) {
          const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * v));
          if constexpr (nibbles) {
            const __m256i bytes = _mm256_cvtepu8_epi32(raw);
            step(weight(value(_mm256_and_si256(bytes, low_bits)), v), v, g0 + k);
            step(weight(value(_mm256_srli_epi32(bytes, 4)), v), v, g0 + k + 1);
          } else {
            step(weight(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), v), v, g0 + k);
          }
        }
      }
    }
    store(acc, y + c0, y_stride, cols - c0);
  }
}

// The quantized tile on AVX2: q converted to float (q - zero for nibbles: the value the AVX-512 table gives),
// then scale * q (or q * scale + offset, fused) and the float32 tile's step, as there.
// V, first: qtile_wide's (one or two rows; the strips below always cover the whole panel).
template <int R, bool has_offset, bool nibbles, int V = 8 / R>
inline void qtile(const float* x, int64_t x_stride, const uint8_t* panel, int64_t K, int64_t G, int zero_point,
                  float* y, int64_t y_stride, int64_t cols, int64_t first = 0) {
  if constexpr (R <= 2) {
    if (nibbles && zero_point == 0)
      qtile_wide<R, has_offset, nibbles, false, V>(x, x_stride, panel, K, G, zero_point, y, y_stride, cols, first);
    else
      qtile_wide<R, has_offset, nibbles, nibbles, V>(x, x_stride, panel, K, G, zero_point, y, y_stride, cols, first);
    return;
  }
  const int64_t floats = (has_offset ? 2 : 1) * PANEL, q_bytes = (nibbles ? G / 2 : G) * PANEL;
  const int64_t group_bytes = floats * 4 + q_bytes;
  const __m256i low_bits = _mm256_set1_epi32(15), zero_v = _mm256_set1_epi32(zero_point);
  for (int64_t s = 0; s < STRIPS && 16 * s < cols; ++s) {
    __m256 acc[R][STRIP];
    zero(acc);
    const uint8_t* group = panel;
    for (int64_t g0 = 0; g0 < K; g0 += G, group += group_bytes) {
      const float* scale = reinterpret_cast<const float*>(group) + 16 * s;
      const uint8_t* q = group + floats * 4 + 16 * s;
      __m256 sc[STRIP], off[STRIP];
      for (int v = 0; v < STRIP; ++v) {
        sc[v] = _mm256_loadu_ps(scale + 8 * v);
        off[v] = has_offset ? _mm256_loadu_ps(scale + PANEL + 8 * v) : _mm256_setzero_ps();
      }
      const auto weights = [&](const __m256 (&qf)[STRIP], __m256 (&wv)[STRIP]) {
        for (int v = 0; v < STRIP; ++v)
          wv[v] = has_offset ? _mm256_fmadd_ps(qf[v], sc[v], off[v]) : _mm256_mul_ps(qf[v], sc[v]);
      };
      for (int64_t k = 0; k < G; k += nibbles ? 2 : 1, q += PANEL) {
        if (s == 0) _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH_AHEAD * PANEL), _MM_HINT_T0);
        __m256 qf[STRIP], wv[STRIP];
        if constexpr (nibbles) {
          __m256 hi[STRIP];
          for (int v = 0; v < STRIP; ++v) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * v)));
            qf[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, low_bits), zero_v));
            hi[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), zero_v));
          }
          weights(qf, wv);
          fma_step<R>(acc, wv, x + g0 + k, x_stride);
          weights(hi, wv);
          fma_step<R>(acc, wv, x + g0 + k + 1, x_stride);
        } else {
          for (int v = 0; v < STRIP; ++v)
            qf[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * v))));
          weights(qf, wv);
          fma_step<R>(acc, wv, x + g0 + k, x_stride);
        }
      }
    }
    store(acc, y + 16 * s, y_stride, cols - 16 * s);
  }
}

#endif

#ifdef EPDSERVE_PANEL_KERNEL
// The float32 tile's signature with the bias the bfloat16 one rounds in (float32 adds it afterwards).
template <int R>
inline void tile(const float* x, int64_t x_stride, const float* panel, int64_t K, float* y, int64_t y_stride,
                 int64_t cols, const float*) {
  tile<R>(x, x_stride, panel, K, y, y_stride, cols);
}

// What a quantized panel holds: groups of G k's, each scale[64] float32, offset[64] float32 (has_offset)
// and q[G][64] int8, or (zero >= 0) q[G / 2][64] bytes of two nibbles, q + zero each.
struct QuantLayout {
  int64_t G;
  bool has_offset;
  int zero;  // -1: a byte per weight
};

// f(has_offset, nibbles), the layout's form as std::bool_constant's: a tile of its own for each. Without offsets
// (Q4_0, Q8_0, Q6_K), a weight is one multiply.
template <typename F>
inline void with_form(QuantLayout layout, F&& f) {
  if (layout.zero >= 0) {
    if (layout.has_offset)
      f(std::true_type{}, std::true_type{});
    else
      f(std::false_type{}, std::true_type{});
  } else if (layout.has_offset) {
    f(std::true_type{}, std::false_type{});
  } else {
    f(std::false_type{}, std::false_type{});
  }
}

template <int R>
inline void tile(const float* x, int64_t x_stride, const uint8_t* panel, int64_t K, float* y, int64_t y_stride,
                 int64_t cols, QuantLayout layout) {
  with_form(layout, [&](auto has_offset, auto nibbles) {
    constexpr bool offset = decltype(has_offset)::value, nibble = decltype(nibbles)::value;
    qtile<R, offset, nibble>(x, x_stride, panel, K, layout.G, nibble ? layout.zero : 0, y, y_stride, cols);
  });
}

#if !defined(__AVX512F__)
// Half a panel, columns [32 half, 32 half + 32), for one or two rows (AVX2): a layer of an odd number of panels
// on two threads then splits one of them instead of leaving a thread idle while the other does it (run()). Each
// column's chain is the whole panel's: the same results, bit for bit.
inline void half_tile(const float* x, int64_t x_stride, int64_t rows, const float* panel, int64_t K, float* y,
                      int64_t y_stride, int64_t cols, const float*, int half) {
  const int64_t first = 32 * half, end = std::min<int64_t>(cols, first + 32);
  if (rows == 1)
    tile_wide<1, 4>(x, x_stride, panel, K, y, y_stride, end, first);
  else
    tile_wide<2, 2>(x, x_stride, panel, K, y, y_stride, end, first);
}

inline void half_tile(const float* x, int64_t x_stride, int64_t rows, const uint8_t* panel, int64_t K, float* y,
                      int64_t y_stride, int64_t cols, QuantLayout layout, int half) {
  const int64_t first = 32 * half, end = std::min<int64_t>(cols, first + 32);
  with_form(layout, [&](auto has_offset, auto nibbles) {
    constexpr bool offset = decltype(has_offset)::value, nibble = decltype(nibbles)::value;
    const int zero = nibble ? layout.zero : 0;
    if (rows == 1)
      qtile<1, offset, nibble, 4>(x, x_stride, panel, K, layout.G, zero, y, y_stride, end, first);
    else
      qtile<2, offset, nibble, 2>(x, x_stride, panel, K, layout.G, zero, y, y_stride, end, first);
  });
}
#endif

template <typename T, typename W, typename Extra>
void rows_times_panel(const T* x, int64_t x_stride, int64_t rows, const W* panel, int64_t K, T* y, int64_t y_stride,
                      int64_t cols, Extra extra) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) tile<ROWS>(x + r * x_stride, x_stride, panel, K, y + r * y_stride, y_stride, cols, extra);
  const T* xr = x + r * x_stride;
  T* yr = y + r * y_stride;
  switch (rows - r) {
    case 5: tile<5>(xr, x_stride, panel, K, yr, y_stride, cols, extra); break;
    case 4: tile<4>(xr, x_stride, panel, K, yr, y_stride, cols, extra); break;
    case 3: tile<3>(xr, x_stride, panel, K, yr, y_stride, cols, extra); break;
    case 2: tile<2>(xr, x_stride, panel, K, yr, y_stride, cols, extra); break;
    case 1: tile<1>(xr, x_stride, panel, K, yr, y_stride, cols, extra); break;
    default: break;
  }
}

// A quantized panel's weights as float32 [K][64], each the value the quantized tiles compute in registers: the
// nibble or byte less its zero, converted, times its group's scale, plus its offset, each rounded as the
// reference dequantizer does (this file is built without contraction into fused multiply-adds; the products
// being exact, the tiles' fused form rounds alike). Plain loops: the compiler vectorizes them for the level.
template <bool has_offset, bool nibbles>
void dequantize_panel(const uint8_t* panel, int64_t K, int64_t G, int zero, float* out) {
  const int64_t floats = (has_offset ? 2 : 1) * PANEL, q_bytes = (nibbles ? G / 2 : G) * PANEL;
  for (int64_t g0 = 0; g0 < K; g0 += G, panel += floats * 4 + q_bytes) {
    const float* scale = reinterpret_cast<const float*>(panel);
    const float* offset = scale + PANEL;
    const uint8_t* q = panel + floats * 4;
    for (int64_t k = 0; k < G; ++k) {
      float* w = out + (g0 + k) * PANEL;
      const uint8_t* qk = q + (nibbles ? k / 2 : k) * PANEL;
      const int shift = nibbles && (k & 1) ? 4 : 0;
      for (int64_t c = 0; c < PANEL; ++c) {
        const int v = nibbles ? ((qk[c] >> shift) & 15) - zero : static_cast<int8_t>(qk[c]);
        float wv = static_cast<float>(v) * scale[c];
        if constexpr (has_offset) wv = wv + offset[c];
        w[c] = wv;
      }
    }
  }
}

// A quantized panel times more rows than one tile holds: the tiles would each unpack the whole panel again, so it
// is unpacked once, into this thread's buffer (it stays in the core's cache while the tiles read it), and the
// float32 tiles run over that - the same values in the same fused multiply-adds, so the same results bit for bit.
// Unpacking first paid, when a tile unpacked a weight with offset in a multiply and an add, from two tiles on
// (measured: 1.1-1.3x at 7-10 rows, 1.3-1.5x at 12, 1.6-2.2x from 64) with offsets, from two whole tiles on
// without (0.95x at 9-10 rows, 1.3x at 12).
void rows_times_panel(const float* x, int64_t x_stride, int64_t rows, const uint8_t* panel, int64_t K, float* y,
                      int64_t y_stride, int64_t cols, QuantLayout layout) {
  if (rows <= (layout.has_offset ? ROWS : 2 * ROWS - 1)) {
    rows_times_panel<float, uint8_t, QuantLayout>(x, x_stride, rows, panel, K, y, y_stride, cols, layout);
    return;
  }
  thread_local std::vector<float> buffer;
  buffer.resize(K * PANEL);
  const int64_t G = layout.G;
  if (layout.zero >= 0)
    layout.has_offset ? dequantize_panel<true, true>(panel, K, G, layout.zero, buffer.data())
                      : dequantize_panel<false, true>(panel, K, G, layout.zero, buffer.data());
  else
    layout.has_offset ? dequantize_panel<true, false>(panel, K, G, 0, buffer.data())
                      : dequantize_panel<false, false>(panel, K, G, 0, buffer.data());
  rows_times_panel(x, x_stride, rows, buffer.data(), K, y, y_stride, cols, static_cast<const float*>(nullptr));
}

// The panel's bias pointer for the float tiles; the layout, the same for every panel, for the quantized one.
inline const float* panel_extra(const float* bias, int64_t p) { return bias ? bias + p * PANEL : nullptr; }
inline QuantLayout panel_extra(QuantLayout layout, int64_t) { return layout; }

template <typename T, typename W, typename Extra>
void run(const T* xp, int64_t x_stride, const W* wp, T* yp, int64_t M, int64_t K, int64_t N, int64_t P,
         int64_t panel_elems, Extra extra) {
  // Work items: panels, and when there are fewer panels than a few per thread, or a number the threads
  // cannot share evenly (9 panels on 2 threads), row chunks of each (in whole tiles); consecutive items
  // share a panel, so a thread reads its panels from memory once.
  const int64_t threads = omp_get_max_threads(), tiles = (M + ROWS - 1) / ROWS;
#if !defined(__AVX512F__)
  if (M <= 2 && P % threads != 0) {
    // One or two rows on AVX2 (one tile: no row chunks to share), the threads unable to share the panels evenly:
    // each takes an even share of half panels, whole panels where it holds both halves (half_tile).
#pragma omp parallel
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      for (int64_t u = 2 * P * t / n, end = 2 * P * (t + 1) / n; u < end;) {
        const int64_t p = u / 2, cols = std::min(PANEL, N - p * PANEL);
        if (u % 2 == 0 && u + 2 <= end) {
          rows_times_panel(xp, x_stride, M, wp + p * panel_elems, K, yp + p * PANEL, N, cols, panel_extra(extra, p));
          u += 2;
        } else {
          half_tile(xp, x_stride, M, wp + p * panel_elems, K, yp + p * PANEL, N, cols, panel_extra(extra, p),
                    static_cast<int>(u % 2));
          u += 1;
        }
      }
    }
    return;
  }
#endif
  const int64_t even = threads / std::gcd(P, threads);  // chunks a multiple of this: items split evenly
  int64_t chunks = ((4 * threads + P - 1) / P + even - 1) / even * even;
  chunks = std::max<int64_t>(1, std::min(chunks, tiles));
  const int64_t chunk_rows = (tiles + chunks - 1) / chunks * ROWS;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < P * chunks; ++item) {
    const int64_t p = item / chunks, first = (item % chunks) * chunk_rows;
    const int64_t rows = std::min(M, first + chunk_rows) - first;
    if (rows <= 0) continue;
    rows_times_panel(xp + first * x_stride, x_stride, rows, wp + p * panel_elems, K, yp + first * N + p * PANEL, N,
                     std::min(PANEL, N - p * PANEL), panel_extra(extra, p));
  }
}

#endif

}  // namespace

// The dtypes this build has a kernel for.
std::vector<std::string> dtypes() {
  std::vector<std::string> out;
#ifdef EPDSERVE_PANEL_KERNEL
  out.push_back("float32");
#endif
#ifdef __AVX512BF16__
  out.push_back("bfloat16");
#endif
  return out;
}

// weight [N, K] -> panels: float32 [ceil(N / 64), K, 64]; bfloat16 [ceil(N / 64), ceil(K / 2), 64, 2] (k
// in pairs). The columns past N are zero.
at::Tensor pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
              (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight: [N, K] float32 or bfloat16 on CPU");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + PANEL - 1) / PANEL;
  if (weight.scalar_type() == at::kFloat) {
    auto padded = weight.new_zeros({panels * PANEL, K});
    padded.narrow(0, 0, N).copy_(weight);
    return padded.view({panels, PANEL, K}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (K + 1) / 2;
  auto padded = weight.new_zeros({panels * PANEL, pairs * 2});
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [panel, column, pair, 2] -> [panel, pair, column, 2]
  return padded.view({panels, PANEL, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}


// x [M, K] (rows contiguous), panels from pack() of an [N, K] weight of x's dtype, bias [N] or None -> y [M, N].
at::Tensor linear(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias) {
  const auto dtype = x.scalar_type();
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu() && (dtype == at::kFloat || bf16),
              "x: [M, K] float32 or bfloat16 on CPU, rows contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == dtype && P * PANEL >= N && (P - 1) * PANEL < N &&
              (bf16 ? panels.dim() == 4 && panels.size(1) == (K + 1) / 2 && panels.size(2) == PANEL
                    : panels.dim() == 3 && panels.size(1) == K && panels.size(2) == PANEL),
              "panels: pack() of an [N, K] weight of x's dtype");
  auto y = x.new_empty({M, N});
  const bool has_bias = bias.has_value() && bias->defined();
  if (dtype == at::kFloat) {
#ifdef EPDSERVE_PANEL_KERNEL
    run(x.data_ptr<float>(), x.stride(0), panels.data_ptr<float>(), y.data_ptr<float>(), M, K, N, P, K * PANEL,
        static_cast<const float*>(nullptr));
#else
    TORCH_CHECK(false, "this build has no float32 panel kernel (AVX-512 or AVX2)");
#endif
    if (has_bias) y.add_(*bias);
    return y;
  }
#ifdef __AVX512BF16__
  // The bias joins the float32 sums before their one rounding, as oneDNN's does.
  at::Tensor bias32 = has_bias ? x.new_zeros({P * PANEL}, x.options().dtype(at::kFloat)) : at::Tensor();
  if (has_bias) bias32.narrow(0, 0, N).copy_(*bias);
  run(x.data_ptr<c10::BFloat16>(), x.stride(0), panels.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), M, K, N,
      P, panels.size(1) * 2 * PANEL, has_bias ? bias32.data_ptr<float>() : nullptr);
#else
  TORCH_CHECK(false, "this build has no bfloat16 panel kernel (AVX-512 BF16)");
#endif
  return y;
}

// A quantized weight [N, K] as q [N, K] int8, scale and offset [N, K / G] float32 (offset undefined where the
// format has none) -> its panels, uint8 [ceil(N / 64), K / G, group bytes]: per group of G k's, scale[64],
// offset[64] and q[G][64] (k-major, the columns past N zero). zero >= 0 (every q + zero in [0, 16), G even):
// q as nibbles, [G / 2][64] bytes, k even in the low nibble of a byte and k + 1 in its high one - half the
// bytes a decode streams for 4-bit formats. With an offset, every scale * q must be exact in float32 where the
// offset is not zero (kernels/cpu_linear.py checks it): the tiles unpack such a weight in one fused multiply-add.
at::Tensor pack_quantized(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t zero) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(), "q: [N, K] int8 on CPU");
  const int64_t N = q.size(0), K = q.size(1), groups = scale.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.scalar_type() == at::kFloat && groups > 0 &&
              K % groups == 0, "scale: [N, K / G] float32");
  const bool has_offset = offset.has_value() && offset->defined();
  TORCH_CHECK(!has_offset || (offset->sizes() == scale.sizes() && offset->scalar_type() == at::kFloat),
              "offset: as scale");
  const int64_t G = K / groups, panels = (N + PANEL - 1) / PANEL, rows = panels * PANEL;
  TORCH_CHECK(zero < 0 || (zero <= 15 && G % 2 == 0 && (q.numel() == 0 ||
                                                        (q.min().item<int>() + zero >= 0 && q.max().item<int>() + zero <= 15))),
              "nibbles: every q + zero in [0, 16) and an even group");
  auto pad = [&](at::Tensor t) {
    auto padded = t.new_zeros({rows, t.size(1)});
    padded.narrow(0, 0, N).copy_(t);
    return padded;
  };
  // [panel, column, group] floats -> [panel, group, column]; q [panel, column, group, G] -> [panel, group, G, column]
  std::vector<at::Tensor> parts{pad(scale).view({panels, PANEL, groups}).transpose(1, 2).contiguous()
                                       .view(at::kByte).view({panels, groups, PANEL * 4})};
  if (has_offset)
    parts.push_back(pad(*offset).view({panels, PANEL, groups}).transpose(1, 2).contiguous().view(at::kByte)
                        .view({panels, groups, PANEL * 4}));
  auto q_panels = pad(q).view({panels, PANEL, groups, G}).permute({0, 2, 3, 1}).contiguous();  // [p, g, k, column]
  if (zero >= 0) {  // the padding columns' q = 0 become nibble `zero`: unread, the store masks them
    auto nib = q_panels.to(at::kShort).add(zero).to(at::kByte).view({panels, groups, G / 2, 2, PANEL});
    q_panels = nib.select(3, 0).bitwise_or(nib.select(3, 1).bitwise_left_shift(4)).contiguous();
    parts.push_back(q_panels.view({panels, groups, G / 2 * PANEL}));
  } else {
    parts.push_back(q_panels.view(at::kByte).view({panels, groups, G * PANEL}));
  }
  int64_t bytes = 0;
  for (const auto& part : parts) bytes += part.size(2);
  auto packed = q.new_empty({panels, groups, bytes}, q.options().dtype(at::kByte));
  bytes = 0;
  for (const auto& part : parts) {
    packed.narrow(2, bytes, part.size(2)).copy_(part);
    bytes += part.size(2);
  }
  return packed;
}

// x [M, K] float32 (rows contiguous), panels from pack_quantized() of an [N, K] weight (with `zero` as packed)
// -> y [M, N]; equal to linear() on the dequantized weight, bit for bit.
at::Tensor linear_quantized(at::Tensor x, at::Tensor panels, int64_t N, bool has_offset, int64_t zero,
                               c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "x: [M, K] float32 on CPU, rows contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), groups = panels.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kByte &&
              P * PANEL >= N && (P - 1) * PANEL < N && groups > 0 && K % groups == 0 &&
              panels.size(2) == ((has_offset ? 2 : 1) * PANEL * 4 + (zero >= 0 ? K / groups / 2 : K / groups) * PANEL),
              "panels: pack_quantized() of an [N, K] weight");
  auto y = x.new_empty({M, N});
#ifdef EPDSERVE_PANEL_KERNEL
  run(x.data_ptr<float>(), x.stride(0), panels.data_ptr<uint8_t>(), y.data_ptr<float>(), M, K, N, P,
      groups * panels.size(2), QuantLayout{K / groups, has_offset, static_cast<int>(zero)});
#else
  TORCH_CHECK(false, "this build has no quantized panel kernel (AVX-512 or AVX2)");
#endif
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// Rows `rows` [T] of the [N, K] weight that panels (pack_quantized, with `zero` as packed) hold, dequantized:
// [T, K] float32, each weight (q - zero) * scale, then + offset, rounded as the reference dequantizer rounds it
// (this file is built without fused multiply-adds). A tied embedding looks its tokens up here, from the
// lm_head's panels, rather than keep the weight a second time (Gemma 3's 262k-row vocabulary: 180 MB).
at::Tensor dequantized_rows(at::Tensor panels, at::Tensor rows, int64_t K, bool has_offset, int64_t zero) {
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kByte && panels.is_cpu(),
              "panels: pack_quantized() of a weight");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_cpu(), "rows: [T] int64 on CPU");
  const int64_t P = panels.size(0), groups = panels.size(1), width = panels.size(2);
  TORCH_CHECK(groups > 0 && K % groups == 0, "K: a multiple of the panels' groups");
  const int64_t G = K / groups, floats = (has_offset ? 2 : 1) * PANEL;
  const bool nibbles = zero >= 0;
  TORCH_CHECK(width == floats * 4 + (nibbles ? G / 2 : G) * PANEL, "panels: pack_quantized() of an [N, K] weight");
  auto out = panels.new_empty({rows.size(0), K}, panels.options().dtype(at::kFloat));
  const auto ids = rows.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < rows.size(0); ++t, o += K) {
    TORCH_CHECK(id[t] >= 0 && id[t] < P * PANEL, "row ", id[t], " is outside the panels");
    const int64_t c = id[t] % PANEL;
    const uint8_t* group = panels.data_ptr<uint8_t>() + id[t] / PANEL * groups * width;
    for (int64_t g = 0; g < groups; ++g, group += width) {
      const float scale = reinterpret_cast<const float*>(group)[c];
      const float offset = has_offset ? reinterpret_cast<const float*>(group)[PANEL + c] : 0.0f;
      const uint8_t* q = group + floats * 4 + c;
      for (int64_t k = 0; k < G; ++k) {
        const int v = nibbles ? ((q[k / 2 * PANEL] >> (k & 1 ? 4 : 0)) & 15) - zero
                              : static_cast<int8_t>(q[k * PANEL]);
        float w = static_cast<float>(v) * scale;
        if (has_offset) w = w + offset;
        o[g * G + k] = w;
      }
    }
  }
  return out;
}

static const epdserve::LinearKernels kKernels{&linear, &linear_quantized};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("kernels") = pybind11::capsule(&kKernels, epdserve::kLinearKernels);
  m.def("dtypes", &dtypes, "The dtypes this build has a kernel for");
  m.def("pack", &pack, "Pack an [N, K] float32 weight into panels for linear (CPU)");
  m.def("linear", &linear, "x W^T + bias from packed panels (CPU, float32 or bfloat16)");
  m.def("pack_quantized", &pack_quantized, "Pack a quantized [N, K] weight (q, scale, offset) into panels");
  m.def("linear_quantized", &linear_quantized, "x W^T + bias from quantized panels (CPU, float32)");
  m.def("dequantized_rows", &dequantized_rows, "Rows of the weight quantized panels hold, dequantized (CPU)");
}

// Attention on CPU, read straight from the paged KV cache, for any mix of decodes and prefill chunks.
//
// The cache is stored head-major: [num_blocks, num_kv_heads, block_size, head_size], so one head of one
// block is one contiguous run. A work item is one query token and one KV head with its GQA group of query
// heads; it attends to the first `len` tokens of its sequence (a decode: the whole context; a prefill
// token: the causal prefix up to itself) and computes in float32: the scores, an exact two-pass softmax,
// and the probability-weighted sum of V (normalised once, at the end). A decode's item reads its K and V
// blocks from memory once. The consecutive tokens of a prefill chunk are taken TILE_TOKENS at a time in
// one item, which reads each K and V block once for all of them while it is in L1 (an item per token would
// stream the whole prefix from L3 for each token - a 4k-token prompt's K and V of one head are 2 MB, more
// than L2 - and runs at half the machine's speed). Each token's sums are added in the same order either way,
// so a token's result does not depend on its tile, its batch or its chunk.
//
// The cache may be stored narrower than the query (--kv-cache-dtype): bfloat16, or FP8 (E4M3 or E5M2, scale
// 1.0 as vLLM's default); its values are widened to float32 as they are read, so the arithmetic is the same.
// An int8 cache's row of one token and head is head_size int8 values and their float16 scale after them
// (head_size + 2 bytes): a value is q * scale, exact in float32 (7 bits times 11), the float32 a dequantized
// cache would hold, so the arithmetic is again that of a float32 cache. write_kv quantizes each row to its own
// scale (its largest magnitude / 127), so what a row holds never depends on which other tokens were written
// with it.
//
// With AVX-512 and a head size that is a multiple of 16 (float32, bfloat16 and FP8 caches), the scores of 16
// tokens come out of one transposing reduction instead of 16 horizontal sums, the softmax runs 16 lanes
// at a time, and the weighted sum of V keeps its accumulators in registers across the whole context.
// Without AVX-512, AVX2 runs the same steps 8 lanes at a time (head sizes a multiple of 8): the vector
// loops are written once, over `Lanes`, the few steps whose instructions differ with the width. The plain
// loops below serve every other case.
// Not torch/extension.h (torch's whole C++ API) nor torch/types.h (every ATen op's declaration): the pybind11
// bindings of at::Tensor, whose methods are all a kernel calls, parse in a third of the time.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Dispatch.h>

#include <omp.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernel_table.h"
#include "vec_math.h"

namespace {

using namespace epdserve;

using E4M3 = c10::Float8_e4m3fn;
using E5M2 = c10::Float8_e5m2;
using I8 = int8_t;

// An int8 row's scale, the float16 after its head_size values.
inline float row_scale(const I8* row, int64_t head_size) {
  c10::Half scale;
  std::memcpy(&scale, row + head_size, sizeof(scale));
  return static_cast<float>(scale);
}

// FP8 values widened exactly through float16: an E5M2 byte is the top half of a float16; an E4M3 byte's
// exponent and mantissa, placed at a float16's (sign kept), read as float16 times 2^8 (the exponent biases
// are 7 and 15), subnormals included. (The E4M3 NaN is never stored: the cache write saturates.) The byte
// goes to the top of 16 bits, an arithmetic shift right by one copies the sign into bit 14 as well, and
// clearing bit 14 leaves sign, exponent and mantissa where a float16 has them: three operations.
#if defined(__AVX512F__)
using epdserve::load16;  // the float32 and bfloat16 loads, beside these (a declaration here hides them otherwise)
inline __m512 fp8_lanes16(__m256i bytes16, bool e4m3) {
  const __m256i top = _mm256_slli_epi16(bytes16, 8);
  if (!e4m3) return _mm512_cvtph_ps(top);
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(top, 1), _mm256_set1_epi16(static_cast<short>(0xbfff)));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
}
inline __m512 load16(const E4M3* p) { return fp8_lanes16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), true); }
inline __m512 load16(const E5M2* p) { return fp8_lanes16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), false); }
inline __m512 load16(const I8* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
#elif defined(__AVX2__) && defined(__FMA__)
using epdserve::load8;
inline __m256 fp8_lanes8(__m128i bytes8, bool e4m3) {
  const __m128i top = _mm_slli_epi16(bytes8, 8);
  if (!e4m3) return _mm256_cvtph_ps(top);
  const __m128i half = _mm_and_si128(_mm_srai_epi16(top, 1), _mm_set1_epi16(static_cast<short>(0xbfff)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
}
inline __m256 load8(const E4M3* p) { return fp8_lanes8(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), true); }
inline __m256 load8(const E5M2* p) { return fp8_lanes8(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), false); }
inline __m256 load8(const I8* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
#endif

// Asks for blocks ahead of their use: the blocks of a sequence are scattered, so the hardware prefetcher
// cannot guess the next one, and a decode is bound by reading K and V from memory. Into L2, not L1: a
// block is 64 lines, more than L1 can have in flight, and asking for L1 stalled the loads (measured).
constexpr int64_t PREFETCH_BLOCKS = 4;

// A prefill chunk's consecutive tokens per work item (see the top): enough to read each K and V block once
// for 16 x the GQA group of query rows (measured: 8 reads 4k-token prompts 4% slower, 32 gains nothing).
constexpr int64_t TILE_TOKENS = 16;

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
}

// The elements of one token's row of one head: head_size, and an int8 row's scale after them.
template <typename T>
constexpr int64_t row_elems(int64_t head_size) {
  return std::is_same_v<T, I8> ? head_size + static_cast<int64_t>(sizeof(c10::Half)) : head_size;
}

// One work item's view of the cache: one KV head of one sequence's blocks.
template <typename T>
struct HeadRows {
  const T* cache;
  const int64_t* table;
  int64_t block_elems, head_offset, block_size, head_size;
  int64_t row_stride = row_elems<T>(head_size);

  const T* block(int64_t b) const { return cache + table[b] * block_elems + head_offset; }
  // Row of token t (in block b = t / block_size).
  const T* row(int64_t t) const { return block(t / block_size) + (t % block_size) * row_stride; }
  void prefetch_block(int64_t b) const {
    prefetch(block(b), block_size * row_stride * static_cast<int64_t>(sizeof(T)));
  }
  // The first PREFETCH_BLOCKS of blocks [b, last].
  void prefetch_ahead(int64_t b, int64_t last) const {
    for (const int64_t end = std::min(last + 1, b + PREFETCH_BLOCKS); b < end; ++b) prefetch_block(b);
  }
};

// The sum of n floats in DOT_LANES partial sums added up in a fixed tree (see dot_plain).
constexpr int64_t DOT_LANES = 8;

inline float fold(const float* part) {
  static_assert(DOT_LANES == 8, "fold adds up exactly 8 partial sums");
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

inline float sum_plain(const float* s, int64_t n) {
  float part[DOT_LANES] = {};
  int64_t i = 0;
  for (; i + DOT_LANES <= n; i += DOT_LANES)
    for (int64_t j = 0; j < DOT_LANES; ++j) part[j] += s[i + j];
  for (int64_t j = 0; i < n; ++i, ++j) part[j] += s[i];
  return fold(part);
}

// Softmax numerators in place over each of `rows` rows of `ctx` scores; returns nothing but writes each
// row's 1 / sum into inv_sum.
inline void softmax_rows_plain(float* scores, int64_t rows, int64_t ctx, float* inv_sum) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * ctx;
    float max = s[0];
    for (int64_t i = 1; i < ctx; ++i) max = s[i] > max ? s[i] : max;
    for (int64_t i = 0; i < ctx; ++i) s[i] = exp_approx(s[i] - max);
    inv_sum[g] = 1.0f / sum_plain(s, ctx);
  }
}

// q . k over d_n, in DOT_LANES partial sums (lane j takes d = j mod DOT_LANES) added up in a fixed tree:
// independent chains the compiler turns into vector fused multiply-adds (a single chain over d is
// latency-bound: with one, an AVX2 Zen 3 prefills a 1k-token prompt 2.5x slower than PyTorch's attention).
// The order is fixed, so a token's score does not depend on its batch.
inline float dot_plain(const float* q, const float* k, int64_t d_n) {
  float part[DOT_LANES] = {};
  int64_t d = 0;
  for (; d + DOT_LANES <= d_n; d += DOT_LANES)
    for (int64_t j = 0; j < DOT_LANES; ++j) part[j] += q[d + j] * k[d + j];
  for (int64_t j = 0; d < d_n; ++d, ++j) part[j] += q[d] * k[d];
  return fold(part);
}

// A cache row as float32: the row itself, or its values widened into `buffer`. The plain loops then run the
// same float32 code whatever the cache stores: loops that convert as they go compile to other code than the
// float32 ones and round differently (an E4M3 cache's results would differ from a float32 cache holding the
// same values).
template <typename T>
inline const float* widened(const T* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else if constexpr (std::is_same_v<T, I8>) {
    const float scale = row_scale(row, n);
    for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(row[d]) * scale;
    return buffer;
  } else {
    for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

// The plain loops: any dtype, any head size, any ISA.
template <typename T>
void attend_plain(const HeadRows<T>& keys, const HeadRows<T>& values, const float* q, int64_t group,
                  int64_t first, int64_t len, float* scores, float* inv_sum, float* acc) {
  const int64_t ctx = len - first, d_n = keys.head_size;
  std::vector<float> buffer(std::is_same_v<T, float> ? 0 : d_n);
  for (int64_t t = first; t < len; ++t) {
    const float* k = widened(keys.row(t), d_n, buffer.data());
    for (int64_t g = 0; g < group; ++g) scores[g * ctx + (t - first)] = dot_plain(q + g * d_n, k, d_n);
  }
  softmax_rows_plain(scores, group, ctx, inv_sum);
  std::fill(acc, acc + group * d_n, 0.0f);
  for (int64_t t = first; t < len; ++t) {
    const float* v = widened(values.row(t), d_n, buffer.data());
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * ctx + (t - first)];
      for (int64_t d = 0; d < d_n; ++d) acc[g * d_n + d] += p * v[d];
    }
  }
}

// The consecutive query tokens of one work item: token j of `tokens` attends to [first, len0 + j) (one
// token, or a run of a prefill chunk's tokens, which share a sequence and, with no sliding window, `first`).
struct Tile {
  const float* q;  // [tokens][group][head_size], scaled
  float* scores;   // token j's `group` rows of ctx(j) scores, one after another, from scores_of(j)
  int64_t tokens, group, first, len0;

  int64_t len(int64_t j) const { return len0 + j; }
  int64_t ctx(int64_t j) const { return len0 + j - first; }
  float* scores_of(int64_t j) const { return scores + group * (j * (len0 - first) + j * (j - 1) / 2); }
  int64_t score_count() const { return group * (tokens * (len0 - first) + tokens * (tokens - 1) / 2); }
};

// Walks the tile's K rows `lanes` tokens of a block at a time, each chunk read from memory for the first of
// the tile's query rows and from L1 for the rest; score(rows, row stride, q of one head, head_size, n, skip, dst)
// writes scores of the chunk's tokens [skip, n) at dst[skip..n) (dst: that head's row at the chunk's first
// token).
template <typename T, typename Score>
void tile_scores(const HeadRows<T>& keys, const Tile& tile, int64_t lanes, Score score) {
  const int64_t d_n = keys.head_size, bs = keys.block_size, len_max = tile.len(tile.tokens - 1);
  const int64_t first_block = tile.first / bs, last_block = (len_max - 1) / bs;
  keys.prefetch_ahead(first_block, last_block);
  for (int64_t b = first_block; b <= last_block; ++b) {
    if (b + PREFETCH_BLOCKS <= last_block) keys.prefetch_block(b + PREFETCH_BLOCKS);
    const T* block = keys.block(b);
    for (int64_t start = b * bs; start < (b + 1) * bs && start < len_max; start += lanes) {
      const int64_t in_block = std::min(lanes, (b + 1) * bs - start);
      const int64_t skip = std::max<int64_t>(0, tile.first - start);  // leading rows before the window
      const T* rows = block + (start - b * bs) * keys.row_stride;
      for (int64_t j = 0; j < tile.tokens; ++j) {
        const int64_t n = std::min(in_block, tile.len(j) - start);
        if (skip >= n) continue;
        float* s = tile.scores_of(j) + (start - tile.first);
        for (int64_t g = 0; g < tile.group; ++g)
          score(rows, keys.row_stride, tile.q + (j * tile.group + g) * d_n, d_n, n, skip, s + g * tile.ctx(j));
      }
    }
  }
}

// acc[j] += the probability-weighted V rows of each of the tile's tokens, VALUE_CHUNK_BLOCKS blocks of V
// at a time (read from memory for the first token, from L1 for the rest); weigh(p, ctx, lo, hi, acc)
// adds rows [lo, hi) of one token to its [group][head_size] accumulators, always in the order of t.
constexpr int64_t VALUE_CHUNK_BLOCKS = 4;

template <typename T, typename Weigh>
void tile_values(const HeadRows<T>& values, const Tile& tile, float* acc, Weigh weigh) {
  const int64_t bs = values.block_size, len_max = tile.len(tile.tokens - 1);
  const int64_t first_block = tile.first / bs, last_block = (len_max - 1) / bs;
  std::fill(acc, acc + tile.tokens * tile.group * values.head_size, 0.0f);
  if (tile.tokens == 1) {  // a decode: nothing to share, one pass (weigh prefetches ahead of its rows)
    weigh(tile.scores, tile.ctx(0), tile.first, tile.len(0), acc);
    return;
  }
  for (int64_t b0 = first_block; b0 <= last_block; b0 += VALUE_CHUNK_BLOCKS) {
    const int64_t b1 = std::min(last_block + 1, b0 + VALUE_CHUNK_BLOCKS);
    values.prefetch_ahead(b1, last_block);
    const int64_t lo = std::max(tile.first, b0 * bs);
    for (int64_t j = 0; j < tile.tokens; ++j) {
      const int64_t hi = std::min(tile.len(j), b1 * bs);
      if (lo < hi) weigh(tile.scores_of(j), tile.ctx(j), lo, hi, acc + j * tile.group * values.head_size);
    }
  }
}

// The vector path's width-specific steps: `Lanes`, the float32 lanes of one register (16 with AVX-512, 8
// with AVX2 and FMA); the loops after it are written once against it.
#if defined(__AVX512F__)
#define VECTOR_PATH 1
struct Lanes {
  using Vec = __m512;
  static constexpr int width = 16;
  // Query heads per pass of the weighted sum of V: with 4 vectors of values, 16 accumulators of the 32
  // registers.
  static constexpr int max_heads = 4;

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  // A cache row's values as float32 lanes.
  template <typename T>
  static Vec load(const T* p) { return load16(p); }

  // r[i] = the sum of v[i]'s 16 lanes: a transposing tree of 15 shuffle-and-add steps.
  static Vec sum_lanes(Vec v[16]) {
    __m512 s2[8], s4[4];
    for (int i = 0; i < 8; ++i)  // lanes alternate v[2i], v[2i+1] in each 128-bit quarter
      s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // each quarter holds partial sums of v[4i..4i+3]
      const __m512d a = _mm512_castps_pd(s2[2 * i]), b = _mm512_castps_pd(s2[2 * i + 1]);
      s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], 0x88), _mm512_shuffle_f32x4(s4[0], s4[1], 0xdd));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], 0x88), _mm512_shuffle_f32x4(s4[2], s4[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xdd));
  }
  // dst[i] = lane i of v for i in [skip, n) (n <= 16).
  static void store_range(float* dst, Vec v, int64_t skip, int64_t n) {
    _mm512_mask_storeu_ps(dst, first_lanes(n) & ~first_lanes(skip), v);
  }

  // The softmax's steps on s[0, min(n, 16)): `max` and the largest of them, lane by lane;
  static Vec max_first(Vec max, const float* s, int64_t n) {
    return _mm512_mask_max_ps(max, first_lanes(n), max, _mm512_maskz_loadu_ps(first_lanes(n), s));
  }
  // s = exp(s - m) in place, returning `sum` plus those values, lane by lane.
  static Vec exp_first(float* s, int64_t n, Vec m, Vec sum) {
    const __mmask16 k = first_lanes(n);
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s), m));
    _mm512_mask_storeu_ps(s, k, e);
    return _mm512_mask_add_ps(sum, k, sum, e);
  }
  static float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define VECTOR_PATH 1
struct Lanes {
  using Vec = __m256;
  static constexpr int width = 8;
  // Query heads per pass of the weighted sum of V: with 4 vectors of values, 12 accumulators of the 16
  // registers.
  static constexpr int max_heads = 3;

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  template <typename T>
  static Vec load(const T* p) { return load8(p); }

  // r[i] = the sum of v[i]'s 8 lanes: a transposing tree of 7 shuffle-and-add steps.
  static Vec sum_lanes(const Vec v[8]) {
    __m256 s2[4], s4[2];
    for (int i = 0; i < 4; ++i)  // in each 128-bit half: lanes alternate v[2i], v[2i+1]
      s2[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {  // each half holds partial sums of v[4i..4i+3]
      const __m256d a = _mm256_castps_pd(s2[2 * i]), b = _mm256_castps_pd(s2[2 * i + 1]);
      s4[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(s4[0], s4[1], 0x20), _mm256_permute2f128_ps(s4[0], s4[1], 0x31));
  }
  static void store_range(float* dst, Vec v, int64_t skip, int64_t n) {
    if (skip == 0 && n == 8) {
      _mm256_storeu_ps(dst, v);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, v);
      for (int64_t i = skip; i < n; ++i) dst[i] = lanes[i];
    }
  }

  static Vec max_first(Vec max, const float* s, int64_t n) {
    const __m256i k = first_lanes8(n);
    return _mm256_max_ps(max, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), load8(s, k), _mm256_castsi256_ps(k)));
  }
  static Vec exp_first(float* s, int64_t n, Vec m, Vec sum) {
    const __m256i k = first_lanes8(n);
    const __m256 e = _mm256_and_ps(exp_approx8(_mm256_sub_ps(load8(s, k), m)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s, k, e);
    return _mm256_add_ps(sum, e);
  }
  static float reduce_max(Vec v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
  }
  static float reduce_add(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
};
#endif

#ifdef VECTOR_PATH
// One cache row's values as float32 lanes, from element d: an int8 row's times its scale (see the top).
template <typename T>
struct RowLanes {
  const T* row;
  RowLanes(const T* row, int64_t /*head_size*/) : row(row) {}
  Lanes::Vec at(int64_t d) const { return Lanes::load(row + d); }
};
template <>
struct RowLanes<I8> {
  const I8* row;
  Lanes::Vec scale;
  RowLanes(const I8* row, int64_t head_size) : row(row), scale(Lanes::set1(row_scale(row, head_size))) {}
  Lanes::Vec at(int64_t d) const { return Lanes::mul(Lanes::load(row + d), scale); }
};

inline void softmax_rows_vector(float* scores, int64_t rows, int64_t ctx, float* inv_sum) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * ctx;
    Lanes::Vec max = Lanes::set1(-INFINITY);
    for (int64_t i = 0; i < ctx; i += Lanes::width) max = Lanes::max_first(max, s + i, ctx - i);
    const Lanes::Vec m = Lanes::set1(Lanes::reduce_max(max));
    Lanes::Vec sum = Lanes::zero();
    for (int64_t i = 0; i < ctx; i += Lanes::width) sum = Lanes::exp_first(s + i, ctx - i, m, sum);
    inv_sum[g] = 1.0f / Lanes::reduce_add(sum);
  }
}

// dst[i] = q . K[start + i] for the chunk's tokens i in [skip, n) (n <= Lanes::width), their rows `stride`
// elements apart from `rows`: the dot products in lanes, then one transposing reduction instead of a
// horizontal sum each. DV: the head size in vectors when known at compile time (0: dv at run time).
template <typename T, int DV>
inline void score_lanes(const T* rows, int64_t stride, const float* qg, int64_t d_n, int64_t n, int64_t skip,
                        float* dst) {
  constexpr int W = Lanes::width, HEAD_128 = 128 / W;  // (the inner loop unrolled as far as a head of 128)
  const int64_t dv = DV ? DV : d_n / W;
  Lanes::Vec v[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) {
    Lanes::Vec a = Lanes::zero();
    if (i < n) {
      const RowLanes<T> k(rows + i * stride, d_n);
#pragma GCC unroll HEAD_128
      for (int64_t c = 0; c < dv; ++c) a = Lanes::fmadd(Lanes::loadu(qg + W * c), k.at(W * c), a);
    }
    v[i] = a;
  }
  Lanes::store_range(dst, Lanes::sum_lanes(v), skip, n);
}

// acc[g][d] += sum over t in [lo, hi) of p[g][t] V[t][d] for GT query heads and VC vectors of values from d0,
// the accumulators in registers across the rows.
template <typename T, int GT, int VC>
void weighted_values(const HeadRows<T>& values, const float* p, int64_t ctx, int64_t first, int64_t lo, int64_t hi,
                     int64_t d0, float* acc, int64_t acc_stride) {
  constexpr int W = Lanes::width;
  Lanes::Vec a[GT][VC];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < VC; ++c) a[g][c] = Lanes::loadu(acc + g * acc_stride + d0 + W * c);
  const int64_t bs = values.block_size, last_block = (hi - 1) / bs;
  for (int64_t b = lo / bs; b <= last_block; ++b) {
    if (b + PREFETCH_BLOCKS <= last_block) values.prefetch_block(b + PREFETCH_BLOCKS);
    const T* block = values.block(b);
    for (int64_t t = std::max(lo, b * bs); t < std::min(hi, (b + 1) * bs); ++t) {
      const RowLanes<T> row(block + (t - b * bs) * values.row_stride, values.head_size);
      Lanes::Vec x[VC];
      for (int c = 0; c < VC; ++c) x[c] = row.at(d0 + W * c);
      for (int g = 0; g < GT; ++g) {
        const Lanes::Vec w = Lanes::set1(p[g * ctx + (t - first)]);
        for (int c = 0; c < VC; ++c) a[g][c] = Lanes::fmadd(w, x[c], a[g][c]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < VC; ++c) Lanes::storeu(acc + g * acc_stride + d0 + W * c, a[g][c]);
}

// weighted_values over the whole head, up to 4 vectors of values at a time.
template <typename T, int GT>
void weighted_values_chunks(const HeadRows<T>& values, const float* p, int64_t ctx, int64_t first, int64_t lo,
                            int64_t hi, float* acc) {
  const int64_t d_n = values.head_size;
  for (int64_t d0 = 0; d0 < d_n; d0 += 4 * Lanes::width) {
    switch (std::min<int64_t>(4, (d_n - d0) / Lanes::width)) {
      case 4: weighted_values<T, GT, 4>(values, p, ctx, first, lo, hi, d0, acc, d_n); break;
      case 3: weighted_values<T, GT, 3>(values, p, ctx, first, lo, hi, d0, acc, d_n); break;
      case 2: weighted_values<T, GT, 2>(values, p, ctx, first, lo, hi, d0, acc, d_n); break;
      default: weighted_values<T, GT, 1>(values, p, ctx, first, lo, hi, d0, acc, d_n); break;
    }
  }
}

// The vector path's work item (head sizes a multiple of Lanes::width).
template <typename T>
void attend_vector(const HeadRows<T>& keys, const HeadRows<T>& values, const Tile& tile, float* inv_sum, float* acc) {
  constexpr int W = Lanes::width;
  const int64_t d_n = keys.head_size, group = tile.group;
  // (Lambdas, not function pointers: each is its own type, so the chunk's loop is inlined and unrolled.)
  switch (d_n) {  // the common head sizes with their loops unrolled
    case 64: tile_scores(keys, tile, W, [](auto... a) { score_lanes<T, 64 / W>(a...); }); break;
    case 128: tile_scores(keys, tile, W, [](auto... a) { score_lanes<T, 128 / W>(a...); }); break;
    default: tile_scores(keys, tile, W, [](auto... a) { score_lanes<T, 0>(a...); }); break;
  }
  // The V blocks are read next; ask for the first ones while the softmax runs.
  values.prefetch_ahead(tile.first / keys.block_size, (tile.len(tile.tokens - 1) - 1) / keys.block_size);
  for (int64_t j = 0; j < tile.tokens; ++j) softmax_rows_vector(tile.scores_of(j), group, tile.ctx(j), inv_sum + j * group);
  tile_values(values, tile, acc, [&](const float* p, int64_t ctx, int64_t lo, int64_t hi, float* out) {
    // Query heads in tiles of up to Lanes::max_heads (4 or 3; case 4 is reached only where it is 4).
    constexpr int G4 = std::min(4, Lanes::max_heads);
    for (int64_t g0 = 0; g0 < group; g0 += Lanes::max_heads) {
      switch (std::min<int64_t>(Lanes::max_heads, group - g0)) {
        case 4: weighted_values_chunks<T, G4>(values, p + g0 * ctx, ctx, tile.first, lo, hi, out + g0 * d_n); break;
        case 3: weighted_values_chunks<T, 3>(values, p + g0 * ctx, ctx, tile.first, lo, hi, out + g0 * d_n); break;
        case 2: weighted_values_chunks<T, 2>(values, p + g0 * ctx, ctx, tile.first, lo, hi, out + g0 * d_n); break;
        default: weighted_values_chunks<T, 1>(values, p + g0 * ctx, ctx, tile.first, lo, hi, out + g0 * d_n); break;
      }
    }
  });
}
#endif

// Q: the query's and output's type; T: the cache's.
template <typename Q, typename T>
void attention_impl(Q* out, const Q* query, const T* key_cache, const T* value_cache,
                    const int64_t* block_tables, const int64_t* table_rows, const int64_t* seq_lens, int64_t num_tokens,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                    int64_t table_stride, double scale, int64_t sliding_window) {
  const int64_t group = num_heads / num_kv_heads, stride = row_elems<T>(head_size);
  const int64_t block_elems = num_kv_heads * block_size * stride;
#ifdef VECTOR_PATH
  constexpr int64_t lanes = Lanes::width;
#else
  constexpr int64_t lanes = 0;
#endif
  constexpr bool vector_type = lanes > 0 && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                                             std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2> ||
                                             std::is_same_v<T, I8>);
  const bool vectorized = vector_type && head_size % lanes == 0;
  // Work items: runs of up to TILE_TOKENS consecutive tokens of one sequence (a prefill chunk's; a decode
  // is a run of one) - with a sliding window each token has its own start, and is its own run.
  std::vector<int64_t> runs{0};
  for (int64_t i = 1; i <= num_tokens; ++i) {
    const bool continues = i < num_tokens && sliding_window <= 0 && i - runs.back() < TILE_TOKENS &&
                           table_rows[i] == table_rows[i - 1] && seq_lens[i] == seq_lens[i - 1] + 1;
    if (!continues) runs.push_back(i);
  }
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  // OpenMP directly, with the calling thread's thread count: at::parallel_for, inlined here, would first
  // reset that count from ATen's process-wide setting, which an engine thread deliberately overrides.
#pragma omp parallel
  {
    const int64_t rows_max = TILE_TOKENS * group;
    std::vector<float> q(rows_max * head_size), acc(rows_max * head_size), inv_sum(rows_max), scores;
    // One item per run and KV head; dynamic, as the tokens' contexts differ in length.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_runs * num_kv_heads; ++item) {
      const int64_t r = item / num_kv_heads, h = item % num_kv_heads, i0 = runs[r];
      const int64_t len0 = seq_lens[i0];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len0 - sliding_window) : 0;
      const int64_t* table = block_tables + table_rows[i0] * table_stride;
      const HeadRows<T> keys{key_cache, table, block_elems, h * block_size * stride, block_size, head_size};
      const HeadRows<T> values{value_cache, table, block_elems, h * block_size * stride, block_size, head_size};
      Tile tile{q.data(), nullptr, runs[r + 1] - i0, group, first, len0};
      // Each token's group of query heads h * group .. (h + 1) * group - 1.
      for (int64_t j = 0; j < tile.tokens; ++j) {
        const int64_t row = ((i0 + j) * num_heads + h * group) * head_size;
        for (int64_t e = 0; e < group * head_size; ++e)
          q[j * group * head_size + e] = static_cast<float>(query[row + e]) * static_cast<float>(scale);
      }
      scores.resize(tile.score_count());
      tile.scores = scores.data();
      if constexpr (vector_type) {
#ifdef VECTOR_PATH
        if (vectorized) attend_vector(keys, values, tile, inv_sum.data(), acc.data());
#endif
      }
      if (!vectorized)
        for (int64_t j = 0; j < tile.tokens; ++j)
          attend_plain(keys, values, q.data() + j * group * head_size, group, first, tile.len(j), tile.scores_of(j),
                       inv_sum.data() + j * group, acc.data() + j * group * head_size);
      for (int64_t j = 0; j < tile.tokens; ++j)
        for (int64_t g = 0; g < group; ++g) {
          const float* a = acc.data() + (j * group + g) * head_size;
          Q* o = out + ((i0 + j) * num_heads + h * group + g) * head_size;
          for (int64_t d = 0; d < head_size; ++d) o[d] = static_cast<Q>(a[d] * inv_sum[j * group + g]);
        }
    }
  }
}

}  // namespace

// Whether every value of a contiguous int64 tensor lies in [lo, hi]: a plain loop over what are a few to a few
// thousand indices, checked in every layer's call (torch's min() and max() cost microseconds each to dispatch).
static bool all_within(const at::Tensor& t, int64_t lo, int64_t hi) {
  const int64_t* p = t.data_ptr<int64_t>();
  bool ok = true;
  for (int64_t i = 0, n = t.numel(); i < n; ++i) ok &= p[i] >= lo && p[i] <= hi;
  return ok;
}

// out, query: [num_tokens, num_heads, head_size] contiguous; per query token i: table_rows[i], its
// sequence's row of block_tables; seq_lens[i], how many of the sequence's tokens it attends to (those of
// the cache up to and including its own). key_cache/value_cache:
// [num_blocks, num_kv_heads, block_size, head_size] contiguous (the head-major storage; an int8 cache's rows
// are head_size + 2 long, see the top); block_tables: [num_seqs, >= blocks of the longest] int64. Indices are
// int64; out and query share a dtype, and the caches share that one, or are bfloat16, FP8 or int8.
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                     at::Tensor value_cache, at::Tensor block_tables, at::Tensor table_rows,
                     at::Tensor seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && key_cache.dim() == 4 &&
              value_cache.sizes() == key_cache.sizes(),
              "out and query [tokens, heads, head_size], caches [blocks, kv_heads, block_size, head_size]");
  TORCH_CHECK(out.is_contiguous() && query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "out, query and the (head-major) caches must be contiguous");
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == cache_type &&
              (cache_type == query.scalar_type() || cache_type == at::kBFloat16 ||
               cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2 || cache_type == at::kChar),
              "out and query share a dtype; the caches share it too, or are bfloat16, float8 (e4m3fn, e5m2) or int8");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && table_rows.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "block_tables, table_rows and seq_lens must be int64");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const bool int8_rows = cache_type == at::kChar;
  TORCH_CHECK(key_cache.size(3) == (int8_rows ? row_elems<I8>(head_size) : head_size) && num_heads % num_kv_heads == 0,
              "head sizes (an int8 cache's rows: head_size + 2) or GQA ratio");
  TORCH_CHECK(table_rows.size(0) == num_tokens && seq_lens.size(0) == num_tokens, "one table row and length per token");
  auto tables = block_tables.contiguous();
  auto rows = table_rows.contiguous();
  auto lens = seq_lens.contiguous();
  if (num_tokens == 0) return;
  TORCH_CHECK(all_within(rows, 0, tables.size(0) - 1), "table_rows out of range");
  TORCH_CHECK(all_within(lens, 1, tables.size(1) * block_size),
              "every token attends to at least one token, and no sequence is longer than its block table");
  TORCH_CHECK(all_within(tables, 0, key_cache.size(0) - 1),
              "block ids out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    using Q = scalar_t;
    const auto run = [&](auto* cache_type_tag) {
      using T = std::remove_pointer_t<decltype(cache_type_tag)>;
      attention_impl<Q, T>(out.data_ptr<Q>(), query.data_ptr<Q>(), static_cast<const T*>(key_cache.data_ptr()),
                           static_cast<const T*>(value_cache.data_ptr()), tables.data_ptr<int64_t>(),
                           rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), num_tokens, num_heads, num_kv_heads,
                           head_size, block_size, tables.size(1), scale, sliding_window);
    };
    if (cache_type == query.scalar_type()) {
      run(static_cast<Q*>(nullptr));
    } else if constexpr (std::is_same_v<Q, float> || std::is_same_v<Q, c10::BFloat16>) {  // the engines' dtypes
      if (cache_type == at::kBFloat16) run(static_cast<c10::BFloat16*>(nullptr));
      else if (cache_type == at::kFloat8_e4m3fn) run(static_cast<E4M3*>(nullptr));
      else if (cache_type == at::kFloat8_e5m2) run(static_cast<E5M2*>(nullptr));
      else run(static_cast<I8*>(nullptr));
    } else {
      TORCH_CHECK(false, "a cache narrower than the query needs a float32 or bfloat16 query");
    }
  });
}

// One row quantized to int8 with its own scale (the row's largest magnitude / 127 as a float16; all-zero rows
// get scale 0), the scale's float16 after the values: exactly what int8_rows.quantize_rows computes (IEEE
// division, rounding half to even, the float16 rounded to nearest).
template <typename X>
void quantize_row(const X* x, int64_t n, I8* out) {
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const c10::Half half_scale(std::min(amax / 127.0f, 65504.0f));
  const float scale = static_cast<float>(half_scale);
  for (int64_t d = 0; d < n; ++d) {
    const float q = scale > 0.0f ? std::nearbyint(static_cast<float>(x[d]) / scale) : 0.0f;
    out[d] = static_cast<I8>(std::min(127.0f, std::max(-127.0f, q)));
  }
  std::memcpy(out + n, &half_scale, sizeof(half_scale));
}

// key_cache[slot] = key, value_cache[slot] = value for each token with a slot (slot < 0: padding, skipped).
// key, value: [num_tokens, num_kv_heads, head_size] contiguous; caches head-major as above; slot_mapping:
// [num_tokens] int64, slot = block * block_size + offset. The caches share the keys' dtype, or are int8
// (the keys float32 or bfloat16, each row quantized as it is written).
void write_kv(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
              at::Tensor slot_mapping) {
  const bool int8_rows = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(key.device().is_cpu() && key_cache.device().is_cpu(), "write_kv runs on CPU tensors");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
              key.size(1) == key_cache.size(1) &&
              key_cache.size(3) == (int8_rows ? row_elems<I8>(key.size(2)) : key.size(2)),
              "key and value [tokens, kv_heads, head_size], caches [blocks, kv_heads, block_size, head_size]"
              " (an int8 cache's rows: head_size + 2)");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key, value and the (head-major) caches must be contiguous");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
              (int8_rows ? key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16
                         : key.scalar_type() == key_cache.scalar_type()),
              "key, value and caches must share a dtype (an int8 cache: float32 or bfloat16 keys)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping: [tokens] int64");
  auto slots = slot_mapping.contiguous();
  const int64_t num_tokens = key.size(0), heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(0) * block_size;
  if (num_tokens == 0) return;
  TORCH_CHECK(all_within(slots, std::numeric_limits<int64_t>::min(), num_slots - 1), "slot out of range");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row_bytes = key_cache.size(3) * key_cache.element_size();
  const int64_t src_bytes = head_size * key.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const auto quantize = [&](const char* src, char* dst) {
    if (key.scalar_type() == at::kFloat)
      quantize_row(reinterpret_cast<const float*>(src), head_size, reinterpret_cast<I8*>(dst));
    else
      quantize_row(reinterpret_cast<const c10::BFloat16*>(src), head_size, reinterpret_cast<I8*>(dst));
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = ((block * heads + h) * block_size + offset) * row_bytes, src = (t * heads + h) * src_bytes;
      if (int8_rows) {
        quantize(k + src, kc + dst);
        quantize(v + src, vc + dst);
      } else {
        std::memcpy(kc + dst, k + src, row_bytes);
        std::memcpy(vc + dst, v + src, row_bytes);
      }
    }
  }
}

static const epdserve::AttentionKernels kKernels{&write_kv, &paged_attention};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("kernels") = pybind11::capsule(&kKernels, epdserve::kAttentionKernels);
  m.def("write_kv", &write_kv, "Write tokens' K and V into their slots of the head-major paged cache (CPU)");
  m.def("paged_attention", &paged_attention, "Attention of query tokens over the head-major paged KV cache (CPU)");
}

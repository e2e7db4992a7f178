// Decode attention on CPU, read straight from the paged KV cache (one query token per sequence).
//
// The cache is stored head-major: [num_blocks, num_kv_heads, block_size, head_size], so one block of every
// head is one contiguous run. Work is split over sequences: each reads its K and V blocks once, in order,
// for every query head (a KV head serves its GQA group), and computes in float32: scores, an exact
// two-pass softmax, and the probability-weighted sum of V.
#include <torch/extension.h>

#include <omp.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// exp for x <= 0 (scores minus their maximum), within 2 ulp of std::exp for x >= -87, written so that the
// compiler vectorizes loops over it: Cody-Waite range reduction, a degree-6 polynomial (Cephes expf) and
// the power of two put together in the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Dot products and row updates over head_size values: AVX-512 when the build has it and head_size is a
// multiple of 16, plain loops otherwise. (A `#pragma omp simd` reduction leaves a 16-step scalar sum per
// dot product, which made the whole kernel several times slower.)
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float sum = 0.0f;
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void add_scaled(float* y, float p, const float* x, int64_t n) {  // y += p * x
#ifdef __AVX512F__
  if (n % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < n; d += 16)
      _mm512_storeu_ps(y + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < n; ++d) y[d] += p * x[d];
}

// A row of the cache as float32: the row itself when it is float32, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {

    for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

#ifdef __AVX512F__
// 16 bfloat16 values as float32: a bfloat16 is the top half of a float32.
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif

// q . row and acc += p * row for a cache row of type T, widened to float32 in registers where the build
// has AVX-512 (float32, bfloat16), else through `buffer`.
template <typename T>
inline float dot_row(const float* q, const T* row, float* buffer, int64_t n) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (n % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(row + d), acc);
      return _mm512_reduce_add_ps(acc);
    }
  }
#endif
  return dot(q, as_float(row, buffer, n), n);
}

template <typename T>
inline void add_scaled_row(float* acc, float p, const T* row, float* buffer, int64_t n) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (n % 16 == 0) {
      const __m512 pv = _mm512_set1_ps(p);
      for (int64_t d = 0; d < n; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(row + d), _mm512_loadu_ps(acc + d)));
      return;
    }
  }
#endif
  add_scaled(acc, p, as_float(row, buffer, n), n);
}

// Asks for a block ahead of its use: the blocks of a sequence are scattered, so the
// hardware prefetcher cannot guess the next one, and a decode is bound by reading K and V from memory.
inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

// Calls row_fn(kv_head, t, row) for every KV head and every token t in [first, len) of one sequence, block
// by block (a block of every KV head is one contiguous run), prefetching two blocks ahead: one block's
// arithmetic is shorter than fetching the next from memory.
template <typename T, typename RowFn>
inline void for_each_row(const T* cache, const int64_t* table, int64_t first, int64_t len, int64_t num_kv_heads,
                         int64_t block_size, int64_t head_size, RowFn&& row_fn) {
  const int64_t block_elems = num_kv_heads * block_size * head_size;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  const int64_t first_block = first / block_size, last_block = (len - 1) / block_size;
  for (int64_t b = first_block; b <= std::min(last_block, first_block + 1); ++b)
    prefetch(cache + table[b] * block_elems, block_bytes);
  for (int64_t b = first_block; b <= last_block; ++b) {
    if (b + 2 <= last_block) prefetch(cache + table[b + 2] * block_elems, block_bytes);
    const T* block = cache + table[b] * block_elems;
    const int64_t lo = std::max(first, b * block_size), hi = std::min(len, (b + 1) * block_size);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t = lo; t < hi; ++t) row_fn(h, t, block + (h * block_size + t % block_size) * head_size);
  }
}

template <typename T>
void decode_attention_impl(T* out, const T* query, const int64_t* token_idx, const T* key_cache,
                           const T* value_cache, const int64_t* block_tables, const int64_t* seq_lens,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                           int64_t block_size, int64_t table_stride, double scale, int64_t sliding_window) {
  const int64_t group = num_heads / num_kv_heads;
  // OpenMP directly, with the calling thread's thread count: at::parallel_for, inlined here, would first
  // reset that count from ATen's process-wide setting, which an engine thread deliberately overrides.
#pragma omp parallel firstprivate(num_seqs, num_heads, num_kv_heads, head_size, block_size, table_stride, scale, \
                                    sliding_window, group)
  {
    std::vector<float> q(num_heads * head_size), acc(num_heads * head_size), scores, buffer(head_size);
#pragma omp for schedule(static)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t len = seq_lens[seq];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t ctx = len - first;
      const int64_t* table = block_tables + seq * table_stride;
      const int64_t row = token_idx[seq] * num_heads * head_size;  // this sequence's token in query and out
      for (int64_t i = 0; i < num_heads * head_size; ++i) q[i] = static_cast<float>(query[row + i]) * static_cast<float>(scale);
      scores.resize(num_heads * ctx);  // [query head][token]
      for_each_row(key_cache, table, first, len, num_kv_heads, block_size, head_size,
                   [&](int64_t h, int64_t t, const T* key) {
                     for (int64_t g = h * group; g < (h + 1) * group; ++g)
                       scores[g * ctx + (t - first)] = dot_row(q.data() + g * head_size, key, buffer.data(), head_size);
                   });
      for (int64_t g = 0; g < num_heads; ++g) {
        float* s = scores.data() + g * ctx;
        float max = s[0];
        for (int64_t i = 1; i < ctx; ++i) max = s[i] > max ? s[i] : max;
        float sum = 0.0f;
        for (int64_t i = 0; i < ctx; ++i) {
          s[i] = exp_nonpositive(s[i] - max);
          sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < ctx; ++i) s[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for_each_row(value_cache, table, first, len, num_kv_heads, block_size, head_size,
                   [&](int64_t h, int64_t t, const T* value) {
                     for (int64_t g = h * group; g < (h + 1) * group; ++g)
                       add_scaled_row(acc.data() + g * head_size, scores[g * ctx + (t - first)], value, buffer.data(),
                                      head_size);
                   });
      for (int64_t i = 0; i < num_heads * head_size; ++i) out[row + i] = static_cast<T>(acc[i]);
    }
  }
}

}  // namespace

// out, query: [num_tokens, num_heads, head_size] contiguous; token_idx: [num_seqs] int64, the row of each
// sequence's single query token (its output goes to the same row of out); key_cache/value_cache:
// [num_blocks, num_kv_heads, block_size, head_size] contiguous (the head-major storage); block_tables:
// [num_seqs, >= blocks of the longest] int64; seq_lens: [num_seqs] int64. Everything shares one dtype.
void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor token_idx, torch::Tensor key_cache,
                      torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                      int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "decode_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && key_cache.dim() == 4 &&
              value_cache.sizes() == key_cache.sizes(),
              "out and query [tokens, heads, head_size], caches [blocks, kv_heads, block_size, head_size]");
  TORCH_CHECK(out.is_contiguous() && query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "out, query and the (head-major) caches must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && query.scalar_type() == key_cache.scalar_type() &&
              key_cache.scalar_type() == value_cache.scalar_type(), "out, query and caches must share a dtype");
  TORCH_CHECK(token_idx.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64 &&
              seq_lens.scalar_type() == torch::kInt64, "token_idx, block_tables and seq_lens must be int64");
  const int64_t num_seqs = token_idx.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size && num_heads % num_kv_heads == 0, "head sizes or GQA ratio");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one table row and length per seq");
  auto idx = token_idx.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  if (num_seqs == 0) return;
  TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < query.size(0), "token_idx out of range");
  TORCH_CHECK(lens.min().item<int64_t>() >= 1, "every sequence has at least one token");
  TORCH_CHECK(lens.max().item<int64_t>() <= tables.size(1) * block_size, "a sequence is longer than its block table");
  TORCH_CHECK(tables.numel() == 0 || (tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < key_cache.size(0)),
              "block ids out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(),
                                    key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                                    tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), num_seqs, num_heads,
                                    num_kv_heads, head_size, block_size, tables.size(1), scale, sliding_window);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Decode attention over the head-major paged KV cache (CPU)");
}

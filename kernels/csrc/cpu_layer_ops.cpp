// RMSNorm (with the residual add before it), rotary embedding and the MLP's SiLU-and-multiply for CPU, one
// op each instead of the small PyTorch ops that spell them (per layer, per step: at small batches a decode
// step is mostly such dispatch overhead, and at large ones each op is another pass over memory).
//
// All round exactly where the PyTorch spelling does (HF Llama/Qwen2 numerics): the residual add in the
// model dtype; RMSNorm in float32, cast to the model dtype, then multiplied by the weight in the model
// dtype; rotary as q*cos + rotate_half(q)*sin with every product and the sum rounded to the model dtype;
// silu(gate) rounded to the model dtype before the product with up. Only RMSNorm's sum of squares adds up
// in another order than torch's reduction does, and SiLU's exp is our own (vec_math.h: within 2 ulp of
// std::exp, as torch's vectorized one is).
// Not torch/extension.h (torch's whole C++ API) nor torch/types.h (every ATen op's declaration): the pybind11
// bindings of at::Tensor, whose methods are all a kernel calls, parse in a third of the time.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/gelu_ops.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernel_table.h"
#include "vec_math.h"

namespace {

using namespace epdserve;

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// With `delta`, x[r] += delta[r] first (in place, rounded to T) and the sum is normalised. With `unit_offset`
// (Gemma) the weight is an offset from 1 and scales in float32 before the one rounding to T (HF's
// Gemma3RMSNorm: (x / rms(x)) * (1 + weight), both in float32).
template <typename T>
void rms_norm_impl(T* out, T* x, const T* delta, const T* weight, int64_t rows, int64_t hidden, int64_t x_stride,
                   float eps, bool unit_offset) {
#pragma omp parallel for schedule(static) if (rows * hidden >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * x_stride;
    if (delta != nullptr) {
      const T* dr = delta + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) xr[i] = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) {
      const float v = static_cast<float>(xr[i]);
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    T* o = out + r * hidden;
    if (unit_offset) {
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = round_to<T>((static_cast<float>(xr[i]) * inv) * (1.0f + static_cast<float>(weight[i])));
      continue;
    }
    for (int64_t i = 0; i < hidden; ++i) {
      const T normed = round_to<T>(static_cast<float>(xr[i]) * inv);
      o[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
    }
  }
}

// x: [tokens, heads, head_size] with any token and head strides (a view into the fused QKV output).
template <typename T>
void rotary_impl(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t head_size,
                 int64_t token_stride, int64_t head_stride, int64_t table_stride) {
  const int64_t half = head_size / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_size >= 32768)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * table_stride;
    const T* s = sin + t * table_stride;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * token_stride + h * head_stride;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
        // rotate_half(v) = (-b, a); each product, then the sum, rounded to T as the PyTorch spelling does.
        const T lo = round_to<T>(static_cast<float>(round_to<T>(a * static_cast<float>(c[i]))) +
                                 static_cast<float>(round_to<T>(-b * static_cast<float>(s[i]))));
        const T hi = round_to<T>(static_cast<float>(round_to<T>(b * static_cast<float>(c[i + half]))) +
                                 static_cast<float>(round_to<T>(a * static_cast<float>(s[i + half]))));
        v[i] = lo;
        v[i + half] = hi;
      }
    }
  }
}

#ifdef __AVX512F__
// Float32 lanes back to T (bfloat16: rounded to nearest even, as c10 does), or rounded to T's values.
inline void store16(float* p, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(p, k, v); }
inline __m512i bf16_bits(__m512 v) {  // the rounded bfloat16 in the top half of each lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  // NaN stays NaN (c10 makes it the quiet NaN 0x7fc0).
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
}
inline void store16(c10::BFloat16* p, __mmask16 k, __m512 v) {
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}
#endif

// gate = silu(gate) * up, in place; both [rows, cols] with contiguous rows.
template <typename T>
void silu_mul_impl(T* gate, const T* up, int64_t rows, int64_t cols, int64_t gate_stride, int64_t up_stride) {
#pragma omp parallel for schedule(static) if (rows * cols >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    T* g = gate + r * gate_stride;
    const T* u = up + r * up_stride;
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
      for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 k = first_lanes(cols - i);
        const __m512 x = load16(g + i, k);
        const __m512 silu = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                   exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), x)))),
                                    static_cast<T*>(nullptr));
        store16(g + i, k, _mm512_mul_ps(silu, load16(u + i, k)));
      }
      continue;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, float>) {  // the AVX-512 loop's steps on 8 lanes (bfloat16: no AVX2 kernels)
      for (int64_t i = 0; i < cols; i += 8) {
        const __m256i k = first_lanes8(cols - i);
        const __m256 x = load8(g + i, k);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                           exp_approx8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_maskstore_ps(g + i, k, _mm256_mul_ps(silu, load8(u + i, k)));
      }
      continue;
    }
#endif
    for (int64_t i = 0; i < cols; ++i) {
      const float x = static_cast<float>(g[i]);
      const T silu = round_to<T>(x / (1.0f + exp_approx(-x)));
      g[i] = round_to<T>(static_cast<float>(silu) * static_cast<float>(u[i]));
    }
  }
}
}  // namespace

// out[r] = weight * (x[r] / rms(x[r])) (unit_offset: (1 + weight) * ...); x: [rows, hidden] with contiguous rows,
// out: [rows, hidden] contiguous.
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden] on CPU, rows contiguous");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
              weight.is_contiguous(), "out like x (contiguous), weight [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), static_cast<float>(eps), unit_offset);
  });
}

// x += delta (in place), then out = rms_norm(x); delta: [rows, hidden] contiguous, like out.
void add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor delta, at::Tensor weight, double eps,
                  bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden] on CPU, rows contiguous");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
              weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "out and delta like x (contiguous), weight [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && delta.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type(), "one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0), static_cast<float>(eps),
                            unit_offset);
  });
}

// gate = silu(gate) * up, in place; gate, up: [rows, cols], contiguous within a row.
void silu_mul_(at::Tensor gate, at::Tensor up) {
  TORCH_CHECK(gate.device().is_cpu() && gate.dim() == 2 && gate.stride(1) == 1 && up.sizes() == gate.sizes() &&
              up.stride(1) == 1, "gate, up: [rows, cols] on CPU, rows contiguous");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type(), "one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_mul_", [&] {
    silu_mul_impl<scalar_t>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), gate.size(0), gate.size(1),
                            gate.stride(0), up.stride(0));
  });
}

// x = x * cos + rotate_half(x) * sin, in place; x: [tokens, heads, head_size] (head_size contiguous);
// cos, sin: [tokens, head_size] rows (any row stride, contiguous within a row).
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x: [tokens, heads, head_size] on CPU, head_size even and contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
              cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "cos, sin: [tokens, head_size], rows contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), x.size(0),
                          x.size(1), x.size(2), x.stride(0), x.stride(1), cos.stride(0));
  });
}

// Sampling by temperature alone (no top-k, top-p or min-p), the sampler's commonest case, in one op instead of a
// softmax and the dozen small ops of an inverse CDF: a row's token is the i with cdf(i - 1) <= u * total < cdf(i)
// of the weights exp(logit / temperature - max), by one uniform u in [0, 1) - i with probability weight i / total.
// Two levels keep the cumulative sums short: blocks of kSampleBlock tokens (float32 sums, their running sum in
// float64), then the chosen block's tokens (a float64 running sum). A -inf logit (masked) weighs exactly 0 and is
// never drawn, nor is a NaN's; weights under exp(-87) of the largest are exp(-87) (exp_approx), which no draw can
// tell from their true values (1e-38 of the total at most, a vocabulary's worth 1e-32).
namespace {
constexpr int64_t kSampleBlock = 256;

// The weights of logits[0, n), each exp(logit / temperature - max) (0 for -inf and NaN), into w; returns their sum
// in float32, summed lane by lane (in a fixed order: the same for the same logits).
inline float block_weights(const float* logits, int64_t n, float temperature, float max, float* w) {
  float total = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(logits + i), _mm512_set1_ps(temperature));
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);  // false for NaN too
    const __m512 e = _mm512_maskz_mov_ps(live, exp_approx16(_mm512_sub_ps(x, _mm512_set1_ps(max))));
    _mm512_storeu_ps(w + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  for (float lane : lanes) total += lane;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(logits + i), _mm256_set1_ps(temperature));
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ);
    const __m256 e = _mm256_and_ps(live, exp_approx8(_mm256_sub_ps(x, _mm256_set1_ps(max))));
    _mm256_storeu_ps(w + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  for (float lane : lanes) total += lane;
#endif
  for (; i < n; ++i) {
    const float x = logits[i] / temperature;
    w[i] = x > -INFINITY ? exp_approx(x - max) : 0.0f;
    total += w[i];
  }
  return total;
}

// The largest of logits[0, n) / temperature; a NaN never wins.
inline float scaled_max(const float* logits, int64_t n, float temperature) {
  float max = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16)  // max_ps(x, m) is m where x is NaN
    m = _mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(logits + i), _mm512_set1_ps(temperature)), m);
  max = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8)
    m = _mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(logits + i), _mm256_set1_ps(temperature)), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float lane : lanes) max = std::max(max, lane);
#endif
  for (; i < n; ++i) max = std::max(max, logits[i] / temperature);
  return max;
}

// One row's token; `parallel`: its blocks shared among the threads (a batch of fewer rows than threads). The
// same token either way: a block's weights and sum are its own.
int64_t sample_row(const float* logits, int64_t vocab, float temperature, double u, bool parallel,
                   std::vector<float>& w, std::vector<float>& sums, std::vector<double>& cdf) {
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  const auto size = [&](int64_t b) { return std::min(kSampleBlock, vocab - b * kSampleBlock); };
  float max = -INFINITY;
#pragma omp parallel for schedule(static) reduction(max : max) if (parallel)
  for (int64_t b = 0; b < blocks; ++b)
    max = std::max(max, scaled_max(logits + b * kSampleBlock, size(b), temperature));
  if (max == -INFINITY) return 0;  // nothing can be drawn (a broken model): any token rather than fail the batch
  w.resize(vocab);
  sums.resize(blocks);
  cdf.resize(blocks);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kSampleBlock;
    if (std::isinf(max)) {  // +inf logits: they share all of the mass
      float sum = 0.0f;
      for (int64_t i = first; i < first + size(b); ++i) sum += (w[i] = logits[i] / temperature == max ? 1.0f : 0.0f);
      sums[b] = sum;
    } else {
      sums[b] = block_weights(logits + first, size(b), temperature, max, w.data() + first);
    }
  }
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) cdf[b] = running += sums[b];
  // u < 1 keeps u * total below the total: rounding to nearest cannot reach it.
  const double target = u * cdf[blocks - 1];
  // The first block whose running sum passes the target: how many are at or below it (the sums never decrease).
  const int64_t block = std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin(), blocks - 1);
  const double before = block > 0 ? cdf[block - 1] : 0.0;
  const int64_t first = block * kSampleBlock, n = size(block);
  double within = 0.0;
  for (int64_t i = first; i < first + n; ++i) within += w[i];
  // The block's float64 sum may differ from its float32 one in the last bits: stay inside it.
  const double rest = std::min(target - before, std::nextafter(within, 0.0));
  within = 0.0;
  for (int64_t i = first; i < first + n; ++i) {
    within += w[i];
    if (within > rest) return i;
  }
  return first + n - 1;  // only NaN sums come here
}
}  // namespace

// logits [rows, vocab] float32 (rows contiguous), temperature [rows] float32 (> 0), u [rows] float64 in [0, 1)
// -> [rows] int64 tokens.
at::Tensor sample_by_temperature(at::Tensor logits, at::Tensor temperature, at::Tensor u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
              logits.scalar_type() == at::kFloat, "logits: [rows, vocab] float32 on CPU, rows contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits: an empty vocabulary");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows && temperature.scalar_type() == at::kFloat &&
              temperature.is_contiguous(), "temperature: [rows] float32");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kDouble && u.is_contiguous(),
              "u: [rows] float64");
  auto tokens = u.new_empty({rows}, u.options().dtype(at::kLong));
  const float* l = logits.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  pybind11::gil_scoped_release released;
  // Rows on threads of their own; fewer rows than threads share each row's blocks instead.
  if (rows < omp_get_max_threads()) {
    thread_local std::vector<float> w, sums;
    thread_local std::vector<double> cdf;
    for (int64_t r = 0; r < rows; ++r)
      out[r] = sample_row(l + r * stride, vocab, t[r], uu[r], vocab >= 1 << 16, w, sums, cdf);
    return tokens;
  }
#pragma omp parallel if (rows * vocab >= 1 << 16)
  {
    thread_local std::vector<float> w, sums;
    thread_local std::vector<double> cdf;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = sample_row(l + r * stride, vocab, t[r], uu[r], false, w, sums, cdf);
  }
  return tokens;
}

// A linear layer's weight as the panel kernels read it: quantized panels (cpu_linear.pack_quantized) or
// float32/bfloat16 ones (cpu_linear.pack).
struct PanelWeight {
  at::Tensor panels;
  int64_t out_features;
  bool quantized, has_offset;
  int64_t zero;
  c10::optional<at::Tensor> bias;
};

// One decoder layer of the dense families (Llama, Qwen2, Qwen3, Gemma 3: shared/models/llama.py) over the paged
// KV cache, its caches head-major ([blocks, kv_heads, block_size, head_size], as the attention kernels take them).
// The optional parts are what ModelConfig turns on: per-head query/key norms (Qwen3, Gemma 3), Gemma 3's sandwich
// norms (the attention's and the MLP's outputs normed before they join the residual stream), (1 + weight) norms,
// a GeGLU MLP, and a second RoPE table for its sliding layers.
struct DecoderLayer {
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm, pre_feedforward_norm, post_feedforward_norm;
  bool unit_offset, gelu, local_rope;
  PanelWeight qkv, o, gate;
  c10::optional<PanelWeight> up;  // none: gate's output columns are the gate projection's, then the up one's
  PanelWeight down;
  int64_t num_heads, num_kv_heads, head_size;
  double scale;
  int64_t sliding_window;  // -1: the whole context
  at::Tensor key_cache, value_cache;
};

// The model's layers in one call per step: the same kernels, in the same order, on the same tensors as the
// Python layers call them (shared/models/llama.py), so every value is the same bit for bit - without the
// ~100 us of Python a layer costs between them, which at batch 1 is a third of a decode step.
class DecoderStack {
 public:
  // layers: one dict a layer, DecoderLayer's fields by name, its linear layers' dicts of PanelWeight's (read here
  // rather than bound as classes: binding two more classes made this file's compile 60% longer).
  DecoderStack(pybind11::capsule linear, pybind11::capsule attention, double eps, pybind11::list layers)
      : linear_(kernels<epdserve::LinearKernels>(linear, epdserve::kLinearKernels)),
        attention_(kernels<epdserve::AttentionKernels>(attention, epdserve::kAttentionKernels)),
        eps_(eps) {
    for (const auto& layer : layers) layers_.push_back(decoder_layer(layer.cast<pybind11::dict>()));
  }

  // x: the residual stream [tokens, hidden] (updated in place); rope: cos and sin [tokens, head_size], and the
  // sliding layers' own (local_rope; the same tensors where there is one table); slots: each token's cache
  // slot; table, table_rows, lens: the step's attention plan (cpu_attention.plan_attention). Returns what the
  // last layer adds to x (the final norm adds it), and the seconds the attention kernels took (the engine's
  // step timer counts them apart from the rest of the forward pass).
  std::tuple<at::Tensor, double> forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
                                         at::Tensor local_sin, at::Tensor slots, at::Tensor table,
                                         at::Tensor table_rows, at::Tensor lens) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [tokens, hidden] contiguous");
    // A long prefill holds no lock that the service's other threads (its event loop, transfers) wait on.
    pybind11::gil_scoped_release released;
    const int64_t tokens = x.size(0);
    at::Tensor delta;
    std::chrono::steady_clock::duration attention{};
    for (const auto& layer : layers_) {
      const auto norm = [&](const at::Tensor& in, const at::Tensor& weight) {  // RMSNorm alone
        auto out = in.new_empty(in.sizes());
        rms_norm(out, in, weight, eps_, layer.unit_offset);
        return out;
      };
      const auto add_norm = [&](const at::Tensor& add, const at::Tensor& weight) {  // x += add, then RMSNorm
        auto out = x.new_empty(x.sizes());
        add_rms_norm(out, x, add, weight, eps_, layer.unit_offset);
        return out;
      };
      auto qkv = apply(layer.qkv, delta.defined() ? add_norm(delta, layer.input_norm) : norm(x, layer.input_norm));
      const int64_t hs = layer.head_size, q_size = layer.num_heads * hs, kv_size = layer.num_kv_heads * hs;
      auto q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
      if (layer.q_norm.has_value()) {  // each head on its own: [tokens * heads, head_size]
        q = norm(q.reshape({-1, hs}), *layer.q_norm);
        k = norm(k.reshape({-1, hs}), *layer.k_norm);
      }
      q = q.view({tokens, layer.num_heads, hs});
      k = k.view({tokens, layer.num_kv_heads, hs});
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, layer.num_kv_heads, hs});
      rotary_(q, layer.local_rope ? local_cos : cos, layer.local_rope ? local_sin : sin);
      rotary_(k, layer.local_rope ? local_cos : cos, layer.local_rope ? local_sin : sin);
      // As cpu_attention.kv_cache_write converts: to the cache's dtype, or kept for an int8 cache's rows.
      const auto kv_dtype = layer.key_cache.scalar_type() == at::kChar ? k.scalar_type()
                                                                       : layer.key_cache.scalar_type();
      auto started = std::chrono::steady_clock::now();
      attention_->write_kv(k.to(kv_dtype).contiguous(), v.to(kv_dtype).contiguous(), layer.key_cache,
                           layer.value_cache, slots);
      attention += std::chrono::steady_clock::now() - started;
      auto attended = q.new_empty({tokens, layer.num_heads, hs});
      auto query = q.contiguous();
      started = std::chrono::steady_clock::now();
      attention_->paged_attention(attended, query, layer.key_cache, layer.value_cache, table, table_rows, lens,
                                  layer.scale, layer.sliding_window);
      attention += std::chrono::steady_clock::now() - started;
      auto attn_out = apply(layer.o, attended.view({tokens, q_size}));
      const bool sandwich = layer.pre_feedforward_norm.has_value();
      auto h = sandwich ? add_norm(norm(attn_out, layer.post_attention_norm), *layer.pre_feedforward_norm)
                        : add_norm(attn_out, layer.post_attention_norm);
      auto gate = apply(layer.gate, h), up = gate;
      if (layer.up.has_value()) {
        up = apply(*layer.up, h);
      } else {
        const int64_t intermediate = layer.gate.out_features / 2;
        up = gate.narrow(1, intermediate, intermediate);
        gate = gate.narrow(1, 0, intermediate);
      }
      // GeGLU: HF's act(gate) * up, in the model dtype (at::gelu's own op: its header pulls in half of ATen)
      if (layer.gelu)
        gate = at::_ops::gelu::call(gate, "tanh").mul_(up);
      else
        silu_mul_(gate, up);
      delta = apply(layer.down, gate);
      if (sandwich) delta = norm(delta, *layer.post_feedforward_norm);
    }
    return {delta, std::chrono::duration<double>(attention).count()};
  }

 private:
  static c10::optional<at::Tensor> optional_tensor(const pybind11::handle& value) {
    return value.is_none() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(value.cast<at::Tensor>());
  }

  static PanelWeight panel_weight(const pybind11::dict& w) {
    return {w["panels"].cast<at::Tensor>(), w["out_features"].cast<int64_t>(), w["quantized"].cast<bool>(),
            w["has_offset"].cast<bool>(), w["zero"].cast<int64_t>(), optional_tensor(w["bias"])};
  }

  static DecoderLayer decoder_layer(const pybind11::dict& d) {
    const auto tensor = [&](const char* key) { return d[key].cast<at::Tensor>(); };
    const auto weight = [&](const char* key) { return panel_weight(d[key].cast<pybind11::dict>()); };
    const auto integer = [&](const char* key) { return d[key].cast<int64_t>(); };
    const auto flag = [&](const char* key) { return d[key].cast<bool>(); };
    return {tensor("input_norm"), tensor("post_attention_norm"), optional_tensor(d["q_norm"]),
            optional_tensor(d["k_norm"]), optional_tensor(d["pre_feedforward_norm"]),
            optional_tensor(d["post_feedforward_norm"]), flag("unit_offset"), flag("gelu"), flag("local_rope"),
            weight("qkv"), weight("o"), weight("gate"),
            d["up"].is_none() ? c10::optional<PanelWeight>() : c10::optional<PanelWeight>(weight("up")), weight("down"),
            integer("num_heads"),
            integer("num_kv_heads"), integer("head_size"), d["scale"].cast<double>(), integer("sliding_window"),
            tensor("key_cache"), tensor("value_cache")};
  }

  template <typename Table>
  static const Table* kernels(const pybind11::capsule& capsule, const char* name) {
    TORCH_CHECK(capsule.name() != nullptr && std::string(capsule.name()) == name, "expected the capsule ", name);
    return capsule.get_pointer<Table>();
  }

  at::Tensor apply(const PanelWeight& w, const at::Tensor& x) const {
    if (w.quantized) return linear_->linear_quantized(x, w.panels, w.out_features, w.has_offset, w.zero, w.bias);
    return linear_->linear(x, w.panels, w.out_features, w.bias);
  }

  const epdserve::LinearKernels* linear_;
  const epdserve::AttentionKernels* attention_;
  double eps_;
  std::vector<DecoderLayer> layers_;
};

// Its types local to the module: every CPU level's build registers the same names, and a process may load several
// (the kernels' tests do).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm into out (CPU)", pybind11::arg("out"), pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("unit_offset") = false);
  m.def("rotary_", &rotary_, "Rotary embedding in place, rotate-half form (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "Residual add in place, then RMSNorm into out (CPU)", pybind11::arg("out"),
        pybind11::arg("x"), pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("unit_offset") = false);
  m.def("silu_mul_", &silu_mul_, "gate = silu(gate) * up in place (CPU)");
  m.def("sample_by_temperature", &sample_by_temperature,
        "One token a row from softmax(logits / temperature), by inverse CDF with one uniform a row (CPU)");
  pybind11::class_<DecoderStack>(m, "DecoderStack", pybind11::module_local())
      .def(pybind11::init<pybind11::capsule, pybind11::capsule, double, pybind11::list>(),
           pybind11::arg("linear_kernels"), pybind11::arg("attention_kernels"), pybind11::arg("eps"),
           pybind11::arg("layers"))
      .def("forward", &DecoderStack::forward, "Every layer of a step; returns the last one's addition (CPU)");
}

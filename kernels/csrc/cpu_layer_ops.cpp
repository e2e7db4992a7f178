// RMSNorm and rotary embedding for CPU, one op each instead of the half dozen small PyTorch ops that
// spell them (per layer, per step: at small batches a decode step is mostly such dispatch overhead).
//
// Both round exactly where the PyTorch spelling does (HF Llama/Qwen2 numerics): RMSNorm in float32, cast
// to the model dtype, then multiplied by the weight in the model dtype; rotary as q*cos + rotate_half(q)*sin
// with every product and the sum rounded to the model dtype. Only RMSNorm's sum of squares adds up in
// another order than torch's reduction does.
#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

template <typename T>
void rms_norm_impl(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden, int64_t x_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) {
      const float v = static_cast<float>(xr[i]);
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    T* o = out + r * hidden;
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

}  // namespace

// out[r] = weight * (x[r] / rms(x[r])); x: [rows, hidden] with contiguous rows, out: [rows, hidden] contiguous.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden] on CPU, rows contiguous");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
              weight.is_contiguous(), "out like x (contiguous), weight [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), x.stride(0), static_cast<float>(eps));
  });
}

// x = x * cos + rotate_half(x) * sin, in place; x: [tokens, heads, head_size] (head_size contiguous);
// cos, sin: [tokens, head_size] rows (any row stride, contiguous within a row).
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm into out (CPU)");
  m.def("rotary_", &rotary_, "Rotary embedding in place, rotate-half form (CPU)");
}

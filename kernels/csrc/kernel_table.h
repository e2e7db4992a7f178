// The entry points one kernel module hands another, as a capsule of function pointers: cpu_layer_ops' decoder
// stack runs a whole step's layers in C++, calling the linear and attention kernels of their own modules (each
// compiled with its own flags, so every op rounds as it does when Python calls it) with no Python in between.
// The modules of one CPU level are built from the same sources against the same torch, so the types agree.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace epdserve {

struct LinearKernels {
  // x [M, K] -> [M, N], float32 or bfloat16 panels (cpu_linear.cpp's `linear`)
  at::Tensor (*linear)(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias);
  // x [M, K] float32 -> [M, N], quantized panels (`linear_quantized`)
  at::Tensor (*linear_quantized)(at::Tensor x, at::Tensor panels, int64_t N, bool has_offset, int64_t zero,
                                 c10::optional<at::Tensor> bias);
};

struct AttentionKernels {
  // cpu_paged_attention.cpp's `write_kv` and `paged_attention`
  void (*write_kv)(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                   at::Tensor slot_mapping);
  void (*paged_attention)(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                          at::Tensor block_tables, at::Tensor table_rows, at::Tensor seq_lens, double scale,
                          int64_t sliding_window);
};

// The capsules' names (a capsule of another name is refused).
inline constexpr const char* kLinearKernels = "epdserve.kernels.cpu_linear";
inline constexpr const char* kAttentionKernels = "epdserve.kernels.cpu_paged_attention";

}  // namespace epdserve

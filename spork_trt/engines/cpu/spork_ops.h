// spork's CPU ops as C++ functions (avx512_matmul.cpp, avx512_attention.cpp, avx512_ops.cpp define them; each file's
// header says what they compute), for fused_layers.cpp to call without the dispatcher between them.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace spork_ops {

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, bool wide);
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
at::Tensor attend(const at::Tensor& qk, int64_t heads, const at::Tensor& pool_k, const at::Tensor& pool_v,
                  const at::Tensor& slots, const at::Tensor& mask);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                                double eps);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& slots,
                      const at::Tensor& write);
at::Tensor silu_mul(const at::Tensor& gu);

// AMX-BF16 on this CPU, the kernel letting this process use its tile data (Linux: arch_prctl), and not switched off
// (SPORK_AMX=0): decided once per process (avx512_matmul.cpp); where true, the matmuls' block sums and the attention's
// scores run on the tile unit, whose bits are not vdpbf16ps's
bool amx_on();

}  // namespace spork_ops

// spork::int4_layers: the CPU torch engine's layers on spork's int4 kernels as one op, cpu_forward.fused_layers'
// arithmetic call for call (the same ops in the same order, so the same bits) with nothing between them: no
// TorchScript interpreter, no dispatcher (about 12 ops a layer, each a microsecond or two of both).
//
//   x [N, C] fp32 (the residual stream of the N real rows `real` of a [B, T] forward), cos, sin [B, T, D] fp32,
//   mask [B, T, C'] bool, pool_k, pool_v [L, slots, Hkv, S, D] bf16 (each layer's K/V rows written at `slots` [B]
//   and `write` [B, T]), norms [2L] (each layer's attention then MLP norm), packed, scales [4L] (each layer's
//   q/k/v, output, gate/up and down projections, packed for spork::int4_mm) -> x after every layer, and x after
//   each layer in `taps` (1-based)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "spork_ops.h"

namespace {

std::tuple<at::Tensor, std::vector<at::Tensor>> int4_layers(
    const at::Tensor& x0, const at::Tensor& real, int64_t b, int64_t t, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& mask, const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& slots,
    const at::Tensor& write, at::TensorList norms, at::TensorList packed, at::TensorList scales, int64_t heads,
    double eps, at::IntArrayRef taps) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(norms.size() % 2 == 0 && static_cast<int64_t>(packed.size()) == 4 * layers &&
                  scales.size() == packed.size() && pool_k.dim() == 5 && pool_k.size(0) >= layers &&
                  pool_v.sizes() == pool_k.sizes(),
              "spork::int4_layers: 2 norms and 4 projections a layer, pools [L, slots, Hkv, S, D]");
  TORCH_CHECK(x0.dim() == 2 && x0.scalar_type() == at::kFloat && real.dim() == 1 && real.numel() == x0.size(0),
              "spork::int4_layers: x [N, C] fp32, real [N]");
  const bool padding = real.numel() != b * t;  // else every row is real: no scatter, no gather
  at::Tensor x = x0, y = spork_ops::rms_norm(x, norms[0], eps);
  std::vector<at::Tensor> tapped;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t j = 4 * i;
    at::Tensor qkv = spork_ops::int4_mm(y, packed[j], scales[j], false);  // [N, (H + 2 Hkv) D]
    if (padding) qkv = at::zeros({b * t, qkv.size(1)}, qkv.options()).index_copy_(0, real, qkv);  // padding: 0
    const at::Tensor layer_k = pool_k.select(0, i), layer_v = pool_v.select(0, i);
    const at::Tensor qk = spork_ops::rope_store(qkv, cos, sin, heads, layer_k, layer_v, slots, write);
    at::Tensor out = spork_ops::attend(qk, heads, layer_k, layer_v, slots, mask);  // [B * T, H D]
    if (padding) out = out.index_select(0, real);
    std::tie(x, y) = spork_ops::add_rms_norm(x, spork_ops::int4_mm(out, packed[j + 1], scales[j + 1], true),
                                             norms[2 * i + 1], eps);
    const at::Tensor gate_up = spork_ops::int4_mm(y, packed[j + 2], scales[j + 2], false);  // [N, 2F]
    const at::Tensor down = spork_ops::int4_mm(spork_ops::silu_mul(gate_up), packed[j + 3], scales[j + 3], true);
    if (i + 1 < layers) {
      std::tie(x, y) = spork_ops::add_rms_norm(x, down, norms[2 * i + 2], eps);
    } else {
      x = x + down;
    }
    if (std::find(taps.begin(), taps.end(), i + 1) != taps.end()) tapped.push_back(x);
  }
  return {x, tapped};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spork, m) {
  m.def("int4_layers(Tensor x, Tensor real, int b, int t, Tensor cos, Tensor sin, Tensor mask, Tensor(a!) pool_k, "
        "Tensor(b!) pool_v, Tensor slots, Tensor write, Tensor[] norms, Tensor[] packed, Tensor[] scales, int heads, "
        "float eps, int[] taps) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(spork, CPU, m) { m.impl("int4_layers", &int4_layers); }

// The CPU torch engine's small ops between its matmuls, one native op each where the layer ran 3-8 ATen ops (each a
// few microseconds of dispatch: most of a one-token forward's time outside the matmuls). Every row is computed by
// the same instructions whatever the number of rows and the thread (row-invariant by construction), in fp32, with
// one rounding to bf16 at the end; the residual stream stays fp32 (only what a matmul reads is rounded to bf16):
//
//   rms_norm      x [N, C] fp32 or bf16, w [C] -> w x / sqrt(mean(x^2) + eps), bf16   (the sum of squares: 16
//                                                                          lanes, then a fixed reduction)
//   add_rms_norm  x [N, C] fp32, d [N, C] fp32 or bf16, w -> (s = x + d fp32, rms_norm(s) bf16)
//   rope_store    qkv [B*T, (H + 2 Hkv) D], cos, sin [B, T, D] fp32 (sin's first half negated) -> qk [B, H + Hkv,
//                 T, D]: q and k rotated (x cos + roll(x, D/2) sin); k and v written into the pool [slots, Hkv, S, D]
//                 at each sequence's slot and each row's write position [B, T]
//   silu_mul      gu [N, 2F] -> silu(g) u [N, F]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "avx512_simd.h"
#include "op_checks.h"
#include "spork_ops.h"

namespace {

using spork_simd::exp_ps;
using spork_simd::first;
using spork_simd::load_bf16;
using spork_simd::store_bf16;


using spork_checks::bf16_in;
using spork_checks::bf16_out;
using spork_checks::GRAIN;



// 16 values of a row, bf16 or fp32, as fp32 (the first `n`)
inline __m512 load(const uint16_t* p, __mmask16 n) { return load_bf16(p, n); }
inline __m512 load(const float* p, __mmask16 n) { return _mm512_maskz_loadu_ps(n, p); }

// one row: y = w x / sqrt(mean(x^2) + eps)
template <typename In>
void norm_row(const In* x, const uint16_t* w, int64_t c, float eps, uint16_t* y) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < c; i += 16) {
    const __m512 v = load(x + i, first(c - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(c) + eps));
  for (int64_t i = 0; i < c; i += 16)
    store_bf16(y + i, _mm512_mul_ps(_mm512_mul_ps(load(x + i, first(c - i)), r), load_bf16(w + i, first(c - i))),
               first(c - i));
}



// s = x + d over one row of c (d fp32 or bf16)
template <typename D>
void add_row(const float* x, const D* d, int64_t c, float* s) {
  for (int64_t i = 0; i < c; i += 16)
    _mm512_mask_storeu_ps(s + i, first(c - i), _mm512_add_ps(load(x + i, first(c - i)), load(d + i, first(c - i))));
}

// x [D] bf16 rotated by cos, sin [D] (sin's first half negated) -> out [D] bf16
void rotate(const uint16_t* x, const float* cs, const float* sn, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = first(half - i);
    const __m512 lo = load_bf16(x + i, m), hi = load_bf16(x + half + i, m);
    store_bf16(out + i, _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(m, sn + i),
                                        _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(m, cs + i))), m);
    store_bf16(out + half + i, _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(m, sn + half + i),
                                               _mm512_mul_ps(hi, _mm512_maskz_loadu_ps(m, cs + half + i))), m);
  }
}

}  // namespace

namespace spork_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return spork_checks::rms_norm(x, w, eps, [](const auto* r, const uint16_t* wp, int64_t c, float e, uint16_t* y) {
    norm_row(r, wp, c, e, y);
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                                double eps) {
  return spork_checks::add_rms_norm(
      x, d, w, eps, [](const float* xr, const auto* dr, int64_t c, float* s) { add_row(xr, dr, c, s); },
      [](const float* r, const uint16_t* wp, int64_t c, float e, uint16_t* y) { norm_row(r, wp, c, e, y); });
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& slots,
                      const at::Tensor& write) {
  return spork_checks::rope_store(qkv, cos, sin, heads, pool_k, pool_v, slots, write, rotate);
}

at::Tensor silu_mul(const at::Tensor& gu) {
  spork_checks::rows(gu, "silu_mul");
  TORCH_CHECK(gu.size(1) % 2 == 0, "spork::silu_mul: gu [N, 2F]");
  const int64_t f = gu.size(1) / 2;
  at::Tensor y = at::empty({gu.size(0), f}, gu.options());
  const uint16_t* gp = bf16_in(gu);
  uint16_t* yp = bf16_out(y);
  at::parallel_for(0, gu.size(0), GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      for (int64_t i = 0; i < f; i += 16) {
        const __mmask16 m = first(f - i);
        const __m512 g = load_bf16(gp + n * 2 * f + i, m), u = load_bf16(gp + n * 2 * f + f + i, m);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));  // silu(g) = g / (1 + exp(-g))
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        store_bf16(yp + n * f + i, _mm512_mul_ps(s, u), m);
      }
  });
  return y;
}

}  // namespace spork_ops

TORCH_LIBRARY_FRAGMENT(spork, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int heads, Tensor(a!) pool_k, Tensor(b!) pool_v, "
        "Tensor slots, Tensor write) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(spork, CPU, m) {
  m.impl("rms_norm", &spork_ops::rms_norm);
  m.impl("add_rms_norm", &spork_ops::add_rms_norm);
  m.impl("rope_store", &spork_ops::rope_store);
  m.impl("silu_mul", &spork_ops::silu_mul);
}

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

#include "cpu_simd.h"
#include "spork_ops.h"

namespace {

using spork_simd::exp_ps;
using spork_simd::first;
using spork_simd::load_bf16;
using spork_simd::store_bf16;

constexpr int64_t GRAIN = 8;  // rows a thread takes at least

const uint16_t* bf16_in(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf16_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "spork::", name,
              ": x [N, C], contiguous bf16");
}

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

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "spork::", name, ": x [N, C], contiguous fp32 or bf16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == x.size(1), "spork::", name,
              ": w [C] bf16");
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
  check_norm(x, w, "rms_norm");
  const int64_t c = x.size(1);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const uint16_t* wp = bf16_in(w);
  uint16_t* yp = bf16_out(y);
  const float* wide = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;  // else bf16
  const uint16_t* narrow = wide ? nullptr : bf16_in(x);
  at::parallel_for(0, x.size(0), GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      if (wide) norm_row(wide + n * c, wp, c, static_cast<float>(eps), yp + n * c);
      else norm_row(narrow + n * c, wp, c, static_cast<float>(eps), yp + n * c);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w, "add_rms_norm");
  check_norm(d, w, "add_rms_norm");
  TORCH_CHECK(x.scalar_type() == at::kFloat && d.sizes() == x.sizes(),
              "spork::add_rms_norm: x [N, C] fp32 (the residual stream), d [N, C]");
  const int64_t c = x.size(1);
  at::Tensor s = at::empty_like(x), y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = bf16_in(w);
  float* sp = s.data_ptr<float>();
  uint16_t* yp = bf16_out(y);
  const float* wide = d.scalar_type() == at::kFloat ? d.data_ptr<float>() : nullptr;  // else bf16
  const uint16_t* narrow = wide ? nullptr : bf16_in(d);
  at::parallel_for(0, x.size(0), GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      if (wide) add_row(xp + n * c, wide + n * c, c, sp + n * c);
      else add_row(xp + n * c, narrow + n * c, c, sp + n * c);
      norm_row(sp + n * c, wp, c, static_cast<float>(eps), yp + n * c);
    }
  });
  return {s, y};
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& slots,
                      const at::Tensor& write) {
  check_rows(qkv, "rope_store");
  TORCH_CHECK(write.dim() == 2 && write.scalar_type() == at::kLong && write.is_contiguous() &&
              slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == write.size(0),
              "spork::rope_store: slots [B], write [B, T] int64");
  TORCH_CHECK(pool_k.dim() == 4 && pool_k.scalar_type() == at::kBFloat16 && pool_k.is_contiguous() &&
              pool_v.sizes() == pool_k.sizes() && pool_v.scalar_type() == at::kBFloat16 && pool_v.is_contiguous(),
              "spork::rope_store: pools [slots, Hkv, S, D] contiguous bf16");
  const int64_t b = write.size(0), t = write.size(1), hkv = pool_k.size(1), s_len = pool_k.size(2);
  const int64_t d = pool_k.size(3), width = (heads + 2 * hkv) * d;
  TORCH_CHECK(d % 2 == 0 && qkv.size(0) == b * t && qkv.size(1) == width,
              "spork::rope_store: qkv [B*T, (H + 2 Hkv) D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == b * t * d && sin.numel() == b * t * d,
              "spork::rope_store: cos, sin [B, T, D] fp32");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* wp = write.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < pool_k.size(0), "spork::rope_store: slot out of range");
  for (int64_t i = 0; i < b * t; ++i)
    TORCH_CHECK(wp[i] >= 0 && wp[i] < s_len, "spork::rope_store: write position out of range");
  at::Tensor qk = at::empty({b, heads + hkv, t, d}, qkv.options());
  const uint16_t* xp = bf16_in(qkv);
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  uint16_t *op = bf16_out(qk), *kp = reinterpret_cast<uint16_t*>(pool_k.data_ptr<at::BFloat16>()),
           *vp = reinterpret_cast<uint16_t*>(pool_v.data_ptr<at::BFloat16>());
  at::parallel_for(0, b * t, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t seq = row / t, tok = row % t;
      const uint16_t* x = xp + row * width;
      for (int64_t h = 0; h < heads + hkv; ++h) {
        uint16_t* o = op + ((seq * (heads + hkv) + h) * t + tok) * d;
        rotate(x + h * d, cp + row * d, snp + row * d, d, o);
        if (h >= heads)
          std::copy(o, o + d, kp + ((sp[seq] * hkv + (h - heads)) * s_len + wp[row]) * d);
      }
      for (int64_t h = 0; h < hkv; ++h)
        std::copy(x + (heads + hkv + h) * d, x + (heads + hkv + h + 1) * d,
                  vp + ((sp[seq] * hkv + h) * s_len + wp[row]) * d);
    }
  });
  return qk;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul");
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

// spork::attend and the small layer ops on AVX2 + FMA (CPUs without AVX512-BF16: attention_kernel.cpp's and
// layer_ops.cpp's ops, their shapes and their meaning, in 8 lanes of fp32, with this file's own sums). Every row is
// computed alone by the same instructions whatever the batch, the rows beside it and the thread; attend's sums take
// only the columns a row attends, in column order, so a row attending the same keys gives the same bits wherever they
// sit (a tree's node and its chain):
//
//   attend        qk [B, H + Hkv, T, D] bf16 (rotated queries in heads 0..H-1), pool_k, pool_v [slots, Hkv, S, D]
//                 bf16, slots [B], mask [B, T, C] bool -> out [B * T, H * D] bf16:
//                 s[j] = (q . k[j], D/8 lanes of fmas in order, then reduce_add) / sqrt(D); m = max over the
//                 attended j; e[j] = exp(s[j] - m); out = (sum over attended j, in order, of e[j] v[j]: fp32 fmas) /
//                 (sum over attended j, in order, of e[j]: one fp32 add after another)
//   rms_norm      x [N, C] fp32 or bf16, w [C] bf16 -> w x / sqrt(mean(x^2) + eps), bf16 (x^2 in 8 lanes of fmas,
//                 then reduce_add)
//   add_rms_norm  x [N, C] fp32, d [N, C] fp32 or bf16, w -> (s = x + d fp32, rms_norm(s) bf16)
//   rope_store    qkv [B*T, (H + 2 Hkv) D] bf16, cos, sin [B, T, D] fp32 (sin's first half negated) -> qk [B, H + Hkv,
//                 T, D]: q and k rotated (x cos + roll(x, D/2) sin); k and v written into the pool [slots, Hkv, S, D]
//                 at each sequence's slot and each row's write position [B, T]
//   silu_mul      gu [N, 2F] bf16 -> silu(g) u [N, F] bf16
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "avx2_simd.h"
#include "spork_ops.h"

namespace {

using spork_avx2::exp_ps;
using spork_avx2::load_bf16;
using spork_avx2::load_ps;
using spork_avx2::reduce_add;
using spork_avx2::store_bf16;

constexpr int64_t GRAIN = 8;  // rows a thread takes at least (the layer ops)
constexpr int MAX_D = 128;
constexpr int MAX_G = 16;  // query heads a KV head serves, at most

const uint16_t* bf16_in(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf16_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

inline __m256 load(const uint16_t* p, int64_t n) { return load_bf16(p, n); }
inline __m256 load(const float* p, int64_t n) { return load_ps(p, n); }

// the g query rows of one token against one KV head: q [g][D] fp32 -> o [g] rows of D bf16
void attend_token(const float (*q)[MAX_D], int g, const uint16_t* k, const uint16_t* v, const uint8_t* m, int64_t hi,
                  int64_t d, float scale, std::vector<float>& sc, uint16_t* const* o) {
  const int lanes = static_cast<int>(d / 8);
  sc.resize(static_cast<size_t>(g * hi));
  float top[MAX_G];
  std::fill(top, top + g, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < hi; ++j) {
    if (!m[j]) continue;
    __m256 kj[MAX_D / 8];
    for (int l = 0; l < lanes; ++l) kj[l] = load_bf16(k + j * d + 8 * l);
    for (int r = 0; r < g; ++r) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q[r]), kj[0]);
      for (int l = 1; l < lanes; ++l) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 8 * l), kj[l], acc);
      const float s = reduce_add(acc) * scale;
      sc[r * hi + j] = s;
      top[r] = std::max(top[r], s);
    }
  }
  for (int r = 0; r < g; ++r) {
    float* s = sc.data() + r * hi;
    const __m256 mx = _mm256_set1_ps(top[r]);
    for (int64_t j = 0; j < hi; j += 8) {  // exp lane by lane; the unattended columns are not read below
      const int64_t n = std::min<int64_t>(8, hi - j);
      spork_avx2::store_ps(s + j, exp_ps(_mm256_sub_ps(load_ps(s + j, n), mx)), n);
    }
    __m256 acc[MAX_D / 8];
    for (int l = 0; l < lanes; ++l) acc[l] = _mm256_setzero_ps();
    float sum = 0.f;
    for (int64_t j = 0; j < hi; ++j) {
      if (!m[j]) continue;
      const __m256 e = _mm256_set1_ps(s[j]);
      sum += s[j];
      for (int l = 0; l < lanes; ++l) acc[l] = _mm256_fmadd_ps(e, load_bf16(v + j * d + 8 * l), acc[l]);
    }
    const __m256 inv = _mm256_set1_ps(sum);
    for (int l = 0; l < lanes; ++l) store_bf16(o[r] + 8 * l, _mm256_div_ps(acc[l], inv));
  }
}

// one row: y = w x / sqrt(mean(x^2) + eps)
template <typename In>
void norm_row(const In* x, const uint16_t* w, int64_t c, float eps, uint16_t* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < c; i += 8) {
    const __m256 v = load(x + i, c - i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(reduce_add(acc) / static_cast<float>(c) + eps));
  for (int64_t i = 0; i < c; i += 8)
    store_bf16(y + i, _mm256_mul_ps(_mm256_mul_ps(load(x + i, c - i), r), load_bf16(w + i, c - i)), c - i);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "spork::", name,
              ": x [N, C], contiguous bf16");
}

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "spork::", name, ": x [N, C], contiguous fp32 or bf16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == x.size(1), "spork::", name,
              ": w [C] bf16");
}

// x [D] bf16 rotated by cos, sin [D] (sin's first half negated) -> out [D] bf16
void rotate(const uint16_t* x, const float* cs, const float* sn, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const int64_t n = half - i;
    const __m256 lo = load_bf16(x + i, n), hi = load_bf16(x + half + i, n);
    store_bf16(out + i, _mm256_fmadd_ps(hi, load_ps(sn + i, n), _mm256_mul_ps(lo, load_ps(cs + i, n))), n);
    store_bf16(out + half + i,
               _mm256_fmadd_ps(lo, load_ps(sn + half + i, n), _mm256_mul_ps(hi, load_ps(cs + half + i, n))), n);
  }
}

}  // namespace

namespace spork_ops {

at::Tensor attend(const at::Tensor& qk, int64_t heads, const at::Tensor& pool_k, const at::Tensor& pool_v,
                  const at::Tensor& slots, const at::Tensor& mask) {
  TORCH_CHECK(qk.dim() == 4 && pool_k.dim() == 4 && mask.dim() == 3, "spork::attend: qk [B, H + Hkv, T, D], pools "
              "[slots, Hkv, S, D], mask [B, T, C]");
  TORCH_CHECK(qk.scalar_type() == at::kBFloat16 && pool_k.scalar_type() == at::kBFloat16 &&
              pool_v.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kBool &&
              slots.scalar_type() == at::kLong, "spork::attend: bf16 qk and pools, bool mask, int64 slots");
  TORCH_CHECK(qk.is_contiguous() && pool_k.is_contiguous() && pool_v.is_contiguous() && mask.is_contiguous() &&
              slots.is_contiguous() && pool_k.sizes() == pool_v.sizes(), "spork::attend: contiguous tensors");
  const int64_t b = qk.size(0), t = qk.size(2), d = qk.size(3), hkv = pool_k.size(1), s_len = pool_k.size(2);
  const int64_t c = mask.size(2), g = heads / hkv;
  TORCH_CHECK(d % 8 == 0 && d <= MAX_D && pool_k.size(3) == d, "spork::attend: head size a multiple of 8, at most 128");
  TORCH_CHECK(heads % hkv == 0 && g <= MAX_G && qk.size(1) == heads + hkv && mask.size(0) == b &&
              mask.size(1) == t && slots.size(0) == b && c <= s_len, "spork::attend: shapes disagree");
  at::Tensor out = at::empty({b * t, heads * d}, qk.options());
  const uint16_t* qp = bf16_in(qk);
  const uint16_t* kp = bf16_in(pool_k);
  const uint16_t* vp = bf16_in(pool_v);
  uint16_t* op = bf16_out(out);
  const auto* mp = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < pool_k.size(0), "spork::attend: slot out of range");
  std::vector<int64_t> ends(b * t);  // each token's last attended column + 1
  for (int64_t i = 0; i < b * t; ++i) {
    const uint8_t* m = mp + i * c;
    int64_t e = c;
    while (e > 0 && !m[e - 1]) --e;
    TORCH_CHECK(e > 0, "spork::attend: a row attends no column");
    ends[i] = e;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, b * hkv * t, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc;
    float q[MAX_G][MAX_D];
    uint16_t* o[MAX_G];
    for (int64_t item = begin; item < end; ++item) {  // (sequence, KV head, token)
      const int64_t seq = item / (hkv * t), h = item / t % hkv, tok = item % t;
      for (int r = 0; r < g; ++r) {
        const int64_t head = h * g + r;
        const uint16_t* src = qp + ((seq * (heads + hkv) + head) * t + tok) * d;
        for (int64_t l = 0; l < d; l += 8) _mm256_storeu_ps(q[r] + l, load_bf16(src + l));
        o[r] = op + (seq * t + tok) * heads * d + head * d;
      }
      const int64_t base = (sp[seq] * hkv + h) * s_len * d;
      attend_token(q, static_cast<int>(g), kp + base, vp + base, mp + (seq * t + tok) * c, ends[seq * t + tok], d,
                   scale, sc, o);
    }
  });
  return out;
}

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
      for (int64_t i = 0; i < c; i += 8) {
        const __m256 dv = wide ? load(wide + n * c + i, c - i) : load(narrow + n * c + i, c - i);
        spork_avx2::store_ps(sp + n * c + i, _mm256_add_ps(load(xp + n * c + i, c - i), dv), c - i);
      }
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
      for (int64_t i = 0; i < f; i += 8) {
        const __m256 g = load_bf16(gp + n * 2 * f + i, f - i), u = load_bf16(gp + n * 2 * f + f + i, f - i);
        const __m256 ex = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));  // silu(g) = g / (1 + exp(-g))
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), ex));
        store_bf16(yp + n * f + i, _mm256_mul_ps(s, u), f - i);
      }
  });
  return y;
}

}  // namespace spork_ops

TORCH_LIBRARY_FRAGMENT(spork, m) {
  m.def("attend(Tensor qk, int heads, Tensor pool_k, Tensor pool_v, Tensor slots, Tensor mask) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int heads, Tensor(a!) pool_k, Tensor(b!) pool_v, "
        "Tensor slots, Tensor write) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(spork, CPU, m) {
  m.impl("attend", &spork_ops::attend);
  m.impl("rms_norm", &spork_ops::rms_norm);
  m.impl("add_rms_norm", &spork_ops::add_rms_norm);
  m.impl("rope_store", &spork_ops::rope_store);
  m.impl("silu_mul", &spork_ops::silu_mul);
}

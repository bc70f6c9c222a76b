// spork::attend and the small layer ops on AVX2 + FMA (CPUs without AVX512-BF16: avx512_attention.cpp's and
// avx512_ops.cpp's ops, their shapes and their meaning, in 8 lanes of fp32, with this file's own sums). Every row is
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
#include "op_checks.h"
#include "spork_ops.h"

namespace {

using spork_avx2::exp_ps;
using spork_avx2::load_bf16;
using spork_avx2::load_ps;
using spork_avx2::reduce_add;
using spork_avx2::store_bf16;

constexpr int MAX_D = 128;
constexpr int MAX_G = 16;  // query heads a KV head serves, at most

using spork_checks::bf16_in;
using spork_checks::bf16_out;
using spork_checks::GRAIN;

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





// s = x + d over one row of c (d fp32 or bf16)
template <typename D>
void add_row(const float* x, const D* d, int64_t c, float* s) {
  for (int64_t i = 0; i < c; i += 8)
    spork_avx2::store_ps(s + i, _mm256_add_ps(load(x + i, c - i), load(d + i, c - i)), c - i);
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
  spork_checks::attend(qk, heads, pool_k, pool_v, slots, mask);
  const int64_t b = qk.size(0), t = qk.size(2), d = qk.size(3), hkv = pool_k.size(1), s_len = pool_k.size(2);
  const int64_t c = mask.size(2), g = heads / hkv;
  TORCH_CHECK(d % 8 == 0 && d <= MAX_D && g <= MAX_G, "spork::attend: head size a multiple of 8, at most 128; at most "
              "16 query heads a KV head");
  at::Tensor out = at::empty({b * t, heads * d}, qk.options());
  const uint16_t* qp = bf16_in(qk);
  const uint16_t* kp = bf16_in(pool_k);
  const uint16_t* vp = bf16_in(pool_v);
  uint16_t* op = bf16_out(out);
  const auto* mp = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  const int64_t* sp = slots.data_ptr<int64_t>();
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

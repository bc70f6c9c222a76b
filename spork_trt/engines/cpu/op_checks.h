// What both flavors of spork's CPU ops share apart from their arithmetic (avx512_matmul.cpp, avx512_attention.cpp and
// avx512_ops.cpp on AVX512-BF16; avx2_matmul.cpp and avx2_ops.cpp on AVX2): the ops' argument checks, and
// the row loops of rms_norm, add_rms_norm and rope_store around a flavor's arithmetic.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace spork_checks {

constexpr int64_t GRAIN = 8;  // rows a thread takes at least (the layer ops)

inline const uint16_t* bf16_in(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline uint16_t* bf16_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// the code width of an int4_mm layout: 8 where packed holds a byte per weight ([N, K]), else 4 ([N, K/2]; a wrong
// shape is then refused by blocks_mm)
inline int code_bits(const at::Tensor& x, const at::Tensor& packed) {
  return x.dim() == 2 && packed.dim() == 2 && packed.size(1) == x.size(1) ? 8 : 4;
}

// int4_mm / q8_mm: x [M, K] bf16, packed [N, K * bits / 8] uint8, scales [N, K/16] fp16 or fp32, blocks of `group`,
// N a multiple of `tile`
inline void blocks_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int bits, int group,
                      int tile, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, op, ": packed must be [N, K * bits / 8] uint8");
  TORCH_CHECK(scales.dim() == 2 && (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat), op,
              ": scales must be [N, K/16] fp16 or fp32");
  const int64_t K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K % group == 0 && N % tile == 0 && packed.size(1) * 8 == K * bits && scales.size(0) == N &&
                  scales.size(1) == 2 * (K / group),
              op, ": shapes do not match");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), op, ": packed and scales must be contiguous");
}

// attend: qk [B, H + Hkv, T, D], pools [slots, Hkv, S, D] bf16, slots [B] int64 in range, mask [B, T, C] bool, C <= S
inline void attend(const at::Tensor& qk, int64_t heads, const at::Tensor& pool_k, const at::Tensor& pool_v,
                   const at::Tensor& slots, const at::Tensor& mask) {
  TORCH_CHECK(qk.dim() == 4 && pool_k.dim() == 4 && mask.dim() == 3, "spork::attend: qk [B, H + Hkv, T, D], pools "
              "[slots, Hkv, S, D], mask [B, T, C]");
  TORCH_CHECK(qk.scalar_type() == at::kBFloat16 && pool_k.scalar_type() == at::kBFloat16 &&
              pool_v.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kBool &&
              slots.scalar_type() == at::kLong, "spork::attend: bf16 qk and pools, bool mask, int64 slots");
  TORCH_CHECK(qk.is_contiguous() && pool_k.is_contiguous() && pool_v.is_contiguous() && mask.is_contiguous() &&
              slots.is_contiguous() && pool_k.sizes() == pool_v.sizes(), "spork::attend: contiguous tensors");
  const int64_t b = qk.size(0), hkv = pool_k.size(1);
  TORCH_CHECK(pool_k.size(3) == qk.size(3) && hkv > 0 && heads % hkv == 0 && qk.size(1) == heads + hkv &&
              mask.size(0) == b && mask.size(1) == qk.size(2) && slots.size(0) == b && mask.size(2) <= pool_k.size(2),
              "spork::attend: shapes disagree");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < pool_k.size(0), "spork::attend: slot out of range");
}

inline void rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "spork::", name,
              ": x [N, C], contiguous bf16");
}

inline void norm(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "spork::", name, ": x [N, C], contiguous fp32 or bf16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == x.size(1), "spork::", name,
              ": w [C] bf16");
}

// rope_store: qkv [B*T, (H + 2 Hkv) D] bf16, cos, sin [B, T, D] fp32 (sin's first half negated) -> qk [B, H + Hkv, T,
// D]: q and k rotated by `rotate(x, cos, sin, D, out)` (a flavor's: x cos + roll(x, D/2) sin, bf16 out); k and v
// written into the pools [slots, Hkv, S, D] at each sequence's slot and each row's write position [B, T]
template <typename Rotate>
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& slots,
                      const at::Tensor& write, Rotate rotate) {
  rows(qkv, "rope_store");
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

// rms_norm: x [N, C] fp32 or bf16, w [C] bf16 -> [N, C] bf16, each row by a flavor's `row(x row (const float* or
// const uint16_t*), w, C, eps, y row)`
template <typename Row>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, Row row) {
  norm(x, w, "rms_norm");
  const int64_t c = x.size(1);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const uint16_t* wp = bf16_in(w);
  uint16_t* yp = bf16_out(y);
  const float* wide = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;  // else bf16
  const uint16_t* narrow = wide ? nullptr : bf16_in(x);
  at::parallel_for(0, x.size(0), GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      if (wide) row(wide + n * c, wp, c, static_cast<float>(eps), yp + n * c);
      else row(narrow + n * c, wp, c, static_cast<float>(eps), yp + n * c);
    }
  });
  return y;
}

// add_rms_norm: x [N, C] fp32 (the residual stream), d [N, C] fp32 or bf16, w -> (s = x + d fp32, rms_norm(s)
// bf16), each row by a flavor's `add(x row, d row (const float* or const uint16_t*), C, s row)` and `row`
template <typename Add, typename Row>
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                                double eps, Add add, Row row) {
  norm(x, w, "add_rms_norm");
  norm(d, w, "add_rms_norm");
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
      if (wide) add(xp + n * c, wide + n * c, c, sp + n * c);
      else add(xp + n * c, narrow + n * c, c, sp + n * c);
      row(sp + n * c, wp, c, static_cast<float>(eps), yp + n * c);
    }
  });
  return {s, y};
}

}  // namespace spork_checks

// What spork's CPU kernels share (avx512_matmul.cpp, avx512_attention.cpp, avx512_ops.cpp): AVX512 helpers, every lane
// computed by the same instructions, and AMX's tile configuration.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace spork_simd {

// exp(x) (inf past 88, about 2^-126 at most below -87): 2^n p(r) with x = n ln2 + r (Cephes' expf polynomial),
// every lane by the same instructions
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 (the first `n`) -> fp32
inline __m512 load_bf16(const uint16_t* p, __mmask16 n = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(n, p)), 16));
}

// 16 fp32 -> bf16 (round to nearest even), the first `n` stored
inline void store_bf16(uint16_t* p, __m512 v, __mmask16 n = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, n, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }

// AMX (where spork_ops::amx_on()): ldtilecfg's palette 1 layout, tile i holding rows[i] rows of colsb[i] bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig& tile(int i, int r, int bytes) {
    rows[i] = static_cast<uint8_t>(r);
    colsb[i] = static_cast<uint16_t>(bytes);
    return *this;
  }
};

// a thread's tiles configured while in scope, released after
struct TileScope {
  explicit TileScope(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace spork_simd

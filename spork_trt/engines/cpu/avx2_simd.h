// What spork's AVX2 kernels share (avx2_matmul.cpp, avx2_ops.cpp: the library built where the CPU has AVX2, FMA and
// F16C but not AVX512-BF16): 8-lane fp32 helpers, every lane computed by the same instructions. Built with
// -ffp-contract=off, so the fmas are the ones written here and nothing else is fused.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace spork_avx2 {

// 8 bf16 -> fp32 (exact)
inline __m256 load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the first n (< 8) bf16 -> fp32, zeros after
inline __m256 load_bf16(const uint16_t* p, int64_t n) {
  if (n >= 8) return load_bf16(p);
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * 2);
  return load_bf16(buf);
}

inline __m256 load_ps(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * 4);
  return _mm256_load_ps(buf);
}

inline void store_ps(float* p, __m256 v, int64_t n) {
  if (n >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(std::max<int64_t>(n, 0)) * 4);
}

// 8 fp32 -> bf16, rounded to nearest even (NaN -> a quiet NaN), as AVX512-BF16's vcvtneps2bf16
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // words 0-3, 0-3 | 4-7, 4-7 (per 128-bit half)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // words 0-7
}

inline void store_bf16(uint16_t* p, __m256 v, int64_t n = 8) {
  const __m128i b = to_bf16(v);
  if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  alignas(16) uint16_t buf[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), b);
  std::memcpy(p, buf, static_cast<size_t>(std::max<int64_t>(n, 0)) * 2);
}

// the 8 lanes summed in a fixed order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_(i+4)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // (0 + 2), (1 + 3)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float reduce_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) (inf past about 88.7, about 2^-126 at most below -87): 2^n p(r) with x = n ln2 + r, Cephes' expf
// polynomial (avx512_simd.h's exp_ps in 8 lanes; 2^n built in two halves, exact for every n it meets)
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // -126 .. 129
  const __m256i half = _mm256_srai_epi32(ni, 1);
  auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}

}  // namespace spork_avx2

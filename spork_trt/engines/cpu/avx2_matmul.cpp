// spork::int4_mm and spork::q8_mm on AVX2 + FMA (CPUs without AVX512-BF16: avx512_matmul.cpp's ops, its packed
// layout and its formula, the dot products in 16-bit integers). Each output is computed by the same instructions
// whatever M, the thread and the rows beside it (row-invariant by construction):
//
//   y[m, n] = sum over blocks g, in order, of  d[g, n] * (s[m, g] * dot_g(m, n)) + off[g, n] * xs[m, g]
//   dot_g   = xq[m, 32g] c[n, 32g] + ... + xq[m, 32g + 31] c[n, 32g + 31]: vpmaddwd pairs summed in int32, exact
//             in any order (|dot_g| < 2^24 at 4 bits, so exact in fp32 too), c the code (4-bit q in 0..15; 8-bit
//             the stored q + 128, off = -128 d)
//   xq, s   = the row's block of 32 x in 16 bits: s = max |x| / 32767, xq = x / s rounded to nearest even (NaN out
//             where the block holds a NaN or an infinity)
//   xs      = the block's 32 x summed in fp32 (4 vectors added in order, then avx2_simd.h's reduce_add)
//
// So w = d q + off with the checkpoint's own fp16 d and off, exactly, as on AVX512-BF16; x is not: its 16-bit step
// is 1/32767 of its block's largest |x| (bf16 x itself carries 8 significant bits). Measured against fp32: top-1
// 0.9919, mean KL 0.0002 (`bench fidelity --cpu-torch int4`, the same as the AVX512-BF16 flavor's), and against
// the fp32 fmas this flavor ran before (x exact, each code expanded to fp32: about three instructions per 8
// weights), a one-row projection 1.2-1.6x faster, the Q8_0 head 2.8x (docs/engines.md). The bits are this file's own
// (a process runs one library). A chunk's codes (64 columns of a block) are expanded to 16-bit pairs once for all
// rows, then register blocks of 1 row x 4 tiles, 2 x 2 or 4 x 1 sum them; for up to FEW rows (a decode step, a
// short chain) into registers as they are used instead.
//
//   x [M, K] bf16, packed, scales: cpu/kernels.py's pack (avx512_matmul.cpp's header) -> [M, N] bf16 (int4_mm), fp32
//   (int4_mm with `wide`, q8_mm)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_simd.h"
#include "op_checks.h"
#include "spork_ops.h"

namespace {

using spork_avx2::load_bf16;
using spork_avx2::store_bf16;

constexpr int TILE = 16;   // columns of a tile (two ymm)
constexpr int NT = 4;      // tiles a chunk holds (64 columns)
constexpr int GROUP = 32;  // weights per block
constexpr int AHEAD = 4;   // blocks prefetched ahead: the weights stream from memory

// a block's codes of tile t as 16-bit pairs: w[P * NT * TILE * 2 + t * TILE * 2 + 2 j + i] = the code at k = 2P + i
// of column j (4-bit: quad e's bytes hold k = 4e, 4e + 2 | 4e + 1, 4e + 3, so their low nibbles are pair 2e and their
// high nibbles pair 2e + 1; 8-bit: pair p's two bytes are pair p)
template <int BITS>
inline void codes16(const uint8_t* src, __m256i* lo, __m256i* hi) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));  // 8 columns
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi16(0xF);
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  } else {
    *lo = v;
  }
}

template <int BITS>
void expand_tile(const uint8_t* src, int16_t* w, int t) {
  constexpr int STEP = BITS == 4 ? 2 : 1;  // pairs per 16 bytes of a half tile
  for (int q = 0; q < GROUP / 2 / STEP; ++q)
    for (int h = 0; h < 2; ++h) {
      __m256i c[2];
      codes16<BITS>(src + q * 2 * TILE + h * 16, &c[0], &c[1]);
      for (int i = 0; i < STEP; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + ((q * STEP + i) * NT + t) * TILE * 2 + h * 16), c[i]);
    }
}

// a register block's integer sums of one block -> y: y = d (s isum) + y, then y = off xs + y (tiles t .. t + T - 1;
// s: the row's block scale, xs its block sum)
template <int R, int T>
inline void finish(const __m256i (&acc)[R][T][2], int t, const float* d, const float* off, const float* xs,
                   const float* s, int64_t G, float* y, int64_t ystride) {
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_set1_ps(xs[r * G]), scale = _mm256_set1_ps(s[r * G]);
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < 2; ++h) {
        const int col = (t + i) * TILE + h * 8;
        float* yp = y + r * ystride + col;
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][i][h]), scale);
        const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(d + col), dot, _mm256_loadu_ps(yp));
        _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_loadu_ps(off + col), sum, v));
      }
  }
}

// x's 16-bit pair (k = 2P, 2P + 1) of row r, in every dword
inline __m256i xpair(const int16_t* x, int64_t K, int r, int P) {
  int32_t v;
  std::memcpy(&v, x + r * K + 2 * P, 4);
  return _mm256_set1_epi32(v);
}

// R rows x T tiles (from tile t) of one block, its codes expanded in w: acc = the exact integer dot, then `finish`
template <int R, int T>
void rows(const int16_t* x, int64_t K, const int16_t* w, int t, const float* d, const float* off, const float* xs,
          const float* s, int64_t G, float* y, int64_t ystride) {
  __m256i acc[R][T][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < T; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_si256();
  for (int P = 0; P < GROUP / 2; ++P) {
    __m256i c[T][2];
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < 2; ++h)
        c[i][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (P * NT + t + i) * TILE * 2 + h * 16));
    for (int r = 0; r < R; ++r) {
      const __m256i a = xpair(x, K, r, P);
      for (int i = 0; i < T; ++i)
        for (int h = 0; h < 2; ++h) acc[r][i][h] = _mm256_add_epi32(acc[r][i][h], _mm256_madd_epi16(c[i][h], a));
    }
  }
  finish<R, T>(acc, t, d, off, xs, s, G, y, ystride);
}

// `rows` for a few rows with the codes expanded into registers as they are used (src: the block's codes of tile t):
// integer sums, exact in any order, so the same bits
template <int BITS, int R, int T>
void few(const int16_t* x, int64_t K, const uint8_t* src, int t, const float* d, const float* off, const float* xs,
         const float* s, int64_t G, float* y, int64_t ystride) {
  constexpr int BYTES = GROUP * BITS / 8 * TILE;
  constexpr int STEP = BITS == 4 ? 2 : 1;  // pairs per 16 bytes of a half tile
  __m256i acc[R][T][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < T; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_si256();
  for (int q = 0; q < GROUP / 2 / STEP; ++q) {
    __m256i a[R][STEP];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < STEP; ++j) a[r][j] = xpair(x, K, r, q * STEP + j);
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < 2; ++h) {
        __m256i c[2];
        codes16<BITS>(src + i * BYTES + q * 2 * TILE + h * 16, &c[0], &c[1]);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < STEP; ++j)
            acc[r][i][h] = _mm256_add_epi32(acc[r][i][h], _mm256_madd_epi16(c[j], a[r][j]));
      }
  }
  finish<R, T>(acc, t, d, off, xs, s, G, y, ystride);
}

using RowsFn = void (*)(const int16_t*, int64_t, const int16_t*, int, const float*, const float*, const float*,
                        const float*, int64_t, float*, int64_t);

// tiles a register block of r rows takes (up to 8 sums in flight)
int tiles_for(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }

RowsFn rows_fn(int r, int t) {
  switch (r) {
    case 1: return t >= 4 ? rows<1, 4> : t == 3 ? rows<1, 3> : t == 2 ? rows<1, 2> : rows<1, 1>;
    case 2: return t >= 2 ? rows<2, 2> : rows<2, 1>;
    case 3: return rows<3, 1>;
    default: return rows<4, 1>;
  }
}

using FewFn = void (*)(const int16_t*, int64_t, const uint8_t*, int, const float*, const float*, const float*,
                       const float*, int64_t, float*, int64_t);

template <int BITS>
FewFn few_fn(int r, int t) {
  switch (r) {
    case 1: return t >= 4 ? few<BITS, 1, 4> : t == 3 ? few<BITS, 1, 3> : t == 2 ? few<BITS, 1, 2> : few<BITS, 1, 1>;
    case 2: return t >= 2 ? few<BITS, 2, 2> : few<BITS, 2, 1>;
    case 3: return few<BITS, 3, 1>;
    default: return few<BITS, 4, 1>;
  }
}

// a tile half's 8 scales (d or off) in fp32: the checkpoint's fp16 ones, or the K-quants' fp32 (avx512_matmul.cpp)
inline __m256 scales8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }

constexpr int FEW = 4;  // rows up to which the codes are expanded into registers (again for each register block)

// tiles t0 .. t1 - 1 of chunk c (nt tiles) for every row into y [M, (t1 - t0) * 16] fp32, then out
template <int BITS, typename Out, typename S>
void chunk(const int16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const S* scales,
           const float* xs, const float* xscale, int64_t c, int nt, int t0, int t1, float* y, int16_t* w, Out* out) {
  constexpr int BYTES = GROUP * BITS / 8 * TILE;  // a block of a tile
  const int64_t G = K / GROUP;
  const int n = t1 - t0, ystride = n * TILE;
  const uint8_t* codes = packed + c * G * NT * BYTES;
  const S* sc = scales + c * G * 2 * NT * TILE;
  std::fill(y, y + M * ystride, 0.f);
  alignas(32) float d[NT * TILE], off[NT * TILE];
  const int rows_at_once = M >= 4 ? 4 : static_cast<int>(M);
  for (int64_t g = 0; g < G; ++g, codes += nt * BYTES, sc += 2 * nt * TILE) {
    for (int i = 0; i < nt * BYTES; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + AHEAD * nt * BYTES + i), _MM_HINT_T0);
    for (int i = 0; i < 2 * nt * TILE; i += 64 / sizeof(S))
      _mm_prefetch(reinterpret_cast<const char*>(sc + AHEAD * 2 * nt * TILE + i), _MM_HINT_T0);
    for (int t = 0; t < n; ++t) {
      if (M > FEW) expand_tile<BITS>(codes + (t0 + t) * BYTES, w, t);
      for (int h = 0; h < 2; ++h) {
        const S* s = sc + (t0 + t) * TILE + h * 8;
        _mm256_storeu_ps(d + t * TILE + h * 8, scales8(s));
        _mm256_storeu_ps(off + t * TILE + h * 8, scales8(s + nt * TILE));
      }
    }
    for (int64_t m = 0; m < M; m += rows_at_once) {
      const int r = static_cast<int>(std::min<int64_t>(rows_at_once, M - m));
      for (int t = 0; t < n; t += tiles_for(r)) {
        const int16_t* xr = x + m * K + g * GROUP;
        const float *xsr = xs + m * G + g, *sr = xscale + m * G + g;
        if (M > FEW) rows_fn(r, n - t)(xr, K, w, t, d, off, xsr, sr, G, y + m * ystride, ystride);
        else few_fn<BITS>(r, n - t)(xr, K, codes + (t0 + t) * BYTES, t, d, off, xsr, sr, G, y + m * ystride, ystride);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < 2; ++h) {
        Out* o = out + m * N + (c * NT + t0 + t) * TILE + h * 8;
        const __m256 v = _mm256_loadu_ps(y + m * ystride + t * TILE + h * 8);
        if constexpr (std::is_same_v<Out, float>) _mm256_storeu_ps(o, v);
        else store_bf16(reinterpret_cast<uint16_t*>(o), v);
      }
}

// a row's block of 32 x (bf16) -> xq (16-bit, x / s rounded to nearest even), s = max |x| / 32767 (NaN where x holds
// a NaN or an infinity, so the outputs are NaN), and the block's sum xs in fp32 (4 vectors added in order, then
// reduce_add)
inline void quantize_block(const uint16_t* x, int16_t* xq, float* s, float* xs) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = load_bf16(x + j * 8);
  *xs = spork_avx2::reduce_add(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), v[2]), v[3]));
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m256 bad = _mm256_setzero_ps();  // lanes holding a NaN
  for (int j = 0; j < 4; ++j) bad = _mm256_or_ps(bad, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
  const float amax = spork_avx2::reduce_max(m);
  if (_mm256_movemask_ps(bad) != 0 || !(amax < INFINITY)) {  // a NaN or an infinity: NaN out
    *s = NAN;
    std::memset(xq, 0, GROUP * 2);
    return;
  }
  *s = amax / 32767.f;
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 32767.f / amax : 0.f);
  for (int j = 0; j < 4; j += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j * 8), p);
  }
}

template <int BITS, typename Out, typename S>
at::Tensor blocks_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const char* op) {
  spork_checks::blocks_mm(x, packed, scales, BITS, GROUP, TILE, op);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = packed.size(0), G = K / GROUP;
  at::Tensor out = at::empty({M, N}, xc.options().dtype(std::is_same_v<Out, float> ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<int16_t> xq(M * K);  // x in 16 bits per block of 32
  std::vector<float> xscale(M * G), xs(M * G);  // [M, G]: each row's block scales and block sums
  for (int64_t i = 0; i < M * G; ++i)
    quantize_block(xp + i * GROUP, xq.data() + i * GROUP, &xscale[i], &xs[i]);
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const S* sc = scales.data_ptr<S>();
  Out* dst = out.data_ptr<Out>();
  const int64_t tiles = N / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {  // each thread an equal run of tiles, chunk by chunk
    std::vector<float> y(M * NT * TILE);
    std::vector<int16_t> w(GROUP * NT * TILE);
    for (int64_t c = b / NT; c * NT < e; ++c) {
      const int nt = static_cast<int>(std::min<int64_t>(NT, tiles - c * NT));
      chunk<BITS, Out, S>(xq.data(), M, K, N, pk, sc, xs.data(), xscale.data(), c, nt,
                          static_cast<int>(std::max<int64_t>(b - c * NT, 0)),
                          static_cast<int>(std::min<int64_t>(e - c * NT, nt)), y.data(), w.data(), dst);
    }
  });
  return out;
}

// the layout's code width (spork_checks::code_bits) and the scales' type pick the instance
template <typename Out>
at::Tensor any_blocks_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const char* op) {
  const bool wide_scales = scales.scalar_type() == at::kFloat;
  if (spork_checks::code_bits(x, packed) == 8)
    return wide_scales ? blocks_mm<8, Out, float>(x, packed, scales, op)
                       : blocks_mm<8, Out, at::Half>(x, packed, scales, op);
  return wide_scales ? blocks_mm<4, Out, float>(x, packed, scales, op)
                     : blocks_mm<4, Out, at::Half>(x, packed, scales, op);
}

}  // namespace

namespace spork_ops {

bool amx_on() { return false; }  // this library runs AVX2 only

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, bool wide) {
  return wide ? any_blocks_mm<float>(x, packed, scales, "int4_mm")
              : any_blocks_mm<at::BFloat16>(x, packed, scales, "int4_mm");
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return scales.scalar_type() == at::kFloat ? blocks_mm<8, float, float>(x, packed, scales, "q8_mm")
                                            : blocks_mm<8, float, at::Half>(x, packed, scales, "q8_mm");
}

}  // namespace spork_ops

TORCH_LIBRARY(spork, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scales, bool wide=False) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("uses_amx() -> bool", [] { return spork_ops::amx_on(); });
}

TORCH_LIBRARY_IMPL(spork, CPU, m) {
  m.impl("int4_mm", &spork_ops::int4_mm);
  m.impl("q8_mm", &spork_ops::q8_mm);
}

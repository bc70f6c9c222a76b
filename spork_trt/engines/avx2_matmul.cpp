// spork::int4_mm and spork::q8_mm on AVX2 + FMA (CPUs without AVX512-BF16: int4_kernel.cpp's ops, its packed
// layout and its formula, in 8 lanes of fp32). Each output is computed by the same instructions whatever M, the
// thread and the rows beside it (row-invariant by construction):
//
//   y[m, n] = sum over blocks g, in order, of  d[g, n] * dot_g(m, n) + off[g, n] * xs[m, g]
//   dot_g   = x[m, 32g] c[n, 32g] + ... + x[m, 32g + 31] c[n, 32g + 31]: fp32 fmas in k order from 0, c the code
//             as fp32 (4-bit q in 0..15; 8-bit the stored q + 128, off = -128 d), each product exact
//   xs      = the block's 32 x summed in fp32 (4 vectors added in order, then avx2_simd.h's reduce_add)
//
// So w = d q + off with the checkpoint's own fp16 d and off, exactly, as on AVX512-BF16; the sums' fp32 rounding is
// this file's own (other bits than vdpbf16ps's: a process runs one library). A chunk's codes (64 columns of a block)
// are expanded to fp32 once for all rows, then register blocks of 1 row x 4 tiles, 2 x 2 or 4 x 1 sum them; for
// up to FEW rows (a decode step, a short chain) into registers as they are used instead.
//
//   x [M, K] bf16, packed, scales: int4_kernel.py's pack (int4_kernel.cpp's header) -> [M, N] bf16 (int4_mm), fp32
//   (int4_mm with `wide`, q8_mm)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
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

// a block's codes of tile t as fp32: w[k * NT * TILE + t * TILE + j], column j of the tile
template <int BITS>
void expand_tile(const uint8_t* src, float* w, int t) {
  const __m256i low4 = _mm256_set1_epi32(0xF), low8 = _mm256_set1_epi32(0xFF);
  float* out = w + t * TILE;
  if constexpr (BITS == 4) {
    for (int e = 0; e < GROUP / 4; ++e)  // quad e: column j's bytes q[4e] | q[4e + 2] << 4, q[4e + 1] | q[4e + 3] << 4
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e * 2 * TILE + h * 16)));
        const int shifts[4] = {0, 8, 4, 12};  // k = 4e, 4e + 1, 4e + 2, 4e + 3
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(out + (4 * e + i) * NT * TILE + h * 8, _mm256_cvtepi32_ps(_mm256_and_si256(
              _mm256_srlv_epi32(v, _mm256_set1_epi32(shifts[i])), low4)));
      }
  } else {
    for (int p = 0; p < GROUP / 2; ++p)  // pair p: column j's bytes c[2p], c[2p + 1]
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + p * 2 * TILE + h * 16)));
        _mm256_storeu_ps(out + 2 * p * NT * TILE + h * 8, _mm256_cvtepi32_ps(_mm256_and_si256(v, low8)));
        _mm256_storeu_ps(out + (2 * p + 1) * NT * TILE + h * 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 8)));
      }
  }
}

// a register block's sums of one block -> y: y = d acc + y, then y = off xs + y (tiles t .. t + T - 1)
template <int R, int T>
inline void finish(const __m256 (&acc)[R][T][2], int t, const float* d, const float* off, const float* xs, int64_t G,
                   float* y, int64_t ystride) {
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_set1_ps(xs[r * G]);
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < 2; ++h) {
        const int col = (t + i) * TILE + h * 8;
        float* yp = y + r * ystride + col;
        const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(d + col), acc[r][i][h], _mm256_loadu_ps(yp));
        _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_loadu_ps(off + col), s, v));
      }
  }
}

// R rows x T tiles (from tile t) of one block, its codes expanded in w: acc = dot_g, then `finish`
template <int R, int T>
void rows(const float* x, int64_t K, const float* w, int t, const float* d, const float* off, const float* xs,
          int64_t G, float* y, int64_t ystride) {
  __m256 acc[R][T][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < T; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
  for (int k = 0; k < GROUP; ++k) {
    __m256 c[T][2];
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < 2; ++h) c[i][h] = _mm256_loadu_ps(w + k * NT * TILE + (t + i) * TILE + h * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      for (int i = 0; i < T; ++i)
        for (int h = 0; h < 2; ++h) acc[r][i][h] = _mm256_fmadd_ps(a, c[i][h], acc[r][i][h]);
    }
  }
  finish<R, T>(acc, t, d, off, xs, G, y, ystride);
}

// `rows` for a few rows with the codes expanded into registers as they are used (src: the block's codes of tile t):
// per output the same fmas in the same order, so the same bits
template <int BITS, int R, int T>
void few(const float* x, int64_t K, const uint8_t* src, int t, const float* d, const float* off, const float* xs,
         int64_t G, float* y, int64_t ystride) {
  constexpr int BYTES = GROUP * BITS / 8 * TILE;
  __m256 acc[R][T][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < T; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
  constexpr int STEP = BITS == 4 ? 4 : 2;  // k per 16 bytes of a half tile
  for (int k0 = 0; k0 < GROUP; k0 += STEP)
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(src + i * BYTES + k0 / STEP * 2 * TILE + h * 16)));
        __m256 c[STEP];
        if constexpr (BITS == 4) {
          const __m256i low4 = _mm256_set1_epi32(0xF);
          c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
          c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), low4));
          c[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), low4));
          c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12));
        } else {
          c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFF)));
          c[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 8));
        }
        for (int j = 0; j < STEP; ++j)
          for (int r = 0; r < R; ++r)
            acc[r][i][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + k0 + j), c[j], acc[r][i][h]);
      }
  finish<R, T>(acc, t, d, off, xs, G, y, ystride);
}

using RowsFn = void (*)(const float*, int64_t, const float*, int, const float*, const float*, const float*, int64_t,
                        float*, int64_t);

// tiles a register block of r rows takes (up to 8 sums in flight and their codes in 16 ymm)
int tiles_for(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }

RowsFn rows_fn(int r, int t) {
  switch (r) {
    case 1: return t >= 4 ? rows<1, 4> : t == 3 ? rows<1, 3> : t == 2 ? rows<1, 2> : rows<1, 1>;
    case 2: return t >= 2 ? rows<2, 2> : rows<2, 1>;
    case 3: return rows<3, 1>;
    default: return rows<4, 1>;
  }
}

using FewFn = void (*)(const float*, int64_t, const uint8_t*, int, const float*, const float*, const float*, int64_t,
                       float*, int64_t);

template <int BITS>
FewFn few_fn(int r, int t) {
  switch (r) {
    case 1: return t >= 4 ? few<BITS, 1, 4> : t == 3 ? few<BITS, 1, 3> : t == 2 ? few<BITS, 1, 2> : few<BITS, 1, 1>;
    case 2: return t >= 2 ? few<BITS, 2, 2> : few<BITS, 2, 1>;
    case 3: return few<BITS, 3, 1>;
    default: return few<BITS, 4, 1>;
  }
}

constexpr int FEW = 4;  // rows up to which the codes are expanded into registers (again for each register block)

// tiles t0 .. t1 - 1 of chunk c (nt tiles) for every row into y [M, (t1 - t0) * 16] fp32, then out
template <int BITS, typename Out>
void chunk(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const at::Half* scales,
           const float* xs, int64_t c, int nt, int t0, int t1, float* y, float* w, Out* out) {
  constexpr int BYTES = GROUP * BITS / 8 * TILE;  // a block of a tile
  const int64_t G = K / GROUP;
  const int n = t1 - t0, ystride = n * TILE;
  const uint8_t* codes = packed + c * G * NT * BYTES;
  const at::Half* sc = scales + c * G * 2 * NT * TILE;
  std::fill(y, y + M * ystride, 0.f);
  alignas(32) float d[NT * TILE], off[NT * TILE];
  const int rows_at_once = M >= 4 ? 4 : static_cast<int>(M);
  for (int64_t g = 0; g < G; ++g, codes += nt * BYTES, sc += 2 * nt * TILE) {
    for (int i = 0; i < nt * BYTES; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + AHEAD * nt * BYTES + i), _MM_HINT_T0);
    for (int i = 0; i < 2 * nt * TILE; i += 32)
      _mm_prefetch(reinterpret_cast<const char*>(sc + AHEAD * 2 * nt * TILE + i), _MM_HINT_T0);
    for (int t = 0; t < n; ++t) {
      if (M > FEW) expand_tile<BITS>(codes + (t0 + t) * BYTES, w, t);
      for (int h = 0; h < 2; ++h) {
        const auto* s = reinterpret_cast<const __m128i*>(sc + (t0 + t) * TILE + h * 8);
        _mm256_storeu_ps(d + t * TILE + h * 8, _mm256_cvtph_ps(_mm_loadu_si128(s)));
        _mm256_storeu_ps(off + t * TILE + h * 8, _mm256_cvtph_ps(_mm_loadu_si128(s + nt * TILE / 8)));
      }
    }
    for (int64_t m = 0; m < M; m += rows_at_once) {
      const int r = static_cast<int>(std::min<int64_t>(rows_at_once, M - m));
      for (int t = 0; t < n; t += tiles_for(r)) {
        const float* xr = x + m * K + g * GROUP;
        if (M > FEW) rows_fn(r, n - t)(xr, K, w, t, d, off, xs + m * G + g, G, y + m * ystride, ystride);
        else few_fn<BITS>(r, n - t)(xr, K, codes + (t0 + t) * BYTES, t, d, off, xs + m * G + g, G, y + m * ystride,
                                    ystride);
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

template <int BITS, typename Out>
at::Tensor blocks_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const char* op) {
  spork_checks::blocks_mm(x, packed, scales, BITS, GROUP, TILE, op);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = packed.size(0), G = K / GROUP;
  at::Tensor out = at::empty({M, N}, xc.options().dtype(std::is_same_v<Out, float> ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> xf(M * K), xs(M * G);  // x as fp32; [M, G]: each row's block sums
  for (int64_t i = 0; i < M * G; ++i) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = load_bf16(xp + i * GROUP + j * 8);
      _mm256_storeu_ps(xf.data() + i * GROUP + j * 8, v[j]);
    }
    xs[i] = spork_avx2::reduce_add(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), v[2]), v[3]));
  }
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  Out* dst = out.data_ptr<Out>();
  const int64_t tiles = N / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {  // each thread an equal run of tiles, chunk by chunk
    std::vector<float> y(M * NT * TILE), w(GROUP * NT * TILE);
    for (int64_t c = b / NT; c * NT < e; ++c) {
      const int nt = static_cast<int>(std::min<int64_t>(NT, tiles - c * NT));
      chunk<BITS>(xf.data(), M, K, N, pk, sc, xs.data(), c, nt, static_cast<int>(std::max<int64_t>(b - c * NT, 0)),
                  static_cast<int>(std::min<int64_t>(e - c * NT, nt)), y.data(), w.data(), dst);
    }
  });
  return out;
}

}  // namespace

namespace spork_ops {

bool amx_on() { return false; }  // this library runs AVX2 only

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, bool wide) {
  return wide ? blocks_mm<4, float>(x, packed, scales, "int4_mm")
              : blocks_mm<4, at::BFloat16>(x, packed, scales, "int4_mm");
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return blocks_mm<8, float>(x, packed, scales, "q8_mm");
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

// spork::int4_mm and spork::q8_mm: x [M, K] bf16 @ a checkpoint's 4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) blocks ->
// [M, N], bf16 (int4_mm, a layer's projections; fp32 with `wide`, those added to the residual stream) or
// fp32 (q8_mm, the LM head's logits), on AVX512-BF16, and on AMX-BF16's tile unit where the CPU has it.
//
// Each output is computed by the same instructions whatever M, whichever thread and whichever row block holds its
// row, so a row gives the same bits alone, in a chain or in a batch (row-invariant by construction):
//
//   y[m, n] = sum over blocks g, in order, of  d[g, n] * dot_g(m, n) + (off[g, n] - BIAS d[g, n]) * xs[m, g]
//   dot_g   = sum of x[m, k] c[n, k] over the block's 32 k: 16 bf16 pairs accumulated by vdpbf16ps from 0, in pair
//             order, with c exact in bf16: 4-bit, c = 128 + q (bits 0x4300 | q: two logic ops per 32 codes,
//             BIAS 128); 8-bit, c = the stored code q + 128 in 0..255 converted (BIAS 0, off = -128 d)
//   xs      = the block's 32 x summed in fp32 (a fixed order)
//
// That is w = d q + off with the checkpoint's own fp16 d and off (Q4_1: off = m; Q4_0: off = -8 d; Q8_0: w = d q),
// exactly; only the fp32 rounding of the sums differs from any other order. A block's codes are expanded once per
// 64 columns for all rows (ATen's int4 CPU kernel expands them again for every 4 rows); for a few rows (a decode
// step, a small tree: `few`, up to Codes::FEW) into registers as they are used, again for each 4 rows, with every
// tile's sums (and for 1-2 rows two blocks') in flight together: the same instructions per output, so the same bits.
// One row: 0.92 ms for 30 layers' projections against 1.52 expanding once into memory (hot; 1.72 against 1.93 read
// from memory), 4 rows 1.81 against 2.33, 16 rows unchanged (scratch benchmark, in one process).
//
// On a CPU with AMX-BF16 (Xeons from Sapphire Rapids on) dot_g is TDPBF16PS's instead, for every row count
// (`amx_rows`): the same pairs summed from 0, each row of a tile alone, but not with vdpbf16ps's bits (on a Xeon about
// 2.6% of such sums differ in their last place: vdpbf16ps there is two fp32 fmas, odd element first; the tile unit
// matched no order of fmas tried), so a process runs one arithmetic for all its calls (`amx_on`; SPORK_AMX=0 keeps
// vdpbf16ps). vdpbf16ps runs at about a third of its EPYC rate there; the int4 engine's forward after 256 rows on a
// 2-core Xeon, both in one process, alternating (medians): T=4 16.6 -> 12.9 ms, T=16 42.3 -> 20.4, T=64 146.0 ->
// 47.2, 16 x 1 47.3 -> 26.1; T=1 about the same (10.5, 11.3: its weights stream from memory).
//
//   packed   chunks of 4 tiles (64 columns), each whole: for chunk c, block g, tile t (16 columns), then
//            4-bit: quad e (k = 32g + 4e .. + 3), column j, two bytes: q[., 4e] | q[., 4e + 2] << 4 and
//                   q[., 4e + 1] | q[., 4e + 3] << 4;
//            8-bit: pair p (k = 32g + 2p, + 1), column j, two bytes: c[., 2p], c[., 2p + 1].
//            A thread reads its run of tiles (threads split the N/16 tiles evenly, a chunk between two if need be; the
//            last chunk holds the N/16 % 4 tiles left, if any)
//   scales   the same chunks: for chunk c, block g: d of its columns, then off, fp16 (the checkpoint's own: Q4_0,
//            Q4_1, Q5_0, Q5_1, Q8_0) or fp32 (the K-quants': d times a sub-block's 6-bit scale, exact in fp32 only)
//
// int4_mm takes either code width (a layer's projections: 4-bit Q4_0 / Q4_1 / Q4_K codes, or 8-bit codes holding a
// Q5_0 / Q5_1 / Q5_K / Q8_0 block's 5 or 8 bits exactly: cpu/kernels.py's pack), told apart by the packed width
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "avx512_simd.h"
#include "op_checks.h"
#include "spork_ops.h"

namespace {

constexpr int TILE = 16;   // columns in a zmm of fp32
constexpr int NT = 4;      // tiles a chunk holds (64 columns)
constexpr int GROUP = 32;  // weights per block
constexpr int PAIRS = GROUP / 2;
constexpr int AHEAD = 4;  // blocks a thread prefetches ahead of its reads: the weights stream from memory

// 32 bytes of quad e -> the bf16 pairs 2e and 2e + 1 (lane j: (128 + q[2p]) | (128 + q[2p + 1]) << 16)
inline void expand(const uint8_t* p, __m512i* even, __m512i* odd) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  *even = _mm512_ternarylogic_epi32(words, low4, bias, 0xEA);  // (a & b) | c
  *odd = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), low4, bias, 0xEA);
}

// 32 bytes of pair p -> its bf16 pairs (lane j: c[2p] | c[2p + 1] << 16; columns 0-7 in the first 16 bytes)
inline __m512i widen(const uint8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // bf16 0..15 from lo, 16..31 from hi: exact (c < 256)
}

// a block's codes of one tile -> its 16 bf16 pairs, w[p * NT + t]
template <int BITS>
struct Codes {
  static constexpr int BYTES = GROUP * BITS / 8 * TILE;  // a block of a tile
  static constexpr float BIAS = BITS == 4 ? 128.f : 0.f;  // what the expanded codes add to q
  static constexpr int FEW = BITS == 4 ? 8 : 4;  // rows up to which `chunk` runs `few` (which expands the codes
                                                 // again for each 4 rows: 8-bit codes cost more to widen)
  static void expand_tile(const uint8_t* src, __m512i* w, int t) {
    if constexpr (BITS == 4) {
      for (int e = 0; e < GROUP / 4; ++e) expand(src + e * 2 * TILE, &w[2 * e * NT + t], &w[(2 * e + 1) * NT + t]);
    } else {
      for (int p = 0; p < PAIRS; ++p) w[p * NT + t] = widen(src + p * 2 * TILE);
    }
  }
};

// a tile's 16 scales (d or off) in fp32: fp16 as the checkpoint stores Q4_0 / Q4_1 / Q5_0 / Q8_0 ones, or fp32 for
// the K-quants' (their d times a sub-block's 6-bit scale: exact in fp32, not in fp16)
inline __m512 scales16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }

// one block of a chunk (codes, sc: its codes and scales), the stream AHEAD blocks on prefetched (the next chunk's,
// past the end): tiles t0 .. t0 + n - 1 -> their expanded codes w[p * NT + t], d and off - BIAS d
template <int BITS, typename S>
void expand_block(const uint8_t* codes, const S* sc, int nt, int t0, int n, __m512i* w, __m512* d,
                  __m512* off) {
  using C = Codes<BITS>;
  for (int i = 0; i < nt * C::BYTES; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes + AHEAD * nt * C::BYTES + i), _MM_HINT_T0);
  for (int i = 0; i < 2 * nt * TILE; i += 64 / sizeof(S))
    _mm_prefetch(reinterpret_cast<const char*>(sc + AHEAD * 2 * nt * TILE + i), _MM_HINT_T0);
  for (int t = 0; t < n; ++t) {
    d[t] = scales16(sc + (t0 + t) * TILE);
    off[t] = _mm512_fnmadd_ps(_mm512_set1_ps(C::BIAS), d[t], scales16(sc + (nt + t0 + t) * TILE));
    C::expand_tile(codes + (t0 + t) * C::BYTES, w, t);
  }
}

inline void store(at::BFloat16* out, __m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);  // round to nearest even
  std::memcpy(out, &b, 32);
}
inline void store(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

// R rows x T tiles of one block (T independent sums per row in flight): acc = the pairs' dot products, then
// y = d acc + y; y = (off - 128 d) xs + y
template <int R, int T>
void rows(const uint16_t* x, int64_t K, const __m512i* w, const __m512* d, const __m512* off, const float* xs,
          int64_t G, float* y, int64_t ystride) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int p = 0; p < PAIRS; ++p) {
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, (__m512bh)w[p * NT + t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(xs[r * G]);
    for (int t = 0; t < T; ++t) {
      float* yp = y + r * ystride + t * TILE;
      const __m512 v = _mm512_fmadd_ps(d[t], acc[r][t], _mm512_loadu_ps(yp));
      _mm512_storeu_ps(yp, _mm512_fmadd_ps(off[t], s, v));
    }
  }
}

using RowsFn = void (*)(const uint16_t*, int64_t, const __m512i*, const __m512*, const __m512*, const float*,
                        int64_t, float*, int64_t);

template <int R>
RowsFn rows_for(int t) {
  switch (t) {
    case 4: return rows<R, 4>;
    case 3: return rows<R, 3>;
    case 2: return rows<R, 2>;
    default: return rows<R, 1>;
  }
}

RowsFn rows_fn(int r, int t) {
  switch (r) {
    case 4: return rows_for<4>(t);
    case 3: return rows_for<3>(t);
    case 2: return rows_for<2>(t);
    default: return rows_for<1>(t);
  }
}

// R rows (a few: a decode step, a small tree) against T tiles of blocks g .. g + NB - 1 (`src`, `sc`: block g's
// codes and d of the first tile; `stride`, `sstride`: one block on), R x NB x T sums in flight together (a row or
// two alone have too few independent sums to hide vdpbf16ps's latency), the codes expanded into registers as their
// pairs are used, each x pair broadcast once for the T tiles; then, block by block in order, each output's two fmas:
// per output the instructions of rows<R, T>, so the same bits
template <int BITS, int R, int NB, int T, typename S>
void few_rows(const uint16_t* x, int64_t K, const uint8_t* src, int64_t stride, const S* sc, int64_t sstride,
              int nt, const float* xs, int64_t G, float* y, int64_t ystride) {
  using C = Codes<BITS>;
  __m512 acc[R][NB][T];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      for (int t = 0; t < T; ++t) acc[r][b][t] = _mm512_setzero_ps();
  for (int p = 0; p < PAIRS; p += 2) {
    __m512bh a0[R][NB], a1[R][NB];  // x's pairs p and p + 1 of each row and block
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) {
        int32_t pair[2];
        std::memcpy(pair, x + r * K + b * GROUP + 2 * p, 8);
        a0[r][b] = (__m512bh)_mm512_set1_epi32(pair[0]);
        a1[r][b] = (__m512bh)_mm512_set1_epi32(pair[1]);
      }
    for (int t = 0; t < T; ++t)
      for (int b = 0; b < NB; ++b) {
        const uint8_t* q = src + b * stride + t * C::BYTES;
        __m512i w0, w1;  // the tile's pairs p and p + 1
        if constexpr (BITS == 4) {
          expand(q + p * TILE, &w0, &w1);
        } else {
          w0 = widen(q + p * 2 * TILE);
          w1 = widen(q + (p + 1) * 2 * TILE);
        }
        for (int r = 0; r < R; ++r)
          acc[r][b][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][b][t], a0[r][b], (__m512bh)w0), a1[r][b],
                                          (__m512bh)w1);
      }
  }
  for (int t = 0; t < T; ++t) {
    __m512 d[NB], off[NB];
    for (int b = 0; b < NB; ++b) {
      const S* s = sc + b * sstride + t * TILE;
      d[b] = scales16(s);
      off[b] = _mm512_fnmadd_ps(_mm512_set1_ps(C::BIAS), d[b], scales16(s + nt * TILE));
    }
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_loadu_ps(y + r * ystride + t * TILE);
      for (int b = 0; b < NB; ++b)
        v = _mm512_fmadd_ps(off[b], _mm512_set1_ps(xs[r * G + b]), _mm512_fmadd_ps(d[b], acc[r][b][t], v));
      _mm512_storeu_ps(y + r * ystride + t * TILE, v);
    }
  }
}

template <typename S>
using FewRowsFn = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, const S*, int64_t, int,
                           const float*, int64_t, float*, int64_t);

template <int BITS, int R, int NB, typename S>
FewRowsFn<S> few_rows_fn(int t) {
  switch (t) {
    case 4: return few_rows<BITS, R, NB, 4, S>;
    case 3: return few_rows<BITS, R, NB, 3, S>;
    case 2: return few_rows<BITS, R, NB, 2, S>;
    default: return few_rows<BITS, R, NB, 1, S>;
  }
}

// `chunk` for R <= 4 rows: tiles t0 .. t0 + n - 1, NB blocks at a time
template <int BITS, int R, int NB, typename S>
void few(const uint16_t* x, int64_t K, const uint8_t* codes, const S* sc, int nt, int t0, int n,
         const float* xs, float* y, int64_t ystride) {
  using C = Codes<BITS>;
  const int64_t G = K / GROUP, stride = nt * C::BYTES, sstride = 2 * nt * TILE;
  const FewRowsFn<S> all = few_rows_fn<BITS, R, NB, S>(n), one = few_rows_fn<BITS, R, 1, S>(n);
  for (int64_t g = 0; g < G; g += NB) {
    for (int i = 0; i < NB * stride; i += 64)  // the stream AHEAD blocks on, as in `expanded`
      _mm_prefetch(reinterpret_cast<const char*>(codes + (g + AHEAD) * stride + i), _MM_HINT_T0);
    for (int i = 0; i < NB * sstride; i += 64 / sizeof(S))
      _mm_prefetch(reinterpret_cast<const char*>(sc + (g + AHEAD) * sstride + i), _MM_HINT_T0);
    const uint8_t* src = codes + g * stride + t0 * C::BYTES;
    const S* s = sc + g * sstride + t0 * TILE;
    if (g + NB <= G) {
      all(x + g * GROUP, K, src, stride, s, sstride, nt, xs + g, G, y, ystride);
    } else {
      for (int64_t b = 0; g + b < G; ++b)
        one(x + (g + b) * GROUP, K, src + b * stride, stride, s + b * sstride, sstride, nt, xs + g + b, G, y, ystride);
    }
  }
}

template <int BITS, typename S>
void few_for(int64_t m, const uint16_t* x, int64_t K, const uint8_t* codes, const S* sc, int nt, int t0,
             int n, const float* xs, float* y, int64_t ystride) {
  switch (m) {
    case 1: return few<BITS, 1, 2, S>(x, K, codes, sc, nt, t0, n, xs, y, ystride);
    case 2: return few<BITS, 2, 2, S>(x, K, codes, sc, nt, t0, n, xs, y, ystride);
    case 3: return few<BITS, 3, 1, S>(x, K, codes, sc, nt, t0, n, xs, y, ystride);
    default: return few<BITS, 4, 1, S>(x, K, codes, sc, nt, t0, n, xs, y, ystride);
  }
}

// `chunk` for more rows: each block's codes expanded once into w for all rows, then register blocks of up to 4 rows
// x 4 tiles
template <int BITS, typename S>
void expanded(const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes, const S* sc, int nt, int t0,
              int n, const float* xs, float* y, int64_t ystride) {
  using C = Codes<BITS>;
  const int64_t G = K / GROUP;
  alignas(64) __m512i w[PAIRS * NT];
  for (int64_t g = 0; g < G; ++g, codes += nt * C::BYTES, sc += 2 * nt * TILE) {
    __m512 d[NT], off[NT];
    expand_block<BITS, S>(codes, sc, nt, t0, n, w, d, off);
    for (int64_t m = 0; m < M; m += 4) {
      const int r = static_cast<int>(std::min<int64_t>(4, M - m));
      rows_fn(r, n)(x + m * K + g * GROUP, K, w, d, off, xs + m * G + g, G, y + m * ystride, ystride);
    }
  }
}

// ---- AMX (Xeons with AMX-BF16): every row count on the tile unit ----
//
// TDPBF16PS sums a block's 16 pairs into a tile of fp32 from 0, each row of the tile alone, like the vdpbf16ps chain
// above but not with its bits (measured on a Xeon: about 2.6% of the sums differ in their last place), so where AMX
// runs it computes every row, 1 to any: a process decides once (`amx_on`) and every call follows. The rest is the same
// arithmetic: per block and output, y = d acc + y, then y = (off - BIAS d) xs + y, fp32 fmas in block order.

constexpr int ROWS_MAX = 16;  // rows of a tile
// tile registers (literal numbers in the intrinsics): 0-3 a row group's sums of the chunk's 4 tiles, 4 its x,
// 5-7 codes

// tiles for row groups of R rows: sums [R, 16] fp32 (4), x [R, 32] bf16, codes [16 pairs, 16 columns x 2] bf16 (3)
spork_simd::TileConfig tiles_for(int r) {
  spork_simd::TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.tile(i, i < 5 ? r : PAIRS, 64);
  return cfg;
}

// one block's sums of tile t (tile register t) for a row group: x (tile 4) . the codes at w + t (pair rows NT zmm
// apart, loaded into tile register b) -> out[t]
#define SPORK_TILE_SUMS(t, b)               \
  do {                                      \
    _tile_zero(t);                          \
    _tile_loadd(b, w + (t), NT * 64);       \
    _tile_dpbf16ps(t, 4, b);                \
    _tile_stored(t, out[t], TILE * 4);      \
  } while (0)

// a block's codes of a chunk's tiles, expanded, and their d and off - BIAS d
struct alignas(64) AmxBlock {
  __m512i w[PAIRS * NT];
  __m512 d[NT], off[NT];
};

// `chunk` on AMX: each block's codes expanded once for all rows (`expand_block`, as in `expanded`), then for each
// group of R rows (x holds whole groups: rows past M are zeros) the tile unit's sums and each output's two fmas. A
// unit (block, row group)'s fmas run after the next unit's tile work is issued (its sums and block in the other of
// two buffers): the tile unit's latency, not its throughput, bounds a few rows
template <int BITS, typename S>
void amx_rows(const uint16_t* x, int64_t M, int R, int64_t K, const uint8_t* codes, const S* sc, int nt,
              int t0, int n, const float* xs, float* y, int64_t ystride) {
  using C = Codes<BITS>;
  const int64_t G = K / GROUP;
  AmxBlock blk[2];
  alignas(64) float sums[2][NT][ROWS_MAX * TILE];
  auto issue = [&](int64_t g, int64_t m0, const AmxBlock& bk, float (*out)[ROWS_MAX * TILE]) {
    const __m512i* w = bk.w;
    _tile_loadd(4, x + m0 * K + g * GROUP, K * 2);
    SPORK_TILE_SUMS(0, 5);
    if (n > 1) SPORK_TILE_SUMS(1, 6);
    if (n > 2) SPORK_TILE_SUMS(2, 7);
    if (n > 3) SPORK_TILE_SUMS(3, 5);
  };
  auto finish = [&](int64_t g, int64_t m0, const AmxBlock& bk, const float (*in)[ROWS_MAX * TILE]) {
    const int rows = static_cast<int>(std::min<int64_t>(R, M - m0));
    for (int r = 0; r < rows; ++r) {
      const __m512 s = _mm512_set1_ps(xs[(m0 + r) * G + g]);
      for (int t = 0; t < n; ++t) {
        float* yp = y + (m0 + r) * ystride + t * TILE;
        const __m512 v = _mm512_fmadd_ps(bk.d[t], _mm512_load_ps(in[t] + r * TILE), _mm512_loadu_ps(yp));
        _mm512_storeu_ps(yp, _mm512_fmadd_ps(bk.off[t], s, v));
      }
    }
  };
  int64_t pg = -1, pm = 0;  // the unit whose fmas wait
  int pu = 0;
  for (int64_t g = 0, u = 0; g < G; ++g, codes += nt * C::BYTES, sc += 2 * nt * TILE) {
    AmxBlock& bk = blk[g & 1];
    expand_block<BITS, S>(codes, sc, nt, t0, n, bk.w, bk.d, bk.off);
    for (int64_t m0 = 0; m0 < M; m0 += R, ++u) {
      issue(g, m0, bk, sums[u & 1]);
      if (pg >= 0) finish(pg, pm, blk[pg & 1], sums[pu]);
      pg = g, pm = m0, pu = static_cast<int>(u & 1);
    }
  }
  finish(pg, pm, blk[pg & 1], sums[pu]);
}
#undef SPORK_TILE_SUMS

// tiles t0 .. t1 - 1 of chunk c (which holds nt tiles: 4c .. 4c + nt - 1) for every row: y [M, (t1 - t0) * 16] fp32,
// then out. Each output column is computed alike whichever tiles share its call, and each row alike whichever path
template <int BITS, typename Out, typename S>
void chunk(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, const S* scales,
           const float* xs, int64_t c, int nt, int t0, int t1, float* y, Out* out, int amx_r) {
  using C = Codes<BITS>;
  const int64_t G = K / GROUP;
  const int n = t1 - t0, ystride = n * TILE;
  const uint8_t* codes = packed + c * G * NT * C::BYTES;
  const S* sc = scales + c * G * 2 * NT * TILE;
  std::fill(y, y + M * ystride, 0.f);
  if (amx_r > 0) {
    amx_rows<BITS, S>(x, M, amx_r, K, codes, sc, nt, t0, n, xs, y, ystride);
  } else if (M <= C::FEW) {
    for (int64_t m = 0; m < M; m += 4)
      few_for<BITS, S>(std::min<int64_t>(4, M - m), x + m * K, K, codes, sc, nt, t0, n, xs + m * G, y + m * ystride,
                    ystride);
  } else {
    expanded<BITS, S>(x, M, K, codes, sc, nt, t0, n, xs, y, ystride);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int t = 0; t < n; ++t) store(out + m * N + (c * NT + t0 + t) * TILE, _mm512_loadu_ps(y + m * ystride + t * TILE));
}

// x @ the blocks of `packed` / `scales` -> [M, N] of Out (BITS: 4 or 8 per code; S: the scales' type)
template <int BITS, typename Out, typename S>
at::Tensor blocks_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const char* op) {
  spork_checks::blocks_mm(x, packed, scales, BITS, GROUP, TILE, op);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = packed.size(0), G = K / GROUP;
  at::Tensor out = at::empty({M, N}, xc.options().dtype(std::is_same_v<Out, float> ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> xs(M * G);  // [M, G]: each row's block sums
  for (int64_t i = 0; i < M * G; ++i) {
    const __m512i h = _mm512_loadu_si512(xp + i * GROUP);  // 32 bf16 -> two halves of 16 fp32
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const S* sc = scales.data_ptr<S>();
  Out* dst = out.data_ptr<Out>();
  const int64_t tiles = N / TILE;
  // on AMX: groups of R rows, as even as 16 a group allows, x padded with zero rows to whole groups
  const int64_t groups = (M + ROWS_MAX - 1) / ROWS_MAX;
  const int amx_r = spork_ops::amx_on() ? static_cast<int>((M + groups - 1) / groups) : 0;
  std::vector<uint16_t> padded;
  if (amx_r > 0 && groups * amx_r > M) {
    padded.assign(groups * amx_r * K, 0);
    std::memcpy(padded.data(), xp, M * K * 2);
    xp = padded.data();
  }
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {  // each thread an equal run of tiles, chunk by chunk
    std::vector<float> y(M * NT * TILE);
    std::optional<spork_simd::TileScope> amx;
    if (amx_r > 0) amx.emplace(tiles_for(amx_r));
    for (int64_t c = b / NT; c * NT < e; ++c) {
      const int nt = static_cast<int>(std::min<int64_t>(NT, tiles - c * NT));
      chunk<BITS, Out, S>(xp, M, K, N, pk, sc, xs.data(), c, nt, static_cast<int>(std::max<int64_t>(b - c * NT, 0)),
                          static_cast<int>(std::min<int64_t>(e - c * NT, nt)), y.data(), dst, amx_r);
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

bool amx_on() {
  static const bool on = [] {
    const char* env = std::getenv("SPORK_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return on;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, bool wide) {
  return wide ? any_blocks_mm<float>(x, packed, scales, "int4_mm") : any_blocks_mm<at::BFloat16>(x, packed, scales,
                                                                                                 "int4_mm");
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return scales.scalar_type() == at::kFloat ? blocks_mm<8, float, float>(x, packed, scales, "q8_mm")
                                            : blocks_mm<8, float, at::Half>(x, packed, scales, "q8_mm");
}

}  // namespace spork_ops

TORCH_LIBRARY(spork, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scales, bool wide=False) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("uses_amx() -> bool", [] { return spork_ops::amx_on(); });  // which arithmetic this process's calls run
}

TORCH_LIBRARY_IMPL(spork, CPU, m) {
  m.impl("int4_mm", &spork_ops::int4_mm);
  m.impl("q8_mm", &spork_ops::q8_mm);
}

// spork::attend: the CPU torch engine's attention, read from the K/V pool in place, on AVX512-BF16.
//
// Each output row is computed by the same instructions whatever the batch, the number of rows, the thread and the
// row's place among them, and its sums take only the columns it attends, in column order, so the same row attending
// the same keys gives the same bits wherever those keys sit in its slot (a tree's rows attend their ancestors at
// other columns than a chain's) and however wide the forward's window is:
//
//   s[j]   = q . k[j] / sqrt(D): the D/2 bf16 pairs accumulated by vdpbf16ps into 4 partial sums (pair i into sum
//            i % 4, in pair order, then (s0 + s1) + (s2 + s3)), fp32; for 16 keys at once (keys transposed to pair
//            rows: data movement only, once per thread for all the work items of a sequence and KV head). Where the
//            process runs AMX (spork_ops::amx_on: its matmuls do too), TDPBF16PS's instead: the pairs in tiles of 16
//            (zero pairs past D/2), tile after tile into one sum from 0, each row of a tile alone, then x 1/sqrt(D).
//            On a 2-core AMX Xeon, against vdpbf16ps with a transpose per item, same process (medians): 16 rows over
//            320 keys 0.72 of the time, 64 rows 0.64, 128 rows over 1,200 keys 0.65, 16 sequences x 1 row 0.92
//   m      = the max of s over the attended columns (exact in any order)
//   e[j]   = exp(s[j] - m) (a fixed polynomial, lane by lane), 0 where the row does not attend j
//   out    = (sum over attended j, in order, of e[j] v[j]: fp32 fmas) / (sum over attended j, in order, of e[j]).
//            Where the scores run on AMX, TDPBF16PS's instead (weigh_tiles): the row's attended keys in rank order
//            (its first attended key rank 0, ...), 32 a tile of pairs, bf16(e) times v, tile after tile into one fp32
//            sum from 0, divided by the sum of the same bf16(e) (16 lanes by rank, then reduced). Ranks, not
//            columns, so a tree's node, its ancestors at other columns, sums the same tiles as the chain (a tile
//            rounds where its terms sit: the same products at other places give other fp32 sums). On a 2-core AMX
//            Xeon against fp32 fmas (medians, same process): 16 and 64 rows over 320 keys 0.73 of the time, a
//            128-row chunk over 1,200 keys 0.70, a 16-node tree 0.74, but 16 sequences x 1 row 1.25-1.40 and 1 row
//            1.03-1.09 (a decode item has 3 rows, and a tile product costs the same for 3 rows as for 16)
//
//   qk     [B, H + Hkv, T, D] bf16 (rotated queries in heads 0..H-1); pool_k, pool_v [slots, Hkv, S, D] bf16 (a
//          layer's pool); slots [B] int64 (each sequence's slot); mask [B, T, C] bool (the columns each row attends,
//          C <= S) -> out [B * T, H * D] bf16
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "avx512_simd.h"
#include "op_checks.h"
#include "spork_ops.h"

namespace {

using spork_simd::exp_ps;

constexpr int LANES = 16;  // fp32 lanes of a zmm: keys scored at once
constexpr int ROWS = 8;    // query rows of one sequence and KV head that one work item computes (16, half
                           // of them with P @ V's rows in lanes, ran slower at every shape measured)
constexpr int MAX_D = 128;
constexpr int PAIR_ROWS = 16;  // pairs of a tile of queries or keys (AMX)

// r[i] (16 dwords each) -> r[i] holds dword i of every input, in input order (a 16 x 16 transpose)
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// acc + the 16 keys' pair (kt: one pair of each) . the query's pair qw, by vdpbf16ps
inline __m512 dot_pair(__m512 acc, const float* kt, uint32_t qw) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(_mm512_load_ps(kt)),
                          (__m512bh)_mm512_set1_epi32(static_cast<int>(qw)));
}

// 1 + the last column row mask m [c] attends (0: none), scanning 64 columns at a time from the end
inline int64_t attended_end(const uint8_t* m, int64_t c) {
  for (int64_t e = c; e > 0;) {
    const int64_t s = std::max<int64_t>(0, e - 64);
    const __mmask64 in = _mm512_test_epi8_mask(
        _mm512_maskz_loadu_epi8(e - s == 64 ? ~0ULL : (1ULL << (e - s)) - 1, m + s), _mm512_set1_epi8(1));
    if (in) return s + 64 - __builtin_clzll(in);
    e = s;
  }
  return 0;
}

// tile registers of `score` on AMX, for work items of up to `rows` rows (ROWS, or fewer where a sequence and KV head
// has fewer: a decode step): 0 a group's scores [rows, 16 keys] fp32, 1-4 the rows' queries (16 pairs each), 5-7 the
// group's keys (16 pair rows of 16 keys each). weigh_tiles reads the same shapes: 0-3 the rows' outputs [rows, 16
// columns] fp32, 4 their probabilities (16 pairs of keys), 5-7 a group's values (16 pair rows of 16 columns)
spork_simd::TileConfig score_tiles(int rows) {
  spork_simd::TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.tile(i, i < 5 ? rows : PAIR_ROWS, 64);
  return cfg;
}

// the group's scores (kt: its keys' pair rows, zero past w; the query tiles loaded) -> sc's rows (as configured) at sc,
// `stride` floats apart: TDPBF16PS over tiles of 16 pairs, in order, into one tile from 0
inline void tile_scores(const float (*kt)[LANES], int64_t tiles, float* sc, int64_t stride) {
  _tile_zero(0);
  _tile_loadd(5, kt[0], LANES * 4);
  _tile_dpbf16ps(0, 1, 5);
  if (tiles > 1) {
    _tile_loadd(6, kt[PAIR_ROWS], LANES * 4);
    _tile_dpbf16ps(0, 2, 6);
  }
  if (tiles > 2) {
    _tile_loadd(7, kt[2 * PAIR_ROWS], LANES * 4);
    _tile_dpbf16ps(0, 3, 7);
  }
  if (tiles > 3) {
    _tile_loadd(5, kt[3 * PAIR_ROWS], LANES * 4);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, sc, stride * 4);
}

constexpr int KEYS = 2 * PAIR_ROWS;  // keys of a P @ V group on AMX: one tile of pairs

// 32 keys' value rows (nullptr: zero) -> `slices` tiles of 16 pair rows (two a 32-column chunk), row i of each holding
// the bf16 pairs (key 2 i, key 2 i + 1) of 16 columns, in vpunpck's order: chunk c's even slice has columns 32 c + 8 L
// + p, its odd slice 32 c + 8 L + 4 + p, for L, p in 0..3 (dword 4 L + p; zero past d). unpair() puts them back
inline void pair_rows(const uint16_t* const* rows, int64_t d, int64_t slices, __m512* vt) {
  for (int64_t c = 0; c < slices / 2; ++c) {
    const __mmask32 cols = d - 32 * c >= 32 ? ~0u : (1u << (d - 32 * c)) - 1;
    for (int i = 0; i < PAIR_ROWS; ++i) {
      const uint16_t *lo = rows[2 * i], *hi = rows[2 * i + 1];
      const __m512i a = lo ? _mm512_maskz_loadu_epi16(cols, lo + 32 * c) : _mm512_setzero_si512();
      const __m512i b = hi ? _mm512_maskz_loadu_epi16(cols, hi + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(&vt[2 * c * PAIR_ROWS + i], _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(&vt[(2 * c + 1) * PAIR_ROWS + i], _mm512_unpackhi_epi16(a, b));
    }
  }
}

// a chunk's two slices of fp32 sums (pair_rows' column order) / total -> its 32 columns in order, bf16, the first
// `n` stored at out
inline void unpair(const float* even, const float* odd, __m512 total, uint16_t* out, int64_t n) {
  const __m512i order = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8, 23, 22, 21, 20,
                                         7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);  // column o from (o & 4 ? 16 : 0)
                                                                                   // + 4 (o >> 3) + (o & 3)
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_div_ps(_mm512_load_ps(odd), total),
                                                    _mm512_div_ps(_mm512_load_ps(even), total));
  _mm512_mask_storeu_epi16(out, n >= 32 ? ~0u : (1u << n) - 1, _mm512_permutexvar_epi16(order, both));
}

// one slot and head's keys as pair rows, 16 keys a group: kt[i][l] = pair i of key 16k + l for group k (zero past the
// keys the pool holds), pair rows past w zero up to whole tiles of 16. Where a sequence's rows take several work items
// (`keep`: a chunk, a tree), a thread transposes each group once for all of them; else one group at a time, in place
struct KeyGroups {
  const uint16_t* keys = nullptr;  // whose groups these are
  int64_t s_len = 0, w = 0, rows = 0, have = 0;  // keys in the pool, pairs a key; pair rows a group; groups kept
  bool keep = false;
  std::vector<__m512> data;  // a pair row a zmm: 64-byte aligned

  void use(const uint16_t* k, int64_t s, int64_t pairs, bool reuse) {
    if (k == keys && reuse && keep) return;  // the groups transposed so far stand
    keys = k, s_len = s, w = pairs, keep = reuse, have = 0;
    rows = (w + PAIR_ROWS - 1) / PAIR_ROWS * PAIR_ROWS;
    const size_t need = (keep ? (s_len + LANES - 1) / LANES : 1) * rows;  // every group, or one at a time
    if (data.size() < need) data.resize(need);  // here, not in at(): the groups it gave out stay where they are
  }

  // group k (asked in order from 0)
  const float (*at(int64_t k))[LANES] {
    const int64_t slot = keep ? k : 0;
    float(*kt)[LANES] = reinterpret_cast<float(*)[LANES]>(&data[slot * rows]);
    if (keep && k < have) return kt;
    const int64_t j0 = k * LANES, nk = std::min<int64_t>(LANES, s_len - j0);  // keys the pool holds past j0
    for (int64_t l = 0; l < LANES * 2 * w; l += 32)  // the group after next, into cache (a stream from memory
      _mm_prefetch(reinterpret_cast<const char*>(keys + (j0 + 4 * LANES) * 2 * w + l), _MM_HINT_T0);  // waits else)
    for (int64_t c0 = 0; c0 < w; c0 += LANES) {
      const __mmask16 cm = static_cast<__mmask16>((1u << std::min<int64_t>(LANES, w - c0)) - 1);
      __m512 r[LANES];
      for (int l = 0; l < LANES; ++l)
        r[l] = l < nk ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(
                            cm, reinterpret_cast<const uint32_t*>(keys + (j0 + l) * 2 * w) + c0))
                      : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t i = c0; i < std::min<int64_t>(c0 + LANES, w); ++i) _mm512_store_ps(kt[i], r[i - c0]);
    }
    for (int64_t i = w; i < rows; ++i) _mm512_store_ps(kt[i], _mm512_setzero_ps());
    if (keep) have = k + 1;
    return kt;
  }
};

// one slot and head's values as pair rows of keys, 32 keys a group, for TDPBF16PS: group k is `slices` tiles of 16
// pair rows, slice s's row i holding the bf16 pairs (key 32 k + 2 i, key 32 k + 2 i + 1) of 16 value columns
// (pair_rows' order; zero past the keys the pool holds and past D). Kept for all of a sequence and head's work items
// like KeyGroups
struct ValueGroups {
  const uint16_t* values = nullptr;
  int64_t s_len = 0, d = 0, slices = 0, have = 0;
  bool keep = false;
  std::vector<__m512> data;  // [group][slice][16 pair rows]

  void use(const uint16_t* v, int64_t s, int64_t dim, bool reuse) {
    if (v == values && reuse && keep) return;
    values = v, s_len = s, d = dim, keep = reuse, have = 0;
    slices = 2 * ((d + 31) / 32);
    const size_t need = (keep ? (s_len + KEYS - 1) / KEYS : 2) * slices * PAIR_ROWS;  // as KeyGroups
    if (data.size() < need) data.resize(need);
  }

  bool holds(const uint16_t* v) const { return v == values && keep; }  // v's groups, kept from an earlier item

  // group k (asked in order from 0)
  const __m512* at(int64_t k) {
    const int64_t slot = keep ? k : k % 2, size = slices * PAIR_ROWS;  // else two in turn: the next is built
                                                                       // while the tiles read this one
    __m512* vt = &data[slot * size];
    if (keep && k < have) return vt;
    const int64_t j0 = k * KEYS;
    for (int64_t l = 0; l < KEYS * d; l += 32)  // the group after next, into cache
      _mm_prefetch(reinterpret_cast<const char*>(values + (j0 + 2 * KEYS) * d + l), _MM_HINT_T0);
    const uint16_t* rows[KEYS];
    for (int i = 0; i < KEYS; ++i) rows[i] = j0 + i < s_len ? values + (j0 + i) * d : nullptr;
    pair_rows(rows, d, slices, vt);
    if (keep) have = k + 1;
    return vt;
  }
};

// Scores of `n` rows (query pointers q[r], as bf16 pairs) against keys [0, hi) of one slot and head (kg: its
// groups): sc[r][j]. On AMX (tile_rows > 0: the tiles' rows, n at most) sc holds tile_rows rows, those past n the
// scores of zero queries
void score(const uint32_t* const* q, int n, KeyGroups& kg, int64_t hi, int64_t w, float scale, float* sc,
           int64_t stride, int tile_rows, const uint16_t* values) {
  const bool amx = tile_rows > 0;
  const int64_t tiles = kg.rows / PAIR_ROWS;
  if (amx) {  // the rows' queries as tiles of 16 pairs, zero past w and past n
    alignas(64) uint32_t qt[ROWS][MAX_D / 2];
    for (int r = 0; r < tile_rows; ++r) {
      if (r < n) std::memcpy(qt[r], q[r], w * 4);
      std::memset(qt[r] + (r < n ? w : 0), 0, (tiles * PAIR_ROWS - (r < n ? w : 0)) * 4);
    }
    _tile_loadd(1, qt[0], sizeof qt[0]);
    if (tiles > 1) _tile_loadd(2, qt[0] + PAIR_ROWS, sizeof qt[0]);
    if (tiles > 2) _tile_loadd(3, qt[0] + 2 * PAIR_ROWS, sizeof qt[0]);
    if (tiles > 3) _tile_loadd(4, qt[0] + 3 * PAIR_ROWS, sizeof qt[0]);
  }
  for (int64_t j0 = 0; j0 < hi; j0 += LANES) {
    const float(*kt)[LANES] = kg.at(j0 / LANES);
    if (values)  // the same keys' values into L2 while the scores run (weigh_tiles reads them in bursts)
      for (int64_t l = 0; l < LANES * 2 * w; l += 32)
        _mm_prefetch(reinterpret_cast<const char*>(values + j0 * 2 * w + l), _MM_HINT_T1);
    if (amx) {
      tile_scores(kt, tiles, sc + j0, stride);
      continue;
    }
    for (int r = 0; r < n; ++r) {  // pair i into partial sum i % 4, in registers (an array spilled to the stack)
      const uint32_t* qr = q[r];
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 4 <= w; i += 4) {
        a0 = dot_pair(a0, kt[i], qr[i]);
        a1 = dot_pair(a1, kt[i + 1], qr[i + 1]);
        a2 = dot_pair(a2, kt[i + 2], qr[i + 2]);
        a3 = dot_pair(a3, kt[i + 3], qr[i + 3]);
      }
      if (i < w) a0 = dot_pair(a0, kt[i], qr[i]);
      if (i + 1 < w) a1 = dot_pair(a1, kt[i + 1], qr[i + 1]);
      if (i + 2 < w) a2 = dot_pair(a2, kt[i + 2], qr[i + 2]);
      const __m512 dot = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
      _mm512_storeu_ps(sc + r * stride + j0, _mm512_mul_ps(dot, _mm512_set1_ps(scale)));
    }
  }
  if (amx)
    for (int r = 0; r < n; ++r)
      for (int64_t j0 = 0; j0 < hi; j0 += LANES)
        _mm512_storeu_ps(sc + r * stride + j0, _mm512_mul_ps(_mm512_loadu_ps(sc + r * stride + j0),
                                                             _mm512_set1_ps(scale)));
}

// sc[j] (scores) -> e[j] = exp(sc[j] - max) where m[j], else 0, over [0, hi)
void softmax_terms(float* sc, const uint8_t* m, int64_t hi) {
  const float inf = std::numeric_limits<float>::infinity();
  __m512 mx = _mm512_set1_ps(-inf);
  for (int64_t j0 = 0; j0 < hi; j0 += LANES) {
    const __mmask16 in = _mm_test_epi8_mask(
        _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << std::min<int64_t>(LANES, hi - j0)) - 1), m + j0),
        _mm_set1_epi8(1));
    mx = _mm512_mask_max_ps(mx, in, mx, _mm512_loadu_ps(sc + j0));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t j0 = 0; j0 < hi; j0 += LANES) {
    const __mmask16 in = _mm_test_epi8_mask(
        _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << std::min<int64_t>(LANES, hi - j0)) - 1), m + j0),
        _mm_set1_epi8(1));
    _mm512_storeu_ps(sc + j0, _mm512_maskz_mov_ps(in, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + j0), top))));
  }
}

// out[r] = (sum over j < top of e[r][j] v[j], in order) / (sum of e[r][j], in order) for RS rows: fp32 fmas, NV
// zmm per row (e is zero past each row's columns: a zero term leaves both sums as they were)
template <int NV, int RS>
void weigh_block(const float* e, int64_t stride, int64_t top, const uint16_t* values, int64_t d,
                 uint16_t* const* out) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (d - (NV - 1) * LANES)) - 1);
  __m512 acc[RS][NV];
  float sums[RS];
#pragma GCC unroll 8
  for (int r = 0; r < RS; ++r) {
    sums[r] = 0.0f;
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < top; ++j) {
    for (int64_t l = 0; l < d; l += 32)
      _mm_prefetch(reinterpret_cast<const char*>(values + (j + 24) * d + l), _MM_HINT_T0);
    __m512 v[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      const __m256i raw = _mm256_maskz_loadu_epi16(c + 1 < NV ? 0xFFFF : tail, values + j * d + c * LANES);
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
#pragma GCC unroll 8
    for (int r = 0; r < RS; ++r) {
      const float p = e[r * stride + j];
      sums[r] += p;
      const __m512 pv = _mm512_set1_ps(p);
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pv, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RS; ++r) {
    const __m512 total = _mm512_set1_ps(sums[r]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c)
      _mm256_mask_storeu_epi16(out[r] + c * LANES, c + 1 < NV ? 0xFFFF : tail,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_div_ps(acc[r][c], total)));
  }
}

// weigh_block over n rows, at most RMAX at once (the accumulators stay in registers)
template <int NV>
void weigh(const float* e, int64_t stride, int64_t top, int n, const uint16_t* values, int64_t d,
           uint16_t* const* out) {
  constexpr int RMAX = NV <= 2 ? 8 : (NV <= 4 ? 4 : 2);
  for (int r0 = 0; r0 < n; r0 += RMAX) {
    const float* er = e + r0 * stride;
    switch (std::min(RMAX, n - r0)) {
      case 1: weigh_block<NV, 1>(er, stride, top, values, d, out + r0); break;
      case 2: weigh_block<NV, 2>(er, stride, top, values, d, out + r0); break;
      case 3: weigh_block<NV, (RMAX >= 3 ? 3 : 1)>(er, stride, top, values, d, out + r0); break;
      case 4: weigh_block<NV, (RMAX >= 4 ? 4 : 1)>(er, stride, top, values, d, out + r0); break;
      case 5: weigh_block<NV, (RMAX >= 5 ? 5 : 1)>(er, stride, top, values, d, out + r0); break;
      case 6: weigh_block<NV, (RMAX >= 6 ? 6 : 1)>(er, stride, top, values, d, out + r0); break;
      case 7: weigh_block<NV, (RMAX >= 7 ? 7 : 1)>(er, stride, top, values, d, out + r0); break;
      default: weigh_block<NV, RMAX>(er, stride, top, values, d, out + r0); break;
    }
  }
}

using Weigh = void (*)(const float*, int64_t, int64_t, int, const uint16_t*, int64_t, uint16_t* const*);

Weigh weigher(int64_t d) {  // P @ V for a head size
  switch ((d + LANES - 1) / LANES) {
    case 1: return weigh<1>;
    case 2: return weigh<2>;
    case 3: return weigh<3>;
    case 4: return weigh<4>;
    case 5: return weigh<5>;
    case 6: return weigh<6>;
    case 7: return weigh<7>;
    default: return weigh<8>;
  }
}

// What P @ V on AMX keeps for one row: its probabilities `e` (sc's row, rewritten) for keys in rank order, the
// rank at which its own groups start and the columns behind them
struct RowKeys {
  int64_t shared = 0;  // keys [0, shared) come from the sequence's groups of 32 (those before its first gap, whole
                       // groups only): the same columns at the same ranks as in a chain
  int64_t count = 0;   // keys the row attends; ranks [shared, count) are its own groups, of the columns `cols`
  size_t cols = 0;     // where those columns start in the thread's list
};

// Row e [0, hi) (softmax_terms': zero where not attended) -> its keys in rank order for the tiles, in place: every
// value rounded to bf16, the attended columns past `shared` moved down to their ranks (in order), zero up to
// `width`; those columns appended to `cols`
RowKeys rank_keys(float* e, const uint8_t* m, int64_t hi, int64_t width, std::vector<int64_t>& cols) {
  RowKeys k{hi, hi, cols.size()};
  for (int64_t j0 = 0; j0 < hi; j0 += 64) {  // the first unattended column before hi
    const uint64_t valid = hi - j0 >= 64 ? ~0ULL : (1ULL << (hi - j0)) - 1;
    const uint64_t gaps = ~_mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(valid, m + j0), _mm512_set1_epi8(1)) & valid;
    if (gaps) {
      k.shared = (j0 + __builtin_ctzll(gaps)) / KEYS * KEYS;
      break;
    }
  }
  int64_t rank = k.shared;
  for (int64_t j = k.shared; j < hi && k.shared < hi; ++j)
    if (m[j]) {
      e[rank++] = e[j];
      cols.push_back(j);
    }
  if (k.shared < hi) k.count = rank;
  std::fill(e + k.count, e + width, 0.0f);
  for (int64_t j0 = 0; j0 < k.count; j0 += LANES)  // bf16, as the tiles read them (fp32 with bf16's bits)
    _mm512_storeu_ps(e + j0, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(e + j0))), 16)));
  return k;
}

// tiles 0 .. n_slices-1 += the probabilities' tile (4, loaded) x group vt's slices s0 .. s0+n_slices-1
inline void weigh_group(const __m512* vt, int64_t s0, int64_t n_slices) {
  _tile_loadd(5, &vt[s0 * PAIR_ROWS], 64);
  _tile_dpbf16ps(0, 4, 5);
  if (n_slices > 1) {
    _tile_loadd(6, &vt[(s0 + 1) * PAIR_ROWS], 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if (n_slices > 2) {
    _tile_loadd(7, &vt[(s0 + 2) * PAIR_ROWS], 64);
    _tile_dpbf16ps(2, 4, 7);
  }
  if (n_slices > 3) {
    _tile_loadd(5, &vt[(s0 + 3) * PAIR_ROWS], 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// 32 probabilities (bf16 already, as fp32) -> the 16 bf16 pairs of a tile row
inline __m512i prob_pairs(const float* e) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(e + LANES), _mm512_loadu_ps(e));
}

// the probabilities' tile of `tile_rows` rows for ranks [k0, k0 + 32) of rows [lo, hi) (their own keys), zero for
// the other rows -> tile 4
inline void load_probs(const float* e, int64_t stride, int tile_rows, int64_t k0, int lo, int hi) {
  alignas(64) uint32_t pt[ROWS][PAIR_ROWS];
  for (int r = 0; r < tile_rows; ++r) {
    const bool in = r >= lo && r < hi;
    _mm512_store_si512(pt[r], in ? prob_pairs(e + r * stride + k0) : _mm512_setzero_si512());
  }
  _tile_loadd(4, pt[0], 64);
}

// P @ V on AMX (where the scores run there too): out[r] = (sum over the row's attended keys, in rank order, 32 a
// tile, of bf16(e[j]) v[j], TDPBF16PS into one fp32 sum from 0) / (the sum of the same bf16(e[j]), 16 lanes by
// rank, then reduced). A row's keys before its first gap (whole groups of 32) come from groups shared by the work
// item's rows; the rest from groups of its own columns (a tree's node: its ancestors, wherever they lie), so its
// tiles hold the same keys at the same ranks as the same row in a chain, alone or in any batch
void weigh_tiles(float* e, int64_t stride, int n, int tile_rows, const uint8_t* const* m, const int64_t* hi,
                 ValueGroups& vg, std::vector<int64_t>& cols, std::vector<__m512>& probs, std::vector<__m512>& own_vt,
                 int64_t d, uint16_t* const* out) {
  cols.clear();
  RowKeys rk[ROWS];
  float total[ROWS];
  int64_t groups = 0;
  for (int r = 0; r < n; ++r) {
    rk[r] = rank_keys(e + r * stride, m[r], hi[r], stride, cols);
    groups = std::max(groups, (rk[r].shared + KEYS - 1) / KEYS);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < rk[r].count; j0 += LANES) sum = _mm512_add_ps(sum, _mm512_loadu_ps(e + r * stride + j0));
    total[r] = _mm512_reduce_add_ps(sum);
  }
  own_vt.resize(vg.slices * PAIR_ROWS);
  probs.resize(tile_rows * groups);  // [tile_rows][groups]: the rows' probabilities in the shared groups, bf16 pairs
  for (int r = 0; r < tile_rows; ++r)
    for (int64_t k = 0; k < groups; ++k)
      probs[r * groups + k] = r < n && k * KEYS < rk[r].shared ? (__m512)prob_pairs(e + r * stride + k * KEYS)
                                                               : _mm512_setzero_ps();
  alignas(64) float acc[ROWS][4 * LANES];
  for (int64_t s0 = 0; s0 < vg.slices; s0 += 4) {  // up to 4 slices of 16 columns a pass (tiles 0-3)
    const int64_t ns = std::min<int64_t>(4, vg.slices - s0);
    _tile_zero(0);  // tile numbers are immediates
    if (ns > 1) _tile_zero(1);
    if (ns > 2) _tile_zero(2);
    if (ns > 3) _tile_zero(3);
    const __m512* next = groups > 0 ? vg.at(0) : nullptr;
    for (int64_t k = 0; k < groups; ++k) {
      const __m512* vt = next;
      if (k + 1 < groups) next = vg.at(k + 1);  // its stores done before the tiles read them
      _tile_loadd(4, &probs[k], groups * 64);
      weigh_group(vt, s0, ns);
    }
    for (int r = 0, r1; r < n; r = r1) {  // own groups: once for the rows of a token (the same columns)
      for (r1 = r + 1; r1 < n && m[r1] == m[r]; ++r1) {
      }
      for (int64_t k0 = rk[r].shared; k0 < rk[r].count; k0 += KEYS) {
        const uint16_t* rows[KEYS];
        for (int i = 0; i < KEYS; ++i) {
          const int64_t rank = k0 + i;
          rows[i] = rank < rk[r].count ? vg.values + cols[rk[r].cols + rank - rk[r].shared] * d : nullptr;
        }
        pair_rows(rows, d, vg.slices, own_vt.data());
        load_probs(e, stride, tile_rows, k0, r, r1);
        weigh_group(own_vt.data(), s0, ns);
      }
    }
    _tile_stored(0, &acc[0][0], sizeof acc[0]);
    if (ns > 1) _tile_stored(1, &acc[0][LANES], sizeof acc[0]);
    if (ns > 2) _tile_stored(2, &acc[0][2 * LANES], sizeof acc[0]);
    if (ns > 3) _tile_stored(3, &acc[0][3 * LANES], sizeof acc[0]);
    for (int r = 0; r < n; ++r)
      for (int64_t t = 0; t < ns; t += 2)
        unpair(&acc[r][t * LANES], &acc[r][(t + 1) * LANES], _mm512_set1_ps(total[r]), out[r] + (s0 + t) * LANES,
               d - (s0 + t) * LANES);
  }
}

// a thread's working memory, kept from call to call (its memory, not its contents): one thread-local lookup a call
struct Scratch {
  std::vector<float> sc;         // the work item's scores, then probabilities [rows, stride]
  KeyGroups kg;
  ValueGroups vg;
  std::vector<int64_t> cols;     // weigh_tiles: the rows' own columns
  std::vector<__m512> probs;     // weigh_tiles: the rows' probabilities in the shared groups
  std::vector<__m512> own;       // weigh_tiles: a group of a row's own values
};

Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

namespace spork_ops {

at::Tensor attend(const at::Tensor& qk, int64_t heads, const at::Tensor& pool_k, const at::Tensor& pool_v,
                  const at::Tensor& slots, const at::Tensor& mask) {
  spork_checks::attend(qk, heads, pool_k, pool_v, slots, mask);
  const int64_t b = qk.size(0), t = qk.size(2), d = qk.size(3), hkv = pool_k.size(1), s_len = pool_k.size(2);
  const int64_t c = mask.size(2), g = heads / hkv;
  TORCH_CHECK(d % 2 == 0 && d <= MAX_D, "spork::attend: head size even, at most 128");
  at::Tensor out = at::empty({b * t, heads * d}, qk.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(qk.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(pool_k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(pool_v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* mp = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t blocks = (g * t + ROWS - 1) / ROWS, w = d / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const Weigh weigh = weigher(d);
  const int tile_rows = spork_ops::amx_on() ? static_cast<int>(std::min<int64_t>(ROWS, g * t)) : 0;
  at::parallel_for(0, b * hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch& scratch = thread_scratch();
    std::vector<float>& sc = scratch.sc;
    KeyGroups& kg = scratch.kg;
    ValueGroups& vg = scratch.vg;
    kg.keys = nullptr, vg.values = nullptr;  // the pool's rows may have changed since the last call
    std::optional<spork_simd::TileScope> tiles;
    if (tile_rows > 0) tiles.emplace(score_tiles(tile_rows));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / (hkv * blocks), h = item / blocks % hkv, r0 = item % blocks * ROWS;
      const int n = static_cast<int>(std::min<int64_t>(ROWS, g * t - r0));
      const uint32_t* q[ROWS];
      const uint8_t* m[ROWS];
      uint16_t* o[ROWS];
      int64_t hi[ROWS], top = 0;
      for (int r = 0; r < n; ++r) {  // row r0 + r: token (r0 + r) / g, head h * g + (r0 + r) % g (a token's g
        const int64_t tok = (r0 + r) / g, head = h * g + (r0 + r) % g;  // heads side by side: the same columns)
        q[r] = reinterpret_cast<const uint32_t*>(qp + ((seq * (heads + hkv) + head) * t + tok) * d);
        m[r] = mp + (seq * t + tok) * c;
        o[r] = op + (seq * t + tok) * heads * d + head * d;
        hi[r] = attended_end(m[r], c);  // past its last attended column it reads nothing
        TORCH_CHECK(hi[r] > 0, "spork::attend: a row attends no column");
        top = std::max(top, hi[r]);
      }
      const int64_t align = tile_rows > 0 ? KEYS : LANES;  // a row's probabilities: whole groups
      const int64_t stride = (top + align - 1) / align * align;
      sc.resize(static_cast<size_t>(std::max(n, tile_rows) * stride));
      const int64_t base = (sp[seq] * hkv + h) * s_len * d;
      for (int64_t l = 0; l < std::min<int64_t>(top, 4 * LANES) * d; l += 32) {  // the streams' heads (the loops
        _mm_prefetch(reinterpret_cast<const char*>(kp + base + l), _MM_HINT_T0);  // prefetch ahead of themselves)
        if (l < 24 * d) _mm_prefetch(reinterpret_cast<const char*>(vp + base + l), _MM_HINT_T0);
      }
      kg.use(kp + base, s_len, w, blocks > 1);
      const bool ahead = tile_rows > 0 && !vg.holds(vp + base);  // its values into L2 with the scores
      score(q, n, kg, top, w, scale, sc.data(), stride, tile_rows, ahead ? vp + base : nullptr);
      for (int r = 0; r < n; ++r) {
        softmax_terms(sc.data() + r * stride, m[r], hi[r]);
        std::fill(sc.begin() + r * stride + hi[r], sc.begin() + (r + 1) * stride, 0.0f);
      }
      if (tile_rows > 0) {
        vg.use(vp + base, s_len, d, blocks > 1);
        weigh_tiles(sc.data(), stride, n, tile_rows, m, hi, vg, scratch.cols, scratch.probs, scratch.own, d, o);
      } else {
        weigh(sc.data(), stride, top, n, vp + base, d, o);
      }
    }
  });
  return out;
}

}  // namespace spork_ops

TORCH_LIBRARY_FRAGMENT(spork, m) {
  m.def("attend(Tensor qk, int heads, Tensor pool_k, Tensor pool_v, Tensor slots, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(spork, CPU, m) { m.impl("attend", &spork_ops::attend); }

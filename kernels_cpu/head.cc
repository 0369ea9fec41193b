// The output head as the tied embedding stores it: out [M, V] = x [M, E] @ rows [V, E]^T, the rows float32,
// bfloat16 or int8 with a scale per E/G values of each row (jaxcb.model.quant.QuantRows), called from the
// step through XLA's FFI.
//
// Why: for int8 rows XLA:CPU dequantizes the whole [V, E] table to float32 every step before its dot
// (at SmolLM2's 49,152 x 576, 28 M values written and read again: a third of a 32-row step's matmul
// time); here each row is widened in registers as it is used and the table streams from memory once.
// With few rows of x (decode of a few sequences, bound by reading the table) the reduction runs along a
// row (contiguous): blocks of kVB vocabulary rows (one row for float32 up to kNarrow rows of x) x up to
// kMB rows of x, kVB x kMB accumulators of 16 lanes, summed across lanes once at the end of the row. With
// kTiled rows or more, that widened each int8 row once per block of x rows; instead each block of kTR
// vocabulary rows (int8 rows widened once into an L1 buffer, float32 rows where they are: copying them
// there too made SmolLM2's head at 16 / 32 / 64 rows 8.09 / 12.88 / 20.33 ms against 6.05 / 9.98 / 18.31,
// 2-core Zen 4) is multiplied by x transposed ([E, M], made once a call, M padded to whole vectors), kTR x
// 32 accumulators, the tile then stored transposed (tiles of 12 or 14 rows: 1.4x slower); bfloat16 rows,
// where the CPU has AVX512_BF16, go through tiles of their own (vdpbf16ps on pairs of x's values, below).
// Against a bfloat16 table x is rounded to bfloat16 on every path. Ranges of vocabulary rows are the work
// items (shared with XLA's intra-op pool).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int8.h"
#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxcb::kLanes;
using jaxcb::vf;
using jaxcb::vload;
#ifndef HEAD_NARROW
#define HEAD_NARROW 6
#endif
#ifndef HEAD_VB
#define HEAD_VB 4
#endif
// Float32 tables with up to kNarrow rows of x go one vocabulary row at a time: the table streams in
// order. Blocks of 4 rows read 4 interleaved runs 2,304 bytes apart, which the prefetchers follow worse:
// SmolLM2's head at 1 / 2 / 3 / 4 / 6 rows took 3.48 / 4.15 / 4.12 / 4.36 / 4.77 ms with them, 2.77 / 2.81 /
// 3.38 / 4.23 / 4.18 ms one row at a time (XLA's dot: 2.73 / 5.93 / 6.51 / 6.76 / 7.26; 2-core Zen 4), 3%
// slower at 8. An int8 row is a quarter as long and widened as it is read: its blocks stay. A bfloat16
// row goes one at a time too (1 / 4 rows of x: 3.03 / 3.38 ms in blocks, 1.66 / 2.39 one at a time).
constexpr int64_t kNarrow = HEAD_NARROW;
constexpr int kVB = HEAD_VB;  // vocabulary rows per block with more rows of x
constexpr int kMB = 4;      // rows of x per block
constexpr int64_t kItem = 256;  // vocabulary rows per work item

using jaxcb::hsum;

// A vocabulary row's 16 values at e as floats: float32 rows as they are, bfloat16 rows widened, int8 rows
// times their scale (the 16 values lie in one group: the caller checks that groups are whole vectors).
struct F32Rows {
  const float* w;
  int64_t e;
  inline vf at(int64_t v, int64_t i) const { return vload(w + v * e + i); }
  inline const void* ptr(int64_t v, int64_t i) const { return w + v * e + i; }
  inline float scalar(int64_t v, int64_t i) const { return w[v * e + i]; }
};
struct BF16Rows {  // bfloat16 bits, widened exactly
  const uint16_t* w;
  int64_t e;
  inline vf at(int64_t v, int64_t i) const { return jaxcb::load_bf16(w + v * e + i); }
  inline const void* ptr(int64_t v, int64_t i) const { return w + v * e + i; }
  inline float scalar(int64_t v, int64_t i) const {
    const uint32_t bits = static_cast<uint32_t>(w[v * e + i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};
struct Q8Rows {
  const int8_t* q;
  const float* scale;  // [V, G]
  int64_t e, groups, group;
  int shift;  // log2(group) where group is a power of two (a GGUF's 32), else -1: a 64-bit division per
              // vector was a third of the widening's time (SmolLM2's head at 32 rows, 2-core Zen 5)
  inline int64_t group_of(int64_t i) const { return shift >= 0 ? i >> shift : i / group; }
  inline vf at(int64_t v, int64_t i) const { return jaxcb::load_i8(q + v * e + i) * scale[v * groups + group_of(i)]; }
  inline const void* ptr(int64_t v, int64_t i) const { return q + v * e + i; }
  inline float scalar(int64_t v, int64_t i) const { return q[v * e + i] * scale[v * groups + group_of(i)]; }
};

// out[m0:m0+MB, v0:v0+VB] for whole blocks; e16 = the vectorised part of each row, the rest scalar.
// The next block's rows are asked for as this one's are read (a row is a short run the hardware
// prefetchers barely start on before it ends).
template <int VB, int MB, class R>
inline void block(const float* x, const R& w, float* out, int64_t nv, int64_t e, int64_t e16, int64_t m0, int64_t v0) {
  vf acc[MB][VB] = {};
  for (int64_t i = 0; i < e16; i += kLanes) {
    for (int b = 0; b < VB; ++b) __builtin_prefetch(w.ptr(v0 + VB + b, i));
    vf wv[VB];
    for (int b = 0; b < VB; ++b) wv[b] = w.at(v0 + b, i);
    for (int a = 0; a < MB; ++a) {
      const vf xv = vload(x + (m0 + a) * e + i);
      for (int b = 0; b < VB; ++b) acc[a][b] += xv * wv[b];
    }
  }
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < VB; ++b) {
      float s = hsum(acc[a][b]);
      for (int64_t i = e16; i < e; ++i) s += x[(m0 + a) * e + i] * w.scalar(v0 + b, i);
      out[(m0 + a) * nv + v0 + b] = s;
    }
}

// Vocabulary rows [v0, v1) for every row of x: blocks of VBlock rows, then single rows; for each, the
// rows of x in blocks of kMB, then the rest together.
template <int VBlock, class R>
void vocab_range(const float* x, const R& w, float* out, int64_t m, int64_t nv, int64_t e, int64_t e16, int64_t v0,
                 int64_t v1) {
  int64_t v = v0;
  auto each_m = [&](auto vb, int64_t at) {
    constexpr int VB = decltype(vb)::value;
    int64_t a = 0;
    for (; a + kMB <= m; a += kMB) block<VB, kMB>(x, w, out, nv, e, e16, a, at);
    switch (m - a) {  // the rest in one pass over the block
      case 1: block<VB, 1>(x, w, out, nv, e, e16, a, at); break;
      case 2: block<VB, 2>(x, w, out, nv, e, e16, a, at); break;
      case 3: block<VB, 3>(x, w, out, nv, e, e16, a, at); break;
      default: break;
    }
  };
  for (; v + VBlock <= v1; v += VBlock) each_m(std::integral_constant<int, VBlock>{}, v);
  for (; v < v1; ++v) each_m(std::integral_constant<int, 1>{}, v);
}

constexpr int64_t kTiled = 16;  // rows of x from which the tiled path runs
#ifndef HEAD_TR
#define HEAD_TR 8
#endif
constexpr int kTR = HEAD_TR;     // vocabulary rows per tile

// tile[r][0:NV*16] = sum_e rows[r][e] * xt[e][m0 : m0 + NV*16] for the kTR float rows at `a`.
template <int NV>
inline void tile(const float* a, int64_t e, const float* xt, int64_t mp, int64_t m0, vf (&acc)[kTR][2]) {
  for (int r = 0; r < kTR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = vf{};
  for (int64_t k = 0; k < e; ++k) {
    vf xv[NV];
    for (int i = 0; i < NV; ++i) xv[i] = vload(xt + k * mp + m0 + i * kLanes);
    for (int r = 0; r < kTR; ++r) {
      const float av = a[r * e + k];
      for (int i = 0; i < NV; ++i) acc[r][i] += av * xv[i];
    }
  }
}

template <class R>
void vocab_range_tiled(const float* xt, const R& w, float* out, int64_t m, int64_t mp, int64_t nv, int64_t e,
                       int64_t e16, int64_t v0, int64_t v1) {
  std::vector<float> a(std::is_same_v<R, F32Rows> ? 0 : kTR * e);  // int8 rows widened here
  int64_t v = v0;
  for (; v + kTR <= v1; v += kTR) {
    const float* rows = a.data();
    if constexpr (std::is_same_v<R, F32Rows>) {
      rows = w.w + v * e;  // float32 rows are read where they are
    } else {
      // The next block's rows asked for now, to arrive while this one's tiles run: widening them
      // unasked waited on memory for most of the head's time (1.3x slower than float32 rows at 32 rows).
      if (v + 2 * kTR <= v1)
        for (int64_t b = 0; b < kTR * e; b += 64) __builtin_prefetch(static_cast<const char*>(w.ptr(v + kTR, 0)) + b);
      for (int r = 0; r < kTR; ++r) {  // the block's rows widened once
        for (int64_t i = 0; i < e16; i += kLanes) jaxcb::vstore(a.data() + r * e + i, w.at(v + r, i));
        for (int64_t i = e16; i < e; ++i) a[r * e + i] = w.scalar(v + r, i);
      }
    }
    for (int64_t m0 = 0; m0 < mp; m0 += 2 * kLanes) {
      vf acc[kTR][2];
      const int nvec = mp - m0 >= 2 * kLanes ? 2 : 1;
      if (nvec == 2)
        tile<2>(rows, e, xt, mp, m0, acc);
      else
        tile<1>(rows, e, xt, mp, m0, acc);
      for (int i = 0; i < nvec; ++i)
        for (int j = 0; j < kLanes; ++j) {
          const int64_t row = m0 + i * kLanes + j;
          if (row >= m) break;
          for (int r = 0; r < kTR; ++r) out[row * nv + v + r] = acc[r][i][j];
        }
    }
  }
  for (; v < v1; ++v)  // the last rows of the range, one at a time
    for (int64_t row = 0; row < m; ++row) {
      float s = 0.0f;
      for (int64_t i = 0; i < e; ++i) s += xt[i * mp + row] * w.scalar(v, i);
      out[row * nv + v] = s;
    }
}

template <class R>
void run(ffi::ThreadPool& pool, const float* x, const R& w, float* out, int64_t m, int64_t nv, int64_t e, int64_t e16) {
  const int64_t items = (nv + kItem - 1) / kItem;
  if (m >= kTiled) {
    const int64_t mp = (m + kLanes - 1) / kLanes * kLanes;
    std::vector<float> xt(e * mp, 0.0f);
    for (int64_t row = 0; row < m; ++row)
      for (int64_t i = 0; i < e; ++i) xt[i * mp + row] = x[row * e + i];
    const float* xtp = xt.data();
    jaxcb::parallel_for(pool, items, true, [=, &w](int64_t i) {
      vocab_range_tiled(xtp, w, out, m, mp, nv, e, e16, i * kItem, std::min(nv, (i + 1) * kItem));
    });
    return;
  }
  jaxcb::parallel_for(pool, items, m * nv * e >= (1 << 16), [=, &w](int64_t i) {
    if (!std::is_same_v<R, Q8Rows> && m <= kNarrow)
      vocab_range<1>(x, w, out, m, nv, e, e16, i * kItem, std::min(nv, (i + 1) * kItem));
    else
      vocab_range<kVB>(x, w, out, m, nv, e, e16, i * kItem, std::min(nv, (i + 1) * kItem));
  });
}

#if defined(__AVX512F__)
// A tile of R vocabulary rows x nvec vectors of x's rows (lanes) into out [M, V] at (m0, v), transposed;
// the padding rows past m dropped.
template <int R>
inline void store_tile(const __m512 (&acc)[R][2], int nvec, float* out, int64_t m, int64_t m0, int64_t nv, int64_t v) {
  for (int i = 0; i < nvec; ++i) {
    alignas(64) float lanes[R][kLanes];
    for (int r = 0; r < R; ++r) _mm512_store_ps(lanes[r], acc[r][i]);
    for (int j = 0; j < kLanes; ++j) {
      const int64_t row = m0 + i * kLanes + j;
      if (row >= m) break;
      for (int r = 0; r < R; ++r) out[row * nv + v + r] = lanes[r][j];
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 rows with kTiledBF16 rows of x or more: x's values in pairs along E, transposed ([E / 2, mp] 32-bit
// lanes), and each pair of a vocabulary row broadcast against them, vdpbf16ps summing a lane's two
// products at once (the rows read where they are, nothing widened). SmolLM2's head at 16 / 32 / 64 rows:
// 4.52 / 5.96 / 10.41 ms against 8.27 / 11.79 / 21.22 with the rows widened into the float32 tiles (and
// 6.29 / 9.85 / 18.22 for float32 rows); the tiles cost the same from 5 to 16 rows (4.1-4.5 ms, the rows
// of x padded to 16), one vocabulary row at a time costs 3.2-3.3 / 4.0-4.1 / 5.3-5.4 ms at 5 / 8 / 12 rows
// (2-core Zen 4).
#ifndef HEAD_TILED_BF16
#define HEAD_TILED_BF16 9
#endif
constexpr int64_t kTiledBF16 = HEAD_TILED_BF16;
template <int NV>
inline void tile_dpbf16(const uint16_t* rows, int64_t e, const uint32_t* xt, int64_t mp, int64_t m0,
                        __m512 (&acc)[kTR][2]) {
  for (int r = 0; r < kTR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < e / 2; ++p) {
    __m512bh xv[NV];
    for (int i = 0; i < NV; ++i)
      xv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xt + p * mp + m0 + i * kLanes));
    for (int r = 0; r < kTR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, rows + r * e + 2 * p, 4);
      const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wb, xv[i]);
    }
  }
}

void vocab_range_dpbf16(const uint32_t* xt, const uint16_t* w, const float* xr, float* out, int64_t m, int64_t mp,
                        int64_t nv, int64_t e, int64_t v0, int64_t v1) {
  const BF16Rows rows{w, e};
  int64_t v = v0;
  for (; v + kTR <= v1; v += kTR)
    for (int64_t m0 = 0; m0 < mp; m0 += 2 * kLanes) {
      __m512 acc[kTR][2];
      const int nvec = mp - m0 >= 2 * kLanes ? 2 : 1;
      if (nvec == 2)
        tile_dpbf16<2>(w + v * e, e, xt, mp, m0, acc);
      else
        tile_dpbf16<1>(w + v * e, e, xt, mp, m0, acc);
      store_tile(acc, nvec, out, m, m0, nv, v);
    }
  for (; v < v1; ++v)  // the last rows of the range, one at a time
    for (int64_t row = 0; row < m; ++row) {
      float s = 0.0f;
      for (int64_t i = 0; i < e; ++i) s += xr[row * e + i] * rows.scalar(v, i);
      out[row * nv + v] = s;
    }
}

void run_dpbf16(ffi::ThreadPool& pool, const float* xr, const uint16_t* w, float* out, int64_t m, int64_t nv,
                int64_t e) {
  const int64_t mp = (m + kLanes - 1) / kLanes * kLanes;
  std::vector<uint32_t> xt(e / 2 * mp, 0u);
  for (int64_t row = 0; row < m; ++row)
    for (int64_t p = 0; p < e / 2; ++p) xt[p * mp + row] = jaxcb::bf16_pair(xr[row * e + 2 * p], xr[row * e + 2 * p + 1]);
  const uint32_t* xtp = xt.data();
  jaxcb::parallel_for(pool, (nv + kItem - 1) / kItem, true, [=](int64_t i) {
    vocab_range_dpbf16(xtp, w, xr, out, m, mp, nv, e, i * kItem, std::min(nv, (i + 1) * kItem));
  });
}
#endif

// --- int8 rows against int8 activations (w8a8 / w4a8: jaxcb.model.quant.QuantRows.act_block) ---
// x's rows rounded to int8 per group of the rows' scales (quantize_rows), so each group's products are
// integers: sum_g sx[m, g] sw[v, g] S[m, v, g], S = sum over the group of qx qw, summed in int32 (VNNI)
// and scaled once a group (the tiles, and row_int8 for the vocabulary's last rows). Below kTiledInt8 rows
// of x, and without VNNI, x's rounded values take the float path (the same values up to rounding).
// out[row, v] for one vocabulary row, the integer way (the vocabulary's rows past the last whole tile).
inline void row_int8(const jaxcb::XQuant& x, const Q8Rows& w, float* out, int64_t m, int64_t nv, int64_t e, int64_t v) {
  for (int64_t row = 0; row < m; ++row) {
    float f = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * w.group; i < (g + 1) * w.group; ++i) sum += int32_t{x.q[row * e + i]} * w.q[v * e + i];
      f = std::fma(static_cast<float>(sum), x.scale[row * w.groups + g] * w.scale[v * w.groups + g], f);
    }
    out[row * nv + v] = f;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The tiles' lanes are 16 rows of x (padded): from kTiledInt8 rows on. SmolLM2's head at 1 / 8 / 16 / 32 /
// 64 rows: 1.44 / 1.53 / 1.61 / 2.34 / 4.46 ms, the float path 0.59 / 1.58 / 3.08 / 4.56 / 8.26 (2-core Zen 5).
#ifndef HEAD_TILED_INT8
#define HEAD_TILED_INT8 8
#endif
constexpr int64_t kTiledInt8 = HEAD_TILED_INT8;
// Vocabulary rows per tile (dividing kItem).
#ifndef HEAD_TR_INT8
#define HEAD_TR_INT8 4
#endif
constexpr int kTRI = HEAD_TR_INT8;
static_assert(kItem % kTRI == 0, "work items of whole tiles");
#ifndef HEAD_AHEAD_INT8
#define HEAD_AHEAD_INT8 2
#endif
constexpr int64_t kAheadInt8 = HEAD_AHEAD_INT8;

// x transposed for vpdpbusd: lanes are rows of x (mp, padded with zeros), each 32-bit lane four
// consecutive values of its row; the group scales and 128 x the group sums [G, mp] beside.
struct XLanes {
  std::vector<int32_t> q;      // [E / 4, mp]
  std::vector<float> scale;    // [G, mp]
  std::vector<int32_t> minus;  // [G, mp]: -128 sum(q), where each group's integer sum starts
  int64_t mp;
};

XLanes lanes_of(const jaxcb::XQuant& x, int64_t m, int64_t e, int64_t groups) {
  XLanes t;
  t.mp = (m + kLanes - 1) / kLanes * kLanes;
  t.q.assign(e / 4 * t.mp, 0), t.scale.assign(groups * t.mp, 0.0f), t.minus.assign(groups * t.mp, 0);
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t p = 0; p < e / 4; ++p) std::memcpy(&t.q[p * t.mp + row], &x.q[row * e + 4 * p], 4);
    for (int64_t g = 0; g < groups; ++g) {
      t.scale[g * t.mp + row] = x.scale[row * groups + g];
      t.minus[g * t.mp + row] = -128 * x.sum[row * groups + g];
    }
  }
  return t;
}

// The tile's kTRI vocabulary rows (flipped to unsigned: w + 128, hence the -128 sum(qx) start) against NV
// vectors of x's rows at m0.
template <int NV>
inline void tile_int8(const uint8_t* rows, const float* wscale, const XLanes& x, int64_t e, int64_t groups,
                      int64_t group, int64_t m0, __m512 (&f)[kTRI][2]) {
  for (int r = 0; r < kTRI; ++r)
    for (int i = 0; i < NV; ++i) f[r][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[kTRI][NV];
    for (int i = 0; i < NV; ++i) {
      const __m512i start = _mm512_loadu_si512(x.minus.data() + g * x.mp + m0 + i * kLanes);
      for (int r = 0; r < kTRI; ++r) acc[r][i] = start;
    }
    for (int64_t p = g * group / 4; p < (g + 1) * group / 4; ++p) {
      __m512i xv[NV];
      for (int i = 0; i < NV; ++i) xv[i] = _mm512_loadu_si512(x.q.data() + p * x.mp + m0 + i * kLanes);
      for (int r = 0; r < kTRI; ++r) {
        int32_t four;
        std::memcpy(&four, rows + r * e + 4 * p, 4);
        const __m512i wb = _mm512_set1_epi32(four);
        for (int i = 0; i < NV; ++i) acc[r][i] = jaxcb::dpbusd(acc[r][i], wb, xv[i]);
      }
    }
    for (int r = 0; r < kTRI; ++r) {
      const __m512 sw = _mm512_set1_ps(wscale[r * groups + g]);
      for (int i = 0; i < NV; ++i) {
        const __m512 sx = _mm512_loadu_ps(x.scale.data() + g * x.mp + m0 + i * kLanes);
        f[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][i]), _mm512_mul_ps(sx, sw), f[r][i]);
      }
    }
  }
}

void vocab_range_int8(const XLanes& x, const jaxcb::XQuant& xg, const Q8Rows& w, float* out, int64_t m, int64_t nv,
                      int64_t e, int64_t v0, int64_t v1) {
  std::vector<uint8_t> rows(kTRI * e);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t v = v0;
  for (; v + kTRI <= v1; v += kTRI) {
    const int64_t ahead = v + kAheadInt8 * kTRI;  // the rows kAheadInt8 tiles on (within the table), asked for
    if (ahead + kTRI <= nv)                         // now: a tile's reading waited on them for a third of its time
      for (int64_t b = 0; b < kTRI * e; b += 64) __builtin_prefetch(w.q + ahead * e + b);
    for (int64_t b = 0; b < kTRI * e; b += 64) {  // the tile's rows (one run) flipped to unsigned bytes
      const __mmask64 mask = kTRI * e - b >= 64 ? ~__mmask64{0} : (__mmask64{1} << (kTRI * e - b)) - 1;
      _mm512_mask_storeu_epi8(rows.data() + b, mask, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w.q + v * e + b), flip));
    }
    const float* wscale = w.scale + v * w.groups;
    for (int64_t m0 = 0; m0 < x.mp; m0 += 2 * kLanes) {
      __m512 f[kTRI][2];
      const int nvec = x.mp - m0 >= 2 * kLanes ? 2 : 1;
      if (nvec == 2)
        tile_int8<2>(rows.data(), wscale, x, e, w.groups, w.group, m0, f);
      else
        tile_int8<1>(rows.data(), wscale, x, e, w.groups, w.group, m0, f);
      store_tile(f, nvec, out, m, m0, nv, v);
    }
  }
  for (; v < v1; ++v) row_int8(xg, w, out, m, nv, e, v);
}
#endif

// x [M, E] against int8 rows with x rounded to int8 per group of the rows' scales.
void run_int8(ffi::ThreadPool& pool, const float* xf, const Q8Rows& w, float* out, int64_t m, int64_t nv, int64_t e,
              int64_t e16) {
  const jaxcb::XQuant x = jaxcb::quantize_rows(xf, m, e, w.group);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (m >= kTiledInt8 && w.group % 4 == 0) {
    const XLanes t = lanes_of(x, m, e, w.groups);
    jaxcb::parallel_for(pool, (nv + kItem - 1) / kItem, true, [&](int64_t i) {
      vocab_range_int8(t, x, w, out, m, nv, e, i * kItem, std::min(nv, (i + 1) * kItem));
    });
    return;
  }
#endif
  run(pool, jaxcb::dequantized_rows(x, m, e).data(), w, out, m, nv, e, e16);
}

ffi::Error check(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd) {
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_matmul: x [M, E] and rows [V, E]");
  return ffi::Error::Success();
}

ffi::Error F32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> rows,
                   ffi::ResultBuffer<ffi::F32> out) {
  if (auto err = check(x.dimensions(), rows.dimensions()); err.failure()) return err;
  const int64_t m = x.dimensions()[0], e = x.dimensions()[1], nv = rows.dimensions()[0];
  run(pool, x.typed_data(), F32Rows{rows.typed_data(), e}, out->typed_data(), m, nv, e, e / kLanes * kLanes);
  return ffi::Error::Success();
}

ffi::Error BF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> rows,
                    ffi::ResultBuffer<ffi::F32> out) {
  if (auto err = check(x.dimensions(), rows.dimensions()); err.failure()) return err;
  const int64_t m = x.dimensions()[0], e = x.dimensions()[1], nv = rows.dimensions()[0];
  const uint16_t* w = reinterpret_cast<const uint16_t*>(rows.untyped_data());
  // x rounded to bfloat16 on every path (as the bfloat16 layer matmuls and XLA's reading of the head round
  // it): the products are exact, and a row's logits do not depend on which path its batch takes.
  std::vector<float> xr(m * e);
  for (int64_t i = 0; i < m * e; ++i) xr[i] = jaxcb::round_bf16(x.typed_data()[i]);
#if defined(__AVX512BF16__)
  if (m >= kTiledBF16 && e % 2 == 0) {
    run_dpbf16(pool, xr.data(), w, out->typed_data(), m, nv, e);
    return ffi::Error::Success();
  }
#endif
  run(pool, xr.data(), BF16Rows{w, e}, out->typed_data(), m, nv, e, e / kLanes * kLanes);
  return ffi::Error::Success();
}

ffi::Error Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> rows, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> out, int64_t act_block) {
  if (auto err = check(x.dimensions(), rows.dimensions()); err.failure()) return err;
  const int64_t m = x.dimensions()[0], e = x.dimensions()[1], nv = rows.dimensions()[0];
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[0] != nv || sd[1] < 1 || e % sd[1])
    return ffi::Error::InvalidArgument("rows_matmul: int8 scale [V, G] with G dividing E");
  const int64_t groups = sd[1], group = e / groups;
  if (act_block && act_block != group)
    return ffi::Error::InvalidArgument("rows_matmul: int8 activations are rounded per group of the rows' scales "
                                       "(act_block = E / G)");
  const int shift = (group & (group - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(group)) : -1;
  const Q8Rows w{rows.typed_data(), scale.typed_data(), e, groups, group, shift};
  // Vectors of 16 must not straddle two groups; where they would, the whole row goes the scalar way.
  const int64_t e16 = (groups == 1 || group % kLanes == 0) ? e / kLanes * kLanes : 0;
  if (act_block) {
    run_int8(pool, x.typed_data(), w, out->typed_data(), m, nv, e, e16);
    return ffi::Error::Success();
  }
  run(pool, x.typed_data(), w, out->typed_data(), m, nv, e, e16);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbRowsMatmul, F32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rows [V, E]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, V]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbRowsMatmulBF16, BF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, E]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // rows [V, E]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, V]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbRowsMatmulInt8, Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, E]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // rows [V, E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [V, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, V]
                                  .Attr<int64_t>("act_block"));   // 0, or x rounded to int8 per group (E / G)

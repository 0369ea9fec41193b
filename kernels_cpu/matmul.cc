// x @ w[layer] for the stacked layer weights, called from inside the layer scan through XLA's FFI.
//
// Why: the step scans over layers with every weight stacked on a leading L axis. XLA:CPU feeds each
// layer's matrix to its dot through a dynamic-slice fusion, i.e. it copies the layer's weights every
// step before reading them (measured: a 30-layer scan of SmolLM2's MLP at 32 rows ran at half the rate
// of the same layers unrolled over separate arrays); for int8 and int4 weights that copy is also the
// dequantization, a float32 matrix written and read again. These kernels read the matrix in place from
// the stack, with the layer as an operand, so the weights stream from memory once a step at their
// stored width, and quantized values become floats only in registers.
//
// Four weight formats (jaxcb.model.quant), out [M, N] = x [M, K] @ w[layer]:
//   float32  w [L, K, N].
//   bfloat16 w [L, N / kNB, K / 2, 2 kNB]: blocks of kNB columns, each in pairs of input rows, a 32-bit
//            lane holding rows 2p (low half) and 2p + 1 (high half) of one column (kernels_cpu.pair_block);
//            x is rounded to bfloat16 as it comes in (see the bfloat16 section below).
//   int8     q [L, K, N] int8, scale [L, G, N] float32: w = q * scale of its group of K/G input rows
//            (G = 1: one scale per column).
//   int4     q [L, K/2, N] uint8 (input rows 2i and 2i+1 in the low and high nibble of byte row i),
//            scale and offset [L, G, N] float16: w = nibble * scale + offset of its group. Per group,
//            sum_k x_k w_k = scale * sum_k x_k nibble_k + offset * sum_k x_k.
// int8 or int4 with activations quantized too ("w8a8", "w4a8": act_block > 0, dividing kKB and int4's
// group): each row of x is quantized per block of act_block input rows (scale = max |x| / 127, values
// rounded half to even), and, where the build has AVX-512 VNNI (and int8 weights have one scale per
// column), a block's products are summed in int32 by vpdpbusd (unsigned x signed bytes, 4 input rows per
// 32-bit lane): int8 weights, stored signed, are flipped to w + 128 as a block is read in that layout
// (the sums start at -128 * sum(x) of the row's block), then the sum is scaled by the row's block scale,
// and by the column's scale after the last block; int4 nibbles are unsigned already, and the block's sum
// becomes (sum * scale + sum(x) * offset) * the row's block scale, as llama.cpp's Q4_1 x Q8_1 dot does.
// The layout is the stacks' own where they lie in quad blocks (kernels_cpu.quad_block, which
// jaxcb.model.quant.blocked_layers applies where the build has VNNI: each block of 32 columns one run, read
// as it lies), else each slab of a block is packed into it first. Elsewhere x is replaced by its
// quantized values and takes the float path, the same sums up to rounding.
// Ranges of columns are the work items (shared with XLA's intra-op pool); within one, the reduction
// goes in slabs of kKB rows of w, each slab in blocks of kNB columns (the block stays in L1 while every
// row block of x passes over it; a quantized block is widened to floats in registers as it is used
// when x has at most kDirect rows, else once into an L1 buffer),
// kMR rows of x at a time with kMR x kNB accumulators in registers. Columns past the last whole block
// take a plain loop.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
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
using jaxcb::vstore;
using jaxcb::dequantized_rows;
using jaxcb::quantize_rows;
using jaxcb::XQuant;
constexpr int kNV = 2;                // vectors of columns per block
constexpr int kNB = kNV * kLanes;     // columns per block
constexpr int kMR = 8;                // rows of x per micro-kernel call
constexpr int64_t kKB = 128;          // rows of w per slab (even: int4's byte rows stay whole)

inline float half(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// One layer's matrix in one of the three formats (n columns; `group` input rows per scale).
struct F32 {
  const float* w;
  int64_t n;
  bool blocked = false;  // [N / kNB, K, kNB]: each block of columns one contiguous run (kernels_cpu.block_stack)
};
struct Q8 {
  const int8_t* q;
  const float* scale;  // [G, N]
  int64_t n, group;
  // [N / kNB, K / 4, 4 kNB]: each block of columns one run of 4-row groups, a column's four rows side by
  // side, as vpdpbusd reads them (kernels_cpu.quad_block); read only through the integer sums.
  bool quads = false;
};
struct Q4 {
  const uint8_t* q;
  const uint16_t* scale;  // [G, N] float16 bits
  const uint16_t* offset;
  int64_t n, group;
  // [N / kNB, K / 8, 4 kNB]: each block of columns one run of 8-row groups, byte i of a column's four
  // holding input row 8g + i in its low nibble and 8g + 4 + i in its high one (kernels_cpu.quad_block):
  // the two halves of a group are vpdpbusd's 4-row lanes once masked. Read only through the integer sums.
  bool quads = false;
};

#ifndef JAXCB_PREFETCH_ROWS
#define JAXCB_PREFETCH_ROWS 64
#endif
constexpr int64_t kPrefetchRows = JAXCB_PREFETCH_ROWS;

// c[0:R, 0:kNB] (+)= a[0:R, 0:kn] @ b[0:kn, 0:kNB]; `first`: c starts at zero.
// `linear`: b is a blocked matrix's block read in place (its rows, the next slab's and the next block's
// follow on): ask kPrefetchRows rows ahead along it.
template <int R>
inline void micro(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t kn,
                  bool first, bool linear = false) {
  vf acc[R][kNV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) acc[r][i] = first ? vf{} : vload(c + r * ldc + i * kLanes);
  const bool strided = ldb != kNB;  // reading w in place, a row of the block per 4 KB page
  for (int64_t k = 0; k < kn; ++k) {
    if (linear) {
      const float* p = b + (k + kPrefetchRows) * kNB;
      for (int i = 0; i < kNB; i += 16) __builtin_prefetch(p + i);
    } else if (strided) {
      const int64_t ahead = k + kPrefetchRows;
      const float* p = ahead < kn ? b + ahead * ldb : b + (ahead - kn) * ldb + kNB;
      for (int i = 0; i < kNB; i += 16) __builtin_prefetch(p + i);  // a 64-byte line per 16 floats
    }
    vf bv[kNV];
    for (int i = 0; i < kNV; ++i) bv[i] = vload(b + k * ldb + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + k];
      for (int i = 0; i < kNV; ++i) acc[r][i] += x * bv[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) vstore(c + r * ldc + i * kLanes, acc[r][i]);
}

// Rows e .. e + kStep - 1 of a quantized matrix at columns j .. j + kNB - 1, widened to floats in
// registers (int8: one row; int4: the two rows of a byte row, which share a group as groups are even).
inline void widen(const Q8& w, int64_t e, int64_t j, vf (&out)[1][kNV]) {
  const int8_t* q = w.q + e * w.n + j;
  const float* s = w.scale + (e / w.group) * w.n + j;
  for (int i = 0; i < kNV; ++i) out[0][i] = jaxcb::load_i8(q + i * kLanes) * vload(s + i * kLanes);
}

inline void widen(const Q4& w, int64_t e, int64_t j, vf (&out)[2][kNV]) {
  const uint8_t* q = w.q + (e / 2) * w.n + j;
  const int64_t at = (e / w.group) * w.n + j;
  for (int i = 0; i < kNV; ++i) {
    vf lo, hi;
    jaxcb::load_u4(q + i * kLanes, lo, hi);
    const vf s = jaxcb::load_f16(w.scale + at + i * kLanes), o = jaxcb::load_f16(w.offset + at + i * kLanes);
    out[0][i] = lo * s + o;
    out[1][i] = hi * s + o;
  }
}

template <class W> constexpr int kStep = 1;
template <> constexpr int kStep<Q4> = 2;

// Asks early for the quantized values kPrefetchRows rows past row k of the block (slab rows k0..k0+kn-1,
// columns j..j+kNB-1), past its end the first rows of the next block: each row of a block lies in a
// page of its own, where the hardware prefetchers do not follow.
inline void prefetch_at(const Q8& w, int64_t e, int64_t j) { __builtin_prefetch(w.q + e * w.n + j); }
inline void prefetch_at(const Q4& w, int64_t e, int64_t j) { __builtin_prefetch(w.q + (e / 2) * w.n + j); }
template <class W>
inline void prefetch(const W& w, int64_t k0, int64_t kn, int64_t k, int64_t j) {
  const int64_t ahead = k + kPrefetchRows;
  if (ahead < kn) prefetch_at(w, k0 + ahead, j);
  else prefetch_at(w, k0 + ahead - kn, j + kNB);
}

// The float weights w[k0:k0+kn, j:j+kNB] of a quantized block into buf [kn, kNB] (L1): with more than
// kDirect rows of x, each value is widened once per block, however many row blocks then pass over it.
template <class W>
inline void dequantize(const W& w, int64_t k0, int64_t kn, int64_t j, float* buf) {
  for (int64_t e = 0; e < kn; e += kStep<W>) {
    prefetch(w, k0, kn, e, j);
    vf rows[kStep<W>][kNV];
    widen(w, k0 + e, j, rows);
    for (int t = 0; t < kStep<W>; ++t)
      for (int i = 0; i < kNV; ++i) vstore(buf + (e + t) * kNB + i * kLanes, rows[t][i]);
  }
}

// With few rows of x (decode of one to a few sequences, bound by reading the weights) the block is
// widened in registers and used at once: no buffer to write and read back.
constexpr int64_t kDirect = 4;

template <int R, class W>
inline void micro_direct(const float* a, int64_t lda, const W& w, float* c, int64_t ldc, int64_t k0, int64_t kn,
                         int64_t j, bool first) {
  vf acc[R][kNV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) acc[r][i] = first ? vf{} : vload(c + r * ldc + i * kLanes);
  for (int64_t k = 0; k < kn; k += kStep<W>) {
    prefetch(w, k0, kn, k, j);
    vf bv[kStep<W>][kNV];
    widen(w, k0 + k, j, bv);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < kStep<W>; ++t) {
        const float x = a[r * lda + k + t];
        for (int i = 0; i < kNV; ++i) acc[r][i] += x * bv[t][i];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) vstore(c + r * ldc + i * kLanes, acc[r][i]);
}

// c[:, j:j+kNB] for one slab of w (rows k0:k0+kn): whole 8-row blocks, then the remaining rows with a
// micro-kernel of their own count (a row at a time would re-read the slab once per row).
template <class W>
inline void rows(const float* a, const W& w, float* c, int64_t m, int64_t k, int64_t n, int64_t k0, int64_t kn,
                 int64_t j) {
  const float* b;
  int64_t ldb;
  alignas(64) float buf[kKB * kNB];
  const bool first = k0 == 0;
  bool linear = false;
  if constexpr (std::is_same_v<W, F32>) {
    if (w.blocked) b = w.w + (j / kNB) * (k * kNB) + k0 * kNB, ldb = kNB, linear = true;
    else b = w.w + k0 * n + j, ldb = n;
  } else {
    if (m <= kDirect) {
      const float* am = a + k0;
      float* cm = c + j;
      switch (m) {
        case 1: return micro_direct<1>(am, k, w, cm, n, k0, kn, j, first);
        case 2: return micro_direct<2>(am, k, w, cm, n, k0, kn, j, first);
        case 3: return micro_direct<3>(am, k, w, cm, n, k0, kn, j, first);
        case 4: return micro_direct<4>(am, k, w, cm, n, k0, kn, j, first);
        default: return;
      }
    }
    dequantize(w, k0, kn, j, buf);
    b = buf, ldb = kNB;
  }
  int64_t m0 = 0;
  for (; m0 + kMR <= m; m0 += kMR) micro<kMR>(a + m0 * k + k0, k, b, ldb, c + m0 * n + j, n, kn, first, linear);
  const float* am = a + m0 * k + k0;
  float* cm = c + m0 * n + j;
  switch (m - m0) {
    case 1: micro<1>(am, k, b, ldb, cm, n, kn, first, linear); break;
    case 2: micro<2>(am, k, b, ldb, cm, n, kn, first, linear); break;
    case 3: micro<3>(am, k, b, ldb, cm, n, kn, first, linear); break;
    case 4: micro<4>(am, k, b, ldb, cm, n, kn, first, linear); break;
    case 5: micro<5>(am, k, b, ldb, cm, n, kn, first, linear); break;
    case 6: micro<6>(am, k, b, ldb, cm, n, kn, first, linear); break;
    case 7: micro<7>(am, k, b, ldb, cm, n, kn, first, linear); break;
    default: break;
  }
}

// Columns [n0, n1) of the output (whole kNB blocks): slab by slab, so that each row of a slab is read
// as one contiguous run of the range's columns rather than a block at a time.
template <class W>
void column_range(const float* a, const W& w, float* c, int64_t m, int64_t k, int64_t n, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<W, F32>) {
    if (w.blocked) {  // block by block, each read front to back as one run
      for (int64_t j = n0; j < n1; j += kNB)
        for (int64_t k0 = 0; k0 < k; k0 += kKB) rows(a, w, c, m, k, n, k0, std::min(kKB, k - k0), j);
      return;
    }
  }
  for (int64_t k0 = 0; k0 < k; k0 += kKB) {
    const int64_t kn = std::min(kKB, k - k0);
    for (int64_t j = n0; j < n1; j += kNB) rows(a, w, c, m, k, n, k0, kn, j);
  }
}

inline float weight(const F32& w, int64_t e, int64_t j) { return w.w[e * w.n + j]; }
inline float weight(const Q8& w, int64_t e, int64_t j) { return w.q[e * w.n + j] * w.scale[(e / w.group) * w.n + j]; }
inline float weight(const Q4& w, int64_t e, int64_t j) {
  const uint8_t byte = w.q[(e / 2) * w.n + j];
  const int64_t at = (e / w.group) * w.n + j;
  return static_cast<float>((e % 2) ? byte >> 4 : byte & 15) * half(w.scale[at]) + half(w.offset[at]);
}

template <class W>
void column_tail(const float* a, const W& w, float* c, int64_t m, int64_t k, int64_t n, int64_t n0) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = n0; j < n; ++j) {
      float s = 0.0f;
      for (int64_t e = 0; e < k; ++e) s += a[i * k + e] * weight(w, e, j);
      c[i * n + j] = s;
    }
}


// --- int8 activations (w8a8) ---

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXCB_VNNI 1

// Four input rows of unsigned bytes at 32 columns (r0 .. r3) into out as vpdpbusd reads them: 32 lanes of
// 4 bytes, a column's four rows in a lane.
inline void pack_four(__m256i r0, __m256i r1, __m256i r2, __m256i r3, uint8_t* bytes) {
  const __m256i lo01 = _mm256_unpacklo_epi8(r0, r1), hi01 = _mm256_unpackhi_epi8(r0, r1);
  const __m256i lo23 = _mm256_unpacklo_epi8(r2, r3), hi23 = _mm256_unpackhi_epi8(r2, r3);
  const __m256i c0 = _mm256_unpacklo_epi16(lo01, lo23);  // columns 0-3 | 16-19
  const __m256i c4 = _mm256_unpackhi_epi16(lo01, lo23);  // 4-7 | 20-23
  const __m256i c8 = _mm256_unpacklo_epi16(hi01, hi23);  // 8-11 | 24-27
  const __m256i c12 = _mm256_unpackhi_epi16(hi01, hi23);  // 12-15 | 28-31
  __m256i* out = reinterpret_cast<__m256i*>(bytes);
  _mm256_storeu_si256(out, _mm256_permute2x128_si256(c0, c4, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(c8, c12, 0x20));
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(c0, c4, 0x31));
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(c8, c12, 0x31));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Rows k0 .. k0 + kn - 1 (kn a multiple of 4) of columns j .. j + 31 into buf as vpdpbusd reads them.
// int8: w + 128 (the signed values with their top bit flipped: the instruction's unsigned operand).
inline void pack_block(const Q8& w, int64_t k0, int64_t kn, int64_t j, uint8_t* buf) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t e = 0; e < kn; e += 4) {
    const int8_t* q = w.q + (k0 + e) * w.n + j;
    const auto row = [&](int t) { return _mm256_xor_si256(load32(q + t * w.n), flip); };
    pack_four(row(0), row(1), row(2), row(3), buf + e * 32);
  }
}

// int4: the nibbles as they are (0 .. 15), input rows 2i and 2i + 1 from byte row i's low and high halves.
inline void pack_block(const Q4& w, int64_t k0, int64_t kn, int64_t j, uint8_t* buf) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t e = 0; e < kn; e += 4) {
    const uint8_t* q = w.q + ((k0 + e) / 2) * w.n + j;
    const __m256i b0 = load32(q), b1 = load32(q + w.n);
    pack_four(_mm256_and_si256(b0, low), _mm256_and_si256(_mm256_srli_epi16(b0, 4), low), _mm256_and_si256(b1, low),
              _mm256_and_si256(_mm256_srli_epi16(b1, 4), low), buf + e * 32);
  }
}

// c[0:R, 0:32] (+)= for one slab (columns j .. j + 31), block by block of x's quantization, the block's
// integer sums S = sum_k q_x u_k (u the packed bytes) scaled back:
//   int8: (S - 128 sum_k q_x) * x's block scale * column scale (exact integers up to the scales);
//   int4: S * (group scale * x's block scale) + (sum_k q_x * x's block scale) * group offset (the block
//         inside one group; folded so, the epilogue of a 32-value block took 17.0 ms where scaling the
//         sum last took 21.1, 30 layers of 576 x 1536 at 128 rows, 2-core AMD EPYC Zen 4).
template <int R, bool Quads, class W>
inline void micro_vnni(const XQuant& x, const W& w, int64_t row0, int64_t k, int64_t k0, const uint8_t* buf,
                       int64_t kn, int64_t j, float* c, int64_t ldc, bool first, bool last) {
  static_assert(kNB == 32, "two 16-lane vectors of columns");
  constexpr bool q4 = std::is_same_v<W, Q4>;
  const int8_t* xq = x.q.data() + row0 * k + k0;
  __m512 s0, s1, o0, o1;
  if constexpr (!q4) s0 = _mm512_loadu_ps(w.scale + j), s1 = _mm512_loadu_ps(w.scale + j + 16);
  for (int64_t b0 = 0; b0 < kn; b0 += x.block) {
    if constexpr (q4) {
      const int64_t at = ((k0 + b0) / w.group) * w.n + j;
      s0 = reinterpret_cast<__m512>(jaxcb::load_f16(w.scale + at));
      s1 = reinterpret_cast<__m512>(jaxcb::load_f16(w.scale + at + 16));
      o0 = reinterpret_cast<__m512>(jaxcb::load_f16(w.offset + at));
      o1 = reinterpret_cast<__m512>(jaxcb::load_f16(w.offset + at + 16));
    }
    const int64_t block = (k0 + b0) / x.block;
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r)  // int8: the sums start at -128 sum(x) (the flip of w), exact in int32
      acc[r][0] = acc[r][1] = q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * x.sum[(row0 + r) * x.blocks + block]);
    const int64_t b1 = std::min(kn, b0 + x.block);
    // Input rows e .. e + 3 of the 32 columns (w0, w1: a 4-byte lane per column) into every row's sums.
    const auto products = [&](__m512i w0, __m512i w1, int64_t e) __attribute__((always_inline)) {
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k + e, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        acc[r][0] = jaxcb::dpbusd(acc[r][0], w0, xb);
        acc[r][1] = jaxcb::dpbusd(acc[r][1], w1, xb);
      }
    };
    if constexpr (Quads && q4) {  // 128 bytes hold 8 input rows: 4 in the low nibbles, 4 in the high
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int64_t e = b0; e < b1; e += 8) {
        const __m512i r0 = _mm512_loadu_si512(buf + e * 16), r1 = _mm512_loadu_si512(buf + e * 16 + 64);
        products(_mm512_and_si512(r0, low), _mm512_and_si512(r1, low), e);
        products(_mm512_and_si512(_mm512_srli_epi16(r0, 4), low), _mm512_and_si512(_mm512_srli_epi16(r1, 4), low), e + 4);
      }
    } else {
      for (int64_t e = b0; e < b1; e += 4) {
        __m512i w0 = _mm512_loadu_si512(buf + e * 32), w1 = _mm512_loadu_si512(buf + e * 32 + 64);
        if constexpr (Quads) {  // int8 quad blocks hold the signed values: flipped here, as pack_block does
          const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
          w0 = _mm512_xor_si512(w0, flip), w1 = _mm512_xor_si512(w1, flip);
        }
        products(w0, w1, e);
      }
    }
    const bool start = first && !b0, end = last && b0 + x.block >= kn;
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * x.blocks + block;
      const __m512 f = _mm512_set1_ps(x.scale[at]);
      float* cr = c + r * ldc;
      const __m512 c0 = start ? _mm512_setzero_ps() : _mm512_loadu_ps(cr);
      const __m512 c1 = start ? _mm512_setzero_ps() : _mm512_loadu_ps(cr + 16);
      __m512 v0, v1;
      if constexpr (q4) {
        const __m512 sum = _mm512_set1_ps(static_cast<float>(x.sum[at]) * x.scale[at]);
        v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s0, f), _mm512_fmadd_ps(sum, o0, c0));
        v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(s1, f), _mm512_fmadd_ps(sum, o1, c1));
      } else {  // the column's scale once, after the last block
        v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), f, c0);
        v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), f, c1);
        if (end) v0 = _mm512_mul_ps(v0, s0), v1 = _mm512_mul_ps(v1, s1);
      }
      _mm512_storeu_ps(cr, v0);
      _mm512_storeu_ps(cr + 16, v1);
    }
  }
}

// Every row of x over one slab of columns j .. j + 31 (buf: the slab's 4-row groups), kMR rows at a time.
template <bool Quads, class W>
void rows_vnni(const XQuant& x, const W& w, const uint8_t* buf, float* c, int64_t m, int64_t k, int64_t n, int64_t k0,
               int64_t kn, int64_t j) {
  const bool first = k0 == 0, last = k0 + kn == k;
  int64_t m0 = 0;
  for (; m0 + kMR <= m; m0 += kMR) micro_vnni<kMR, Quads>(x, w, m0, k, k0, buf, kn, j, c + m0 * n + j, n, first, last);
  float* cm = c + m0 * n + j;
  switch (m - m0) {
    case 1: micro_vnni<1, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    case 2: micro_vnni<2, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    case 3: micro_vnni<3, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    case 4: micro_vnni<4, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    case 5: micro_vnni<5, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    case 6: micro_vnni<6, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    case 7: micro_vnni<7, Quads>(x, w, m0, k, k0, buf, kn, j, cm, n, first, last); break;
    default: break;
  }
}

// Weights as stored: each slab of each block of columns packed into 4-row groups first.
template <class W>
void column_range_vnni(const XQuant& x, const W& w, float* c, int64_t m, int64_t k, int64_t n, int64_t n0,
                       int64_t n1) {
  alignas(64) uint8_t buf[kKB * kNB];
  for (int64_t k0 = 0; k0 < k; k0 += kKB) {
    const int64_t kn = std::min(kKB, k - k0);
    for (int64_t j = n0; j < n1; j += kNB) {
      pack_block(w, k0, kn, j, buf);
      rows_vnni<false>(x, w, buf, c, m, k, n, k0, kn, j);
    }
  }
}

// Slabs asked for ahead of a quad block's reading: one run, which the prefetchers followed too late (the
// first rows of x waited on half its reads at 32 rows, SmolLM2's up projection, 2-core Zen 5).
#ifndef JAXCB_QUAD_AHEAD
#define JAXCB_QUAD_AHEAD 2
#endif
constexpr int64_t kQuadAhead = JAXCB_QUAD_AHEAD;

// Quad blocks: read where they lie, block after block, each down the whole of K (one run from memory
// for the range; packing in place of it was a quarter of the time of SmolLM2's up projection at 32
// rows, and its strided reads waited on memory, 2-core Zen 5).
template <class W>
void column_range_quads(const XQuant& x, const W& w, float* c, int64_t m, int64_t k, int64_t n, int64_t n0,
                        int64_t n1) {
  constexpr int64_t per_row = std::is_same_v<W, Q4> ? kNB / 2 : kNB;  // a block's bytes per input row
  const uint8_t* q = reinterpret_cast<const uint8_t*>(w.q);
  const uint8_t* end = q + (n1 / kNB) * k * per_row;
  for (int64_t j = n0; j < n1; j += kNB) {
    const uint8_t* block = q + (j / kNB) * k * per_row;
    for (int64_t k0 = 0; k0 < k; k0 += kKB) {
      const uint8_t* ahead = block + (k0 + kQuadAhead * kKB) * per_row;  // the slab kQuadAhead further on
      for (int64_t b = 0; b < kKB * per_row && ahead + b < end; b += 64) __builtin_prefetch(ahead + b);
      rows_vnni<true>(x, w, block + k0 * per_row, c, m, k, n, k0, std::min(kKB, k - k0), j);
    }
  }
}
#endif

// Whether this build sums int8 products with VNNI (and so reads quad blocks).
#ifdef JAXCB_VNNI
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif


// --- bfloat16 weights ---
// Every path multiplies x rounded to bfloat16 (to nearest even) by the bfloat16 weights: the products are
// exact in float32 and are summed in float32, as a bfloat16 matmul on an accelerator does. With AVX512_BF16
// and more than kPairsWiden rows, vdpbf16ps sums a lane's two products at once (twice the float32 FMA's
// work per instruction); otherwise each pair lane is widened to two float32 vectors (the low half shifted
// up, the high half masked: both exact) and multiplied by x's rounded values.

// The weights' pair rows of one layer: block jb, pair row p at w + (jb * k / 2 + p) * kNB lanes.
struct BF16 {
  const uint32_t* w;
  int64_t k, n;
};

using jaxcb::bits_of;
using jaxcb::round_bf16;

// x [m, k] rounded, in the form the call's path reads: as floats (the widening path), or as pairs of
// bfloat16 in 32-bit lanes [m, k / 2] (vdpbf16ps: `as_pairs`).
struct XPairs {
  std::vector<float> rounded;
  std::vector<uint32_t> pairs;
};
inline XPairs round_rows(const float* a, int64_t m, int64_t k, bool as_pairs) {
  XPairs x;
  if (!as_pairs) {
    x.rounded.resize(m * k);
    for (int64_t i = 0; i < m * k; ++i) x.rounded[i] = round_bf16(a[i]);
    return x;
  }
  x.pairs.resize(m * k / 2);
  for (int64_t i = 0; i < m * k / 2; ++i) x.pairs[i] = jaxcb::bf16_pair(a[2 * i], a[2 * i + 1]);
  return x;
}

typedef uint32_t vu __attribute__((vector_size(64), aligned(4)));  // 16 pair lanes

// c[0:R, 0:kNB] (+)= x[0:R, 2 p0 : 2 (p0 + pn)] @ the block's pair rows b[0:pn], each widened in registers.
template <int R>
inline void micro_pairs(const float* a, int64_t lda, const uint32_t* b, int64_t pn, float* c, int64_t ldc, bool first) {
  vf acc[R][kNV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) acc[r][i] = first ? vf{} : vload(c + r * ldc + i * kLanes);
  for (int64_t p = 0; p < pn; ++p) {
    const uint32_t* ahead = b + (p + kPrefetchRows / 2) * kNB;  // the stream of blocks: 2 lines a pair row
    __builtin_prefetch(ahead);
    __builtin_prefetch(ahead + 16);
    vf even[kNV], odd[kNV];
    for (int i = 0; i < kNV; ++i) {
      const vu v = *reinterpret_cast<const vu*>(b + p * kNB + i * kLanes);
      even[i] = reinterpret_cast<vf>(v << 16);
      odd[i] = reinterpret_cast<vf>(v & 0xFFFF0000u);
    }
    for (int r = 0; r < R; ++r) {
      const float x0 = a[r * lda + 2 * p], x1 = a[r * lda + 2 * p + 1];
      for (int i = 0; i < kNV; ++i) acc[r][i] += x0 * even[i] + x1 * odd[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) vstore(c + r * ldc + i * kLanes, acc[r][i]);
}

#if defined(__AVX512BF16__)
#define JAXCB_DPBF16 1
// The same sums by vdpbf16ps: x's pairs broadcast against the block's pair rows.
template <int R>
inline void micro_dpbf16(const uint32_t* xp, int64_t ldp, const uint32_t* b, int64_t pn, float* c, int64_t ldc,
                         bool first) {
  static_assert(kNB == 32, "two 16-lane vectors of columns");
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2; ++i) acc[r][i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + i * 16);
  for (int64_t p = 0; p < pn; ++p) {
    const uint32_t* ahead = b + (p + kPrefetchRows / 2) * kNB;
    __builtin_prefetch(ahead);
    __builtin_prefetch(ahead + 16);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kNB));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kNB + 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp[r * ldp + p])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2; ++i) _mm512_storeu_ps(c + r * ldc + i * 16, acc[r][i]);
}
#endif

// Up to this many rows of x the widening path runs where vdpbf16ps is there too (as fast, where reading
// the weights bounds the product; a build's tests then run both).
#ifndef JAXCB_PAIRS_WIDEN
#define JAXCB_PAIRS_WIDEN 4
#endif
constexpr int64_t kPairsWiden = JAXCB_PAIRS_WIDEN;

// Whether vdpbf16ps sums a call's products: the build has it and x has more than kPairsWiden rows.
inline bool dpbf16_for(int64_t m) {
#ifdef JAXCB_DPBF16
  return m > kPairsWiden;
#else
  (void)m;
  return false;
#endif
}

template <int R>
inline void pairs_rows(const XPairs& x, const BF16& w, float* c, int64_t row0, int64_t p0, int64_t pn, int64_t j,
                       const uint32_t* b, bool dp, bool first) {
  float* cr = c + row0 * w.n + j;
#ifdef JAXCB_DPBF16
  if (dp) return micro_dpbf16<R>(x.pairs.data() + row0 * (w.k / 2) + p0, w.k / 2, b, pn, cr, w.n, first);
#endif
  micro_pairs<R>(x.rounded.data() + row0 * w.k + 2 * p0, w.k, b, pn, cr, w.n, first);
}

// Columns [n0, n1) (whole kNB blocks), block by block, each read front to back in slabs of kKB input rows.
// Without vdpbf16ps every row block widens the slab in registers (widened once into an L1 buffer instead,
// 8 / 16 / 32 / 64 rows ran at 0.74 / 0.78 / 0.91 / 0.93x float32 against 1.11 / 0.94 / 0.88 / 0.87x, 2-core Zen 4
// built without it).
void column_range_bf16(const XPairs& x, const BF16& w, float* c, int64_t m, int64_t n0, int64_t n1) {
  const int64_t pairs = w.k / 2;
  const bool dp = dpbf16_for(m);
  for (int64_t j = n0; j < n1; j += kNB)
    for (int64_t p0 = 0; p0 < pairs; p0 += kKB / 2) {
      const int64_t pn = std::min(kKB / 2, pairs - p0);
      const uint32_t* b = w.w + ((j / kNB) * pairs + p0) * kNB;
      const bool first = p0 == 0;
      int64_t m0 = 0;
      for (; m0 + kMR <= m; m0 += kMR) pairs_rows<kMR>(x, w, c, m0, p0, pn, j, b, dp, first);
      switch (m - m0) {
        case 1: pairs_rows<1>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        case 2: pairs_rows<2>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        case 3: pairs_rows<3>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        case 4: pairs_rows<4>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        case 5: pairs_rows<5>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        case 6: pairs_rows<6>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        case 7: pairs_rows<7>(x, w, c, m0, p0, pn, j, b, dp, first); break;
        default: break;
      }
    }
}

// range(n0, n1) over the whole kNB-column blocks of an [m, k] @ [k, n] product, shared with the pool in
// work items of whole blocks, their count a multiple of the threads (at least three per thread, at most
// 256 columns each unless there are fewer blocks) and their sizes within a block of each other, so that
// no thread is left with a last item alone (576 columns in items of 128 left one thread 64 columns
// idle). Returns where the whole blocks end: the caller does the rest.
template <class F>
int64_t whole_columns(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n, F range) {
  const int64_t whole = n / kNB * kNB;
  const int64_t blocks = whole / kNB;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t items = std::max<int64_t>(3 * workers, (whole + 255) / 256);
  items = std::min(blocks, (items + workers - 1) / workers * workers);
  jaxcb::parallel_for(pool, items, m * k * n >= (1 << 16),
                      [=](int64_t i) { range(i * blocks / items * kNB, (i + 1) * blocks / items * kNB); });
  return whole;
}

template <class W>
void run(ffi::ThreadPool& pool, const float* a, const W& w, float* c, int64_t m, int64_t k, int64_t n) {
  const int64_t whole =
      whole_columns(pool, m, k, n, [=, &w](int64_t n0, int64_t n1) { column_range(a, w, c, m, k, n, n0, n1); });
  if (whole < n) column_tail(a, w, c, m, k, n, whole);
}

// Whether the integer sums apply: int8 with one scale per column, int4 with each block of x inside one
// group of the weights; whole 4-row steps of vpdpbusd.
inline bool integer_sums(const Q8& w, int64_t k, int64_t block) { return w.group == k && k % 4 == 0 && block % 4 == 0; }
inline bool integer_sums(const Q4& w, int64_t k, int64_t block) {
  return w.group % block == 0 && k % 4 == 0 && block % 4 == 0;
}

// x @ w with x's rows quantized per block (w8a8, w4a8): integer sums where the build and the weights
// allow, else x's quantized values through the float path.
template <class W>
void run_a8(ffi::ThreadPool& pool, const float* a, const W& w, float* c, int64_t m, int64_t k, int64_t n,
            int64_t block) {
  const XQuant x = quantize_rows(a, m, k, block);
#ifdef JAXCB_VNNI
  if (w.quads) {
    whole_columns(pool, m, k, n, [&](int64_t n0, int64_t n1) { column_range_quads(x, w, c, m, k, n, n0, n1); });
    return;
  }
  if (integer_sums(w, k, block)) {
    const int64_t whole =
        whole_columns(pool, m, k, n, [&](int64_t n0, int64_t n1) { column_range_vnni(x, w, c, m, k, n, n0, n1); });
    if (whole < n) {
      const std::vector<float> xf = dequantized_rows(x, m, k);
      column_tail(xf.data(), w, c, m, k, n, whole);
    }
    return;
  }
#endif
  const std::vector<float> xf = dequantized_rows(x, m, k);
  run(pool, xf.data(), w, c, m, k, n);
}

// Checks x [M, K], the stack's [L, rows, N] (rows = K / per_byte_row) and the layer; sets m, k, n, l.
ffi::Error shapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, int64_t per_byte_row, int32_t layer,
                  int64_t& m, int64_t& k, int64_t& n, int64_t& l) {
  if (per_byte_row == 1 && xd.size() == 2 && wd.size() == 4) {  // float32 blocked: [L, N / kNB, K, kNB]
    if (wd[3] != kNB || xd[1] != wd[2])
      return ffi::Error::InvalidArgument("layer_matmul: x [M, K] and a blocked w [L, N / B, K, B] with B = "
                                         "kernels_cpu.block_columns()");
    m = xd[0], k = xd[1], n = wd[1] * kNB, l = layer;
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
    return ffi::Error::Success();
  }
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] * per_byte_row)
    return ffi::Error::InvalidArgument("layer_matmul: x [M, K] and w [L, K, N]");
  m = xd[0], k = xd[1], n = wd[2], l = layer;
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
  return ffi::Error::Success();
}

// Checks x [M, K] and quad blocks [L, N / kNB, K / rows, 4 kNB] (rows: the input rows a block's 4-byte lanes
// hold, 4 for int8 and 8 for int4) and the layer; sets m, k, n, l.
ffi::Error quad_shapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, int64_t rows, int32_t layer,
                       int64_t& m, int64_t& k, int64_t& n, int64_t& l) {
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != 4 * kNB || xd[1] != rows * wd[2])
    return ffi::Error::InvalidArgument("layer_matmul: x [M, K] and quad blocks w [L, N / B, K / " + std::to_string(rows) +
                                       ", 4 B] with B = kernels_cpu.block_columns()");
  m = xd[0], k = xd[1], n = wd[1] * kNB, l = layer;
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
  return ffi::Error::Success();
}

// --- float32, one row of x: each row of w read as one run ---
// Decode of one sequence is bound by reading the weights. The tile above reads a 32-column block of w
// down its rows, 128 bytes a row a page apart, where the hardware prefetchers do not follow; here a work
// item's accumulators span up to 16 vectors of columns, so each row of w is read as one contiguous run of
// up to 1 KB. (SmolLM2's 1-row decode step on a 2-core Xeon: 27.7-28.8 -> 25.6-26.3 ms. Two to four rows
// in runs of 512-256 bytes were no faster than the tile, or slower: 33.4 -> 37.9 ms at 4 rows.)
template <int NV>
inline void row_run(const float* x, const float* w, int64_t k, int64_t n, int64_t j, float* c) {
  vf acc[NV] = {};
  for (int64_t e = 0; e < k; ++e) {
    const float* wr = w + e * n + j;
    const float xe = x[e];
    for (int i = 0; i < NV; ++i) acc[i] += xe * vload(wr + i * kLanes);
  }
  for (int i = 0; i < NV; ++i) vstore(c + j + i * kLanes, acc[i]);
}

// x [1, k] @ w: work items of up to 16 vectors of columns, at least four of them.
void run_one_row(ffi::ThreadPool& pool, const float* x, const F32& w, float* c, int64_t k, int64_t n) {
  const int64_t vecs = n / kLanes;
  const int64_t per = std::min<int64_t>(16, std::max<int64_t>(1, (vecs + 3) / 4));
  const int64_t items = (vecs + per - 1) / per;
  jaxcb::parallel_for(pool, items, k * n >= (1 << 16), [=](int64_t i) {
    const int64_t v0 = i * per, nv = std::min(per, vecs - v0), j = v0 * kLanes;
    switch (nv) {
#define ROW_CASE(V) case V: return row_run<V>(x, w.w, k, n, j, c);
      ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) ROW_CASE(5) ROW_CASE(6) ROW_CASE(7) ROW_CASE(8)
      ROW_CASE(9) ROW_CASE(10) ROW_CASE(11) ROW_CASE(12) ROW_CASE(13) ROW_CASE(14) ROW_CASE(15) ROW_CASE(16)
#undef ROW_CASE
      default: return;
    }
  });
  if (vecs * kLanes < n) column_tail(x, w, c, 1, k, n, vecs * kLanes);
}

ffi::Error F32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  int64_t m, k, n, l;
  if (auto e = shapes(x.dimensions(), w.dimensions(), 1, layer.typed_data()[0], m, k, n, l); e.failure()) return e;
  const F32 view{w.typed_data() + static_cast<size_t>(l) * k * n, n, w.dimensions().size() == 4};
  if (m == 1 && !view.blocked) {  // a blocked matrix's blocks are runs already: the tile reads them at speed
    run_one_row(pool, x.typed_data(), view, out->typed_data(), k, n);
    return ffi::Error::Success();
  }
  run(pool, x.typed_data(), view, out->typed_data(), m, k, n);
  return ffi::Error::Success();
}

// bfloat16 weights in pair-row blocks [L, N / kNB, K / 2, 2 kNB] (N a multiple of kNB, K even).
ffi::Error BF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != 2 * kNB || xd[1] != 2 * wd[2])
    return ffi::Error::InvalidArgument("layer_matmul: x [M, K] and a bfloat16 w [L, N / B, K / 2, 2 B] with B = "
                                       "kernels_cpu.block_columns()");
  const int64_t m = xd[0], k = xd[1], n = wd[1] * kNB, l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
  const BF16 view{reinterpret_cast<const uint32_t*>(w.untyped_data()) + static_cast<size_t>(l) * (k / 2) * n, k, n};
  const XPairs xr = round_rows(x.typed_data(), m, k, dpbf16_for(m));
  float* c = out->typed_data();
  whole_columns(pool, m, k, n, [&](int64_t n0, int64_t n1) { column_range_bf16(xr, view, c, m, n0, n1); });
  return ffi::Error::Success();
}

ffi::Error Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t act_block) {
  int64_t m, k, n, l;
  const bool quads = q.dimensions().size() == 4;
  if (auto e = quads ? quad_shapes(x.dimensions(), q.dimensions(), 4, layer.typed_data()[0], m, k, n, l)
                     : shapes(x.dimensions(), q.dimensions(), 1, layer.typed_data()[0], m, k, n, l);
      e.failure())
    return e;
  const int64_t groups = scale.dimensions()[1];
  if (scale.dimensions().size() != 3 || k % groups || scale.dimensions()[2] != n)
    return ffi::Error::InvalidArgument("layer_matmul: int8 scale [L, G, N] with G dividing K");
  const int64_t group = k / groups;
  const Q8 view{q.typed_data() + static_cast<size_t>(l) * k * n, scale.typed_data() + static_cast<size_t>(l) * groups * n,
                n, group, quads};
  if (act_block < 0 || (act_block && kKB % act_block))
    return ffi::Error::InvalidArgument("layer_matmul: int8 activations are quantized in blocks that divide 128");
  if (quads && !(kVnni && act_block && integer_sums(view, k, act_block)))
    return ffi::Error::InvalidArgument("layer_matmul: int8 quad blocks are read only by VNNI's integer sums (int8 "
                                       "activations in blocks of a multiple of 4, one scale per column; "
                                       "kernels_cpu.vnni())");
  if (act_block)
    run_a8(pool, x.typed_data(), view, out->typed_data(), m, k, n, act_block);
  else
    run(pool, x.typed_data(), view, out->typed_data(), m, k, n);
  return ffi::Error::Success();
}

ffi::Error Q4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> scale,
                  ffi::Buffer<ffi::F16> offset, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                  int64_t act_block) {
  int64_t m, k, n, l;
  const bool quads = q.dimensions().size() == 4;
  if (auto e = quads ? quad_shapes(x.dimensions(), q.dimensions(), 8, layer.typed_data()[0], m, k, n, l)
                     : shapes(x.dimensions(), q.dimensions(), 2, layer.typed_data()[0], m, k, n, l);
      e.failure())
    return e;
  const int64_t groups = scale.dimensions()[1];
  if (scale.dimensions().size() != 3 || k % groups || (k / groups) % 2 || scale.dimensions()[2] != n)
    return ffi::Error::InvalidArgument("layer_matmul: int4 scale [L, G, N] with even groups dividing K");
  const int64_t group = k / groups;
  const size_t at = static_cast<size_t>(l) * groups * n;
  const Q4 view{q.typed_data() + static_cast<size_t>(l) * (k / 2) * n,
                reinterpret_cast<const uint16_t*>(scale.typed_data()) + at,
                reinterpret_cast<const uint16_t*>(offset.typed_data()) + at, n, group, quads};
  if (act_block < 0 || (act_block && (kKB % act_block || group % act_block)))
    return ffi::Error::InvalidArgument("layer_matmul: int8 activations with int4 weights are quantized in blocks "
                                       "that divide 128 and the weights' group");
  if (quads && !(kVnni && act_block && act_block % 8 == 0 && integer_sums(view, k, act_block)))
    return ffi::Error::InvalidArgument("layer_matmul: int4 quad blocks are read only by VNNI's integer sums (int8 "
                                       "activations in blocks of a multiple of 8 inside the groups; "
                                       "kernels_cpu.vnni())");
  if (act_block)
    run_a8(pool, x.typed_data(), view, out->typed_data(), m, k, n, act_block);
  else
    run(pool, x.typed_data(), view, out->typed_data(), m, k, n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbLayerMatmul, F32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [L, K, N], or blocked [L, N / kNB, K, kNB]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]

// The column block of the float32 matmul, the width of a blocked matrix's blocks.
extern "C" int64_t JaxcbMatmulBlockColumns() { return kNB; }

// Whether the build sums int8 products with AVX-512 VNNI (and so reads int8 quad blocks).
extern "C" int64_t JaxcbMatmulVnni() { return kVnni; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbLayerMatmulBF16, BF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [L, N / kNB, K / 2, 2 kNB]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbLayerMatmulInt8, Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q [L, K, N], or quads [L, N / kNB, K / 4, 4 kNB]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [L, G, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, N]
                                  .Attr<int64_t>("act_block"));   // 0, or x quantized per this many rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbLayerMatmulInt4, Q4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // q [L, K/2, N], or quads [L, N / kNB, K / 8, 4 kNB]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scale [L, G, N]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // offset [L, G, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, N]
                                  .Attr<int64_t>("act_block"));   // 0, or x quantized per this many rows

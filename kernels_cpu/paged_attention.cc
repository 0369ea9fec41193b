// Paged attention of a packed step for the CPU, called from the jitted step through XLA's FFI.
//
// Why a native kernel: in plain JAX, XLA:CPU gathers each page into a temporary, runs small batched
// dots and an online softmax as separate passes, and reads the live K/V at 2.8-5 GB/s; its prefill
// formulation also runs every token of the step against every prefill sequence's pages (masked). Here
// each sequence's queries see only their own pages, and one pass streams each page once and does the
// dots, the softmax and the weighted sum while it is in L1.
//
// Layout (jaxcb.model.paged_attention): kv_pages [L, 2, K, P, S, W], W = D (float pages) or D + 4
// (int8 pages: D values, then the float32 scale's 4 bytes). Query head h belongs to KV head h / G.
// Sequence i's tokens are rows cu_q_lens[i]:cu_q_lens[i+1] of q, the last of its kv_lens[i] keys.
//
// Work: one block per (sequence, KV head, up to 8 consecutive queries); a decode token is a block of
// one query. Blocks are shared between the calling thread and XLA's intra-op thread pool (parallel.h).
// A step of few decode rows has too few blocks to keep every thread reading (one row of a model with 3
// KV heads: 3 blocks for 2 threads): its decode blocks are split along their pages into parts, each
// with its own softmax state, merged once all are done.
//
// The plain-JAX `ragged_attention` is the oracle (tests/test_paged_attention.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;
#ifndef PREFETCH_LEVEL
#define PREFETCH_LEVEL 2  // into L2 (prefetcht1): measured 1.7x the rate of prefetching into L1 here
#endif
#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 2
#endif
constexpr int64_t kPrefetchPages = PREFETCH_PAGES;
#ifndef HELPERS_BYTES
#define HELPERS_BYTES (128 << 10)
#endif
#ifndef ITEMS_PER_THREAD
#define ITEMS_PER_THREAD 3
#endif
#ifndef KEYS_PER_PART
#define KEYS_PER_PART 32
#endif
// Pool threads are woken when a call reads at least this many bytes of K/V (waking one costs a few
// microseconds; one decode row of SmolLM2 at context 128 reads 192 KiB a layer, and ran 1.7-2.9x faster
// with both threads and split blocks than alone on the 2-core Xeon, bench.step).
constexpr int64_t kHelpersBytes = HELPERS_BYTES;
// Decode blocks are split until there are about this many work items per thread (3: each part starts
// its prefetching anew; one and two rows of SmolLM2 (3 KV heads) at contexts 128-2,048 read 2-15% faster
// with 2 or 3 than with 4, and 4 was 5-20% faster than 8 at one row; bench.attention_cpu --compare,
// 2-core Zen 4) ...
constexpr int64_t kItemsPerThread = ITEMS_PER_THREAD;
// ... but no part holds fewer keys than this.
constexpr int64_t kKeysPerPart = KEYS_PER_PART;

// exp(x) for x <= 0 (scores minus their running max), vectorisable: 2^n * p(r), |rel err| < 2e-7.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp_nonpos on every lane of V (16 or 8 floats; VI: as many int32), `floor_lanes` the ISA's rounding
// down (GCC leaves the scalar one unvectorised inside a conditional).
template <class V, class VI, class Floor>
inline V exp_nonpos_lanes(V x, Floor floor_lanes) {
  x = x > -87.0f ? x : V{} - 87.0f;
  const V n = floor_lanes(x * 1.44269504088896341f + 0.5f);
  const V r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  return p * reinterpret_cast<const V&>(bits);
}

// A page's slots as float32 rows: float pages are read in place; bfloat16 and int8 pages are widened
// into `scratch` ([S, D] floats) first, with each int8 slot's scale in `scales`.
struct F32Page {
  static constexpr size_t kBytes = 4;
  static inline const float* rows(const uint8_t* page, int64_t s0, int64_t s1, int64_t w, float*, float* scales) {
    for (int64_t t = s0; t < s1; ++t) scales[t] = 1.0f;
    return reinterpret_cast<const float*>(page);
  }
};
struct BF16Page {
  static constexpr size_t kBytes = 2;
  static inline const float* rows(const uint8_t* page, int64_t s0, int64_t s1, int64_t w, float* scratch,
                                  float* scales) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(page);
    for (int64_t t = s0; t < s1; ++t) {
      scales[t] = 1.0f;
#pragma omp simd
      for (int64_t e = 0; e < w; ++e) {
        uint32_t bits = static_cast<uint32_t>(src[t * w + e]) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof(f));
        scratch[t * w + e] = f;
      }
    }
    return scratch;
  }
};
struct I8Page {  // rows of D int8 values then the float32 scale's 4 bytes; scratch rows of D floats
  static constexpr size_t kBytes = 1;
  static inline const float* rows(const uint8_t* page, int64_t s0, int64_t s1, int64_t w, float* scratch,
                                  float* scales) {
    const int64_t d = w - 4;
    const int8_t* src = reinterpret_cast<const int8_t*>(page);
    for (int64_t t = s0; t < s1; ++t) {
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) scratch[t * d + e] = static_cast<float>(src[t * w + e]);
      std::memcpy(&scales[t], src + t * w + d, sizeof(float));
    }
    return scratch;
  }
};

using jaxcb::kLanes;
using jaxcb::vf;
using jaxcb::vload;
using jaxcb::vstore;
using jaxcb::hsum;

// The slot and column loops below go kW lanes at a time in single registers: 16 with AVX-512; 8 with
// AVX2 alone, where vf's 16 lanes are two registers and 16-lane tiles need twice the registers there are
// (measured: 6-7 GB/s of live K/V, a quarter of the copy rate, spilling throughout).
#if defined(__AVX512F__)
constexpr int kW = 16;
typedef float vw __attribute__((vector_size(64)));
typedef int32_t iw __attribute__((vector_size(64)));
inline vw floor_w(vw t) {
  return reinterpret_cast<vw>(
      _mm512_roundscale_ps(reinterpret_cast<__m512>(t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
}
inline float max_of(vw v) { return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v)); }
inline float sum_of(vw v) { return hsum(v); }
// Lanes [t0, t1) of the 16 slots from tw, and the masked max and zeroing the softmax takes with them.
typedef __mmask16 mw;
inline mw slot_mask(int64_t tw, int64_t t0, int64_t t1) {
  const uint32_t below = static_cast<uint32_t>(std::clamp<int64_t>(t0 - tw, 0, kW));
  const uint32_t upto = static_cast<uint32_t>(std::clamp<int64_t>(t1 - tw, 0, kW));
  return static_cast<mw>(((1u << upto) - 1) & ~((1u << below) - 1));
}
inline vw max_where(mw m, vw a, vw b) {
  return reinterpret_cast<vw>(_mm512_mask_max_ps(reinterpret_cast<__m512>(a), m, reinterpret_cast<__m512>(a),
                                                 reinterpret_cast<__m512>(b)));
}
inline vw zero_outside(mw m, vw x) {
  return reinterpret_cast<vw>(_mm512_maskz_mov_ps(m, reinterpret_cast<__m512>(x)));
}

// The lane sums of 16 vectors, r[t] = sum of x[t]'s lanes, as a tree of pairwise shuffles and adds
// (15 adds and 30 shuffles against 16 separate horizontal sums of 4 dependent steps each).
inline vw lane_sums(const vw* x) {
  vw a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif defined(__AVX2__)
constexpr int kW = 8;
typedef float vw __attribute__((vector_size(32)));
typedef int32_t iw __attribute__((vector_size(32)));
inline vw floor_w(vw t) { return reinterpret_cast<vw>(_mm256_floor_ps(reinterpret_cast<__m256>(t))); }
inline float max_of(vw v) {
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = std::max(m, v[i]);
  return m;
}
inline float sum_of(vw v) {
  float total = 0.0f;
  for (int i = 0; i < kW; ++i) total += v[i];
  return total;
}
// Lanes [t0, t1) of the 8 slots from tw as all-ones lanes, and the masked max and zeroing with them.
typedef iw mw;
inline mw slot_mask(int64_t tw, int64_t t0, int64_t t1) {
  const iw lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return (lane >= static_cast<int32_t>(t0 - tw)) & (lane < static_cast<int32_t>(t1 - tw));
}
inline vw max_where(mw m, vw a, vw b) { return m != 0 && b > a ? b : a; }
inline vw zero_outside(mw m, vw x) { return m != 0 ? x : vw{}; }

// r[t] = the sum of x[t]'s 8 lanes, as a tree of pairwise shuffles and adds (the 16-lane pattern).
inline vw lane_sums(const vw* x) {
  vw a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

#if defined(__AVX2__)
typedef float vwu __attribute__((vector_size(sizeof(vw)), aligned(4)));
inline vw loadw(const float* p) { return *reinterpret_cast<const vwu*>(p); }
inline void storew(float* p, vw v) { *reinterpret_cast<vwu*>(p) = v; }
inline vw exp_w(vw x) { return exp_nonpos_lanes<vw, iw>(x, floor_w); }
// The weighted sum of values keeps G x kValueVectors vectors of column sums in registers (G <= 6): 24 of
// AVX-512's 32 registers, 12 of AVX2's 16.
constexpr int kValueVectors = kW == 16 ? 4 : 2;
#endif

// scores[j * S + t] = q_j . k_t * scales[t] for the G query heads, slots [s0, s1) (with AVX2 or AVX-512,
// whole groups of kW slots around them: every slot of a page is memory the page owns, and the extra
// scores are never read).
template <int G>
inline void page_scores(const float* q, const float* k, int64_t d, int64_t s, int64_t s0, int64_t s1,
                        const float* scales, float* scores) {
#if defined(__AVX2__)
  if (d % kW == 0 && s % kW == 0) {  // kW slots' dot products at once, summed across lanes together
    for (int64_t tw = s0 / kW * kW; tw < s1; tw += kW)
      for (int j = 0; j < G; ++j) {
        vw acc[kW] = {};
        for (int64_t c = 0; c < d; c += kW) {
          const vw qv = loadw(q + j * d + c);
          for (int t = 0; t < kW; ++t) acc[t] += qv * loadw(k + (tw + t) * d + c);
        }
        storew(scores + j * s + tw, lane_sums(acc) * loadw(scales + tw));
      }
    return;
  }
#endif
  if (d % kLanes == 0) {
    for (int64_t t = s0; t < s1; ++t) {
      vf acc[G] = {};
      for (int64_t c = 0; c < d; c += kLanes) {
        const vf kv = vload(k + t * d + c);
        for (int j = 0; j < G; ++j) acc[j] += vload(q + j * d + c) * kv;
      }
      for (int j = 0; j < G; ++j) scores[j * s + t] = hsum(acc[j]) * scales[t];
    }
    return;
  }
  for (int64_t t = s0; t < s1; ++t)
    for (int j = 0; j < G; ++j) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < d; ++e) dot += q[j * d + e] * k[t * d + e];
      scores[j * s + t] = dot * scales[t];
    }
}

// acc[j] += sum over t of weights[j * S + t] * scales[t] * v_t.
template <int G>
inline void page_values(const float* weights, const float* v, int64_t d, int64_t s, int64_t s0, int64_t s1,
                        const float* scales, float* acc) {
#if defined(__AVX2__)
  constexpr int64_t kCols = kValueVectors * kW;
  if (d % kCols == 0 && G <= 6) {  // G x kCols columns of sums in registers, each value row read once
    for (int64_t c = 0; c < d; c += kCols) {
      vw o[G][kValueVectors];
      for (int j = 0; j < G; ++j)
        for (int u = 0; u < kValueVectors; ++u) o[j][u] = loadw(acc + j * d + c + u * kW);
      for (int64_t t = s0; t < s1; ++t) {
        vw row[kValueVectors];
        for (int u = 0; u < kValueVectors; ++u) row[u] = loadw(v + t * d + c + u * kW);
        for (int j = 0; j < G; ++j) {
          const float w = weights[j * s + t] * scales[t];
          for (int u = 0; u < kValueVectors; ++u) o[j][u] += w * row[u];
        }
      }
      for (int j = 0; j < G; ++j)
        for (int u = 0; u < kValueVectors; ++u) storew(acc + j * d + c + u * kW, o[j][u]);
    }
    return;
  }
#endif
  if (d % kLanes == 0) {
    for (int64_t c = 0; c < d; c += kLanes) {
      vf o[G];
      for (int j = 0; j < G; ++j) o[j] = vload(acc + j * d + c);
      for (int64_t t = s0; t < s1; ++t) {
        const vf vv = vload(v + t * d + c) * scales[t];
        for (int j = 0; j < G; ++j) o[j] += weights[j * s + t] * vv;
      }
      for (int j = 0; j < G; ++j) vstore(acc + j * d + c, o[j]);
    }
    return;
  }
  for (int64_t t = s0; t < s1; ++t)
    for (int j = 0; j < G; ++j) {
      const float w = weights[j * s + t] * scales[t];
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) acc[j * d + e] += w * v[t * d + e];
    }
}

struct Problem {
  const float* q;          // [T, H, D], already multiplied by the score scale
  const uint8_t* pages;    // [L, 2, K, P, S, W]
  int64_t layer, nk, np, s, w, d, g, n;  // layer, K, P, S, W, D, G, N (page-table width)
  const int32_t* kv_lens;  // [M]
  const int32_t* page_table;  // [M, N]
  const int32_t* cu_q_lens;   // [M + 1]
  int32_t window;  // > 0: a sliding window of that many keys; < 0: chunks of -window keys (Llama 4); 0: none
  float softcap;
  const float* sinks;  // [H] each head's sink logit in its softmax's denominator (gpt-oss), or nullptr
  float* out;  // [T, H, D]
  float* partials;  // [parts, G, D + 2]: a part's unnormalised sums, then its running max and denominator
};

// 1 / a softmax's denominator: the sum `den` of its keys' exp(score - mx), plus the head's sink where the model
// has them (its exp(sink - mx): with no key seen, mx is kMasked and that is inf, so the output is 0); 0 where
// nothing was seen.
inline float inverse_denominator(const Problem& p, int64_t head, float mx, float den) {
  if (p.sinks != nullptr) den += std::exp(p.sinks[head] - mx);
  return den > 0.0f ? 1.0f / den : 0.0f;
}

// A work item: queries j0 .. j0 + nq - 1 of sequence i, against KV head k, over the keys on its
// logical pages [p0, p1); `part` >= 0: a part of a split decode block, written to p.partials.
struct Block {
  int32_t i, k, j0, nq;
  int32_t p0 = 0, p1 = INT32_MAX, part = -1;
};
#ifndef QUERIES_PER_BLOCK
#define QUERIES_PER_BLOCK 8
#endif
constexpr int64_t kQueriesPerBlock = QUERIES_PER_BLOCK;

inline void prefetch_page(const uint8_t* page, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(page + off, 0, PREFETCH_LEVEL);
}

// Where a block's keys and values are: its KV head's K and V planes of the layer, its sequence's page
// table, and the logical pages [first, last] that hold keys its queries see.
struct Span {
  const uint8_t* k_pool;
  const uint8_t* v_pool;
  const int32_t* table;
  int64_t first, last, lo, first_pos, last_pos;
  size_t page_bytes;

  // Pages n .. n + count - 1 of the span (those that exist) requested into L2.
  __attribute__((always_inline)) void prefetch(int64_t n, int64_t count) const {
    for (int64_t m = n; m <= std::min(last, n + count - 1); ++m) {
      prefetch_page(k_pool + table[m] * page_bytes, page_bytes);
      prefetch_page(v_pool + table[m] * page_bytes, page_bytes);
    }
  }
};

// The first key a query at `pos` sees: after pos - window with a sliding window (window > 0), its chunk's first
// with chunks of -window keys (window < 0, Llama 4's chunked attention), else the first. Never decreases with pos.
inline int64_t first_seen(int64_t pos, int32_t window) {
  if (pos < 0) return 0;
  if (window > 0) return std::max<int64_t>(0, pos - window + 1);
  if (window < 0) return pos - pos % (-static_cast<int64_t>(window));
  return 0;
}

// `elem`: bytes per page element (Page::kBytes).
inline Span block_span(const Problem& p, const Block& b, size_t elem) {
  Span sp;
  const int64_t len = p.kv_lens[b.i], q_len = p.cu_q_lens[b.i + 1] - p.cu_q_lens[b.i];
  sp.first_pos = len - q_len + b.j0;
  sp.last_pos = sp.first_pos + b.nq - 1;
  sp.lo = first_seen(sp.first_pos, p.window);  // the first key any query sees
  sp.page_bytes = static_cast<size_t>(p.s * p.w) * elem;
  sp.k_pool = p.pages + static_cast<size_t>((p.layer * 2 + 0) * p.nk + b.k) * p.np * sp.page_bytes;
  sp.v_pool = p.pages + static_cast<size_t>((p.layer * 2 + 1) * p.nk + b.k) * p.np * sp.page_bytes;
  sp.table = p.page_table + static_cast<int64_t>(b.i) * p.n;
  sp.first = std::max<int64_t>(sp.lo / p.s, b.p0);
  sp.last = std::min<int64_t>(sp.last_pos / p.s, b.p1 - 1);
  return sp;
}

#if defined(__AVX512F__)
// Scores of 4 slots for one or two vectors of 16 query rows: st[t][r] = qt[:, r] . k_t * scales[t],
// with each key value broadcast against the rows (the rows' queries transposed, qt [D][RV]).
template <bool kTwo>
inline void score_tile(const float* qt, int64_t rv, int64_t v, const float* k, int64_t d, const float* scales,
                       float* st) {
  vf a0[4] = {}, a1[4] = {};
  for (int64_t c = 0; c < d; ++c) {
    const vf q0 = vload(qt + c * rv + v * kLanes);
    vf q1 = {};
    if (kTwo) q1 = vload(qt + c * rv + (v + 1) * kLanes);
    for (int i = 0; i < 4; ++i) {
      const float kv = k[i * d + c];
      a0[i] += q0 * kv;
      if (kTwo) a1[i] += q1 * kv;
    }
  }
  for (int i = 0; i < 4; ++i) {
    vstore(st + i * rv + v * kLanes, a0[i] * scales[i]);
    if (kTwo) vstore(st + i * rv + (v + 1) * kLanes, a1[i] * scales[i]);
  }
}

// A prefill block (several queries) as small matrix products: its R = nq x G query rows in the lanes,
// 16 slots of a page at a time. Scores come from each key value broadcast against 16 rows' queries (no
// sums across lanes), the online softmax runs down the rows' lanes, and the weighted sum of values keeps
// 6 rows x 64 columns of sums in registers while each value row is read once. Pages of a multiple of
// 16 slots, head dims of a multiple of 64; attend_block does the rest.
template <typename Page, int G>
void attend_block_tiled(const Problem& p, const Block& b) {
  constexpr int64_t kRowTile = 6;
  const int64_t d = p.d, s = p.s, h = p.nk * G, nq = b.nq, rows = nq * G;
  const int64_t rv = (rows + kLanes - 1) / kLanes * kLanes;  // rows padded to whole vectors
  const int64_t row0 = p.cu_q_lens[b.i] + b.j0;
  const Span sp = block_span(p, b, Page::kBytes);
  thread_local std::vector<float> buffers;  // qt [D, RV], st [16, RV], acc [rows + 6, D], K and V widened [2, S, D]
  buffers.resize(static_cast<size_t>(d * rv + kLanes * rv + (rows + kRowTile) * d + 2 * s * d));
  float* qt = buffers.data();
  float* st = qt + d * rv;
  float* acc = st + kLanes * rv;
  float* k_scratch = acc + (rows + kRowTile) * d;
  float* v_scratch = k_scratch + s * d;
  alignas(64) float mx[kQueriesPerBlock * 16 + kLanes], den[kQueriesPerBlock * 16 + kLanes],
      keep[kQueriesPerBlock * 16 + kLanes], page_max[kQueriesPerBlock * 16 + kLanes];
  alignas(64) int32_t pos[kQueriesPerBlock * 16 + kLanes], from[kQueriesPerBlock * 16 + kLanes];
  float kscale[256] = {}, vscale[256] = {};
  for (int64_t r = 0; r < rv; ++r) {
    const bool live = r < rows;
    pos[r] = live ? static_cast<int32_t>(sp.first_pos + r / G) : -1;  // padding rows see no key
    from[r] = live ? static_cast<int32_t>(first_seen(pos[r], p.window)) : 0;
    mx[r] = kMasked;
    den[r] = 0.0f;
    for (int64_t c = 0; c < d; ++c)
      qt[c * rv + r] = live ? p.q[((row0 + r / G) * h + b.k * G + r % G) * d + c] : 0.0f;
  }
  std::fill_n(acc, (rows + kRowTile) * d, 0.0f);
  sp.prefetch(sp.first, kPrefetchPages);
  for (int64_t n = sp.first; n <= sp.last; ++n) {
    sp.prefetch(n + kPrefetchPages, 1);
    const int64_t page = sp.table[n], base = n * s;
    const int64_t s0 = std::max<int64_t>(sp.lo - base, 0), s1 = std::min<int64_t>(sp.last_pos + 1 - base, s);
    const float* keys = Page::rows(sp.k_pool + page * sp.page_bytes, s0, s1, p.w, k_scratch, kscale);
    const float* values = Page::rows(sp.v_pool + page * sp.page_bytes, s0, s1, p.w, v_scratch, vscale);
    for (int64_t t16 = s0 / kLanes * kLanes; t16 < s1; t16 += kLanes) {
      // Scores of the 16 slots (slots outside [s0, s1) were not widened: their lanes are masked below).
      for (int64_t v = 0; v < rv / kLanes; v += 2)
        for (int64_t t = 0; t < kLanes; t += 4) {
          if (v + 1 < rv / kLanes)
            score_tile<true>(qt, rv, v, keys + (t16 + t) * d, d, kscale + t16 + t, st + t * rv);
          else
            score_tile<false>(qt, rv, v, keys + (t16 + t) * d, d, kscale + t16 + t, st + t * rv);
        }
      // Each row sees the keys from its window's start to its own position.
      for (int64_t t = 0; t < kLanes; ++t) {
        const int32_t kp = static_cast<int32_t>(base + t16 + t);
        float* row = st + t * rv;
#pragma omp simd
        for (int64_t r = 0; r < rv; ++r) row[r] = (kp <= pos[r] && kp >= from[r]) ? row[r] : kMasked;
        if (p.softcap > 0.0f)
          for (int64_t r = 0; r < rv; ++r)
            if (row[r] > kMasked) row[r] = p.softcap * std::tanh(row[r] / p.softcap);
      }
#pragma omp simd
      for (int64_t r = 0; r < rv; ++r) page_max[r] = kMasked;
      for (int64_t t = 0; t < kLanes; ++t) {
        const float* row = st + t * rv;
#pragma omp simd
        for (int64_t r = 0; r < rv; ++r) page_max[r] = std::max(page_max[r], row[r]);
      }
#pragma omp simd
      for (int64_t r = 0; r < rv; ++r) {
        const float new_mx = std::max(mx[r], page_max[r]);
        keep[r] = exp_nonpos(mx[r] - new_mx);
        mx[r] = new_mx;
        den[r] *= keep[r];
      }
      for (int64_t v = 0; v < rv; v += kLanes) {
        const vf m = vload(mx + v);
        vf sum = vload(den + v);
        for (int64_t t = 0; t < kLanes; ++t) {
          const vf x = vload(st + t * rv + v);
          const vf e = x > 0.5f * kMasked ? exp_w(x - m) : vf{};
          vstore(st + t * rv + v, e);
          sum += e;
        }
        vstore(den + v, sum);
      }
      for (int64_t r = 0; r < rows; ++r)
        if (keep[r] != 1.0f) {
          float* a = acc + r * d;
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) a[e] *= keep[r];
        }
      // acc[r] += sum over the widened slots of weight[t][r] * scale[t] * v_t, 6 rows x 64 columns at a time.
      const int64_t tv0 = std::max(s0, t16), tv1 = std::min(s1, t16 + kLanes);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile)
        for (int64_t cg = 0; cg < d; cg += 4 * kLanes) {
          vf o[kRowTile][4];
          for (int i = 0; i < kRowTile; ++i)
            for (int u = 0; u < 4; ++u) o[i][u] = vload(acc + (r0 + i) * d + cg + u * kLanes);
          for (int64_t t = tv0; t < tv1; ++t) {
            const float* vr = values + t * d + cg;
            const float sc = vscale[t];
            const vf v0 = vload(vr) * sc, v1 = vload(vr + kLanes) * sc, v2 = vload(vr + 2 * kLanes) * sc,
                     v3 = vload(vr + 3 * kLanes) * sc;
            const float* w = st + (t - t16) * rv + r0;
            for (int i = 0; i < kRowTile; ++i) {
              const float wi = w[i];
              o[i][0] += wi * v0;
              o[i][1] += wi * v1;
              o[i][2] += wi * v2;
              o[i][3] += wi * v3;
            }
          }
          for (int i = 0; i < kRowTile; ++i)
            for (int u = 0; u < 4; ++u) vstore(acc + (r0 + i) * d + cg + u * kLanes, o[i][u]);
        }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.out + ((row0 + r / G) * h + b.k * G + r % G) * d;
    const float inv = inverse_denominator(p, b.k * G + r % G, mx[r], den[r]);
    const float* a = acc + r * d;
    for (int64_t e = 0; e < d; ++e) out[e] = a[e] * inv;
  }
}
#endif

// One query head's online softmax over a page: the scores of slots [t0, t1) become exp(score - max),
// with `mx` the running max and `den` the running denominator brought up to date; returns the factor
// that scales the sums made before this page. Pages of a multiple of kW slots go kW slots at a time
// (the other slots of those groups are set to 0: never read).
__attribute__((always_inline)) inline float page_softmax(float* sj, int64_t s, int64_t t0, int64_t t1, float& mx,
                                                         float& den) {
#if defined(__AVX2__)
  if (s % kW == 0) {
    vw top = vw{} + mx;
    for (int64_t tw = t0 / kW * kW; tw < t1; tw += kW) {
      const vw x = loadw(sj + tw);
      top = max_where(slot_mask(tw, t0, t1), top, x);
    }
    const float new_mx = max_of(top), keep = exp_nonpos(mx - new_mx);
    const vw m = vw{} + new_mx;
    vw sum = {};
    for (int64_t tw = t0 / kW * kW; tw < t1; tw += kW) {
      const vw e = zero_outside(slot_mask(tw, t0, t1), exp_w(loadw(sj + tw) - m));
      storew(sj + tw, e);
      sum += e;
    }
    mx = new_mx;
    den = den * keep + sum_of(sum);
    return keep;
  }
#endif
  float new_mx = mx;
  for (int64_t t = t0; t < t1; ++t) new_mx = std::max(new_mx, sj[t]);
  const float keep = exp_nonpos(mx - new_mx);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = t0; t < t1; ++t) {
    sj[t] = exp_nonpos(sj[t] - new_mx);
    sum += sj[t];
  }
  mx = new_mx;
  den = den * keep + sum;
  return keep;
}

// The block's queries (each with the G query heads of KV head k) over the pages their keys are on,
// page by page with an online softmax per query head. Query j of a sequence with kv_len keys and q_len
// new tokens sits at position kv_len - q_len + j and sees the keys at positions up to its own (and,
// with a window, after position - window). A decode token is a block of one query. `next` (or null):
// the block whose first pages to request while this one ends.
template <typename Page, int G>
void attend_block(const Problem& p, const Block& b, const Block* next) {
  const int64_t g = G, d = p.d, s = p.s, h = p.nk * G;
  const int64_t len = p.kv_lens[b.i];
#if defined(__AVX512F__)
  if (b.nq > 1 && b.part < 0 && len > 0 && s % kLanes == 0 && d % (4 * kLanes) == 0) {
    attend_block_tiled<Page, G>(p, b);
    return;
  }
#endif
  const int64_t row0 = p.cu_q_lens[b.i] + b.j0;  // token row of the block's first query
  const int64_t nq = b.nq;
  if (len <= 0 && b.part < 0) {  // nothing to attend to (an inactive page group): zeros
    for (int64_t jq = 0; jq < nq; ++jq) std::fill_n(p.out + ((row0 + jq) * h + b.k * g) * d, g * d, 0.0f);
    return;
  }
  thread_local std::vector<float> buffers;  // acc [nq, G, D], scores [nq, G, S], K and V pages widened [2, S, D]
  buffers.resize(static_cast<size_t>(kQueriesPerBlock * G * (d + s) + 2 * s * d));
  float* acc = buffers.data();
  float* scores = acc + kQueriesPerBlock * G * d;
  float* k_scratch = scores + kQueriesPerBlock * G * s;
  float* v_scratch = k_scratch + s * d;
  float mx[kQueriesPerBlock * G], den[kQueriesPerBlock * G];
  float kscale[256] = {}, vscale[256] = {};
  std::fill_n(mx, nq * G, kMasked);
  std::fill_n(den, nq * G, 0.0f);
  std::fill_n(acc, nq * G * d, 0.0f);
  const Span sp = block_span(p, b, Page::kBytes);
  const int64_t first_pos = sp.first_pos, last_pos = sp.last_pos, lo = sp.lo, first = sp.first, last = sp.last;
  const size_t page_bytes = sp.page_bytes;
  const uint8_t *k_pool = sp.k_pool, *v_pool = sp.v_pool;
  const int32_t* table = sp.table;
  // The hardware prefetcher stops at the end of a 4 KiB memory page (and pages may lie anywhere in the
  // pool): the page kPrefetchPages ahead is requested while this one is computed, in four quarters
  // spread over the page's work: half its keys before the scores, the rest after them, half its values
  // before the weighted sum, the rest after it. Each burst is short enough not to stall the core on a
  // full miss queue (one burst of the whole page at the top held the rate at 17-21 GB/s; quarters:
  // 22-45 GB/s, Zen 4). On the block's last pages the stream runs on into the first pages of `next`,
  // the block this thread most likely takes next (a guess: the last-level cache is shared, so a wrong
  // one still serves the thread that takes it). Short blocks keep the memory busy that way: 32 rows at
  // context 128 (8 pages a block) read 1.16-1.20x faster than with the next block's first pages
  // requested in one burst as it is taken (bench.attention_cpu --compare, 2-core Zen 4).
  sp.prefetch(first, kPrefetchPages);  // this block's first pages: in cache already, unless it is the first
  Span after{};
  const bool has_next = next != nullptr && p.kv_lens[next->i] > 0;
  if (has_next) after = block_span(p, *next, Page::kBytes);
  for (int64_t n = first; n <= last; ++n) {
    bool ahead = n + kPrefetchPages <= last;
    const uint8_t* k_ahead = ahead ? k_pool + table[n + kPrefetchPages] * page_bytes : nullptr;
    const uint8_t* v_ahead = ahead ? v_pool + table[n + kPrefetchPages] * page_bytes : nullptr;
    if (!ahead && has_next) {
      const int64_t m = after.first + (n + kPrefetchPages - last - 1);
      if (m <= after.last) {
        ahead = true;
        k_ahead = after.k_pool + after.table[m] * after.page_bytes;
        v_ahead = after.v_pool + after.table[m] * after.page_bytes;
      }
    }
    const size_t half = page_bytes / 128 * 64;  // whole cache lines
    if (ahead) prefetch_page(k_ahead, half);
    const int64_t page = table[n], base = n * s;
    const int64_t s0 = std::max<int64_t>(lo - base, 0), s1 = std::min<int64_t>(last_pos + 1 - base, s);
    const float* keys = Page::rows(k_pool + page * page_bytes, s0, s1, p.w, k_scratch, kscale);
    const float* values = Page::rows(v_pool + page * page_bytes, s0, s1, p.w, v_scratch, vscale);
    for (int64_t jq = 0; jq < nq; ++jq) {
      const int64_t pos = first_pos + jq;
      const int64_t from = first_seen(pos, p.window);
      const int64_t t0 = std::max(s0, from - base), t1 = std::min(s1, pos + 1 - base);
      if (t0 >= t1) continue;
      const float* q = p.q + ((row0 + jq) * h + b.k * g) * d;
      float* sc = scores + jq * G * s;
      float* a = acc + jq * G * d;
      page_scores<G>(q, keys, d, s, t0, t1, kscale, sc);
      if (jq == 0 && ahead) prefetch_page(k_ahead + half, page_bytes - half);
      for (int j = 0; j < G; ++j) {
        float* sj = sc + j * s;
        const int64_t r = jq * G + j;
        if (p.softcap > 0.0f)
          for (int64_t t = t0; t < t1; ++t) sj[t] = p.softcap * std::tanh(sj[t] / p.softcap);
        const float keep = page_softmax(sj, s, t0, t1, mx[r], den[r]);
        if (keep != 1.0f) {
          float* aj = a + j * d;
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) aj[e] *= keep;
        }
      }
      if (jq == 0 && ahead) prefetch_page(v_ahead, half);
      page_values<G>(sc, values, d, s, t0, t1, vscale, a);
      if (jq == 0 && ahead) prefetch_page(v_ahead + half, page_bytes - half);
    }
  }
  if (b.part >= 0) {  // one query: its sums and softmax state, merged in merge_parts
    float* part = p.partials + static_cast<int64_t>(b.part) * G * (d + 2);
    for (int j = 0; j < G; ++j) {
      std::copy_n(acc + j * d, d, part + j * (d + 2));
      part[j * (d + 2) + d] = mx[j];
      part[j * (d + 2) + d + 1] = den[j];
    }
    return;
  }
  for (int64_t jq = 0; jq < nq; ++jq) {
    float* out = p.out + ((row0 + jq) * h + b.k * g) * d;
    for (int j = 0; j < G; ++j) {
      const float inv = inverse_denominator(p, b.k * g + j, mx[jq * G + j], den[jq * G + j]);
      const float* a = acc + (jq * G + j) * d;
      for (int64_t e = 0; e < d; ++e) out[j * d + e] = a[e] * inv;
    }
  }
}

// A decode block split into parts first_part .. first_part + parts - 1 of p.partials.
struct Split {
  int32_t i, k, first_part, parts;
};

// Each split block's output: its parts' sums rescaled to their common max, over their common denominator.
void merge_parts(const Problem& p, const std::vector<Split>& splits) {
  const int64_t d = p.d, g = p.g, h = p.nk * p.g;
  for (const Split& sp : splits) {
    float* out = p.out + (static_cast<int64_t>(p.cu_q_lens[sp.i]) * h + sp.k * g) * d;
    for (int64_t j = 0; j < g; ++j) {
      float m = kMasked;
      for (int32_t q = 0; q < sp.parts; ++q) m = std::max(m, p.partials[((sp.first_part + q) * g + j) * (d + 2) + d]);
      float den = 0.0f;
      float* o = out + j * d;
      std::fill_n(o, d, 0.0f);
      for (int32_t q = 0; q < sp.parts; ++q) {
        const float* part = p.partials + ((sp.first_part + q) * g + j) * (d + 2);
        if (part[d + 1] <= 0.0f) continue;  // a part without keys
        const float w = exp_nonpos(part[d] - m);
        den += part[d + 1] * w;
        for (int64_t e = 0; e < d; ++e) o[e] += part[e] * w;
      }
      const float inv = inverse_denominator(p, sp.k * g + j, m, den);
      for (int64_t e = 0; e < d; ++e) o[e] *= inv;
    }
  }
}

template <typename Page, int G>
void run_group(ffi::ThreadPool& pool, const Problem& p, const std::vector<Block>& blocks, bool helpers_pay) {
  const Block* items = blocks.data();
  const int64_t total = static_cast<int64_t>(blocks.size());
  const int64_t ahead = helpers_pay ? std::max<int64_t>(pool.num_threads(), 1) : 1;  // the next block a thread takes
  jaxcb::parallel_for(pool, total, helpers_pay, [p, items, total, ahead](int64_t item) {
    attend_block<Page, G>(p, items[item], item + ahead < total ? &items[item + ahead] : nullptr);
  });
}

// Query heads per KV head as a compile-time constant, so each head's accumulators stay in registers.
template <typename Page>
bool run(ffi::ThreadPool& pool, const Problem& p, const std::vector<Block>& blocks, bool helpers_pay) {
  switch (p.g) {
    case 1: run_group<Page, 1>(pool, p, blocks, helpers_pay); return true;
    case 2: run_group<Page, 2>(pool, p, blocks, helpers_pay); return true;
    case 3: run_group<Page, 3>(pool, p, blocks, helpers_pay); return true;
    case 4: run_group<Page, 4>(pool, p, blocks, helpers_pay); return true;
    case 5: run_group<Page, 5>(pool, p, blocks, helpers_pay); return true;
    case 6: run_group<Page, 6>(pool, p, blocks, helpers_pay); return true;
    case 7: run_group<Page, 7>(pool, p, blocks, helpers_pay); return true;
    case 8: run_group<Page, 8>(pool, p, blocks, helpers_pay); return true;
    case 12: run_group<Page, 12>(pool, p, blocks, helpers_pay); return true;
    case 16: run_group<Page, 16>(pool, p, blocks, helpers_pay); return true;
    default: return false;
  }
}

ffi::Error RaggedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                               ffi::Buffer<ffi::F32> sinks, float softcap, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 6)
    return ffi::Error::InvalidArgument("ragged_attention: q [T, H, D], pages [L, 2, K, P, S, W]");
  Problem p;
  p.q = q.typed_data();
  p.pages = static_cast<const uint8_t*>(kv_pages.untyped_data());
  const int64_t t = qd[0];
  p.d = qd[2];
  p.nk = kd[2];
  p.np = kd[3];
  p.s = kd[4];
  p.w = kd[5];
  p.g = qd[1] / p.nk;
  p.n = page_table.dimensions()[1];
  p.layer = layer.typed_data()[0];
  p.kv_lens = kv_lens.typed_data();
  p.page_table = page_table.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.window = window.typed_data()[0];
  p.softcap = softcap;
  p.sinks = sinks.dimensions()[0] > 0 ? sinks.typed_data() : nullptr;
  if (p.sinks != nullptr && sinks.dimensions()[0] != qd[1])
    return ffi::Error::InvalidArgument("ragged_attention: one sink per query head");
  p.out = out->typed_data();
  const int64_t m = kv_lens.dimensions()[0];
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], m);
  if (p.s > 256 || p.g * p.nk != qd[1])
    return ffi::Error::InvalidArgument("ragged_attention: unsupported page size or heads");
  if (p.layer < 0 || p.layer >= kd[0]) return ffi::Error::InvalidArgument("ragged_attention: layer out of range");
  size_t elem = 0;
  switch (kv_pages.element_type()) {
    case ffi::DataType::F32: elem = 4; break;
    case ffi::DataType::BF16: elem = 2; break;
    case ffi::DataType::S8: elem = 1; break;
    default: return ffi::Error::InvalidArgument("ragged_attention: pages must be float32, bfloat16 or int8");
  }
  if (p.w != p.d + (elem == 1 ? 4 : 0)) return ffi::Error::InvalidArgument("ragged_attention: page width");
  // Blocks of up to kQueriesPerBlock queries per sequence and KV head; the K/V bytes they read decide
  // whether pool threads are worth waking (below kHelpersBytes a call the caller does it alone).
  std::vector<Block> blocks;
  std::vector<Split> splits;
  std::vector<float> partials;
  int64_t slots = 0;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t q_len = p.cu_q_lens[i + 1] - p.cu_q_lens[i];
    for (int64_t j0 = 0; j0 < q_len; j0 += kQueriesPerBlock) {
      const int64_t nq = std::min(kQueriesPerBlock, q_len - j0);
      for (int64_t k = 0; k < p.nk; ++k)
        blocks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(k), static_cast<int32_t>(j0),
                          static_cast<int32_t>(nq)});
      slots += std::max<int64_t>(0, p.kv_lens[i] - q_len + j0 + nq);
    }
  }
  const int64_t live = seqs > 0 ? std::min<int64_t>(p.cu_q_lens[seqs], t) : 0;
  std::fill(p.out + live * qd[1] * p.d, p.out + t * qd[1] * p.d, 0.0f);  // padding tokens: zeros
  const bool helpers_pay = slots * p.nk * 2 * p.w * static_cast<int64_t>(elem) >= kHelpersBytes;
  const int64_t threads = helpers_pay ? std::max<int64_t>(pool.num_threads(), 1) : 1;
  const int64_t wanted = threads > 1 ? kItemsPerThread * threads : 0;
  if (static_cast<int64_t>(blocks.size()) < wanted) {
    // Split decode blocks along their pages, about evenly, into parts of at least kKeysPerPart keys.
    const int64_t per = (wanted + static_cast<int64_t>(blocks.size()) - 1) / static_cast<int64_t>(blocks.size());
    const int64_t min_pages = std::max<int64_t>(1, (kKeysPerPart + p.s - 1) / p.s);
    std::vector<Block> split_blocks;
    int32_t parts_total = 0;
    for (const Block& b : blocks) {
      const Span sp = block_span(p, b, elem);
      const int64_t first = sp.first, pages = p.kv_lens[b.i] > 0 ? sp.last - sp.first + 1 : 0;
      const int64_t parts = std::min(per, pages / min_pages);
      if (b.nq != 1 || p.cu_q_lens[b.i + 1] - p.cu_q_lens[b.i] != 1 || parts < 2) {
        split_blocks.push_back(b);
        continue;
      }
      splits.push_back({b.i, b.k, parts_total, static_cast<int32_t>(parts)});
      for (int64_t q = 0; q < parts; ++q) {
        Block part = b;
        part.p0 = static_cast<int32_t>(first + pages * q / parts);
        part.p1 = static_cast<int32_t>(first + pages * (q + 1) / parts);
        part.part = parts_total++;
        split_blocks.push_back(part);
      }
    }
    blocks.swap(split_blocks);
    partials.resize(static_cast<size_t>(parts_total) * p.g * (p.d + 2));
  }
  p.partials = partials.data();
  bool ok = elem == 4 ? run<F32Page>(pool, p, blocks, helpers_pay)
            : elem == 2 ? run<BF16Page>(pool, p, blocks, helpers_pay)
                        : run<I8Page>(pool, p, blocks, helpers_pay);
  if (!ok) return ffi::Error::InvalidArgument("ragged_attention: unsupported query heads per KV head");
  merge_parts(p, splits);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbRaggedAttention, RaggedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()          // kv_pages [L, 2, K, P, S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [M + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window []
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H] (gpt-oss), or [0]: none
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, H, D]

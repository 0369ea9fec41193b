// Paged decode attention for the CPU, called from the jitted step through XLA's FFI.
//
// Why a native kernel: in plain JAX, XLA:CPU gathers each page into a temporary, runs small batched
// dots and an online softmax as separate passes, and reads the live K/V at 2.8-5 GB/s. Here one pass
// streams each page once from the pool and does the dots, the softmax and the weighted sum while it is
// in L1, so decode attention runs at the speed memory delivers the pages.
//
// Layout (jaxcb.model.paged_attention): kv_pages [L, 2, K, P, S, W], W = D (float pages) or D + 4
// (int8 pages: D values, then the float32 scale's 4 bytes). Query head h belongs to KV head h / G.
//
// Work: one item per (sequence, KV head) of the step's decode sequences (one query token each);
// items are shared between the calling thread and XLA's intra-op thread pool through an atomic
// counter, so a pool thread that starts late finds nothing left and the caller never waits on a task
// that has not started.
//
// The plain-JAX `ragged_attention` is the oracle (tests/test_cpu_kernel.py).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;
#ifndef PREFETCH_LEVEL
#define PREFETCH_LEVEL 2  // into L2 (prefetcht1): measured 1.7x the rate of prefetching into L1 here
#endif
#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 1
#endif
constexpr int64_t kPrefetchPages = PREFETCH_PAGES;

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

// 16 floats: AVX-512 registers where the build has them, two AVX2 (or four SSE) registers elsewhere.
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;
inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline float hsum(vf v) {  // a tree of halves: 4 dependent adds instead of 16
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// scores[j * S + t] = q_j . k_t * scales[t] for the G query heads, slots [s0, s1).
template <int G>
inline void page_scores(const float* q, const float* k, int64_t d, int64_t s, int64_t s0, int64_t s1,
                        const float* scales, float* scores) {
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
  const float* q;          // [M, H, D], already multiplied by the score scale
  const uint8_t* pages;    // [L, 2, K, P, S, W] of `elem` bytes each
  int64_t layer, nk, np, s, w, d, g, m, n;  // layer, K, P, S, W, D, G, M, N (page-table width)
  const int32_t* kv_lens;  // [M]
  const int32_t* page_table;  // [M, N]
  const int32_t* cu_q_lens;   // [M + 1]
  int32_t num_seqs, window;
  float softcap;
  float* out;  // [M, H, D]
};

inline void prefetch_page(const uint8_t* page, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(page + off, 0, PREFETCH_LEVEL);
}

// Attention of sequence i's one query (the G heads of KV head k) over its live pages, page by page
// with an online softmax.
template <typename Page, int G>
void decode_item(const Problem& p, int64_t i, int64_t k) {
  const int64_t g = G, d = p.d, s = p.s;
  float* out = p.out + (i * p.nk * g + k * g) * d;
  const int64_t len = p.kv_lens[i];
  if (i >= p.num_seqs || p.cu_q_lens[i + 1] - p.cu_q_lens[i] != 1 || len <= 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  const float* q = p.q + (i * p.nk * g + k * g) * d;
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, len - p.window) : 0;  // first visible key
  float mx[G], den[G];
  thread_local std::vector<float> buffers;  // per thread: acc [G, D], scores [G, S], a widened page [S, D]
  buffers.resize(static_cast<size_t>(G * d + G * s + s * d));
  float* acc = buffers.data();
  float* scores = acc + G * d;
  float* scratch = scores + G * s;
  float kscale[256], vscale[256];
  for (int j = 0; j < G; ++j) mx[j] = kMasked, den[j] = 0.0f;
  std::fill(acc, acc + g * d, 0.0f);
  const size_t page_bytes = static_cast<size_t>(s * p.w) * Page::kBytes;
  const uint8_t* k_pool = p.pages + static_cast<size_t>((p.layer * 2 + 0) * p.nk + k) * p.np * page_bytes;
  const uint8_t* v_pool = p.pages + static_cast<size_t>((p.layer * 2 + 1) * p.nk + k) * p.np * page_bytes;
  const int32_t* table = p.page_table + i * p.n;
  const int64_t first = lo / s, last = (len - 1) / s;
  // Pages sit anywhere in the pool, so the hardware prefetcher cannot run ahead across them: the
  // pages kPrefetchPages ahead are requested while this one is computed.
  for (int64_t n = first; n <= std::min(last, first + kPrefetchPages - 1); ++n) {
    prefetch_page(k_pool + table[n] * page_bytes, page_bytes);
    prefetch_page(v_pool + table[n] * page_bytes, page_bytes);
  }
  for (int64_t n = first; n <= last; ++n) {
    if (n + kPrefetchPages <= last) {
      prefetch_page(k_pool + table[n + kPrefetchPages] * page_bytes, page_bytes);
      prefetch_page(v_pool + table[n + kPrefetchPages] * page_bytes, page_bytes);
    }
    const int64_t page = table[n];
    const int64_t s0 = std::max<int64_t>(lo - n * s, 0), s1 = std::min<int64_t>(len - n * s, s);
    const float* keys = Page::rows(k_pool + page * page_bytes, s0, s1, p.w, scratch, kscale);
    page_scores<G>(q, keys, d, s, s0, s1, kscale, scores);
    for (int j = 0; j < G; ++j) {
      float* sj = scores + j * s;
      if (p.softcap > 0.0f)
        for (int64_t t = s0; t < s1; ++t) sj[t] = p.softcap * std::tanh(sj[t] / p.softcap);
      float page_max = kMasked;
      for (int64_t t = s0; t < s1; ++t) page_max = std::max(page_max, sj[t]);
      const float new_mx = std::max(mx[j], page_max);
      const float keep = exp_nonpos(mx[j] - new_mx);
      mx[j] = new_mx;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = s0; t < s1; ++t) {
        sj[t] = exp_nonpos(sj[t] - new_mx);
        sum += sj[t];
      }
      den[j] = den[j] * keep + sum;
      if (keep != 1.0f) {
        float* a = acc + j * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) a[e] *= keep;
      }
    }
    const float* values = Page::rows(v_pool + page * page_bytes, s0, s1, p.w, scratch, vscale);
    page_values<G>(scores, values, d, s, s0, s1, vscale, acc);
  }
  for (int j = 0; j < G; ++j) {
    const float inv = den[j] > 0.0f ? 1.0f / den[j] : 0.0f;
    for (int64_t e = 0; e < d; ++e) out[j * d + e] = acc[j * d + e] * inv;
  }
}

template <typename Page, int G>
void run_group(ffi::ThreadPool& pool, const Problem& p) {
  // Waking a pool thread costs tens of microseconds: below about 1 MiB of K/V a call (a few
  // sequences of short context) the calling thread does all of it (measured: 1 row x 128 tokens ran
  // 3x slower with a helper).
  int64_t slots = 0;
  for (int64_t i = 0; i < std::min<int64_t>(p.m, p.num_seqs); ++i) slots += p.kv_lens[i];
  const bool helpers_pay = slots * p.nk * 2 * p.w * static_cast<int64_t>(Page::kBytes) >= (1 << 20);
  jaxcb::parallel_for(pool, p.m * p.nk, helpers_pay,
               [p](int64_t item) { decode_item<Page, G>(p, item / p.nk, item % p.nk); });
}

// Query heads per KV head as a compile-time constant, so each head's accumulators stay in registers.
template <typename Page>
bool run(ffi::ThreadPool& pool, const Problem& p) {
  switch (p.g) {
    case 1: run_group<Page, 1>(pool, p); return true;
    case 2: run_group<Page, 2>(pool, p); return true;
    case 3: run_group<Page, 3>(pool, p); return true;
    case 4: run_group<Page, 4>(pool, p); return true;
    case 5: run_group<Page, 5>(pool, p); return true;
    case 6: run_group<Page, 6>(pool, p); return true;
    case 7: run_group<Page, 7>(pool, p); return true;
    case 8: run_group<Page, 8>(pool, p); return true;
    case 12: run_group<Page, 12>(pool, p); return true;
    case 16: run_group<Page, 16>(pool, p); return true;
    default: return false;
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window, float softcap,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 6) return ffi::Error::InvalidArgument("paged_decode: q [M,H,D], pages [L,2,K,P,S,W]");
  Problem p;
  p.q = q.typed_data();
  p.pages = static_cast<const uint8_t*>(kv_pages.untyped_data());
  p.m = qd[0];
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
  p.num_seqs = num_seqs.typed_data()[0];
  p.window = window.typed_data()[0];
  p.softcap = softcap;
  p.out = out->typed_data();
  if (p.s > 256 || p.g * p.nk != qd[1])
    return ffi::Error::InvalidArgument("paged_decode: unsupported heads, head dim or page size");
  if (p.layer < 0 || p.layer >= kd[0]) return ffi::Error::InvalidArgument("paged_decode: layer out of range");
  switch (kv_pages.element_type()) {
    case ffi::DataType::F32:
      if (p.w != p.d) return ffi::Error::InvalidArgument("paged_decode: float32 pages must have W = D");
      if (!run<F32Page>(pool, p)) return ffi::Error::InvalidArgument("paged_decode: unsupported query heads per KV head");
      break;
    case ffi::DataType::BF16:
      if (p.w != p.d) return ffi::Error::InvalidArgument("paged_decode: bfloat16 pages must have W = D");
      if (!run<BF16Page>(pool, p)) return ffi::Error::InvalidArgument("paged_decode: unsupported query heads per KV head");
      break;
    case ffi::DataType::S8:
      if (p.w != p.d + 4) return ffi::Error::InvalidArgument("paged_decode: int8 pages must have W = D + 4");
      if (!run<I8Page>(pool, p)) return ffi::Error::InvalidArgument("paged_decode: unsupported query heads per KV head");
      break;
    default:
      return ffi::Error::InvalidArgument("paged_decode: pages must be float32, bfloat16 or int8");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [M, H, D]
                                  .Arg<ffi::AnyBuffer>()          // kv_pages [L, 2, K, P, S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [M + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window []
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, H, D]

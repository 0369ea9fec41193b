// x @ w[layer] for the stacked float32 layer weights, called from inside the layer scan through XLA's FFI.
//
// Why: the step scans over layers with every weight stacked on a leading L axis. XLA:CPU feeds each
// layer's matrix to its dot through a dynamic-slice fusion, i.e. it copies the layer's weights every
// step before reading them (measured: a 30-layer scan of SmolLM2's MLP at 32 rows ran at half the rate
// of the same layers unrolled over separate arrays). This kernel reads the matrix in place from the
// stack, with the layer as an operand, so the weights stream from memory once a step.
//
// The kernel: out [M, N] = x [M, K] @ w [L, K, N][layer]. Ranges of columns are the work items (shared
// with XLA's intra-op pool); within one, the reduction goes in slabs of kKB rows of w, each slab in
// blocks of kNB columns (a kKB x kNB block stays in L1 while every row block of x passes over it),
// kMR rows of x at a time with kMR x kNB accumulators in registers. Columns past the last whole block
// take a plain loop.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxcb::kLanes;
using jaxcb::vf;
using jaxcb::vload;
using jaxcb::vstore;
constexpr int kNV = 2;                // vectors of columns per block
constexpr int kNB = kNV * kLanes;     // columns per block (a work item)
constexpr int kMR = 8;                // rows of x per micro-kernel call
constexpr int64_t kKB = 128;          // rows of w per slab (kKB x kNB floats = 16 KiB)

// c[0:R, 0:kNB] (+)= a[0:R, 0:kn] @ b[0:kn, 0:kNB]; `first`: c starts at zero.
template <int R>
inline void micro(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t kn,
                  bool first) {
  vf acc[R][kNV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kNV; ++i) acc[r][i] = first ? vf{} : vload(c + r * ldc + i * kLanes);
  for (int64_t k = 0; k < kn; ++k) {
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

// c[m0:m, :] for one block of columns and one slab of w: whole 8-row blocks, then the remaining rows
// with a micro-kernel of their own count (a row at a time would re-read the slab once per row).
inline void rows(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n, int64_t k0, int64_t kn,
                 int64_t n0) {
  const bool first = k0 == 0;
  int64_t m0 = 0;
  for (; m0 + kMR <= m; m0 += kMR) micro<kMR>(a + m0 * k + k0, k, b + k0 * n + n0, n, c + m0 * n + n0, n, kn, first);
  const float* am = a + m0 * k + k0;
  const float* bm = b + k0 * n + n0;
  float* cm = c + m0 * n + n0;
  switch (m - m0) {
    case 1: micro<1>(am, k, bm, n, cm, n, kn, first); break;
    case 2: micro<2>(am, k, bm, n, cm, n, kn, first); break;
    case 3: micro<3>(am, k, bm, n, cm, n, kn, first); break;
    case 4: micro<4>(am, k, bm, n, cm, n, kn, first); break;
    case 5: micro<5>(am, k, bm, n, cm, n, kn, first); break;
    case 6: micro<6>(am, k, bm, n, cm, n, kn, first); break;
    case 7: micro<7>(am, k, bm, n, cm, n, kn, first); break;
    default: break;
  }
}

// Columns [n0, n1) of the output (whole kNB blocks): slab by slab, so that each row of a slab is read
// as one contiguous run of up to `wide` columns rather than 128 bytes at a time.
void column_range(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n, int64_t n0, int64_t n1) {
  for (int64_t k0 = 0; k0 < k; k0 += kKB) {
    const int64_t kn = std::min(kKB, k - k0);
    for (int64_t j = n0; j < n1; j += kNB) rows(a, b, c, m, k, n, k0, kn, j);
  }
}

void column_tail(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n, int64_t n0) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = n0; j < n; ++j) {
      float s = 0.0f;
      for (int64_t e = 0; e < k; ++e) s += a[i * k + e] * b[e * n + j];
      c[i * n + j] = s;
    }
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("layer_matmul: x [M, K] and w [L, K, N]");
  const int64_t m = xd[0], k = xd[1], n = wd[2], l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
  const float* a = x.typed_data();
  const float* b = w.typed_data() + static_cast<size_t>(l) * k * n;
  float* c = out->typed_data();
  // Work items: ranges of `wide` columns, a multiple of kNB between kNB and 256, about a quarter of
  // the whole blocks so that both threads get work.
  const int64_t whole = n / kNB * kNB;
  const int64_t wide = std::max<int64_t>(kNB, std::min<int64_t>(256, whole / 4 / kNB * kNB));
  const int64_t items = (whole + wide - 1) / wide;
  jaxcb::parallel_for(pool, items, m * k * n >= (1 << 16), [=](int64_t i) {
    column_range(a, b, c, m, k, n, i * wide, std::min(whole, (i + 1) * wide));
  });
  if (whole < n) column_tail(a, b, c, m, k, n, whole);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [L, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]

// Shared by the native CPU kernels' int8 paths (w8a8's layer matmul and head): activations rounded to int8
// per block, as jaxcb.model.quant.quantize_activations rounds them, and VNNI's byte dot product.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace jaxcb {

// One block of n values: q = round(x * 127 / max |x|) (half to even), its scale max |x| / 127 and sum(q).
#ifdef __AVX512F__
inline void quantize_block(const float* x, int64_t n, int8_t* q, float& scale, int32_t& sum) {
  const auto mask = [n](int64_t e) {
    return n - e >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - e)) - 1);
  };
  __m512 amax = _mm512_setzero_ps();
  for (int64_t e = 0; e < n; e += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask(e), x + e)));
  const float top = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  __m512i total = _mm512_setzero_si512();
  for (int64_t e = 0; e < n; e += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask(e), x + e), inv));
    total = _mm512_add_epi32(total, v);
    _mm512_mask_cvtsepi32_storeu_epi8(q + e, mask(e), v);
  }
  scale = top / 127.0f;
  sum = _mm512_reduce_add_epi32(total);
}
#else
inline void quantize_block(const float* x, int64_t n, int8_t* q, float& scale, int32_t& sum) {
  float top = 0.0f;
  for (int64_t e = 0; e < n; ++e) top = std::max(top, std::fabs(x[e]));
  const float inv = top > 0.0f ? 127.0f / top : 0.0f;
  int32_t total = 0;
  for (int64_t e = 0; e < n; ++e) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[e] * inv));
    q[e] = static_cast<int8_t>(v);
    total += v;
  }
  scale = top / 127.0f;
  sum = total;
}
#endif

// x [m, k] quantized per row and block of `block` input rows (the layer matmul: a divisor of its slabs; the
// head: its rows' group): q [m, k], scale and sum of q [m, blocks].
struct XQuant {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  int64_t block, blocks;
};

inline XQuant quantize_rows(const float* a, int64_t m, int64_t k, int64_t block) {
  XQuant x;
  x.block = block, x.blocks = (k + block - 1) / block;
  x.q.resize(m * k), x.scale.resize(m * x.blocks), x.sum.resize(m * x.blocks);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < x.blocks; ++b) {
      const int64_t k0 = b * block;
      quantize_block(a + i * k + k0, std::min(block, k - k0), x.q.data() + i * k + k0, x.scale[i * x.blocks + b],
                     x.sum[i * x.blocks + b]);
    }
  return x;
}

// x as its quantized values, in floats (the path without VNNI, and columns past the last whole block).
inline std::vector<float> dequantized_rows(const XQuant& x, int64_t m, int64_t k) {
  std::vector<float> out(m * k);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t e = 0; e < k; ++e) out[i * k + e] = x.q[i * k + e] * x.scale[i * x.blocks + e / x.block];
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// acc += the four byte products of each 32-bit lane (u unsigned, s signed), in place: through the
// intrinsic, GCC 12 copied every accumulator to another register each step (as many moves as products,
// SmolLM2's up projection at 32 rows 1.3x slower).
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#endif

}  // namespace jaxcb

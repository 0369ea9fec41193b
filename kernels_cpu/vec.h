// Shared by the native CPU kernels: 16-float vectors through GCC's vector extensions (AVX-512 registers
// where the build has them, two AVX2 or four SSE registers elsewhere), loaded and stored unaligned, and
// the widening loads of the narrow formats (16 int8, 16 unsigned 4-bit values, 16 float16 or bfloat16) written
// with the ISA's conversion instructions: GCC 12 turns __builtin_convertvector on bytes into one scalar
// conversion per lane.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace jaxcb {

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;
inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

// The sum of the 16 lanes as a tree of halves: 4 dependent adds instead of 16 (a lane-by-lane loop is
// one chain of 16 adds, which held the head's small-batch blocks back).
inline float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// 16 int32 lanes (one __m512i, or two __m256i) to floats.
#if defined(__AVX512F__)
inline vf from_i8(__m128i b) { return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))); }
inline vf from_u8(__m128i b) { return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))); }
inline vf from_f16(const uint16_t* p) {
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline vf join(__m256 lo, __m256 hi) {
  vf r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
inline vf from_i8(__m128i b) {
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
inline vf from_u8(__m128i b) {
  return join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
inline vf from_f16(const uint16_t* p) {
  return join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
}
#else
#define JAXCB_SCALAR_CONVERSIONS 1
#endif

#ifdef JAXCB_SCALAR_CONVERSIONS
inline vf load_i8(const int8_t* p) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r[i] = p[i];
  return r;
}
inline void load_u4(const uint8_t* p, vf& lo, vf& hi) {
  for (int i = 0; i < kLanes; ++i) lo[i] = p[i] & 15, hi[i] = p[i] >> 4;
}
inline vf load_f16(const uint16_t* p) {
  vf r;
  for (int i = 0; i < kLanes; ++i) {
    _Float16 h;
    std::memcpy(&h, p + i, 2);
    r[i] = static_cast<float>(h);
  }
  return r;
}
#else
// 16 int8 values as floats.
inline vf load_i8(const int8_t* p) { return from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 16 bytes of two 4-bit values each: the low nibbles and the high nibbles as floats.
inline void load_u4(const uint8_t* p, vf& lo, vf& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  lo = from_u8(_mm_and_si128(b, mask));
  hi = from_u8(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}
// 16 float16 values as floats.
inline vf load_f16(const uint16_t* p) { return from_f16(p); }
#endif

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
// x rounded to the nearest bfloat16, ties to even (finite values), as a float.
inline float round_bf16(float x) {
  uint32_t b = bits_of(x);
  b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
// a and b rounded to bfloat16 in one 32-bit lane (a in the low half), as vdpbf16ps reads a pair.
inline uint32_t bf16_pair(float a, float b) {
  return (bits_of(round_bf16(a)) >> 16) | (bits_of(round_bf16(b)) & 0xFFFF0000u);
}

// 16 bfloat16 values as floats (a bfloat16 is a float32's top half: exact).
inline vf load_bf16(const uint16_t* p) {
  typedef uint16_t v16 __attribute__((vector_size(32), aligned(2)));
  typedef uint32_t v32 __attribute__((vector_size(64)));
  const v32 wide = __builtin_convertvector(*reinterpret_cast<const v16*>(p), v32) << 16;
  return reinterpret_cast<vf>(wide);
}

}  // namespace jaxcb

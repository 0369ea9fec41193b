// Shared by the native CPU kernels: 16-float vectors through GCC's vector extensions (AVX-512 registers
// where the build has them, two AVX2 or four SSE registers elsewhere), loaded and stored unaligned.
#pragma once

namespace jaxcb {

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;
inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

}  // namespace jaxcb

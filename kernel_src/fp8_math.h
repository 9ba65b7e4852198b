// Per-row FP8 (float8_e4m3fn) quantization math: scale = max(amax, 1e-12) / 448 and
// q = e4m3(round-to-nearest-even(clamp(y / scale, -448, 448))), fp32 throughout. The CPU
// twins compute it as written here; the CUDA kernels reach the same bits without its
// divisions (fp8_cuda.cuh) and share its constants and amax step.
#pragma once

#if !defined(__CUDACC__)
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#endif

#if defined(__CUDACC__)
#define LTX_FP8_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LTX_FP8_HOST_DEVICE inline
#endif

namespace ltx {

// The largest finite float8_e4m3fn.
constexpr float kFp8E4m3Max = 448.f;
// The smallest amax a scale is made from: an all-zero row gets a finite, nonzero scale.
constexpr float kFp8MinAmax = 1e-12f;

// The running max |y| of a row with |y| = a: NaN once any element is NaN (as torch.amax),
// which makes the row's scale, and so every q of the row, NaN.
LTX_FP8_HOST_DEVICE float fp8_amax_step(float running, float a) { return (a > running || a != a) ? a : running; }

// The row's scale from its amax (NaN stays NaN, as torch.clamp).
LTX_FP8_HOST_DEVICE float fp8_scale_of(float amax) {
  const float clamped = amax < kFp8MinAmax ? kFp8MinAmax : amax;
  return clamped / kFp8E4m3Max;
}

// y / scale (IEEE division: no fast-math build flag) clamped to e4m3's range; NaN stays NaN.
LTX_FP8_HOST_DEVICE float fp8_scaled(float y, float scale) {
  const float q = y / scale;
  return q < -kFp8E4m3Max ? -kFp8E4m3Max : q > kFp8E4m3Max ? kFp8E4m3Max : q;
}

#if !defined(__CUDACC__)
// The CPU twins' row: q[k] = e4m3(fp8_scaled(y[k], scale)) (c10's conversion rounds to
// nearest even; the clamp keeps every finite value in range, as CUDA's saturating one), the
// scale *static_scale, or made from the row's amax and stored at *scale_out.
template <typename V>
inline void fp8_quantize_row(const V* y, int64_t n, c10::Float8_e4m3fn* q, float* scale_out,
                             const float* static_scale) {
  float scale;
  if (static_scale != nullptr) {
    scale = *static_scale;
  } else {
    float amax = 0.f;
    for (int64_t k = 0; k < n; ++k) amax = fp8_amax_step(amax, std::abs(static_cast<float>(y[k])));
    scale = fp8_scale_of(amax);
    *scale_out = scale;
  }
  for (int64_t k = 0; k < n; ++k) q[k] = c10::Float8_e4m3fn(fp8_scaled(static_cast<float>(y[k]), scale));
}
#endif

}  // namespace ltx

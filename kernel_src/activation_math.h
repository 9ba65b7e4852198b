// GELU in fp32, shared by the CUDA kernels and their CPU twins (same formulas as
// torch.nn.functional.gelu: exact erf form, or the tanh approximation).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define LTX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LTX_HOST_DEVICE inline
#endif

namespace ltx {

LTX_HOST_DEVICE float gelu_erf(float x) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  return 0.5f * x * (1.f + erff(x * kInvSqrt2));
}

LTX_HOST_DEVICE float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCoeff = 0.044715f;
  return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + kCoeff * x * x * x)));
}

// d gelu / dx.
LTX_HOST_DEVICE float gelu_erf_grad(float x) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  constexpr float kInvSqrt2Pi = 0.39894228040143268f;
  return 0.5f * (1.f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}

LTX_HOST_DEVICE float gelu_tanh_grad(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCoeff = 0.044715f;
  const float t = tanhf(kSqrt2OverPi * (x + kCoeff * x * x * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kCoeff * x * x);
}

}  // namespace ltx

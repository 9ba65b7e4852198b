// GELU in fp32, shared by the CUDA kernels and their CPU twins (the functions of
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

// sigmoid(z) = 1 / (1 + e^-z): one exp and one reciprocal. On the GPU the hardware
// approximations (__expf, __fdividef: a few fp32 ulps) make the tanh-GELU kernels
// memory-bound; tanhf's ~20 instructions per element made them compute-bound on the H200.
// Limits hold: e^-z = inf gives 0, e^-z = 0 gives 1.
LTX_HOST_DEVICE float sigmoid(float z) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.f, 1.f + __expf(-z));
#else
  return 1.f / (1.f + std::exp(-z));
#endif
}

// The tanh approximation's argument u; 0.5 * (1 + tanh(u)) = sigmoid(2u).
LTX_HOST_DEVICE float gelu_tanh_arg(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCoeff = 0.044715f;
  return kSqrt2OverPi * (x + kCoeff * x * x * x);
}

LTX_HOST_DEVICE float gelu_tanh(float x) { return x * sigmoid(2.f * gelu_tanh_arg(x)); }

// d gelu / dx.
LTX_HOST_DEVICE float gelu_erf_grad(float x) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  constexpr float kInvSqrt2Pi = 0.39894228040143268f;
  return 0.5f * (1.f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}

// d/dx x * s(x), s = sigmoid(2u): s + x * 2 u' * s * (1 - s). The factor s * (1 - s),
// exactly 0 for |x| past ~10, comes before u' (inf once x * x overflows), so that the
// result is 0 or 1 there as PyTorch's is, not inf * 0.
LTX_HOST_DEVICE float gelu_tanh_grad(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCoeff = 0.044715f;
  const float s = sigmoid(2.f * gelu_tanh_arg(x));
  const float du = kSqrt2OverPi * (1.f + 3.f * kCoeff * x * x);
  return s + 2.f * x * s * (1.f - s) * du;
}

}  // namespace ltx

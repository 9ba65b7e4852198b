// GELU in fp32, shared by the CUDA kernels and their CPU twins (the functions of
// torch.nn.functional.gelu: exact erf form, or the tanh approximation).
#pragma once

#include <cmath>
#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cstdint>
#endif

#if defined(__CUDACC__)
#define LTX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LTX_HOST_DEVICE inline
#endif

namespace ltx {

#if !defined(__CUDA_ARCH__)
// The host's selects, 2^x and e^x in fp32 from arithmetic alone, so that the CPU twins'
// GELU loops vectorise at -O3 on baseline x86-64: GCC neither vectorises a call to exp2f
// or expf nor, under its default -ftrapping-math, a ternary whose arms it cannot evaluate
// unconditionally (it threads a clamp's branches into constant results).
namespace host_math {

// c ? a : b as a bit mask, which GCC keeps a select.
inline float select(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & mask) | (std::bit_cast<uint32_t>(b) & ~mask));
}

constexpr float kRoundShift = 12582912.f;  // 1.5 * 2^23: x + it holds round(x) in its low bits

// 2^r's Taylor coefficients, ln(2)^k / k!: degree 7, truncation under 4e-9 relative for
// |r| <= 1/2.
constexpr float kPow2Taylor[] = {1.f, 6.931471805599453e-01f, 2.402265069591007e-01f, 5.550410866482158e-02f,
                                 9.618129107628477e-03f, 1.333355814642844e-03f, 1.540353039338161e-04f,
                                 1.525273380405984e-05f};

// Horner steps of 2^r's polynomial, coefficients HI down to LO, from p (the value of those
// above HI): in parts, so that a CPU twin can give each a pass.
template <int HI, int LO>
inline float pow2_poly(float p, float r) {
  for (int k = HI; k >= LO; --k) p = p * r + kPow2Taylor[k];
  return p;
}

// p * 2^n, n in [-252, 254] read from the low bits of shifted = n + kRoundShift, as two
// exponent-field factors, so that a subnormal result rounds once and one out of range is 0
// or inf.
inline float times_pow2(float p, float shifted) {
  const uint32_t n = std::bit_cast<uint32_t>(shifted) - std::bit_cast<uint32_t>(kRoundShift);
  const uint32_t half = static_cast<uint32_t>(static_cast<int32_t>(n) >> 1);  // floor(n / 2)
  return p * std::bit_cast<float>((half + 127u) << 23) * std::bit_cast<float>((n - half + 127u) << 23);
}

// 2^r * 2^n for |r| <= 1/2 (n as times_pow2 reads it). Over a scan of the floats: within 1.2
// ulps of 2^x (e^x: 1.4).
inline float pow2_scaled(float r, float shifted) {
  return times_pow2(pow2_poly<6, 0>(kPow2Taylor[7], r), shifted);
}

inline float clamp(float x, float lo, float hi) {  // NaN compares false and stays NaN
  return select(x > hi, hi, select(x < lo, lo, x));
}

// exp2's first half: x clamped and split as n + r, |r| <= 1/2, n held in shifted's low
// bits; pow2_scaled(r, shifted) is 2^x. Apart, so that a CPU twin can give each a pass.
inline float exp2_reduce(float x, float& shifted) {
  x = clamp(x, -252.f, 254.f);
  shifted = x + kRoundShift;
  return x - (shifted - kRoundShift);
}

inline float exp2(float x) {
  float shifted;
  const float r = exp2_reduce(x, shifted);
  return pow2_scaled(r, shifted);
}

inline float exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo; n * hi is exact
  x = clamp(x, -174.f, 174.f);
  const float shifted = x * kLog2e + kRoundShift;
  const float n = shifted - kRoundShift;
  return pow2_scaled(((x - n * kLn2Hi) - n * kLn2Lo) * kLog2e, shifted);
}

}  // namespace host_math
#endif

// 2^x: the GPU's ex2.approx (2 ulps; subnormal results flushed to 0), the host's host_math::exp2.
LTX_HOST_DEVICE float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return host_math::exp2(x);
#endif
}

constexpr float kHalfLog2e = 0.72134752044448170f;  // log2(e) / 2: e^(-x^2/2) = 2^(-kHalfLog2e x^2)

#if !defined(__CUDA_ARCH__)
// Phi(x) from lower = Phi(-|x|): normal_cdf's last step on the host.
inline float normal_cdf_from_tail(float x, float lower) { return host_math::select(x < 0.f, lower, 1.f - lower); }
#endif

// Phi(x), the standard normal CDF (exact GELU is x * Phi(x)), without erf. For t = |x|,
// Phi(-t) = 2^(-kHalfLog2e t^2 + Q(t)) with Q = log2(erfcx(t / sqrt 2) / 2) smooth enough
// for one polynomial on [0, 6] (tools/fit_normal_cdf.py): eleven FMAs and one exp2, no
// branch. erff evaluates its two pieces' polynomials behind a select per coefficient, and
// left the erf GELU kernels compute-bound (docs/decisions.md). Relative error in fp32:
// under 5e-7 for x > -1, 3.5e-6 down to x = -6 (1 + erff loses it to cancellation there:
// 5e-4 near x = -4). Past |x| = 6, Q stays at Q(6), which overestimates Phi(-t) (below
// 1e-9 there), while the t^2 term still takes it to 0. The multiply-adds are written
// plainly: nvcc contracts them to FMAs, where std::fma is a software routine on a host
// compiled without FMA (a 7x slower CPU twin).
//
// The CPU twins evaluate it in parts, a pass each (a loop holding the whole chain waits on
// its latency): kUpperQ is Q's Horner value down to coefficient kSplit, kTail goes on from it
// (q_upper) to the exponent, log2 Phi(-|x|), which exp2 and normal_cdf_from_tail finish.
// Parts of one function, not functions of their own: with the polynomial in a function of
// its own, nvcc compiles its first step to a multiply and a subtract instead of an FMA,
// other bits on the GPU.
enum class CdfPart { kWhole, kUpperQ, kTail };
template <CdfPart PART = CdfPart::kWhole>
LTX_HOST_DEVICE float normal_cdf(float x, float q_upper = 0.f) {
  constexpr float kQ[] = {-9.999996424e-01f, -1.151119351e+00f, 2.622302771e-01f,  -5.271166191e-02f,
                          7.299972698e-03f,  -2.607100469e-04f, -1.642475836e-04f, 4.527329293e-05f,
                          -5.938421509e-06f, 4.146658341e-07f,  -1.231696611e-08f};
  constexpr int kDegree = sizeof(kQ) / sizeof(kQ[0]) - 1;
  const float t = std::fabs(x);
#if defined(__CUDA_ARCH__)
  const float t_fit = std::fmin(t, 6.f);
#else
  const float t_fit = host_math::select(t < 6.f, t, 6.f);  // fmin(t, 6), NaN giving 6
#endif
  constexpr int kSplit = 5;  // kUpperQ and kTail take five Horner steps each: even passes
  constexpr int kFirst = PART == CdfPart::kTail ? kSplit - 1 : kDegree - 1;
  constexpr int kLast = PART == CdfPart::kUpperQ ? kSplit : 0;
  float q = PART == CdfPart::kTail ? q_upper : kQ[kDegree];
#pragma unroll
  for (int k = kFirst; k >= kLast; --k) q = q * t_fit + kQ[k];
  if constexpr (PART == CdfPart::kUpperQ) return q;
  const float tail = -kHalfLog2e * (t * t) + q;
  if constexpr (PART == CdfPart::kTail) return tail;
  const float lower = exp2_approx(tail);  // Phi(-t); NaN stays NaN
#if defined(__CUDA_ARCH__)
  return x < 0.f ? lower : 1.f - lower;
#else
  return normal_cdf_from_tail(x, lower);
#endif
}

LTX_HOST_DEVICE float gelu_erf(float x) { return x * normal_cdf(x); }

// sigmoid(z) = 1 / (1 + e^-z): one exp and one reciprocal. On the GPU the hardware
// approximations (__expf, __fdividef: a few fp32 ulps) make the tanh-GELU kernels
// memory-bound; tanhf's ~20 instructions per element made them compute-bound on the H200.
// Limits hold: e^-z = inf gives 0, e^-z = 0 gives 1.
LTX_HOST_DEVICE float sigmoid(float z) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.f, 1.f + __expf(-z));
#else
  return 1.f / (1.f + host_math::exp(-z));
#endif
}

// The tanh approximation's argument u; 0.5 * (1 + tanh(u)) = sigmoid(2u).
LTX_HOST_DEVICE float gelu_tanh_arg(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCoeff = 0.044715f;
  return kSqrt2OverPi * (x + kCoeff * x * x * x);
}

// sigmoid(2u): gelu_tanh(x) is x times it. On the GPU e^-2u is 2^(x (c1 + c2 x^2)), the
// constants folded (three instructions for the argument, six unfolded) and ex2.approx.ftz
// (one; the non-ftz form adds three for subnormals, whose 2^x is 1 and whose results
// leave 1 + e^-2u as it is). As accurate as the unfolded form (within 2e-6 relative of
// fp64 over [-12, 12] before the approximations' ulps), fewer instructions for the
// compute-bound GELU-to-FP8 kernels.
LTX_HOST_DEVICE float gelu_tanh_sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  constexpr float kC1 = -2.302208198f;  // -2 sqrt(2 / pi) log2(e)
  constexpr float kC2 = -0.1029432416f; // kC1 * 0.044715
  return __fdividef(1.f, 1.f + exp2_approx(x * (kC2 * (x * x) + kC1)));
#else
  return sigmoid(2.f * gelu_tanh_arg(x));
#endif
}

LTX_HOST_DEVICE float gelu_tanh(float x) { return x * gelu_tanh_sigmoid(x); }

// d gelu / dx = Phi(x) + x phi(x), phi(x) = 2^(-kHalfLog2e x^2 + log2(1 / sqrt(2 pi))); from
// Phi(x) already computed (gelu's own), or computing it.
LTX_HOST_DEVICE float gelu_erf_grad(float x, float phi) {
  constexpr float kLog2InvSqrt2Pi = -1.32574806473616424f;
  return phi + x * exp2_approx(-kHalfLog2e * (x * x) + kLog2InvSqrt2Pi);
}

LTX_HOST_DEVICE float gelu_erf_grad(float x) { return gelu_erf_grad(x, normal_cdf(x)); }

// d/dx x * s(x), s = sigmoid(2u): s + x * 2 u' * s * (1 - s), from s or computing it. The
// factor s * (1 - s), exactly 0 for |x| past ~10, comes before u' (inf once x * x
// overflows), so that the result is 0 or 1 there as PyTorch's is, not inf * 0.
LTX_HOST_DEVICE float gelu_tanh_grad(float x, float s) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  constexpr float kCoeff = 0.044715f;
  const float du = kSqrt2OverPi * (1.f + 3.f * kCoeff * x * x);
  return s + 2.f * x * s * (1.f - s) * du;
}

LTX_HOST_DEVICE float gelu_tanh_grad(float x) { return gelu_tanh_grad(x, gelu_tanh_sigmoid(x)); }

}  // namespace ltx

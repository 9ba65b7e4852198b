// The GELU family on the CPU: the twin of activation.cu, same fp32 formulas and one
// rounding, rows spread over threads; float64 tensors take the exact formulas in double.
#include <ATen/Parallel.h>

#include "activation.h"
#include "activation_math.h"

#include <cmath>

namespace ltx {

// float64 (CPU only, for gradcheck and fp64 references): erf and tanh themselves, where
// fp32 takes activation_math.h's fitted forms; overloads beside those, so that the type
// picks.
inline constexpr double kInvSqrt2 = 0.70710678118654752440;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;
inline constexpr double kSqrt2OverPi = 0.79788456080286535588;
inline constexpr double kTanhCoeff = 0.044715;

inline double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2)); }
inline double gelu_erf_grad(double x) {
  // e^y as 1 + expm1(y): glibc's exp symbol needs 2.29, past manylinux_2_28 (within 1e-16)
  return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * (1.0 + std::expm1(-0.5 * x * x));
}
inline double gelu_tanh(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kTanhCoeff * x * x * x))); }
inline double gelu_tanh_grad(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kTanhCoeff * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kTanhCoeff * x * x);
}

namespace {

template <typename T, Gelu GELU>
void run(const ActivationArgs& a) {
  using A = acc_t<T>;
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
  const T* grad = static_cast<const T*>(a.grad);
  T* out = static_cast<T*>(a.out);
  T* up_grad = static_cast<T*>(a.up_grad);
  const int64_t grain = std::max<int64_t>(1, 32768 / a.cols);
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate + r * a.gate_stride;
      const T* u = up != nullptr ? up + r * a.up_stride : nullptr;
      const T* dy = grad != nullptr ? grad + r * a.grad_stride : nullptr;
      T* y = out + r * a.out_stride;
      T* du = up_grad != nullptr ? up_grad + r * a.up_grad_stride : nullptr;
      for (int64_t k = 0; k < a.cols; ++k) {
        const A x = static_cast<A>(g[k]);
        const A f = GELU == Gelu::kTanh ? gelu_tanh(x) : gelu_erf(x);
        const A m = u != nullptr ? static_cast<A>(u[k]) : A(1);
        if (dy != nullptr) {
          const A d = static_cast<A>(dy[k]);
          y[k] = static_cast<T>(d * m * (GELU == Gelu::kTanh ? gelu_tanh_grad(x) : gelu_erf_grad(x)));
          if (du != nullptr) du[k] = static_cast<T>(d * f);
        } else {
          y[k] = static_cast<T>(f * m);
        }
      }
    }
  });
}

}  // namespace

void run_activation_cpu(const ActivationArgs& a) {
  LTX_DISPATCH_CPU_FLOAT_TYPES(a.dtype, "activation", [&] {
    return a.gelu == Gelu::kTanh ? run<scalar_t, Gelu::kTanh>(a) : run<scalar_t, Gelu::kErf>(a);
  });
}

}  // namespace ltx

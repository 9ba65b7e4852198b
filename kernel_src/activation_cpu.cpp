// The GELU family on the CPU: the twin of activation.cu, same fp32 formulas and one
// rounding, rows spread over threads.
#include <ATen/Parallel.h>

#include "activation.h"
#include "activation_math.h"

namespace ltx {
namespace {

template <typename T, Gelu GELU>
void run(const ActivationArgs& a) {
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
        const float x = static_cast<float>(g[k]);
        const float f = GELU == Gelu::kTanh ? gelu_tanh(x) : gelu_erf(x);
        const float m = u != nullptr ? static_cast<float>(u[k]) : 1.f;
        if (dy != nullptr) {
          const float d = static_cast<float>(dy[k]);
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
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "activation", [&] {
    return a.gelu == Gelu::kTanh ? run<scalar_t, Gelu::kTanh>(a) : run<scalar_t, Gelu::kErf>(a);
  });
}

}  // namespace ltx

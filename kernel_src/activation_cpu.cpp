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
  T* out = static_cast<T*>(a.out);
  const int64_t grain = std::max<int64_t>(1, 32768 / a.cols);
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate + r * a.gate_stride;
      const T* u = up != nullptr ? up + r * a.up_stride : nullptr;
      T* y = out + r * a.out_stride;
      for (int64_t k = 0; k < a.cols; ++k) {
        const float x = static_cast<float>(g[k]);
        float f = GELU == Gelu::kTanh ? gelu_tanh(x) : gelu_erf(x);
        if (u != nullptr) f *= static_cast<float>(u[k]);
        y[k] = static_cast<T>(f);
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

// FP8 quantization on the CPU: the twin of fp8.cu, the same fp32 math (fp8_math.h's
// fp8_quantize_row), rows spread over threads. A GELU source computes the row's fp32 values
// first, as activation_cpu.cpp does before its rounding.
#include "activation_math.h"
#include "cpu_parallel.h"
#include "fp8.h"
#include "fp8_math.h"

#include <algorithm>
#include <vector>

namespace ltx {
namespace {

template <typename T>
void quantize_rows(const Fp8Args& a, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    fp8_quantize_row(static_cast<const T*>(a.input) + r * a.input_stride, a.cols,
                     reinterpret_cast<c10::Float8_e4m3fn*>(a.out) + r * a.cols,
                     a.scales != nullptr ? a.scales + r : nullptr, a.static_scale);
  }
}

// gelu(x) [* up] of each row into an fp32 row (one loop per step, as activation_cpu.cpp's
// passes), then the row's quantization.
template <typename T, Fp8Source S>
void quantize_gelu_rows(const Fp8Args& a, int64_t begin, int64_t end) {
  std::vector<float> y(a.cols);
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.input) + r * a.input_stride;
    for (int64_t k = 0; k < a.cols; ++k) {
      const float v = static_cast<float>(x[k]);
      y[k] = S == Fp8Source::kGeluTanh ? gelu_tanh(v) : gelu_erf(v);
    }
    if (a.up != nullptr) {
      const T* up = static_cast<const T*>(a.up) + r * a.up_stride;
      for (int64_t k = 0; k < a.cols; ++k) y[k] *= static_cast<float>(up[k]);
    }
    fp8_quantize_row(y.data(), a.cols, reinterpret_cast<c10::Float8_e4m3fn*>(a.out) + r * a.cols,
                     a.scales != nullptr ? a.scales + r : nullptr, a.static_scale);
  }
}

}  // namespace

void run_quantize_fp8_cpu(const Fp8Args& a) {
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "quantize_fp8", [&] {
    using T = scalar_t;
    // About 32k elements per task, as the norms' CPU twins; 8k for a GELU, as the GELU ops'.
    const int64_t grain = std::max<int64_t>(1, (a.source == Fp8Source::kInput ? 32768 : 8192) / a.cols);
    parallel_rows(0, a.rows, grain, [&](int64_t begin, int64_t end) {
      switch (a.source) {
        case Fp8Source::kInput: return quantize_rows<T>(a, begin, end);
        case Fp8Source::kGeluErf: return quantize_gelu_rows<T, Fp8Source::kGeluErf>(a, begin, end);
        case Fp8Source::kGeluTanh: return quantize_gelu_rows<T, Fp8Source::kGeluTanh>(a, begin, end);
      }
    });
  });
}

}  // namespace ltx

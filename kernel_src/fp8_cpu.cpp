// FP8 quantization on the CPU: the twin of fp8.cu, the same fp32 math (fp8_math.h), rows
// spread over threads. c10's conversion rounds to nearest even; the clamp before it keeps
// every finite value in e4m3's range, as the CUDA kernels' saturating conversion does.
#include "cpu_parallel.h"
#include "fp8.h"
#include "fp8_math.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>

namespace ltx {
namespace {

template <typename T>
void quantize_rows(const Fp8Args& a, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.input) + r * a.input_stride;
    c10::Float8_e4m3fn* q = reinterpret_cast<c10::Float8_e4m3fn*>(a.out) + r * a.cols;
    float scale;
    if (a.static_scale != nullptr) {
      scale = *a.static_scale;
    } else {
      float amax = 0.f;
      for (int64_t k = 0; k < a.cols; ++k) amax = fp8_amax_step(amax, std::abs(static_cast<float>(x[k])));
      scale = fp8_scale_of(amax);
      a.scales[r] = scale;
    }
    for (int64_t k = 0; k < a.cols; ++k) q[k] = c10::Float8_e4m3fn(fp8_scaled(static_cast<float>(x[k]), scale));
  }
}

}  // namespace

void run_quantize_fp8_cpu(const Fp8Args& a) {
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "quantize_fp8", [&] {
    // About 32k elements per task, as the norms' CPU twins.
    const int64_t grain = std::max<int64_t>(1, 32768 / a.cols);
    parallel_rows(0, a.rows, grain, [&](int64_t begin, int64_t end) { quantize_rows<scalar_t>(a, begin, end); });
  });
}

}  // namespace ltx

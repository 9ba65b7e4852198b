// FP8 quantization on the CPU: the twin of fp8.cu, the same fp32 math (fp8_math.h's
// fp8_quantize_row), rows spread over threads.
#include "cpu_parallel.h"
#include "fp8.h"
#include "fp8_math.h"

#include <algorithm>

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

}  // namespace

void run_quantize_fp8_cpu(const Fp8Args& a) {
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "quantize_fp8", [&] {
    // About 32k elements per task, as the norms' CPU twins.
    const int64_t grain = std::max<int64_t>(1, 32768 / a.cols);
    parallel_rows(0, a.rows, grain, [&](int64_t begin, int64_t end) { quantize_rows<scalar_t>(a, begin, end); });
  });
}

}  // namespace ltx

// RMSNorm forward on the CPU: the twin of rms_norm.cu, same math and rounding
// (fp32 accumulation, one rounding at the end), rows spread over threads.
#include <ATen/Parallel.h>

#include "rms_norm.h"

#include <cmath>

namespace ltx {
namespace {

// Independent partial sums so that the compiler can vectorise the reduction
// without reassociating one running sum.
constexpr int64_t kLanes = 16;

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, const RmsNormProblem& p, int64_t begin,
                   int64_t end) {
  const int64_t n = p.cols;
  for (int64_t row = begin; row < end; ++row) {
    const T* xr = x + row * p.x_stride;
    T* yr = out + row * p.out_stride;
    float partial[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        const float f = static_cast<float>(xr[j + l]);
        partial[l] += f * f;
      }
    }
    for (; j < n; ++j) {
      const float f = static_cast<float>(xr[j]);
      partial[0] += f * f;
    }
    float sum_sq = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) sum_sq += partial[l];
    const float rstd = 1.f / std::sqrt(sum_sq * p.inv_cols + p.eps);
    if (weight != nullptr) {
      for (int64_t k = 0; k < n; ++k) {
        yr[k] = static_cast<T>(static_cast<float>(xr[k]) * rstd * static_cast<float>(weight[k]));
      }
    } else {
      for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<T>(static_cast<float>(xr[k]) * rstd);
    }
  }
}

}  // namespace

void rms_norm_out_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                      double eps) {
  const RmsNormProblem p = check_rms_norm(out, input, weight, eps, c10::DeviceType::CPU);
  if (p.rows == 0) return;
  // About 32k elements per task: enough work to amortise a thread hand-off.
  const int64_t grain = std::max<int64_t>(1, 32768 / p.cols);
  LTX_DISPATCH_FLOAT_TYPES(input.scalar_type(), "rms_norm", [&] {
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* w = weight ? weight->const_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
      rms_norm_rows(y, x, w, p, begin, end);
    });
  });
}

}  // namespace ltx

// The norm family on the CPU: the twin of norm.cu, same math and roundings (fp32
// accumulation, the residual sum rounded to the input dtype, one rounding at the end),
// rows spread over threads.
#include <ATen/Parallel.h>

#include "norm.h"

#include <cmath>
#include <vector>

namespace ltx {
namespace {

// Independent partial sums so that the compiler can vectorise the reduction without
// reassociating one running sum.
constexpr int64_t kLanes = 16;

float sum_of(const float* v, int64_t n, float shift, bool square) {
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float f = v[j + l] - shift;
      partial[l] += square ? f * f : f;
    }
  }
  for (; j < n; ++j) {
    const float f = v[j] - shift;
    partial[0] += square ? f * f : f;
  }
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += partial[l];
  return s;
}

template <typename T>
const T* row_of(const void* base, int64_t row, int64_t stride) {
  return base == nullptr ? nullptr : static_cast<const T*>(base) + row * stride;
}

template <typename T>
const T* modulation_row(const Modulation& m, int64_t batch, int64_t token) {
  return m.ptr == nullptr ? nullptr
                          : static_cast<const T*>(m.ptr) + batch * m.batch_stride + token * m.token_stride;
}

template <typename T, typename W, typename O>
void norm_rows(const NormArgs& a, int64_t begin, int64_t end) {
  const int64_t n = a.cols;
  std::vector<float> v(n);  // the row in fp32, after the residual add
  for (int64_t r = begin; r < end; ++r) {
    const int64_t batch = r / a.tokens;
    const int64_t token = r - batch * a.tokens;
    const T* x = row_of<T>(a.input, r, a.input_stride);
    const T* res = row_of<T>(a.residual, r, a.residual_stride);
    const T* gate = modulation_row<T>(a.gate, batch, token);
    if (res != nullptr) {
      T* res_out = static_cast<T*>(a.residual_out) + r * a.residual_out_stride;
      for (int64_t k = 0; k < n; ++k) {
        const float g = gate != nullptr ? static_cast<float>(gate[k]) : 1.f;
        const T s = static_cast<T>(static_cast<float>(res[k]) + static_cast<float>(x[k]) * g);
        res_out[k] = s;
        v[k] = static_cast<float>(s);
      }
    } else {
      for (int64_t k = 0; k < n; ++k) v[k] = static_cast<float>(x[k]);
    }
    if (a.kind == NormKind::kNone) continue;

    float mean = 0.f;
    if (a.kind == NormKind::kLayer) mean = sum_of(v.data(), n, 0.f, false) * a.inv_cols;
    const float rstd = 1.f / std::sqrt(sum_of(v.data(), n, mean, true) * a.inv_cols + a.eps);

    const W* w = static_cast<const W*>(a.weight);
    const T* scale = modulation_row<T>(a.scale, batch, token);
    const T* shift = modulation_row<T>(a.shift, batch, token);
    O* y = static_cast<O*>(a.out) + r * a.out_stride;
    for (int64_t k = 0; k < n; ++k) {
      float f = (v[k] - mean) * rstd;
      if (a.cast_before_weight) f = static_cast<float>(static_cast<T>(f));
      if (w != nullptr) f *= a.weight_offset + static_cast<float>(w[k]);
      if (scale != nullptr) f = f * (1.f + static_cast<float>(scale[k])) + static_cast<float>(shift[k]);
      y[k] = static_cast<O>(f);
    }
  }
}

template <typename T, typename W, typename O>
void run(const NormArgs& a) {
  // About 32k elements per task: enough work to amortise a thread hand-off.
  const int64_t grain = std::max<int64_t>(1, 32768 / a.cols);
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) { norm_rows<T, W, O>(a, begin, end); });
}

}  // namespace

void run_norm_cpu(const NormArgs& a) {
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm", [&] {
    using T = scalar_t;
    if (a.weight_fp32 && a.out_fp32) return run<T, float, float>(a);
    if (a.weight_fp32) return run<T, float, T>(a);
    return run<T, T, T>(a);
  });
}

}  // namespace ltx

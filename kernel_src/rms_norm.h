// RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * weight, fp32 math,
// one rounding to the output dtype at the end (as torch.nn.functional.rms_norm).
// Shared by the CUDA and CPU entry points so both validate identically.
#pragma once

#include "common.h"

#include <limits>

namespace ltx {

// Torch-free description of one launch; pointers are typed by the dispatch.
struct RmsNormProblem {
  int64_t rows;
  int64_t cols;        // normalised dim D
  int64_t x_stride;    // elements between rows of x
  int64_t out_stride;  // elements between rows of out
  float eps;
  float inv_cols;      // 1 / cols: a multiply, where a division would call a slow-path routine
};

inline RmsNormProblem check_rms_norm(const at::Tensor& out, const at::Tensor& x,
                                     const std::optional<at::Tensor>& weight, double eps,
                                     c10::DeviceType device) {
  constexpr const char* op = "rms_norm";
  check_device(x, device, op, "input");
  check_float_dtype(x, op, "input");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": input must have a non-empty last dim, got sizes ",
              x.sizes());
  check_same_device(out, x, op, "out", "input");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), op, ": out has dtype ", out.scalar_type(),
              " but input has dtype ", x.scalar_type());
  TORCH_CHECK(out.sizes() == x.sizes(), op, ": out has sizes ", out.sizes(),
              " but input has sizes ", x.sizes());
  if (weight.has_value()) {
    const at::Tensor& w = *weight;
    check_same_device(w, x, op, "weight", "input");
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight has dtype ", w.scalar_type(),
                " but input has dtype ", x.scalar_type());
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight must have shape [",
                x.size(-1), "] (the input's last dim), got ", w.sizes());
    TORCH_CHECK(w.stride(0) == 1 || w.size(0) == 1, op, ": weight must be contiguous, got stride ",
                w.stride(0));
  }
  TORCH_CHECK(x.size(-1) <= std::numeric_limits<int32_t>::max(), op, ": last dim ", x.size(-1),
              " is too large (at most 2^31 - 1)");
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  const RowView xv = row_view(x, op, "input");
  const RowView ov = row_view(out, op, "out");
  return {xv.rows, xv.cols, xv.row_stride, ov.row_stride, static_cast<float>(eps),
          1.0f / static_cast<float>(xv.cols)};
}

// Entry points: write rms_norm(input) into `out` (same sizes and dtype as input).
void rms_norm_out_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                      double eps);
#if defined(CUDA_KERNEL)
void rms_norm_out_cuda(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                       double eps);
#endif

}  // namespace ltx

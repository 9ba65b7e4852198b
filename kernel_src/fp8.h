// FP8 producers for torch._scaled_mm with row-wise scales: ops that compute a row's fp32
// result and write it as float8_e4m3fn with an fp32 scale per row (fp8_math.h):
//   quantize_fp8(x)                 the row itself (a GEMM input with no producer before it);
//   rms_norm_fp8(x, weight, ...)    the fp32 value rms_norm(..., out_dtype=float32) returns;
//   adaln_fp8(x, scale, shift, ...)  AdaLN's fp32 value before its rounding;
//   gated_residual_adaln_fp8(...)   gated_residual_adaln's normed output, the sum in x's dtype;
//   gelu_fp8, gelu_mul_fp8, geglu_fp8  the GELU family's fp32 value (activation.h).
// Each has a static form taking one fp32 scale for the whole tensor instead. Entry points
// are templates over the backend (see norm.h) so the CUDA and CPU ops validate identically.
#pragma once

#include "activation.h"
#include "common.h"
#include "fp8_math.h"
#include "norm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ltx {

// What a quantized row holds: the input itself, or its GELU (times up) in fp32 as the GELU
// ops compute it before their rounding.
enum class Fp8Source { kInput, kGeluErf, kGeluTanh };

// Quantizes rows of fp32/fp16/bf16 values: out[r, :] = e4m3(clamp(y[r, :] / s_r)), y the
// source's value of input (and up), s_r = scales[r] made from the row's amax, or
// *static_scale for every row.
struct Fp8Args {
  at::ScalarType dtype = at::kFloat;  // the input's
  c10::Device device = c10::Device(c10::kCPU);
  Fp8Source source = Fp8Source::kInput;
  const void* input = nullptr;         // [rows, cols], rows input_stride apart
  const void* up = nullptr;            // [rows, cols], rows up_stride apart (GELU sources), or nullptr
  uint8_t* out = nullptr;              // [rows, cols] contiguous float8_e4m3fn
  float* scales = nullptr;             // [rows] (dynamic), or nullptr
  const float* static_scale = nullptr; // one element (static), or nullptr
  int64_t rows = 0, cols = 0, input_stride = 0, up_stride = 0;
};

void run_quantize_fp8_cpu(const Fp8Args& args);
#if defined(CUDA_KERNEL)
void run_quantize_fp8_cuda(const Fp8Args& args);
// Refuses a GPU below compute capability 8.9 (FP8 GEMMs need sm_89+).
void check_fp8_cuda_capability(const char* op, c10::Device device);
#endif

struct CpuFp8 {
  static constexpr c10::DeviceType device = c10::kCPU;
  static void check_capability(const char*, c10::Device) {}
  static void run(const Fp8Args& a) { run_quantize_fp8_cpu(a); }
  static void run(const NormArgs& a) { run_norm_cpu(a); }
};
#if defined(CUDA_KERNEL)
struct CudaFp8 {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static void check_capability(const char* op, c10::Device d) { check_fp8_cuda_capability(op, d); }
  static void run(const Fp8Args& a) { run_quantize_fp8_cuda(a); }
  static void run(const NormArgs& a) { run_norm_cuda(a); }
};
#endif

namespace fp8_detail {

// The input's device, the GPU's capability, then its dtype: FP8 has no float64 meaning.
template <class Backend>
void check_input(const at::Tensor& input, const char* op, const char* arg = "input") {
  check_device(input, Backend::device, op, arg);
  Backend::check_capability(op, input.device());
  const at::ScalarType d = input.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": ", arg, " has dtype ", d,
              "; expected float32, float16 or bfloat16");
  TORCH_CHECK(input.dim() >= 1, op, ": ", arg, " must have at least 1 dim, got a 0-dim tensor");
  TORCH_CHECK(input.size(-1) <= std::numeric_limits<int32_t>::max(), op, ": last dim ", input.size(-1),
              " is too large (at most 2^31 - 1)");
}

inline void check_static_scale(const at::Tensor& scale, const at::Tensor& input, const char* op,
                               const char* arg = "scale", const char* input_arg = "input") {
  check_same_device(scale, input, op, arg, input_arg);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, op, ": ", arg,
              " must be a float32 tensor of one element (the whole tensor's scale), got ",
              scale.scalar_type(), " of sizes ", scale.sizes());
}

// The per-row scales' sizes: the input's with a last dim of 1.
inline std::vector<int64_t> scales_sizes(const at::Tensor& input) {
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = 1;
  return sizes;
}

// q (and, dynamic, the scales) of `input`'s rows, which are `values`' rows: input itself,
// or the fp32 rows an op computed from it.
template <class Backend>
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& input, const at::Tensor& values,
                                                 const at::Tensor* static_scale, const char* op,
                                                 Fp8Source source = Fp8Source::kInput, const at::Tensor* up = nullptr,
                                                 const char* arg = "input") {
  at::Tensor q = at::empty(input.sizes(), input.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = static_scale != nullptr ? at::Tensor()
                                              : at::empty(scales_sizes(input), input.options().dtype(at::kFloat));
  const RowView v = row_view(values, op, arg);
  Fp8Args a;
  a.dtype = values.scalar_type();
  a.device = values.device();
  a.source = source;
  a.input = values.const_data_ptr();
  a.input_stride = v.row_stride;
  if (up != nullptr) {
    a.up = up->const_data_ptr();
    a.up_stride = row_view(*up, op, "up").row_stride;
  }
  a.rows = v.rows;
  a.cols = v.cols;
  a.out = static_cast<uint8_t*>(q.mutable_data_ptr());
  if (static_scale != nullptr) {
    a.static_scale = static_scale->const_data_ptr<float>();
  } else {
    a.scales = scales.mutable_data_ptr<float>();
  }
  if (a.rows > 0 && a.cols > 0) {
    Backend::run(a);
  } else if (a.scales != nullptr && scales.numel() > 0) {  // rows of no columns: amax 0
    scales.fill_(static_cast<double>(fp8_scale_of(0.f)));
  }
  return {q, scales};
}

}  // namespace fp8_detail

template <class Backend>
std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& input) {
  constexpr const char* op = "quantize_fp8";
  fp8_detail::check_input<Backend>(input, op);
  return fp8_detail::quantize_rows<Backend>(input, input, nullptr, op);
}

template <class Backend>
at::Tensor quantize_fp8_static(const at::Tensor& input, const at::Tensor& scale) {
  constexpr const char* op = "quantize_fp8_static";
  fp8_detail::check_input<Backend>(input, op);
  fp8_detail::check_static_scale(scale, input, op);
  return std::get<0>(fp8_detail::quantize_rows<Backend>(input, input, &scale, op));
}

namespace fp8_detail {

// The FP8 outputs of a norm op: q and, dynamic, the scales, pointed to from `a`. Rows of no
// columns run nothing: their scales are amax 0's.
inline std::tuple<at::Tensor, at::Tensor> norm_outputs(NormArgs& a, const at::Tensor& input,
                                                       const at::Tensor* static_scale) {
  at::Tensor q = at::empty(input.sizes(), input.options().dtype(at::kFloat8_e4m3fn));
  a.out_fp8 = true;
  a.out = q.mutable_data_ptr();
  a.out_stride = a.cols;
  if (static_scale != nullptr) {
    a.fp8_static_scale = static_scale->const_data_ptr<float>();
    return {q, at::Tensor()};
  }
  at::Tensor scales = at::empty(scales_sizes(input), input.options().dtype(at::kFloat));
  a.fp8_scales = scales.mutable_data_ptr<float>();
  if (a.rows == 0 && scales.numel() > 0) scales.fill_(static_cast<double>(fp8_scale_of(0.f)));
  return {q, scales};
}

// rms_norm's fp32 result, as rms_norm(input, weight', eps, ..., out_dtype=float32) computes
// it with weight' the weight in fp32 (a 16-bit weight converts exactly; no weight is ones
// and no offset, and times 1 changes no bit), quantized in the same pass: the norm kernels'
// FP8 output mode, whose launch is the fp32 out's, so that its bits are rms_norm's.
template <class Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_fp8(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                                double eps, double weight_offset, bool cast_before_weight,
                                                const at::Tensor* static_scale, const char* op) {
  check_input<Backend>(input, op);
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.weight(weight, /*fp32_allowed=*/true);
  norm_detail::check_eps(eps, op);
  if (static_scale != nullptr) check_static_scale(*static_scale, input, op);
  std::optional<at::Tensor> weight_fp32 = weight;
  if (is_16bit(input.scalar_type())) {  // an fp32 out takes an fp32 weight
    if (!weight.has_value()) weight_offset = 0.0;  // no weight: no offset either, as rms_norm
    weight_fp32 = weight.has_value() ? weight->to(at::kFloat) : at::ones({input.size(-1)}, input.options().dtype(at::kFloat));
    c.weight(weight_fp32, /*fp32_allowed=*/true);
    a.out_fp32 = true;
  }
  a.eps = static_cast<float>(eps);
  a.weight_offset = static_cast<float>(weight_offset);
  a.cast_before_weight = cast_before_weight;
  auto outputs = norm_outputs(a, input, static_scale);
  if (a.rows > 0) Backend::run(a);
  return outputs;
}

}  // namespace fp8_detail

template <class Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_fp8(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                                double eps, double weight_offset, bool cast_before_weight) {
  return fp8_detail::rms_norm_fp8<Backend>(input, weight, eps, weight_offset, cast_before_weight, nullptr,
                                           "rms_norm_fp8");
}

template <class Backend>
at::Tensor rms_norm_fp8_static(const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps,
                               double weight_offset, bool cast_before_weight, const at::Tensor& scale) {
  return std::get<0>(fp8_detail::rms_norm_fp8<Backend>(input, weight, eps, weight_offset, cast_before_weight, &scale,
                                                       "rms_norm_fp8_static"));
}

namespace fp8_detail {

// The AdaLN part of adaln_fp8: norm kind, eps, scale and shift
// as adaln checks them (q is fresh: no overlap), then the static scale.
inline void adaln_args(NormArgs& a, norm_detail::Checker& c, const at::Tensor& input, const at::Tensor& scale,
                       const at::Tensor& shift, double eps, const std::string& norm, const at::Tensor* static_scale,
                       const char* op) {
  a.kind = norm_detail::parse_kind(norm, op);
  norm_detail::check_eps(eps, op);
  a.scale = c.modulation(scale, "scale");
  a.shift = c.modulation(shift, "shift");
  a.eps = static_cast<float>(eps);
  if (static_scale != nullptr) check_static_scale(*static_scale, input, op, "fp8_scale");
}

// adaln's y before its rounding to the input dtype (norm(x) * (1 + scale) + shift in fp32),
// quantized in the same pass.
template <class Backend>
std::tuple<at::Tensor, at::Tensor> adaln_fp8(const at::Tensor& input, const at::Tensor& scale,
                                             const at::Tensor& shift, double eps, const std::string& norm,
                                             const at::Tensor* static_scale, const char* op) {
  check_input<Backend>(input, op);
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.batch_tokens();
  adaln_args(a, c, input, scale, shift, eps, norm, static_scale, op);
  auto outputs = norm_outputs(a, input, static_scale);
  if (a.rows > 0) Backend::run(a);
  return outputs;
}

}  // namespace fp8_detail

template <class Backend>
std::tuple<at::Tensor, at::Tensor> adaln_fp8(const at::Tensor& input, const at::Tensor& scale,
                                             const at::Tensor& shift, double eps, const std::string& norm) {
  return fp8_detail::adaln_fp8<Backend>(input, scale, shift, eps, norm, nullptr, "adaln_fp8");
}

template <class Backend>
at::Tensor adaln_fp8_static(const at::Tensor& input, const at::Tensor& scale, const at::Tensor& shift, double eps,
                            const std::string& norm, const at::Tensor& fp8_scale) {
  return std::get<0>(
      fp8_detail::adaln_fp8<Backend>(input, scale, shift, eps, norm, &fp8_scale, "adaln_fp8_static"));
}

namespace fp8_detail {

// gated_residual_adaln's results: residual_out = residual + input * gate in input's dtype,
// as there, and the AdaLN of that sum in fp32 (the value gated_residual_adaln rounds to the
// dtype), quantized in the same pass. The outputs are fresh: nothing to overlap.
template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_residual_adaln_fp8(
    const at::Tensor& residual, const at::Tensor& input, const at::Tensor& gate, const at::Tensor& scale,
    const at::Tensor& shift, double eps, const std::string& norm, const at::Tensor* static_scale, const char* op) {
  check_input<Backend>(input, op);
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.batch_tokens();
  a.residual_stride = c.like_input(residual, "residual", a.dtype);
  a.residual = residual.const_data_ptr();
  a.gate = c.modulation(gate, "gate");
  adaln_args(a, c, input, scale, shift, eps, norm, static_scale, op);
  at::Tensor residual_out = at::empty(input.sizes(), input.options());
  a.residual_out = residual_out.mutable_data_ptr();
  a.residual_out_stride = a.cols;
  auto [q, scales] = norm_outputs(a, input, static_scale);
  if (a.rows > 0) Backend::run(a);
  return {residual_out, q, scales};
}

}  // namespace fp8_detail

template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_residual_adaln_fp8(const at::Tensor& residual,
                                                                        const at::Tensor& input, const at::Tensor& gate,
                                                                        const at::Tensor& scale, const at::Tensor& shift,
                                                                        double eps, const std::string& norm) {
  return fp8_detail::gated_residual_adaln_fp8<Backend>(residual, input, gate, scale, shift, eps, norm, nullptr,
                                                       "gated_residual_adaln_fp8");
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> gated_residual_adaln_fp8_static(const at::Tensor& residual, const at::Tensor& input,
                                                                   const at::Tensor& gate, const at::Tensor& scale,
                                                                   const at::Tensor& shift, double eps,
                                                                   const std::string& norm,
                                                                   const at::Tensor& fp8_scale) {
  auto [residual_out, q, scales] = fp8_detail::gated_residual_adaln_fp8<Backend>(
      residual, input, gate, scale, shift, eps, norm, &fp8_scale, "gated_residual_adaln_fp8_static");
  return {residual_out, q};
}

namespace fp8_detail {

// gelu(gate) [* up] in fp32, the value the GELU ops round to gate's dtype, quantized in the
// same pass: gate checked as quantize_fp8's input (gate_arg naming it), up as the GELU ops
// check it.
template <class Backend>
std::tuple<at::Tensor, at::Tensor> gelu_fp8(const at::Tensor& gate, const at::Tensor* up, const std::string& approximate,
                                            const at::Tensor* static_scale, const char* op, const char* gate_arg) {
  check_input<Backend>(gate, op, gate_arg);
  const Fp8Source source =
      activation_detail::parse_gelu(approximate, op) == Gelu::kTanh ? Fp8Source::kGeluTanh : Fp8Source::kGeluErf;
  if (up != nullptr) {
    check_same_device(*up, gate, op, "up", gate_arg);
    TORCH_CHECK(up->scalar_type() == gate.scalar_type(), op, ": up has dtype ", up->scalar_type(), " but ", gate_arg,
                " has dtype ", gate.scalar_type());
    TORCH_CHECK(up->sizes() == gate.sizes(), op, ": up has sizes ", up->sizes(), " but expected ", gate.sizes());
  }
  if (static_scale != nullptr) check_static_scale(*static_scale, gate, op, "scale", gate_arg);
  return quantize_rows<Backend>(gate, gate, static_scale, op, source, up, gate_arg);
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> geglu_fp8(const at::Tensor& input, const std::string& approximate,
                                             const at::Tensor* static_scale, const char* op) {
  check_input<Backend>(input, op);
  const auto [value, gate] = activation_detail::geglu_halves(input, op);
  return gelu_fp8<Backend>(gate, &value, approximate, static_scale, op, "input");
}

}  // namespace fp8_detail

template <class Backend>
std::tuple<at::Tensor, at::Tensor> gelu_fp8(const at::Tensor& input, const std::string& approximate) {
  return fp8_detail::gelu_fp8<Backend>(input, nullptr, approximate, nullptr, "gelu_fp8", "input");
}

template <class Backend>
at::Tensor gelu_fp8_static(const at::Tensor& input, const std::string& approximate, const at::Tensor& scale) {
  return std::get<0>(fp8_detail::gelu_fp8<Backend>(input, nullptr, approximate, &scale, "gelu_fp8_static", "input"));
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> gelu_mul_fp8(const at::Tensor& gate, const at::Tensor& up,
                                                const std::string& approximate) {
  return fp8_detail::gelu_fp8<Backend>(gate, &up, approximate, nullptr, "gelu_mul_fp8", "gate");
}

template <class Backend>
at::Tensor gelu_mul_fp8_static(const at::Tensor& gate, const at::Tensor& up, const std::string& approximate,
                               const at::Tensor& scale) {
  return std::get<0>(fp8_detail::gelu_fp8<Backend>(gate, &up, approximate, &scale, "gelu_mul_fp8_static", "gate"));
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> geglu_fp8(const at::Tensor& input, const std::string& approximate) {
  return fp8_detail::geglu_fp8<Backend>(input, approximate, nullptr, "geglu_fp8");
}

template <class Backend>
at::Tensor geglu_fp8_static(const at::Tensor& input, const std::string& approximate, const at::Tensor& scale) {
  return std::get<0>(fp8_detail::geglu_fp8<Backend>(input, approximate, &scale, "geglu_fp8_static"));
}

}  // namespace ltx

// The GELU family of feed-forward activations, elementwise over rows:
//   gelu(x)                GELU (erf or tanh approximation): LTX, FLUX, SD3 feed-forwards;
//   gelu_mul(gate, up)     gelu(gate) * up from two tensors: Gemma's MLP;
//   geglu(x)               x = [value | gate] on the last dim, value * gelu(gate):
//                          diffusers' GEGLU (the gate is the SECOND half).
// fp32 math, one rounding to the input dtype. Entry points are templates over the
// backend (see norm.h) so the CUDA and CPU ops validate identically.
#pragma once

#include "common.h"

#include <ATen/ops/empty.h>

#include <limits>
#include <string>
#include <utility>

namespace ltx {

enum class Gelu { kErf, kTanh };

// Forward: out = gelu(gate) [* up]. Backward (grad set): out = grad * gelu'(gate) [* up],
// the gate's grad, and up_grad = grad * gelu(gate), the up operand's grad.
struct ActivationArgs {
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  Gelu gelu = Gelu::kErf;
  void* out = nullptr;         // [rows, cols]
  const void* gate = nullptr;  // [rows, cols]: the GELU's argument
  const void* up = nullptr;    // [rows, cols] multiplied in, or nullptr (plain GELU)
  const void* grad = nullptr;  // [rows, cols] the output's grad (backward), or nullptr
  void* up_grad = nullptr;     // [rows, cols] (backward with up), or nullptr
  int64_t rows = 0, cols = 0;
  int64_t out_stride = 0, gate_stride = 0, up_stride = 0, grad_stride = 0, up_grad_stride = 0;
};

void run_activation_cpu(const ActivationArgs& args);
#if defined(CUDA_KERNEL)
void run_activation_cuda(const ActivationArgs& args);
#endif

struct CpuActivation {
  static constexpr c10::DeviceType device = c10::kCPU;
  static void run(const ActivationArgs& a) { run_activation_cpu(a); }
};
#if defined(CUDA_KERNEL)
struct CudaActivation {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static void run(const ActivationArgs& a) { run_activation_cuda(a); }
};
#endif

namespace activation_detail {

inline Gelu parse_gelu(const std::string& approximate, const char* op) {
  if (approximate == "none") return Gelu::kErf;
  if (approximate == "tanh") return Gelu::kTanh;
  TORCH_CHECK(false, op, ": approximate must be \"none\" or \"tanh\", got \"", approximate, "\"");
}

// out = gelu(gate) [* up], or with grad the backward (see ActivationArgs); every tensor of
// one shape, dtype and device. gate_arg is what messages call gate: the op's own name for
// that argument.
template <class Backend>
void run_checked(const char* op, at::Tensor& out, const at::Tensor& gate, const at::Tensor* up,
                 const std::string& approximate, const char* gate_arg = "input", const at::Tensor* grad = nullptr,
                 at::Tensor* up_grad = nullptr) {
  check_device(gate, Backend::device, op, gate_arg);
  check_float_dtype(gate, op, gate_arg);
  TORCH_CHECK(gate.dim() >= 1, op, ": ", gate_arg, " must have at least 1 dim");
  ActivationArgs a;
  a.gelu = parse_gelu(approximate, op);
  a.dtype = gate.scalar_type();
  a.device = gate.device();
  const RowView g = row_view(gate, op, gate_arg);
  TORCH_CHECK(g.cols <= std::numeric_limits<int32_t>::max(), op, ": last dim ", g.cols,
              " is too large (at most 2^31 - 1)");
  a.rows = g.rows;
  a.cols = g.cols;
  a.gate = gate.const_data_ptr();
  a.gate_stride = g.row_stride;
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{&out, "out"}, {up, "up"}, {grad, "grad"},
                               {up_grad, "up_grad"}}) {
    if (t == nullptr) continue;
    check_same_device(*t, gate, op, arg, gate_arg);
    TORCH_CHECK(t->scalar_type() == a.dtype, op, ": ", arg, " has dtype ", t->scalar_type(),
                " but ", gate_arg, " has dtype ", a.dtype);
    TORCH_CHECK(t->sizes() == gate.sizes(), op, ": ", arg, " has sizes ", t->sizes(), " but expected ",
                gate.sizes());
  }
  check_output_overlap(out, {{&gate, gate_arg}, {up, "up"}}, op, "out");
  a.out = out.mutable_data_ptr();
  a.out_stride = row_view(out, op, "out").row_stride;
  if (up != nullptr) {
    a.up = up->const_data_ptr();
    a.up_stride = row_view(*up, op, "up").row_stride;
  }
  if (grad != nullptr) {
    a.grad = grad->const_data_ptr();
    a.grad_stride = row_view(*grad, op, "grad").row_stride;
  }
  if (up_grad != nullptr) {
    a.up_grad = up_grad->mutable_data_ptr();
    a.up_grad_stride = row_view(*up_grad, op, "up_grad").row_stride;
  }
  if (a.rows > 0 && a.cols > 0) Backend::run(a);
}

}  // namespace activation_detail

template <class Backend>
void gelu_out(at::Tensor& out, const at::Tensor& input, const std::string& approximate) {
  activation_detail::run_checked<Backend>("gelu", out, input, nullptr, approximate);
}

template <class Backend>
void gelu_mul_out(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up, const std::string& approximate) {
  activation_detail::run_checked<Backend>("gelu_mul", out, gate, &up, approximate, "gate");
}

namespace activation_detail {

// geglu's halves of input [..., 2H]: (value, gate).
inline std::pair<at::Tensor, at::Tensor> geglu_halves(const at::Tensor& input, const char* op) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op,
              ": input's last dim must be even ([..., 2H]: value then gate), got sizes ", input.sizes());
  const int64_t h = input.size(-1) / 2;
  return {input.narrow(-1, 0, h), input.narrow(-1, h, h)};
}

}  // namespace activation_detail

// out [..., H] = input[..., :H] * gelu(input[..., H:]), input [..., 2H].
template <class Backend>
void geglu_out(at::Tensor& out, const at::Tensor& input, const std::string& approximate) {
  constexpr const char* op = "geglu";
  const auto [value, gate] = activation_detail::geglu_halves(input, op);
  activation_detail::run_checked<Backend>(op, out, gate, &value, approximate);
}

// Backward of gelu: grad_input = grad * gelu'(input).
template <class Backend>
at::Tensor gelu_backward(const at::Tensor& grad, const at::Tensor& input, const std::string& approximate) {
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  activation_detail::run_checked<Backend>("gelu_backward", grad_input, input, nullptr, approximate, "input", &grad);
  return grad_input;
}

// Backward of gelu_mul: (grad * up * gelu'(gate), grad * gelu(gate)).
template <class Backend>
std::tuple<at::Tensor, at::Tensor> gelu_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& up, const std::string& approximate) {
  at::Tensor grad_gate = at::empty(gate.sizes(), gate.options());
  at::Tensor grad_up = at::empty(gate.sizes(), gate.options());
  activation_detail::run_checked<Backend>("gelu_mul_backward", grad_gate, gate, &up, approximate, "gate", &grad, &grad_up);
  return {grad_gate, grad_up};
}

// Backward of geglu: grad_input [..., 2H] = [grad * gelu(gate) | grad * value * gelu'(gate)].
template <class Backend>
at::Tensor geglu_backward(const at::Tensor& grad, const at::Tensor& input, const std::string& approximate) {
  constexpr const char* op = "geglu_backward";
  const auto [value, gate] = activation_detail::geglu_halves(input, op);
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  auto [grad_value, grad_gate] = activation_detail::geglu_halves(grad_input, op);
  activation_detail::run_checked<Backend>(op, grad_gate, gate, &value, approximate, "input", &grad, &grad_value);
  return grad_input;
}

}  // namespace ltx

// The GELU family of feed-forward activations, elementwise over rows:
//   gelu(x)                GELU (erf or tanh approximation): LTX, FLUX, SD3 feed-forwards;
//   gelu_mul(gate, up)     gelu(gate) * up from two tensors: Gemma's MLP;
//   geglu(x)               x = [value | gate] on the last dim, value * gelu(gate):
//                          diffusers' GEGLU (the gate is the SECOND half).
// fp32 math, one rounding to the input dtype. Entry points are templates over the
// backend (see norm.h) so the CUDA and CPU ops validate identically.
#pragma once

#include "common.h"

#include <limits>
#include <string>

namespace ltx {

enum class Gelu { kErf, kTanh };

struct ActivationArgs {
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  Gelu gelu = Gelu::kErf;
  void* out = nullptr;       // [rows, cols]
  const void* gate = nullptr;  // [rows, cols]: the GELU's argument
  const void* up = nullptr;    // [rows, cols] multiplied in, or nullptr (plain GELU)
  int64_t rows = 0, cols = 0;
  int64_t out_stride = 0, gate_stride = 0, up_stride = 0;
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

// out = gelu(gate) [* up]; gate, up and out of one shape, dtype and device. gate_arg is
// what messages call gate: the op's own name for that argument.
template <class Backend>
void run_checked(const char* op, at::Tensor& out, const at::Tensor& gate, const at::Tensor* up,
                 const std::string& approximate, const char* gate_arg = "input") {
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
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{&out, "out"}, {up, "up"}}) {
    if (t == nullptr) continue;
    check_same_device(*t, gate, op, arg, gate_arg);
    TORCH_CHECK(t->scalar_type() == a.dtype, op, ": ", arg, " has dtype ", t->scalar_type(),
                " but ", gate_arg, " has dtype ", a.dtype);
    TORCH_CHECK(t->sizes() == gate.sizes(), op, ": ", arg, " has sizes ", t->sizes(), " but expected ",
                gate.sizes());
  }
  check_output_overlap(out, {&gate, up}, op, "out");
  a.out = out.mutable_data_ptr();
  a.out_stride = row_view(out, op, "out").row_stride;
  if (up != nullptr) {
    a.up = up->const_data_ptr();
    a.up_stride = row_view(*up, op, "up").row_stride;
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

// out [..., H] = input[..., :H] * gelu(input[..., H:]), input [..., 2H].
template <class Backend>
void geglu_out(at::Tensor& out, const at::Tensor& input, const std::string& approximate) {
  constexpr const char* op = "geglu";
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op,
              ": input's last dim must be even ([..., 2H]: value then gate), got sizes ", input.sizes());
  // out against the whole input: the two halves are strided views, too hard to compare.
  check_output_overlap(out, {&input}, op, "out");
  const int64_t h = input.size(-1) / 2;
  const at::Tensor value = input.narrow(-1, 0, h);
  const at::Tensor gate = input.narrow(-1, h, h);
  activation_detail::run_checked<Backend>(op, out, gate, &value, approximate);
}

}  // namespace ltx

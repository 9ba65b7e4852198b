// Op schemas and their CPU / CUDA implementations. Each op comes as an out-variant
// (`<op>_out`: outputs first, returns nothing) and a functional form that allocates its
// outputs here in C++, so that a Python call costs one dispatch.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

#include <vector>

namespace {

using at::Tensor;
using std::optional;

Tensor empty_rows_like(const Tensor& input, at::ScalarType dtype) {
  return at::empty_like(input, input.options().dtype(dtype), at::MemoryFormat::Contiguous);
}

template <class B>
Tensor rms_norm(const Tensor& input, const optional<Tensor>& weight, double eps, double weight_offset,
                bool cast_before_weight, optional<at::ScalarType> out_dtype) {
  Tensor out = empty_rows_like(input, out_dtype.value_or(input.scalar_type()));
  ltx::rms_norm_out<B>(out, input, weight, eps, weight_offset, cast_before_weight);
  return out;
}

template <class B>
std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor& input, const Tensor& residual,
                                              const optional<Tensor>& weight, double eps, double weight_offset,
                                              bool cast_before_weight) {
  Tensor out = empty_rows_like(input, input.scalar_type());
  Tensor residual_out = empty_rows_like(input, input.scalar_type());
  ltx::fused_add_rms_norm_out<B>(out, residual_out, input, residual, weight, eps, weight_offset,
                                 cast_before_weight);
  return {out, residual_out};
}

template <class B>
Tensor adaln(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps, c10::string_view norm) {
  Tensor out = empty_rows_like(input, input.scalar_type());
  ltx::adaln_out<B>(out, input, scale, shift, eps, std::string(norm));
  return out;
}

// Each row's mean and rstd, fp32 [..., 2], for the backward. A 0-dim input has no rows:
// a placeholder, as the op's checks then refuse the input before the stats are looked at.
Tensor empty_stats(const Tensor& input) {
  if (input.dim() == 0) return at::empty({0}, input.options().dtype(at::kFloat));
  return at::empty(ltx::stats_sizes(input), input.options().dtype(at::kFloat));
}

template <class B>
std::tuple<Tensor, Tensor> adaln_with_stats(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps,
                                            c10::string_view norm) {
  Tensor out = empty_rows_like(input, input.scalar_type());
  Tensor stats = empty_stats(input);
  ltx::adaln_out<B>(out, input, scale, shift, eps, std::string(norm), &stats);
  return {out, stats};
}

template <class B>
void adaln_out(Tensor& out, const Tensor& input, const Tensor& scale, const Tensor& shift, double eps,
               c10::string_view norm) {
  ltx::adaln_out<B>(out, input, scale, shift, eps, std::string(norm));
}

template <class B>
Tensor gated_residual(const Tensor& residual, const Tensor& input, const Tensor& gate) {
  Tensor residual_out = empty_rows_like(input, input.scalar_type());
  ltx::gated_residual_out<B>(residual_out, std::nullopt, residual, input, gate, std::nullopt, std::nullopt, 0.0, "");
  return residual_out;
}

template <class B>
void gated_residual_out(Tensor& residual_out, const Tensor& residual, const Tensor& input, const Tensor& gate) {
  ltx::gated_residual_out<B>(residual_out, std::nullopt, residual, input, gate, std::nullopt, std::nullopt, 0.0, "");
}

template <class B>
std::tuple<Tensor, Tensor> gated_residual_adaln(const Tensor& residual, const Tensor& input, const Tensor& gate,
                                                const Tensor& scale, const Tensor& shift, double eps,
                                                c10::string_view norm) {
  Tensor residual_out = empty_rows_like(input, input.scalar_type());
  Tensor out = empty_rows_like(input, input.scalar_type());
  ltx::gated_residual_out<B>(residual_out, out, residual, input, gate, scale, shift, eps, std::string(norm));
  return {residual_out, out};
}

template <class B>
std::tuple<Tensor, Tensor, Tensor> gated_residual_adaln_with_stats(const Tensor& residual, const Tensor& input,
                                                                   const Tensor& gate, const Tensor& scale,
                                                                   const Tensor& shift, double eps,
                                                                   c10::string_view norm) {
  Tensor residual_out = empty_rows_like(input, input.scalar_type());
  Tensor out = empty_rows_like(input, input.scalar_type());
  Tensor stats = empty_stats(input);
  ltx::gated_residual_out<B>(residual_out, out, residual, input, gate, scale, shift, eps, std::string(norm), &stats);
  return {residual_out, out, stats};
}

template <class B>
void gated_residual_adaln_out(Tensor& residual_out, Tensor& out, const Tensor& residual, const Tensor& input,
                              const Tensor& gate, const Tensor& scale, const Tensor& shift, double eps,
                              c10::string_view norm) {
  ltx::gated_residual_out<B>(residual_out, out, residual, input, gate, scale, shift, eps, std::string(norm));
}

template <class B>
Tensor gelu(const Tensor& input, c10::string_view approximate) {
  Tensor out = empty_rows_like(input, input.scalar_type());
  ltx::gelu_out<B>(out, input, std::string(approximate));
  return out;
}

template <class B>
void gelu_out(Tensor& out, const Tensor& input, c10::string_view approximate) {
  ltx::gelu_out<B>(out, input, std::string(approximate));
}

template <class B>
Tensor gelu_mul(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  Tensor out = empty_rows_like(gate, gate.scalar_type());
  ltx::gelu_mul_out<B>(out, gate, up, std::string(approximate));
  return out;
}

template <class B>
void gelu_mul_out(Tensor& out, const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  ltx::gelu_mul_out<B>(out, gate, up, std::string(approximate));
}

template <class B>
Tensor geglu(const Tensor& input, c10::string_view approximate) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0,
              "geglu: input's last dim must be even ([..., 2H]: value then gate), got sizes ", input.sizes());
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() /= 2;
  Tensor out = at::empty(sizes, input.options());
  ltx::geglu_out<B>(out, input, std::string(approximate));
  return out;
}

template <class B>
void geglu_out(Tensor& out, const Tensor& input, c10::string_view approximate) {
  ltx::geglu_out<B>(out, input, std::string(approximate));
}

template <class B>
std::tuple<Tensor, Tensor> rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, bool interleaved,
                                int64_t sequence_dim) {
  Tensor q_out = at::empty_like(q);  // q's layout, as the hosts' elementwise math returns
  Tensor k_out = at::empty_like(k);
  ltx::rope_out<B>(q_out, k_out, q, k, cos, sin, interleaved, sequence_dim);
  return {q_out, k_out};
}

template <class B>
void rope_(Tensor& q, Tensor& k, const Tensor& cos, const Tensor& sin, bool interleaved, int64_t sequence_dim) {
  ltx::rope_out<B>(q, k, q, k, cos, sin, interleaved, sequence_dim);
}

template <class B>
std::tuple<Tensor, Tensor> qk_norm_rope(const Tensor& q, const Tensor& k, const Tensor& q_weight, const Tensor& k_weight,
                                        const Tensor& cos, const Tensor& sin, double eps) {
  Tensor q_out = empty_rows_like(q, q.scalar_type());
  Tensor k_out = empty_rows_like(k, k.scalar_type());
  ltx::qk_norm_rope_out<B>(q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps);
  return {q_out, k_out};
}

template <class B>
std::tuple<Tensor, Tensor> rope_backward(const Tensor& grad_q, const Tensor& grad_k, const Tensor& cos, const Tensor& sin,
                                         bool interleaved, int64_t sequence_dim) {
  Tensor grad_q_in = at::empty_like(grad_q);
  Tensor grad_k_in = at::empty_like(grad_k);
  ltx::rope_apply<B>(grad_q_in, grad_k_in, grad_q, grad_k, cos, sin, interleaved, sequence_dim, /*inverse=*/true);
  return {grad_q_in, grad_k_in};
}

template <class B>
std::tuple<Tensor, Tensor, Tensor> adaln_backward(const Tensor& grad_out, const Tensor& input, const Tensor& scale,
                                                  const Tensor& shift, double eps, c10::string_view norm,
                                                  const optional<Tensor>& grad_extra, const optional<Tensor>& stats) {
  return ltx::adaln_backward<B>(grad_out, input, scale, shift, eps, std::string(norm), grad_extra, stats);
}

template <class B>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> gated_residual_adaln_backward(
    const Tensor& grad_out, const Tensor& grad_residual_out, const Tensor& residual_out, const Tensor& input,
    const Tensor& gate, const Tensor& scale, const Tensor& shift, double eps, c10::string_view norm,
    const optional<Tensor>& stats) {
  return ltx::gated_residual_adaln_backward<B>(grad_out, grad_residual_out, residual_out, input, gate, scale, shift,
                                               eps, std::string(norm), stats);
}

template <class B>
Tensor gelu_backward(const Tensor& grad, const Tensor& input, c10::string_view approximate) {
  return ltx::gelu_backward<B>(grad, input, std::string(approximate));
}

template <class B>
std::tuple<Tensor, Tensor> gelu_mul_backward(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                             c10::string_view approximate) {
  return ltx::gelu_mul_backward<B>(grad, gate, up, std::string(approximate));
}

template <class B>
Tensor geglu_backward(const Tensor& grad, const Tensor& input, c10::string_view approximate) {
  return ltx::geglu_backward<B>(grad, input, std::string(approximate));
}

template <class B>
void impl_rope_ops(torch::Library& ops, c10::DeviceType device) {
  ops.impl("qk_norm_rope", device, &qk_norm_rope<B>);
  ops.impl("qk_norm_rope_out", device, &ltx::qk_norm_rope_out<B>);
  ops.impl("rope", device, &rope<B>);
  ops.impl("rope_out", device, &ltx::rope_out<B>);
  ops.impl("rope_", device, &rope_<B>);
  ops.impl("rope_backward", device, &rope_backward<B>);
}

template <class B>
void impl_activation_ops(torch::Library& ops, c10::DeviceType device) {
  ops.impl("gelu", device, &gelu<B>);
  ops.impl("gelu_out", device, &gelu_out<B>);
  ops.impl("gelu_mul", device, &gelu_mul<B>);
  ops.impl("gelu_mul_out", device, &gelu_mul_out<B>);
  ops.impl("geglu", device, &geglu<B>);
  ops.impl("geglu_out", device, &geglu_out<B>);
  ops.impl("gelu_backward", device, &gelu_backward<B>);
  ops.impl("gelu_mul_backward", device, &gelu_mul_backward<B>);
  ops.impl("geglu_backward", device, &geglu_backward<B>);
}

// The AdaLN FP8 producer takes the norm kind as a string view, as adaln.
template <class B>
std::tuple<Tensor, Tensor> adaln_fp8(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps,
                                     c10::string_view norm) {
  return ltx::adaln_fp8<B>(input, scale, shift, eps, std::string(norm));
}

template <class B>
Tensor adaln_fp8_static(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps,
                        c10::string_view norm, const Tensor& fp8_scale) {
  return ltx::adaln_fp8_static<B>(input, scale, shift, eps, std::string(norm), fp8_scale);
}

template <class B>
std::tuple<Tensor, Tensor, Tensor> gated_residual_adaln_fp8(const Tensor& residual, const Tensor& input,
                                                            const Tensor& gate, const Tensor& scale, const Tensor& shift,
                                                            double eps, c10::string_view norm) {
  return ltx::gated_residual_adaln_fp8<B>(residual, input, gate, scale, shift, eps, std::string(norm));
}

template <class B>
std::tuple<Tensor, Tensor> gated_residual_adaln_fp8_static(const Tensor& residual, const Tensor& input,
                                                           const Tensor& gate, const Tensor& scale, const Tensor& shift,
                                                           double eps, c10::string_view norm, const Tensor& fp8_scale) {
  return ltx::gated_residual_adaln_fp8_static<B>(residual, input, gate, scale, shift, eps, std::string(norm), fp8_scale);
}

template <class B>
std::tuple<Tensor, Tensor> gelu_fp8(const Tensor& input, c10::string_view approximate) {
  return ltx::gelu_fp8<B>(input, std::string(approximate));
}

template <class B>
Tensor gelu_fp8_static(const Tensor& input, c10::string_view approximate, const Tensor& scale) {
  return ltx::gelu_fp8_static<B>(input, std::string(approximate), scale);
}

template <class B>
std::tuple<Tensor, Tensor> gelu_mul_fp8(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  return ltx::gelu_mul_fp8<B>(gate, up, std::string(approximate));
}

template <class B>
Tensor gelu_mul_fp8_static(const Tensor& gate, const Tensor& up, c10::string_view approximate, const Tensor& scale) {
  return ltx::gelu_mul_fp8_static<B>(gate, up, std::string(approximate), scale);
}

template <class B>
std::tuple<Tensor, Tensor> geglu_fp8(const Tensor& input, c10::string_view approximate) {
  return ltx::geglu_fp8<B>(input, std::string(approximate));
}

template <class B>
Tensor geglu_fp8_static(const Tensor& input, c10::string_view approximate, const Tensor& scale) {
  return ltx::geglu_fp8_static<B>(input, std::string(approximate), scale);
}

template <class B>
void impl_fp8_ops(torch::Library& ops, c10::DeviceType device) {
  ops.impl("quantize_fp8", device, &ltx::quantize_fp8<B>);
  ops.impl("quantize_fp8_static", device, &ltx::quantize_fp8_static<B>);
  ops.impl("rms_norm_fp8", device, &ltx::rms_norm_fp8<B>);
  ops.impl("rms_norm_fp8_static", device, &ltx::rms_norm_fp8_static<B>);
  ops.impl("adaln_fp8", device, &adaln_fp8<B>);
  ops.impl("adaln_fp8_static", device, &adaln_fp8_static<B>);
  ops.impl("gated_residual_adaln_fp8", device, &gated_residual_adaln_fp8<B>);
  ops.impl("gated_residual_adaln_fp8_static", device, &gated_residual_adaln_fp8_static<B>);
  ops.impl("gelu_fp8", device, &gelu_fp8<B>);
  ops.impl("gelu_fp8_static", device, &gelu_fp8_static<B>);
  ops.impl("gelu_mul_fp8", device, &gelu_mul_fp8<B>);
  ops.impl("gelu_mul_fp8_static", device, &gelu_mul_fp8_static<B>);
  ops.impl("geglu_fp8", device, &geglu_fp8<B>);
  ops.impl("geglu_fp8_static", device, &geglu_fp8_static<B>);
}

template <class B>
void impl_norm_ops(torch::Library& ops, c10::DeviceType device) {
  ops.impl("rms_norm", device, &rms_norm<B>);
  ops.impl("rms_norm_out", device, &ltx::rms_norm_out<B>);
  ops.impl("fused_add_rms_norm", device, &fused_add_rms_norm<B>);
  ops.impl("fused_add_rms_norm_out", device, &ltx::fused_add_rms_norm_out<B>);
  ops.impl("adaln", device, &adaln<B>);
  ops.impl("adaln_out", device, &adaln_out<B>);
  ops.impl("adaln_with_stats", device, &adaln_with_stats<B>);
  ops.impl("gated_residual", device, &gated_residual<B>);
  ops.impl("gated_residual_out", device, &gated_residual_out<B>);
  ops.impl("gated_residual_adaln", device, &gated_residual_adaln<B>);
  ops.impl("gated_residual_adaln_out", device, &gated_residual_adaln_out<B>);
  ops.impl("gated_residual_adaln_with_stats", device, &gated_residual_adaln_with_stats<B>);
  ops.impl("rms_norm_backward", device, &ltx::rms_norm_backward<B>);
  ops.impl("adaln_backward", device, &adaln_backward<B>);
  ops.impl("gated_residual_backward", device, &ltx::gated_residual_backward<B>);
  ops.impl("gated_residual_adaln_backward", device, &gated_residual_adaln_backward<B>);
}

}  // namespace

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("rms_norm(Tensor input, Tensor? weight, float eps, float weight_offset, bool cast_before_weight, "
          "ScalarType? out_dtype) -> Tensor");
  ops.def("rms_norm_out(Tensor! out, Tensor input, Tensor? weight, float eps, float weight_offset, "
          "bool cast_before_weight) -> ()");
  ops.def("fused_add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, float weight_offset, "
          "bool cast_before_weight) -> (Tensor, Tensor)");
  ops.def("fused_add_rms_norm_out(Tensor! out, Tensor! residual_out, Tensor input, Tensor residual, "
          "Tensor? weight, float eps, float weight_offset, bool cast_before_weight) -> ()");
  ops.def("adaln(Tensor input, Tensor scale, Tensor shift, float eps, str norm) -> Tensor");
  ops.def("adaln_out(Tensor! out, Tensor input, Tensor scale, Tensor shift, float eps, str norm) -> ()");
  ops.def("gated_residual(Tensor residual, Tensor input, Tensor gate) -> Tensor");
  ops.def("gated_residual_out(Tensor! residual_out, Tensor residual, Tensor input, Tensor gate) -> ()");
  ops.def("gated_residual_adaln(Tensor residual, Tensor input, Tensor gate, Tensor scale, Tensor shift, "
          "float eps, str norm) -> (Tensor, Tensor)");
  ops.def("gated_residual_adaln_out(Tensor! residual_out, Tensor! out, Tensor residual, Tensor input, "
          "Tensor gate, Tensor scale, Tensor shift, float eps, str norm) -> ()");
  // The forwards that autograd calls (torch_autograd.cpp): also each row's mean and rstd,
  // fp32 [..., 2], which the backward then reads instead of recomputing.
  ops.def("adaln_with_stats(Tensor input, Tensor scale, Tensor shift, float eps, str norm) -> (Tensor, Tensor)");
  ops.def("gated_residual_adaln_with_stats(Tensor residual, Tensor input, Tensor gate, Tensor scale, Tensor shift, "
          "float eps, str norm) -> (Tensor, Tensor, Tensor)");
  // Backward ops: the grads of each differentiable input (see torch_autograd.cpp).
  ops.def("rms_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, float eps, float weight_offset, "
          "bool cast_before_weight, Tensor? grad_extra) -> (Tensor, Tensor)");
  ops.def("adaln_backward(Tensor grad_out, Tensor input, Tensor scale, Tensor shift, float eps, str norm, "
          "Tensor? grad_extra, Tensor? stats=None) -> (Tensor, Tensor, Tensor)");
  ops.def("gated_residual_backward(Tensor grad_out, Tensor input, Tensor gate) -> (Tensor, Tensor)");
  ops.def("gated_residual_adaln_backward(Tensor grad_out, Tensor grad_residual_out, Tensor residual_out, "
          "Tensor input, Tensor gate, Tensor scale, Tensor shift, float eps, str norm, Tensor? stats=None) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  ops.def("gelu(Tensor input, str approximate) -> Tensor");
  ops.def("gelu_out(Tensor! out, Tensor input, str approximate) -> ()");
  ops.def("gelu_mul(Tensor gate, Tensor up, str approximate) -> Tensor");
  ops.def("gelu_mul_out(Tensor! out, Tensor gate, Tensor up, str approximate) -> ()");
  ops.def("geglu(Tensor input, str approximate) -> Tensor");
  ops.def("geglu_out(Tensor! out, Tensor input, str approximate) -> ()");
  ops.def("gelu_backward(Tensor grad, Tensor input, str approximate) -> Tensor");
  ops.def("gelu_mul_backward(Tensor grad, Tensor gate, Tensor up, str approximate) -> (Tensor, Tensor)");
  ops.def("geglu_backward(Tensor grad, Tensor input, str approximate) -> Tensor");

  ops.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, int sequence_dim) -> (Tensor, Tensor)");
  ops.def("rope_out(Tensor! q_out, Tensor! k_out, Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, "
          "int sequence_dim) -> ()");
  ops.def("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, float eps) "
          "-> (Tensor, Tensor)");
  ops.def("qk_norm_rope_out(Tensor! q_out, Tensor! k_out, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
          "Tensor cos, Tensor sin, float eps) -> ()");
  ops.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved, int sequence_dim) -> ()");
  ops.def("rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, bool interleaved, int sequence_dim) "
          "-> (Tensor, Tensor)");

  // FP8 producers (float8_e4m3fn rows for torch._scaled_mm): the quantized rows and each
  // row's fp32 scale, [..., 1]; the static forms take one fp32 scale for the whole tensor.
  ops.def("quantize_fp8(Tensor input) -> (Tensor, Tensor)");
  ops.def("quantize_fp8_static(Tensor input, Tensor scale) -> Tensor");
  ops.def("rms_norm_fp8(Tensor input, Tensor? weight, float eps, float weight_offset, bool cast_before_weight) "
          "-> (Tensor, Tensor)");
  ops.def("rms_norm_fp8_static(Tensor input, Tensor? weight, float eps, float weight_offset, "
          "bool cast_before_weight, Tensor scale) -> Tensor");
  ops.def("adaln_fp8(Tensor input, Tensor scale, Tensor shift, float eps, str norm) -> (Tensor, Tensor)");
  ops.def("adaln_fp8_static(Tensor input, Tensor scale, Tensor shift, float eps, str norm, Tensor fp8_scale) "
          "-> Tensor");
  // gated_residual_adaln's sum (input dtype), then its normed output as FP8.
  ops.def("gated_residual_adaln_fp8(Tensor residual, Tensor input, Tensor gate, Tensor scale, Tensor shift, "
          "float eps, str norm) -> (Tensor, Tensor, Tensor)");
  ops.def("gated_residual_adaln_fp8_static(Tensor residual, Tensor input, Tensor gate, Tensor scale, Tensor shift, "
          "float eps, str norm, Tensor fp8_scale) -> (Tensor, Tensor)");
  ops.def("gelu_fp8(Tensor input, str approximate) -> (Tensor, Tensor)");
  ops.def("gelu_fp8_static(Tensor input, str approximate, Tensor scale) -> Tensor");
  ops.def("gelu_mul_fp8(Tensor gate, Tensor up, str approximate) -> (Tensor, Tensor)");
  ops.def("gelu_mul_fp8_static(Tensor gate, Tensor up, str approximate, Tensor scale) -> Tensor");
  ops.def("geglu_fp8(Tensor input, str approximate) -> (Tensor, Tensor)");
  ops.def("geglu_fp8_static(Tensor input, str approximate, Tensor scale) -> Tensor");

  register_autograd_kernels(ops);

  // CPU twins are registered in every variant: a CUDA build of torch serves CPU tensors too.
  impl_norm_ops<ltx::CpuNorm>(ops, c10::DeviceType::CPU);
  impl_activation_ops<ltx::CpuActivation>(ops, c10::DeviceType::CPU);
  impl_rope_ops<ltx::CpuRope>(ops, c10::DeviceType::CPU);
  impl_fp8_ops<ltx::CpuFp8>(ops, c10::DeviceType::CPU);
#if defined(CUDA_KERNEL)
  impl_norm_ops<ltx::CudaNorm>(ops, c10::DeviceType::CUDA);
  impl_activation_ops<ltx::CudaActivation>(ops, c10::DeviceType::CUDA);
  impl_rope_ops<ltx::CudaRope>(ops, c10::DeviceType::CUDA);
  impl_fp8_ops<ltx::CudaFp8>(ops, c10::DeviceType::CUDA);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)

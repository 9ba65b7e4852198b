// Autograd for every op, as C++ kernels on the Autograd dispatch key (and, for the ops that
// write into given tensors, on the ADInplaceOrView key):
// - functional ops: a call that needs no grad (grad mode off, or no input that requires
//   grad) goes straight on to the CPU / CUDA kernel: torch::autograd::Function::apply
//   would still build a node and save the inputs. A call that needs grad records a node
//   whose backward calls the backward ops;
// - out= and in-place ops: refused where autograd would need a record, and each written
//   tensor's version goes up, so a backward that saved it refuses to run;
// - backward ops and the forwards with row statistics: no derivative; their outputs raise
//   when differentiated (double backward), as torch's once_differentiable does.
// Forward-mode AD (dual tensors, torch.func.jvp) is refused by every op.
// torch.compile traces through these too.
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>

namespace {

using at::Tensor;
using std::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensors2 = std::tuple<Tensor, Tensor>;
using Tensors3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensors5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// The op `name` of this extension, called below the Autograd key by the forwards.
template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string(STRINGIFY(TORCH_EXTENSION_NAME)) + "::" + name).c_str(), "")
      .template typed<Signature>();
}

#define LTX_OP(name, signature)                                       \
  const c10::TypedOperatorHandle<signature>& name##_op() {            \
    static const auto handle = op_handle<signature>(#name);           \
    return handle;                                                    \
  }

LTX_OP(rms_norm, Tensor(const Tensor&, const optional<Tensor>&, double, double, bool, optional<at::ScalarType>))
LTX_OP(fused_add_rms_norm, Tensors2(const Tensor&, const Tensor&, const optional<Tensor>&, double, double, bool))
LTX_OP(rms_norm_backward, Tensors2(const Tensor&, const Tensor&, const optional<Tensor>&, double, double, bool,
                                   const optional<Tensor>&))
LTX_OP(adaln, Tensor(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view))
LTX_OP(gated_residual, Tensor(const Tensor&, const Tensor&, const Tensor&))
LTX_OP(adaln_with_stats, Tensors2(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view))
LTX_OP(gated_residual_adaln, Tensors2(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      double, c10::string_view))
LTX_OP(gated_residual_adaln_with_stats, Tensors3(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, double, c10::string_view))
LTX_OP(adaln_backward, Tensors3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, c10::string_view,
                                const optional<Tensor>&, const optional<Tensor>&))
LTX_OP(gated_residual_backward, Tensors2(const Tensor&, const Tensor&, const Tensor&))
LTX_OP(gated_residual_adaln_backward,
       Tensors5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                const Tensor&, double, c10::string_view, const optional<Tensor>&))
LTX_OP(rope, Tensors2(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, int64_t))
LTX_OP(rope_backward, Tensors2(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, int64_t))
LTX_OP(qk_norm_rope, Tensors2(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, double))
LTX_OP(gelu, Tensor(const Tensor&, c10::string_view))
LTX_OP(gelu_backward, Tensor(const Tensor&, const Tensor&, c10::string_view))
LTX_OP(gelu_mul, Tensor(const Tensor&, const Tensor&, c10::string_view))
LTX_OP(gelu_mul_backward, Tensors2(const Tensor&, const Tensor&, const Tensor&, c10::string_view))
LTX_OP(geglu, Tensor(const Tensor&, c10::string_view))
LTX_OP(geglu_backward, Tensor(const Tensor&, const Tensor&, c10::string_view))
LTX_OP(quantize_fp8, Tensors2(const Tensor&))
LTX_OP(quantize_fp8_static, Tensor(const Tensor&, const Tensor&))
LTX_OP(rms_norm_fp8, Tensors2(const Tensor&, const optional<Tensor>&, double, double, bool))
LTX_OP(rms_norm_fp8_static, Tensor(const Tensor&, const optional<Tensor>&, double, double, bool, const Tensor&))
LTX_OP(adaln_fp8, Tensors2(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view))
LTX_OP(adaln_fp8_static, Tensor(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view, const Tensor&))
LTX_OP(gated_residual_adaln_fp8, Tensors3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          double, c10::string_view))
LTX_OP(gated_residual_adaln_fp8_static, Tensors2(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, double, c10::string_view, const Tensor&))
LTX_OP(gelu_fp8, Tensors2(const Tensor&, c10::string_view))
LTX_OP(gelu_fp8_static, Tensor(const Tensor&, c10::string_view, const Tensor&))
LTX_OP(gelu_mul_fp8, Tensors2(const Tensor&, const Tensor&, c10::string_view))
LTX_OP(gelu_mul_fp8_static, Tensor(const Tensor&, const Tensor&, c10::string_view, const Tensor&))
LTX_OP(geglu_fp8, Tensors2(const Tensor&, c10::string_view))
LTX_OP(geglu_fp8_static, Tensor(const Tensor&, c10::string_view, const Tensor&))
// The ops that write into given tensors (Tensor&: the schema's Tensor!).
LTX_OP(rms_norm_out, void(Tensor&, const Tensor&, const optional<Tensor>&, double, double, bool))
LTX_OP(fused_add_rms_norm_out,
       void(Tensor&, Tensor&, const Tensor&, const Tensor&, const optional<Tensor>&, double, double, bool))
LTX_OP(adaln_out, void(Tensor&, const Tensor&, const Tensor&, const Tensor&, double, c10::string_view))
LTX_OP(gated_residual_out, void(Tensor&, const Tensor&, const Tensor&, const Tensor&))
LTX_OP(gated_residual_adaln_out, void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&, double, c10::string_view))
LTX_OP(gelu_out, void(Tensor&, const Tensor&, c10::string_view))
LTX_OP(gelu_mul_out, void(Tensor&, const Tensor&, const Tensor&, c10::string_view))
LTX_OP(geglu_out, void(Tensor&, const Tensor&, c10::string_view))
LTX_OP(rope_out, void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, int64_t))
LTX_OP(rope_, void(Tensor&, Tensor&, const Tensor&, const Tensor&, bool, int64_t))
LTX_OP(qk_norm_rope_out, void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, double))
#undef LTX_OP

template <class Handle>
struct signature_of;
template <class Sig>
struct signature_of<c10::TypedOperatorHandle<Sig>> {
  using type = Sig;
};
// The C++ signature of the op whose handle `Handle()` returns.
template <auto Handle>
using signature_t = typename signature_of<std::decay_t<decltype(Handle())>>::type;

// The op's name without the build's namespace, as the kernels' messages name it.
std::string op_name(const c10::OperatorHandle& op) {
  const std::string& full = op.schema().name();
  return full.substr(full.find("::") + 2);
}

bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const optional<Tensor>& t) { return t.has_value() && requires_grad(*t); }
template <class NonTensor>
bool requires_grad(const NonTensor&) {
  return false;
}

bool has_forward_grad(const Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
bool has_forward_grad(const optional<Tensor>& t) { return t.has_value() && has_forward_grad(*t); }
template <class NonTensor>
bool has_forward_grad(const NonTensor&) {
  return false;
}

// No op has a forward-mode formula: a dual tensor would come back without its tangent.
template <class... Args>
void refuse_forward_ad(const c10::OperatorHandle& op, const Args&... args) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_forward_grad(args) || ...), op_name(op),
                              ": forward-mode AD (dual tensors, torch.func.jvp, jacfwd) is not supported; "
                              "use reverse mode (.backward() or torch.autograd.grad)");
}

optional<Tensor> maybe(const Tensor& t) { return t.defined() ? optional<Tensor>(t) : std::nullopt; }

// sym_stride: under dynamic-shape tracing a plain stride() would specialise the sizes.
Tensor last_dim_contiguous(const Tensor& t) { return t.sym_stride(-1) == 1 ? t : t.contiguous(); }

// RoPE tables are constants: a cos or sin that requires grad is refused at backward.
void check_constant_tables(AutogradContext* ctx, const char* op, int first_table) {
  TORCH_CHECK(!ctx->needs_input_grad(first_table) && !ctx->needs_input_grad(first_table + 1), op,
              ": gradients for cos and sin are not supported (they are constants); detach them");
}

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const optional<Tensor>& weight, double eps,
                        double weight_offset, bool cast_before_weight, optional<at::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({input, weight.value_or(Tensor())});
    ctx->saved_data["args"] = c10::ivalue::Tuple::create({eps, weight_offset, cast_before_weight});
    return rms_norm_op().call(input, weight, eps, weight_offset, cast_before_weight, out_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto& args = ctx->saved_data["args"].toTupleRef().elements();
    const optional<Tensor> weight = maybe(saved[1]);
    auto [grad_input, grad_weight] = rms_norm_backward_op().call(
        grads[0].contiguous(), saved[0], weight, args[0].toDouble(), args[1].toDouble(), args[2].toBool(), std::nullopt);
    return {grad_input, weight ? grad_weight : Tensor(), {}, {}, {}, {}};
  }
};

struct FusedAddRmsNorm : torch::autograd::Function<FusedAddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& residual,
                               const optional<Tensor>& weight, double eps, double weight_offset,
                               bool cast_before_weight) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, sum] = fused_add_rms_norm_op().call(input, residual, weight, eps, weight_offset, cast_before_weight);
    ctx->save_for_backward({sum, weight.value_or(Tensor())});
    ctx->saved_data["args"] = c10::ivalue::Tuple::create({eps, weight_offset, cast_before_weight});
    return {out, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto& args = ctx->saved_data["args"].toTupleRef().elements();
    const optional<Tensor> weight = maybe(saved[1]);
    // The sum's own grad joins the norm's as grad_extra.
    auto [grad_sum, grad_weight] =
        rms_norm_backward_op().call(grads[0].contiguous(), saved[0], weight, args[0].toDouble(), args[1].toDouble(),
                                    args[2].toBool(), grads[1].contiguous());
    return {grad_sum, grad_sum, weight ? grad_weight : Tensor(), {}, {}, {}};
  }
};

struct Adaln : torch::autograd::Function<Adaln> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& scale, const Tensor& shift,
                        double eps, c10::string_view norm) {
    at::AutoDispatchBelowADInplaceOrView below;
    // The row statistics (8 bytes a row) spare the backward a reduction per row.
    auto [out, stats] = adaln_with_stats_op().call(input, scale, shift, eps, norm);
    ctx->save_for_backward({input, scale, shift, stats});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["norm"] = std::string(norm);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_input, grad_scale, grad_shift] =
        adaln_backward_op().call(grads[0].contiguous(), saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble(),
                                 ctx->saved_data["norm"].toStringRef(), std::nullopt, saved[3]);
    return {grad_input, grad_scale, grad_shift, {}, {}};
  }
};

struct GatedResidual : torch::autograd::Function<GatedResidual> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& input, const Tensor& gate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({input, gate});
    return gated_residual_op().call(residual, input, gate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_input, grad_gate] = gated_residual_backward_op().call(grads[0].contiguous(), saved[0], saved[1]);
    return {grads[0], grad_input, grad_gate};
  }
};

struct GatedResidualAdaln : torch::autograd::Function<GatedResidualAdaln> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& input, const Tensor& gate,
                               const Tensor& scale, const Tensor& shift, double eps, c10::string_view norm) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [sum, out, stats] = gated_residual_adaln_with_stats_op().call(residual, input, gate, scale, shift, eps, norm);
    ctx->save_for_backward({input, gate, scale, shift, sum, stats});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["norm"] = std::string(norm);
    return {sum, out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    // The sum's own grad joins the norm's; the gate's backward runs in the same pass.
    auto [grad_sum, grad_input, grad_gate, grad_scale, grad_shift] = gated_residual_adaln_backward_op().call(
        grads[1].contiguous(), grads[0].contiguous(), saved[4], saved[0], saved[1], saved[2], saved[3],
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["norm"].toStringRef(), saved[5]);
    return {grad_sum, grad_input, grad_gate, grad_scale, grad_shift, {}, {}};
  }
};

struct Rope : torch::autograd::Function<Rope> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, bool interleaved, int64_t sequence_dim) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["sequence_dim"] = sequence_dim;
    auto [q_out, k_out] = rope_op().call(q, k, cos, sin, interleaved, sequence_dim);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_constant_tables(ctx, "rope", 2);
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_q, grad_k] =
        rope_backward_op().call(last_dim_contiguous(grads[0]), last_dim_contiguous(grads[1]), saved[0], saved[1],
                                ctx->saved_data["interleaved"].toBool(), ctx->saved_data["sequence_dim"].toInt());
    return {grad_q, grad_k, {}, {}, {}, {}};
  }
};

struct QkNormRope : torch::autograd::Function<QkNormRope> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& q_weight,
                               const Tensor& k_weight, const Tensor& cos, const Tensor& sin, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({q, k, q_weight, k_weight, cos, sin});
    ctx->saved_data["eps"] = eps;
    auto [q_out, k_out] = qk_norm_rope_op().call(q, k, q_weight, k_weight, cos, sin, eps);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_constant_tables(ctx, "qk_norm_rope", 4);
    const variable_list s = ctx->get_saved_variables();
    const double eps = ctx->saved_data["eps"].toDouble();
    // Un-rotate, then the RMSNorm backward (its weight multiply comes before the rotation).
    auto [grad_q_normed, grad_k_normed] =
        rope_backward_op().call(grads[0].contiguous(), grads[1].contiguous(), s[4], s[5], true, 1);
    auto [grad_q, grad_q_weight] =
        rms_norm_backward_op().call(grad_q_normed, s[0], s[2], eps, 0.0, false, std::nullopt);
    auto [grad_k, grad_k_weight] =
        rms_norm_backward_op().call(grad_k_normed, s[1], s[3], eps, 0.0, false, std::nullopt);
    return {grad_q, grad_k, grad_q_weight, grad_k_weight, {}, {}, {}};
  }
};

struct Gelu : torch::autograd::Function<Gelu> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({input});
    ctx->saved_data["approximate"] = std::string(approximate);
    return gelu_op().call(input, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    return {gelu_backward_op().call(grads[0].contiguous(), saved[0], ctx->saved_data["approximate"].toStringRef()),
            {}};
  }
};

struct GeluMul : torch::autograd::Function<GeluMul> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({gate, up});
    ctx->saved_data["approximate"] = std::string(approximate);
    return gelu_mul_op().call(gate, up, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] = gelu_mul_backward_op().call(grads[0].contiguous(), saved[0], saved[1],
                                                            ctx->saved_data["approximate"].toStringRef());
    return {grad_gate, grad_up, {}};
  }
};

struct Geglu : torch::autograd::Function<Geglu> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({input});
    ctx->saved_data["approximate"] = std::string(approximate);
    return geglu_op().call(input, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    return {geglu_backward_op().call(grads[0].contiguous(), saved[0], ctx->saved_data["approximate"].toStringRef()),
            {}};
  }
};

// The op below the Autograd key when the call needs no grad, else Node::apply (outputs of
// two-tensor ops come back as a tuple, as the schema has them).
template <class Node, class Op, class... Args>
auto autograd_call(const Op& op, const Args&... args) -> decltype(op.call(args...)) {
  refuse_forward_ad(op, args...);
  if (!at::GradMode::is_enabled() || !(requires_grad(args) || ...)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(args...);
  }
  auto outputs = Node::apply(args...);
  if constexpr (std::is_same_v<decltype(outputs), Tensor>) {
    return outputs;
  } else {
    return {outputs[0], outputs[1]};
  }
}

// The Autograd-key kernels, with the ops' schema signatures.
Tensor rms_norm(const Tensor& input, const optional<Tensor>& weight, double eps, double weight_offset,
                bool cast_before_weight, optional<at::ScalarType> out_dtype) {
  return autograd_call<RmsNorm>(rms_norm_op(), input, weight, eps, weight_offset, cast_before_weight, out_dtype);
}

Tensors2 fused_add_rms_norm(const Tensor& input, const Tensor& residual, const optional<Tensor>& weight, double eps,
                            double weight_offset, bool cast_before_weight) {
  return autograd_call<FusedAddRmsNorm>(fused_add_rms_norm_op(), input, residual, weight, eps, weight_offset,
                                        cast_before_weight);
}

Tensor adaln(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps, c10::string_view norm) {
  return autograd_call<Adaln>(adaln_op(), input, scale, shift, eps, norm);
}

Tensor gated_residual(const Tensor& residual, const Tensor& input, const Tensor& gate) {
  return autograd_call<GatedResidual>(gated_residual_op(), residual, input, gate);
}

Tensors2 gated_residual_adaln(const Tensor& residual, const Tensor& input, const Tensor& gate, const Tensor& scale,
                              const Tensor& shift, double eps, c10::string_view norm) {
  return autograd_call<GatedResidualAdaln>(gated_residual_adaln_op(), residual, input, gate, scale, shift, eps, norm);
}

Tensors2 rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, bool interleaved,
              int64_t sequence_dim) {
  return autograd_call<Rope>(rope_op(), q, k, cos, sin, interleaved, sequence_dim);
}

Tensors2 qk_norm_rope(const Tensor& q, const Tensor& k, const Tensor& q_weight, const Tensor& k_weight,
                      const Tensor& cos, const Tensor& sin, double eps) {
  return autograd_call<QkNormRope>(qk_norm_rope_op(), q, k, q_weight, k_weight, cos, sin, eps);
}

Tensor gelu(const Tensor& input, c10::string_view approximate) {
  return autograd_call<Gelu>(gelu_op(), input, approximate);
}

Tensor gelu_mul(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  return autograd_call<GeluMul>(gelu_mul_op(), gate, up, approximate);
}

Tensor geglu(const Tensor& input, c10::string_view approximate) {
  return autograd_call<Geglu>(geglu_op(), input, approximate);
}

// The ops that write into given tensors. Autograd cannot record such a write (the ops
// have no backward), so while grad mode is on no tensor of the call may require grad, as
// torch's out= functions refuse; under torch.no_grad() they run (an optimizer-style update
// of a leaf included).
template <auto Handle, class Sig = signature_t<Handle>>
struct Writes;
template <auto Handle, class... Args>
struct Writes<Handle, void(Args...)> {
  static void autograd(Args... args) {
    const auto& op = Handle();
    refuse_forward_ad(op, args...);
    if (at::GradMode::is_enabled()) {
      size_t index = 0;
      (refuse_grad(op, index++, args), ...);
    }
    at::AutoDispatchBelowAutograd below;
    op.call(args...);
  }

  // Each written tensor's version goes up before the write, as torch's in-place ops do it:
  // a backward that saved the tensor then refuses to run instead of reading the new
  // values. An inference tensor has no version: it is written only in inference mode.
  static void inplace_or_view(Args... args) {
    const auto& op = Handle();
    size_t index = 0;
    (bump_version<Args>(op, index++, args), ...);
    at::AutoDispatchBelowADInplaceOrView below;
    op.call(args...);
  }

 private:
  template <class T>
  static void refuse_grad(const c10::OperatorHandle& op, size_t index, const T& arg) {
    TORCH_CHECK(!requires_grad(arg), op_name(op), ": the out= / in-place form does not support autograd, but ",
                op.schema().arguments()[index].name(),
                " requires grad; call the functional form (no out= or inplace=), or call it under torch.no_grad()");
  }

  template <class T, class A>
  static void bump_version(const c10::OperatorHandle& op, size_t index, const A& arg) {
    if constexpr (std::is_same_v<T, Tensor&>) {
      TORCH_CHECK(!arg.is_inference() || c10::InferenceMode::is_enabled(), op_name(op), ": ",
                  op.schema().arguments()[index].name(),
                  " is an inference tensor (made under torch.inference_mode()), which is written only in inference "
                  "mode; pass a clone of it");
      arg.unsafeGetTensorImpl()->bump_version();
    }
  }
};

// A graph node as this torch holds them: in a c10::intrusive_ptr from torch 2.14, in a
// std::shared_ptr before (Edge::function's type says which).
using NodePtr = decltype(torch::autograd::Edge::function);
template <class T, class... A>
NodePtr make_node(A&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<A>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<A>(args)...);
  }
}

// The ops without a derivative: the backward ops and the forwards that also return row
// statistics. Called on tensors that require grad (a backward with create_graph=True),
// their outputs get a node that raises when it is reached: double backward is not
// supported. Without grad they run as they are.
template <auto Handle, class Sig = signature_t<Handle>>
struct NoDerivative;
template <auto Handle, class Ret, class... Args>
struct NoDerivative<Handle, Ret(Args...)> {
  static Ret autograd(Args... args) {
    const auto& op = Handle();
    refuse_forward_ad(op, args...);
    const bool record = at::GradMode::is_enabled() && (requires_grad(args) || ...);
    Ret out = [&] {
      at::AutoDispatchBelowADInplaceOrView below;
      return op.call(args...);
    }();
    if (record) {
      variable_list inputs;
      (add_tensor(inputs, args), ...);
      auto node = make_node<torch::autograd::Error>(message(op_name(op)), torch::autograd::collect_next_edges(inputs));
      if constexpr (std::is_same_v<Ret, Tensor>) {
        torch::autograd::set_history(out, node);
      } else {
        std::apply([&](const auto&... t) { (torch::autograd::set_history(t, node), ...); }, out);
      }
    }
    return out;
  }

 private:
  static std::string message(const std::string& name) {
    const std::string stats = "_with_stats";
    if (name.size() > stats.size() && name.compare(name.size() - stats.size(), stats.size(), stats) == 0) {
      const std::string functional = name.substr(0, name.size() - stats.size());
      return name + " is not differentiable (autograd calls it inside " + functional + "); call " + functional;
    }
    return name + ": double backward is not supported (the gradients of the ltx ops are not differentiable)";
  }

  static void add_tensor(variable_list& list, const Tensor& t) { list.push_back(t); }
  static void add_tensor(variable_list& list, const optional<Tensor>& t) { list.push_back(t.value_or(Tensor())); }
  template <class NonTensor>
  static void add_tensor(variable_list&, const NonTensor&) {}
};

// The FP8 producers: their outputs carry no gradient (float8 values and scales a GEMM
// consumes), so a call that autograd would record is refused, naming the argument that
// requires grad, rather than returning outputs silently cut from the graph.
template <auto Handle, class Sig = signature_t<Handle>>
struct RefusesGrad;
template <auto Handle, class Ret, class... Args>
struct RefusesGrad<Handle, Ret(Args...)> {
  static Ret autograd(Args... args) {
    const auto& op = Handle();
    refuse_forward_ad(op, args...);
    if (at::GradMode::is_enabled()) {
      size_t index = 0;
      (refuse_grad(op, index++, args), ...);
    }
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(args...);
  }

 private:
  template <class T>
  static void refuse_grad(const c10::OperatorHandle& op, size_t index, const T& arg) {
    TORCH_CHECK(!requires_grad(arg), op_name(op), ": ", op.schema().arguments()[index].name(),
                " requires grad, but FP8 outputs are not differentiable; pass a detached tensor or call it under "
                "torch.no_grad()");
  }
};

}  // namespace

void register_autograd_kernels(torch::Library& ops) {
  const auto key = c10::DispatchKey::Autograd;
  ops.impl("rms_norm", torch::dispatch(key, TORCH_FN(rms_norm)));
  ops.impl("fused_add_rms_norm", torch::dispatch(key, TORCH_FN(fused_add_rms_norm)));
  ops.impl("adaln", torch::dispatch(key, TORCH_FN(adaln)));
  ops.impl("gated_residual", torch::dispatch(key, TORCH_FN(gated_residual)));
  ops.impl("gated_residual_adaln", torch::dispatch(key, TORCH_FN(gated_residual_adaln)));
  ops.impl("rope", torch::dispatch(key, TORCH_FN(rope)));
  ops.impl("qk_norm_rope", torch::dispatch(key, TORCH_FN(qk_norm_rope)));
  ops.impl("gelu", torch::dispatch(key, TORCH_FN(gelu)));
  ops.impl("gelu_mul", torch::dispatch(key, TORCH_FN(gelu_mul)));
  ops.impl("geglu", torch::dispatch(key, TORCH_FN(geglu)));

#define LTX_WRITES(name)                                                              \
  ops.impl(#name, torch::dispatch(key, TORCH_FN(Writes<&name##_op>::autograd)));     \
  ops.impl(#name, torch::dispatch(c10::DispatchKey::ADInplaceOrView, TORCH_FN(Writes<&name##_op>::inplace_or_view)))
  LTX_WRITES(rms_norm_out);
  LTX_WRITES(fused_add_rms_norm_out);
  LTX_WRITES(adaln_out);
  LTX_WRITES(gated_residual_out);
  LTX_WRITES(gated_residual_adaln_out);
  LTX_WRITES(gelu_out);
  LTX_WRITES(gelu_mul_out);
  LTX_WRITES(geglu_out);
  LTX_WRITES(rope_out);
  LTX_WRITES(rope_);
  LTX_WRITES(qk_norm_rope_out);
#undef LTX_WRITES

#define LTX_NO_DERIVATIVE(name) ops.impl(#name, torch::dispatch(key, TORCH_FN(NoDerivative<&name##_op>::autograd)))
  LTX_NO_DERIVATIVE(adaln_with_stats);
  LTX_NO_DERIVATIVE(gated_residual_adaln_with_stats);
  LTX_NO_DERIVATIVE(rms_norm_backward);
  LTX_NO_DERIVATIVE(adaln_backward);
  LTX_NO_DERIVATIVE(gated_residual_backward);
  LTX_NO_DERIVATIVE(gated_residual_adaln_backward);
  LTX_NO_DERIVATIVE(rope_backward);
  LTX_NO_DERIVATIVE(gelu_backward);
  LTX_NO_DERIVATIVE(gelu_mul_backward);
  LTX_NO_DERIVATIVE(geglu_backward);
#undef LTX_NO_DERIVATIVE

#define LTX_REFUSES_GRAD(name) ops.impl(#name, torch::dispatch(key, TORCH_FN(RefusesGrad<&name##_op>::autograd)))
  LTX_REFUSES_GRAD(quantize_fp8);
  LTX_REFUSES_GRAD(quantize_fp8_static);
  LTX_REFUSES_GRAD(rms_norm_fp8);
  LTX_REFUSES_GRAD(rms_norm_fp8_static);
  LTX_REFUSES_GRAD(adaln_fp8);
  LTX_REFUSES_GRAD(adaln_fp8_static);
  LTX_REFUSES_GRAD(gated_residual_adaln_fp8);
  LTX_REFUSES_GRAD(gated_residual_adaln_fp8_static);
  LTX_REFUSES_GRAD(gelu_fp8);
  LTX_REFUSES_GRAD(gelu_fp8_static);
  LTX_REFUSES_GRAD(gelu_mul_fp8);
  LTX_REFUSES_GRAD(gelu_mul_fp8_static);
  LTX_REFUSES_GRAD(geglu_fp8);
  LTX_REFUSES_GRAD(geglu_fp8_static);
#undef LTX_REFUSES_GRAD
}

// The norm family: RMSNorm (weight, zero-centred weight, two cast orders, fp32 weight),
// fused residual add + RMSNorm, AdaLN (RMS or LayerNorm, then * (1 + scale) + shift),
// and the DiT gated residual (residual + input * gate), optionally followed by AdaLN.
//
// Every op is one row-wise pass: [residual add, optionally gated] -> [norm] -> [weight or
// modulation] -> one rounding. The op entry points here validate and describe the work
// as a torch-free NormArgs; run_norm_cuda / run_norm_cpu execute it. Entry points are
// templates over the runner, so the CUDA and CPU ops validate identically.
#pragma once

#include "common.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace ltx {

enum class NormKind { kRms, kLayer };

// A [B or 1, S or 1, D] operand read per row: row r = (b, s) reads
// ptr + b * batch_stride + s * token_stride + [0, D). Broadcast dims have stride 0.
struct Modulation {
  const void* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t token_stride = 0;
};

struct NormArgs {
  NormKind kind = NormKind::kRms;
  bool normed = true;  // false: the gated residual alone, no norm after the add (out nullptr)
  at::ScalarType dtype = at::kFloat;  // input, residual, gate, scale, shift, residual_out
  bool weight_fp32 = false;           // weight is fp32 while the input is fp16/bf16
  bool out_fp32 = false;              // out is fp32 while the input is fp16/bf16
  // out is float8_e4m3fn: the fp32 value of the out_fp32 (or fp32 input) run, quantized by
  // fp8_math.h with a scale per row into fp8_scales, or by *fp8_static_scale.
  bool out_fp8 = false;
  c10::Device device = c10::Device(c10::kCPU);

  void* out = nullptr;           // [rows, cols], or nullptr (not normed)
  float* fp8_scales = nullptr;              // [rows] (out_fp8, dynamic), or nullptr
  const float* fp8_static_scale = nullptr;  // one element (out_fp8, static), or nullptr
  void* residual_out = nullptr;  // [rows, cols] residual + input (* gate), or nullptr
  float* stats = nullptr;        // [rows, 2] each row's mean (0 for RMS) and rstd, or nullptr
  const void* input = nullptr;
  const void* residual = nullptr;
  const void* weight = nullptr;  // [cols] or nullptr
  Modulation gate, scale, shift;

  int64_t rows = 0;
  int64_t cols = 0;
  int64_t tokens = 1;  // rows per batch entry: row r is (r / tokens, r % tokens)
  int64_t input_stride = 0, residual_stride = 0, out_stride = 0, residual_out_stride = 0;

  float eps = 0.f;
  float inv_cols = 0.f;  // 1 / cols: a multiply, where a division calls a slow-path routine
  float weight_offset = 0.f;
  bool cast_before_weight = false;  // round the normed value to dtype before the weight
};

// The backward of the row norms. With n the normed row, g its per-column factor
// (factor_offset + weight, factor_offset + scale, or 1) and dn = dy * g:
//   dx = rstd * (dn - mean(dn) [LayerNorm only] - n * mean(dn * n)) + grad_extra,
// and the column grads, weight or scale: dy * n (dy * round(n) in the Llama order), shift:
// dy. Column grads come per row (an operand with one row per input row) or summed in fp32
// over each group of group_rows consecutive rows, in an order fixed by the launch shape
// alone, so results repeat bit for bit.
// Without `normed` it is the gated residual's backward (residual + x * gate): n = x,
// rstd = 1, no row sums, the gate as the scale with factor_offset 0, so dx = dy * gate and
// the gate's grad is dy * x; no shift grad.
struct NormBackwardArgs {
  NormKind kind = NormKind::kRms;
  bool normed = true;  // false: the gated residual alone (see above)
  at::ScalarType dtype = at::kFloat;  // input, grad_extra, scale, grad_input
  bool weight_fp32 = false;           // weight is fp32 while the input is fp16/bf16
  bool grad_fp32 = false;             // grad_out is fp32 while the input is fp16/bf16
  c10::Device device = c10::Device(c10::kCPU);

  void* grad_input = nullptr;        // [rows, cols] contiguous
  const void* grad_out = nullptr;    // [rows, cols], rows grad_out_stride apart
  const void* input = nullptr;       // [rows, cols], rows input_stride apart
  const void* grad_extra = nullptr;  // [rows, cols] added to grad_input (a residual's grad), or nullptr
  const void* weight = nullptr;      // [cols] or nullptr
  Modulation scale;                  // AdaLN's scale or the gate (g = factor_offset + scale), or ptr nullptr
  const float* stats = nullptr;      // the forward's [rows, 2] (mean, rstd), or nullptr: recomputed

  // gated_residual_adaln's backward: the norm's input is residual + gate_input * gate, so
  // grad_input is the residual's grad and, from it as rounded to dtype (dr), gate_input
  // gets gate_input_grad = dr * gate and the gate gate_rows / gate_sums of dr * gate_input,
  // in the same pass (else a second op reads grad_input back). gate.ptr nullptr: no gate.
  Modulation gate;
  const void* gate_input = nullptr;  // [rows, cols], rows gate_input_stride apart
  void* gate_input_grad = nullptr;   // [rows, cols] contiguous
  void* gate_rows = nullptr;         // [rows, cols] contiguous dr * gate_input, or nullptr
  void* gate_sums = nullptr;         // [groups, cols] sums of dr * gate_input, or nullptr
  int64_t gate_input_stride = 0;

  void* factor_rows = nullptr;    // [rows, cols] contiguous dy * n, or nullptr
  void* factor_sums = nullptr;    // [groups, cols] sums of dy * n, or nullptr
  void* shift_rows = nullptr;     // [rows, cols] contiguous dy, or nullptr
  void* shift_sums = nullptr;     // [groups, cols] sums of dy, or nullptr
  // The sums' dtype: fp32, or else `dtype` (summed in fp32 and rounded once at the end, so
  // that a grad of the operand's dtype takes no cast after the op).
  bool factor_sums_fp32 = true, shift_sums_fp32 = true, gate_sums_fp32 = true;

  int64_t rows = 0, cols = 0;
  int64_t tokens = 1;      // rows per batch entry, for the scale's (batch, token) rows
  // Rows per column-sum group (groups = rows / group_rows). A modulated backward's (AdaLN's,
  // the gate's) groups are its batch entries (group_rows = tokens): the CUDA kernel loads a
  // per-batch scale once per block and finds a row's token from its place in the group.
  int64_t group_rows = 0;
  int64_t input_stride = 0, grad_out_stride = 0, grad_extra_stride = 0;
  float eps = 0.f, inv_cols = 0.f;
  // The constant added to the per-column factor g: rms_norm's weight_offset (g = offset +
  // weight), 1 for AdaLN (g = 1 + scale), 0 for the gate.
  float factor_offset = 0.f;
  bool cast_before_weight = false;
};

// The one ladder over a norm's weight and output types for an input of type T: each is T,
// or float where the weight (and then the output, or for the backward the output's grad)
// is fp32. Calls fn(Type<W>{}, Type<O>{}).
template <typename T, typename Fn>
void with_weight_types(bool weight_fp32, bool out_fp32, Fn&& fn) {
  if (weight_fp32 && out_fp32) return fn(Type<float>{}, Type<float>{});
  if (weight_fp32) return fn(Type<float>{}, Type<T>{});
  return fn(Type<T>{}, Type<T>{});
}

// Sizes of a norm's row statistics: the input's with a last dim of 2 (each row's mean, 0
// for RMSNorm, and rstd), in fp32.
inline std::vector<int64_t> stats_sizes(const at::Tensor& input) {
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = 2;
  return sizes;
}

void run_norm_cpu(const NormArgs& args);
void run_norm_backward_cpu(const NormBackwardArgs& args);
#if defined(CUDA_KERNEL)
void run_norm_cuda(const NormArgs& args);
void run_norm_backward_cuda(const NormBackwardArgs& args);
#endif

namespace norm_detail {

inline NormKind parse_kind(const std::string& norm, const char* op) {
  if (norm == "rms") return NormKind::kRms;
  if (norm == "layer") return NormKind::kLayer;
  TORCH_CHECK(false, op, ": norm must be \"rms\" or \"layer\", got \"", norm, "\"");
}

inline void check_eps(double eps, const char* op) {
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
}

// Checks every tensor a norm op touches; fills the fields they determine.
struct Checker {
  const char* op;
  const at::Tensor& input;
  c10::DeviceType device;
  NormArgs& a;

  void check_input() {
    check_device(input, device, op, "input");
    check_float_dtype(input, op, "input");
    TORCH_CHECK(input.dim() >= 1, op, ": input must have at least 1 dim (the one normalised), got a 0-dim tensor");
    TORCH_CHECK(input.size(-1) <= std::numeric_limits<int32_t>::max(), op, ": last dim ",
                input.size(-1), " is too large (at most 2^31 - 1)");
    const RowView v = row_view(input, op, "input");
    a.dtype = input.scalar_type();
    a.device = input.device();
    a.input = input.const_data_ptr();
    a.rows = v.rows;
    a.cols = v.cols;
    a.input_stride = v.row_stride;
    a.inv_cols = v.cols > 0 ? 1.0f / static_cast<float>(v.cols) : 0.f;  // no columns: no rows run
  }

  // Same sizes and device as input; dtype as given. Returns its row stride.
  int64_t like_input(const at::Tensor& t, const char* arg, at::ScalarType dtype) {
    check_same_device(t, input, op, arg, "input");
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", arg, " has dtype ", t.scalar_type(),
                "; expected ", dtype);
    TORCH_CHECK(t.sizes() == input.sizes(), op, ": ", arg, " has sizes ", t.sizes(),
                " but input has sizes ", input.sizes());
    return row_view(t, op, arg).row_stride;
  }

  void weight(const std::optional<at::Tensor>& w, bool fp32_allowed) {
    if (!w.has_value()) return;
    check_same_device(*w, input, op, "weight", "input");
    const bool fp32 = w->scalar_type() == at::kFloat && is_16bit(a.dtype);
    TORCH_CHECK(w->scalar_type() == a.dtype || (fp32 && fp32_allowed), op, ": weight has dtype ",
                w->scalar_type(), " but input has dtype ", a.dtype,
                fp32_allowed && a.dtype != at::kDouble ? " (the weight may be the input's dtype or float32)" : "");
    TORCH_CHECK(w->dim() == 1 && w->size(0) == a.cols, op, ": weight must have shape [", a.cols,
                "] (the input's last dim), got ", w->sizes());
    TORCH_CHECK(w->stride(0) == 1 || a.cols <= 1, op, ": weight must be contiguous, got stride ",
                w->stride(0));
    a.weight = w->const_data_ptr();
    a.weight_fp32 = fp32;
  }

  // input seen as [B, S, D]: 2-D input is [B, 1, D]; 3-D is itself.
  void batch_tokens() {
    TORCH_CHECK(input.dim() == 2 || input.dim() == 3, op, ": input must be [B, S, D] or [B, D], got sizes ",
                input.sizes());
    a.tokens = input.dim() == 3 ? input.size(1) : 1;
  }

  // A modulation operand of shape [D], [B', D] or [B', S', D] with B' in {B, 1} and
  // S' in {S, 1}, same dtype as input, contiguous last dim; any other strides.
  // The AdaLN part: norm kind and eps, scale and shift, and out, which must not partly
  // overlap `inputs` (the op's other inputs).
  void adaln(at::Tensor& out, const at::Tensor& scale, const at::Tensor& shift, double eps, const std::string& norm,
             std::initializer_list<Named> inputs, at::Tensor* stats_out) {
    a.kind = parse_kind(norm, op);
    check_eps(eps, op);
    a.scale = modulation(scale, "scale");
    a.shift = modulation(shift, "shift");
    a.out_stride = like_input(out, "out", a.dtype);
    check_output_overlap(out, {{&input, "input"}, {&scale, "scale"}, {&shift, "shift"}}, op, "out");
    check_output_overlap(out, inputs, op, "out");
    a.out = out.mutable_data_ptr();
    a.eps = static_cast<float>(eps);
    if (stats_out != nullptr) {
      check_stats(*stats_out, "stats");
      a.stats = stats_out->mutable_data_ptr<float>();
      if (a.rows == 0 && stats_out->numel() > 0) {  // rows of no columns: as torch's layer_norm gives them
        stats_out->select(-1, 0).zero_();
        stats_out->select(-1, 1).fill_(std::numeric_limits<double>::quiet_NaN());
      }
    }
  }

  // A row-statistics tensor: fp32 [..., 2] (each row's mean and rstd), contiguous, 8-byte
  // aligned (the CUDA kernels move a row's pair as one access).
  void check_stats(const at::Tensor& t, const char* arg) {
    check_same_device(t, input, op, arg, "input");
    const std::vector<int64_t> sizes = stats_sizes(input);
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == at::IntArrayRef(sizes), op, ": ", arg,
                " must be float32 of sizes ", at::IntArrayRef(sizes), " (each row's mean and rstd), got ",
                t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.is_contiguous() && aligned_to(t.const_data_ptr(), 8), op, ": ", arg,
                " must be contiguous and 8-byte aligned");
  }

  Modulation modulation(const at::Tensor& m, const char* arg) {
    check_same_device(m, input, op, arg, "input");
    TORCH_CHECK(m.scalar_type() == a.dtype, op, ": ", arg, " has dtype ", m.scalar_type(),
                " but input has dtype ", a.dtype);
    const int64_t batch = input.size(0);
    const int64_t tokens = a.tokens;
    const int64_t d = m.dim();
    TORCH_CHECK(d >= 1 && d <= 3 && m.size(-1) == a.cols, op, ": ", arg, " must be [D], [B, D] or [B, S, D] with D = ",
                a.cols, ", got sizes ", m.sizes());
    const int64_t mb = d >= 2 ? m.size(0) : 1;
    const int64_t ms = d == 3 ? m.size(1) : 1;
    TORCH_CHECK((mb == batch || mb == 1) && (ms == tokens || ms == 1), op, ": ", arg, " with sizes ",
                m.sizes(), " does not broadcast to input [B=", batch, ", S=", tokens, ", D=", a.cols, "]");
    TORCH_CHECK(m.stride(-1) == 1 || a.cols <= 1, op, ": ", arg,
                " must be contiguous in its last dim, got stride ", m.stride(-1));
    Modulation mod;
    mod.ptr = m.const_data_ptr();
    mod.batch_stride = (d >= 2 && mb > 1) ? m.stride(0) : 0;
    mod.token_stride = (d == 3 && ms > 1) ? m.stride(1) : 0;
    return mod;
  }
};

// The RMSNorm part of rms_norm_out and fused_add_rms_norm_out: input, weight, eps, out.
inline NormArgs rms_args(const char* op, c10::DeviceType device, at::Tensor& out, const at::Tensor& input,
                         const std::optional<at::Tensor>& weight, double eps, double weight_offset,
                         bool cast_before_weight) {
  NormArgs a;
  Checker c{op, input, device, a};
  c.check_input();
  c.weight(weight, /*fp32_allowed=*/true);
  check_eps(eps, op);
  a.out_fp32 = out.scalar_type() == at::kFloat && is_16bit(a.dtype);
  TORCH_CHECK(out.scalar_type() == a.dtype || a.out_fp32, op, ": out has dtype ", out.scalar_type(),
              " but input has dtype ", a.dtype, a.dtype == at::kDouble ? "" : " (out may be the input's dtype or float32)");
  TORCH_CHECK(!a.out_fp32 || a.weight_fp32, op, ": a float32 out needs a float32 weight");
  a.out_stride = c.like_input(out, "out", out.scalar_type());
  check_output_overlap(out, {{&input, "input"}, {weight ? &*weight : nullptr, "weight"}}, op, "out");
  a.out = out.mutable_data_ptr();
  a.eps = static_cast<float>(eps);
  a.weight_offset = static_cast<float>(weight_offset);
  a.cast_before_weight = cast_before_weight;
  return a;
}

// The backward's input, grad_out and grad_extra; returns grad_input and fills `b`.
// `a` holds what the forward's checks derived (rows, cols, dtype, weight, scale).
inline at::Tensor backward_args(NormBackwardArgs& b, const NormArgs& a, Checker& c, const at::Tensor& grad_out,
                                const std::optional<at::Tensor>& grad_extra, bool grad_fp32_allowed,
                                const char* grad_extra_name = "grad_extra") {
  b.kind = a.kind, b.normed = a.normed, b.dtype = a.dtype, b.weight_fp32 = a.weight_fp32;
  b.device = a.device;
  b.input = a.input, b.weight = a.weight, b.scale = a.scale;
  b.rows = a.rows, b.cols = a.cols, b.tokens = a.tokens, b.input_stride = a.input_stride;
  b.inv_cols = a.inv_cols;
  b.grad_fp32 = grad_out.scalar_type() == at::kFloat && is_16bit(a.dtype);
  TORCH_CHECK(!b.grad_fp32 || grad_fp32_allowed, c.op, ": grad_out has dtype float32 but input has dtype ", a.dtype,
              " (a float32 grad_out needs a float32 weight)");
  // grad_out has the output's dtype: the input's, or fp32 where an fp32 weight made the output fp32.
  b.grad_out_stride = c.like_input(grad_out, "grad_out", b.grad_fp32 ? at::kFloat : a.dtype);
  b.grad_out = grad_out.const_data_ptr();
  if (grad_extra.has_value()) {
    b.grad_extra_stride = c.like_input(*grad_extra, grad_extra_name, a.dtype);
    b.grad_extra = grad_extra->const_data_ptr();
  }
  at::Tensor grad_input = at::empty(c.input.sizes(), c.input.options());
  b.grad_input = grad_input.mutable_data_ptr();
  return grad_input;
}

// The AdaLN backward's checks and arguments, for adaln_backward and
// gated_residual_adaln_backward (the norm's input is c.input); returns its grad_input.
inline at::Tensor adaln_backward_args(NormBackwardArgs& b, Checker& c, const at::Tensor& grad_out,
                                      const at::Tensor& scale, const at::Tensor& shift, double eps,
                                      const std::string& norm, const std::optional<at::Tensor>& grad_extra,
                                      const std::optional<at::Tensor>& stats, const char* grad_extra_name) {
  c.check_input();
  c.batch_tokens();
  c.a.kind = parse_kind(norm, c.op);
  check_eps(eps, c.op);
  c.a.scale = c.modulation(scale, "scale");
  c.modulation(shift, "shift");
  at::Tensor grad_input = backward_args(b, c.a, c, grad_out, grad_extra, /*grad_fp32_allowed=*/false, grad_extra_name);
  b.eps = static_cast<float>(eps);
  b.factor_offset = 1.f;  // g = 1 + scale
  if (stats.has_value()) {
    c.check_stats(*stats, "stats");
    b.stats = stats->const_data_ptr<float>();
  }
  return grad_input;
}


// A modulated backward's column-sum groups are its batch entries. An input of one row per
// batch entry ([B, D] or [B, 1, D]) is seen as one batch entry of B tokens: a modulation
// row per input row becomes a row per token, and a shared operand's column sums run over
// all rows in one group (B groups of one row each would sum nothing, and the CUDA grid
// takes at most 65535 groups).
inline void group_by_batch_entry(NormBackwardArgs& b) {
  if (b.tokens == 1) {
    for (Modulation* m : {&b.scale, &b.gate}) {
      m->token_stride = m->batch_stride;
      m->batch_stride = 0;
    }
    b.tokens = b.rows;
  }
  b.group_rows = b.tokens;
}

// The grad of a modulation operand (scale, shift or gate) of sizes `like`:
// - per row when the operand has one row per input row;
// - per row, then summed over the batch, when it has one row per token shared by the
//   batch entries ([1, S, D] with B > 1);
// - else column sums per group (batch entry), reduced to its sizes: of the operand's dtype
//   when each group is one of its rows, else fp32 (float64 for float64) summed over the
//   groups after.
// modulation_grad points `rows` or `sums` at the buffer the runner fills; finish() then
// gives the grad.
struct ModulationGrad {
  at::Tensor rows;  // per-row grads, of the operand's sizes or (shared by the batch) the input's
  at::Tensor sums;  // [groups, D] when summed
  // sums is fp32 (float64 operands: float64), and the operand's grad is its sum over the groups
  bool add_groups = false;

  at::Tensor finish(const at::Tensor& like) const {
    if (sums.defined()) {
      if (!add_groups) return sums.reshape(like.sizes());
      return at::sum(sums, {0}, /*keepdim=*/true).reshape(like.sizes()).to(like.scalar_type());
    }
    return rows.sizes() == like.sizes() ? rows : at::sum(rows, {0}, /*keepdim=*/true);
  }
};

inline ModulationGrad modulation_grad(const at::Tensor& like, const at::Tensor& input, const NormBackwardArgs& b,
                                      void*& rows, void*& sums, bool& sums_fp32) {
  const auto contiguous = like.options().memory_format(at::MemoryFormat::Contiguous);
  if (like.numel() == b.rows * b.cols || (like.dim() == 3 && like.size(1) > 1)) {
    at::Tensor grad = at::empty(like.numel() == b.rows * b.cols ? like.sizes() : input.sizes(), contiguous);
    rows = grad.mutable_data_ptr();
    return {grad, {}};
  }
  // The runner's groups (see group_by_batch_entry); without rows, zeros for each batch
  // entry, so that a [B, 1, D] operand keeps its sizes. The runner writes every element.
  const int64_t groups = b.rows > 0 ? b.rows / b.group_rows : input.size(0);
  // An operand without a batch dim of B sums over the groups after, in fp32 (float64:
  // in float64).
  const bool group_per_row = groups == 1 || (like.dim() >= 2 && like.size(0) == groups);
  const bool keep_dtype = group_per_row || like.scalar_type() == at::kDouble;
  sums_fp32 = !keep_dtype || like.scalar_type() == at::kFloat;
  const auto options = keep_dtype ? like.options() : input.options().dtype(at::kFloat);
  at::Tensor s = b.rows > 0 ? at::empty({groups, b.cols}, options) : at::zeros({groups, b.cols}, options);
  sums = s.mutable_data_ptr();
  return {{}, s, !group_per_row};
}

}  // namespace norm_detail

// Where an op runs: the tensors' device type and the function that runs the work.
struct CpuNorm {
  static constexpr c10::DeviceType device = c10::kCPU;
  static void run(const NormArgs& a) { run_norm_cpu(a); }
  static void run(const NormBackwardArgs& a) { run_norm_backward_cpu(a); }
};
#if defined(CUDA_KERNEL)
struct CudaNorm {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static void run(const NormArgs& a) { run_norm_cuda(a); }
  static void run(const NormBackwardArgs& a) { run_norm_backward_cuda(a); }
};
#endif

// out = rms_norm(input) * (weight_offset + weight). With cast_before_weight the normed
// value is rounded to the input dtype before the weight multiply (transformers' Llama
// order); otherwise the math is fp32 with one rounding (F.rms_norm, Gemma). The weight
// may be fp32 for fp16/bf16 input, and out may then be fp32 (what the hosts return).
template <class Backend>
void rms_norm_out(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  double eps, double weight_offset, bool cast_before_weight) {
  const NormArgs a = norm_detail::rms_args("rms_norm", Backend::device, out, input, weight, eps, weight_offset,
                                           cast_before_weight);
  if (a.rows > 0) Backend::run(a);
}

// residual_out = input + residual (rounded to the input dtype, as the hosts add), then
// out = rms_norm(residual_out) as rms_norm_out. out and residual_out may be input and
// residual themselves (in-place, vLLM style); residual_out shares no memory with the weight
// (the sum would overwrite it before the norm reads it).
template <class Backend>
void fused_add_rms_norm_out(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& input,
                            const at::Tensor& residual, const std::optional<at::Tensor>& weight, double eps,
                            double weight_offset, bool cast_before_weight) {
  constexpr const char* op = "fused_add_rms_norm";
  NormArgs a = norm_detail::rms_args(op, Backend::device, out, input, weight, eps, weight_offset, cast_before_weight);
  norm_detail::Checker c{op, input, Backend::device, a};
  a.residual_stride = c.like_input(residual, "residual", a.dtype);
  a.residual_out_stride = c.like_input(residual_out, "residual_out", a.dtype);
  check_disjoint_outputs(out, residual_out, op, "out", "residual_out");
  check_output_overlap(out, {{&residual, "residual"}}, op, "out");
  check_output_overlap(residual_out, {{&input, "input"}, {&residual, "residual"}}, op, "residual_out");
  if (weight) check_disjoint_outputs(residual_out, *weight, op, "residual_out", "weight");
  a.residual = residual.const_data_ptr();
  a.residual_out = residual_out.mutable_data_ptr();
  if (a.rows > 0) Backend::run(a);
}

// out = norm(input) * (1 + scale) + shift, norm "rms" or "layer" (no affine), input
// [B, S, D] or [B, D], scale and shift [D], [B, D], [B, 1, D] or [B, S, D] views. With
// `stats` (fp32 [..., 2], a fresh tensor), each row's mean and rstd are stored there too,
// for the backward.
template <class Backend>
void adaln_out(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale, const at::Tensor& shift,
               double eps, const std::string& norm, at::Tensor* stats = nullptr) {
  constexpr const char* op = "adaln";
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.batch_tokens();
  c.adaln(out, scale, shift, eps, norm, {}, stats);
  if (a.rows > 0) Backend::run(a);
}

// residual_out = residual + input * gate (the DiT gated residual); with an output, also
// out = norm(residual_out) * (1 + scale) + shift (the next block's AdaLN) in the same pass,
// and optionally the norm's row statistics (as adaln_out).
template <class Backend>
void gated_residual_out(at::Tensor& residual_out, const std::optional<at::Tensor>& out,
                        const at::Tensor& residual, const at::Tensor& input, const at::Tensor& gate,
                        const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
                        double eps, const std::string& norm, at::Tensor* stats = nullptr) {
  constexpr const char* op = "gated_residual";
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.batch_tokens();
  a.residual_stride = c.like_input(residual, "residual", a.dtype);
  a.residual_out_stride = c.like_input(residual_out, "residual_out", a.dtype);
  check_output_overlap(residual_out, {{&input, "input"}, {&residual, "residual"}, {&gate, "gate"}}, op, "residual_out");
  a.residual = residual.const_data_ptr();
  a.residual_out = residual_out.mutable_data_ptr();
  a.gate = c.modulation(gate, "gate");
  TORCH_CHECK(out.has_value() == scale.has_value() && out.has_value() == shift.has_value(), op,
              ": out, scale and shift come together (the fused AdaLN) or not at all");
  a.normed = out.has_value();
  if (out.has_value()) {
    at::Tensor out_tensor = *out;  // shares out's storage
    check_disjoint_outputs(out_tensor, residual_out, op, "out", "residual_out");
    // A row's residual_out is stored before its scale and shift are read: no shared memory.
    check_disjoint_outputs(residual_out, *scale, op, "residual_out", "scale");
    check_disjoint_outputs(residual_out, *shift, op, "residual_out", "shift");
    c.adaln(out_tensor, *scale, *shift, eps, norm, {{&residual, "residual"}, {&gate, "gate"}}, stats);
  }
  if (a.rows > 0) Backend::run(a);
}

// Backward of rms_norm (and of fused_add_rms_norm, whose residual_out grad is
// grad_extra): returns (grad_input, grad_weight); grad_weight is [D] of the weight's dtype,
// or an empty tensor without a weight. Its column sums add in fp32 in a fixed order.
template <class Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& input,
                                                     const std::optional<at::Tensor>& weight, double eps,
                                                     double weight_offset, bool cast_before_weight,
                                                     const std::optional<at::Tensor>& grad_extra) {
  constexpr const char* op = "rms_norm_backward";
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.weight(weight, /*fp32_allowed=*/true);
  norm_detail::check_eps(eps, op);
  NormBackwardArgs b;
  at::Tensor grad_input = norm_detail::backward_args(b, a, c, grad_out, grad_extra, a.weight_fp32);
  b.eps = static_cast<float>(eps);
  b.factor_offset = static_cast<float>(weight_offset);  // g = weight_offset + weight
  b.cast_before_weight = cast_before_weight;
  b.group_rows = b.rows;
  // The weight's grad: fp32 column sums, rounded once to the weight's dtype by the runner.
  at::Tensor grad_weight = at::empty({0}, input.options());
  if (weight.has_value()) {
    grad_weight = at::empty({b.cols}, weight->options().memory_format(at::MemoryFormat::Contiguous));
    b.factor_sums = grad_weight.mutable_data_ptr();
    b.factor_sums_fp32 = weight->scalar_type() == at::kFloat;
  }
  if (b.rows > 0) {
    Backend::run(b);
  } else {
    grad_weight.zero_();
  }
  return {grad_input, grad_weight};
}

// Backward of adaln: returns (grad_input, grad_scale, grad_shift) in the sizes and dtypes of
// input, scale and shift; grad_extra, if given, is added to grad_input. `stats`, the
// forward's row statistics, saves the backward computing them again (LayerNorm: a
// reduction per row).
template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_backward(const at::Tensor& grad_out, const at::Tensor& input,
                                                               const at::Tensor& scale, const at::Tensor& shift,
                                                               double eps, const std::string& norm,
                                                               const std::optional<at::Tensor>& grad_extra,
                                                               const std::optional<at::Tensor>& stats) {
  NormArgs a;
  norm_detail::Checker c{"adaln_backward", input, Backend::device, a};
  NormBackwardArgs b;
  at::Tensor grad_input =
      norm_detail::adaln_backward_args(b, c, grad_out, scale, shift, eps, norm, grad_extra, stats, "grad_extra");
  norm_detail::group_by_batch_entry(b);
  auto grad_scale = norm_detail::modulation_grad(scale, input, b, b.factor_rows, b.factor_sums, b.factor_sums_fp32);
  auto grad_shift = norm_detail::modulation_grad(shift, input, b, b.shift_rows, b.shift_sums, b.shift_sums_fp32);
  if (b.rows > 0) Backend::run(b);
  return {grad_input, grad_scale.finish(scale), grad_shift.finish(shift)};
}

// Backward of gated_residual_adaln (residual_out = residual + input * gate, out =
// adaln(residual_out)) in one pass: returns (grad_residual, grad_input, grad_gate,
// grad_scale, grad_shift). grad_residual is adaln_backward's grad_input with
// grad_residual_out as its grad_extra; grad_input and grad_gate are gated_residual_backward's
// formulas on grad_residual as stored, in the same pass (no second read of it).
template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_residual_adaln_backward(
    const at::Tensor& grad_out, const at::Tensor& grad_residual_out, const at::Tensor& residual_out,
    const at::Tensor& input, const at::Tensor& gate, const at::Tensor& scale, const at::Tensor& shift, double eps,
    const std::string& norm, const std::optional<at::Tensor>& stats) {
  NormArgs a;
  norm_detail::Checker c{"gated_residual_adaln_backward", input, Backend::device, a};
  NormBackwardArgs b;
  at::Tensor grad_residual = norm_detail::adaln_backward_args(b, c, grad_out, scale, shift, eps, norm,
                                                              grad_residual_out, stats, "grad_residual_out");
  // The norm's input is residual_out; input is the gated one.
  b.gate_input = b.input, b.gate_input_stride = b.input_stride;
  b.input_stride = c.like_input(residual_out, "residual_out", a.dtype);
  b.input = residual_out.const_data_ptr();
  b.gate = c.modulation(gate, "gate");
  at::Tensor grad_input = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  b.gate_input_grad = grad_input.mutable_data_ptr();
  norm_detail::group_by_batch_entry(b);
  auto grad_scale = norm_detail::modulation_grad(scale, input, b, b.factor_rows, b.factor_sums, b.factor_sums_fp32);
  auto grad_shift = norm_detail::modulation_grad(shift, input, b, b.shift_rows, b.shift_sums, b.shift_sums_fp32);
  auto grad_gate = norm_detail::modulation_grad(gate, input, b, b.gate_rows, b.gate_sums, b.gate_sums_fp32);
  if (b.rows > 0) Backend::run(b);
  return {grad_residual, grad_input, grad_gate.finish(gate), grad_scale.finish(scale), grad_shift.finish(shift)};
}

// Backward of gated_residual's input * gate: returns (grad_input, grad_gate) = (grad_out *
// gate, grad_out * input reduced to the gate's sizes) in one pass, the gate's column sums
// in fp32 in a fixed order. The residual's grad is grad_out itself.
template <class Backend>
std::tuple<at::Tensor, at::Tensor> gated_residual_backward(const at::Tensor& grad_out, const at::Tensor& input,
                                                           const at::Tensor& gate) {
  constexpr const char* op = "gated_residual_backward";
  NormArgs a;
  norm_detail::Checker c{op, input, Backend::device, a};
  c.check_input();
  c.batch_tokens();
  a.normed = false;
  a.scale = c.modulation(gate, "gate");
  NormBackwardArgs b;
  at::Tensor grad_input = norm_detail::backward_args(b, a, c, grad_out, std::nullopt, /*grad_fp32_allowed=*/false);
  b.factor_offset = 0.f;  // g = gate
  norm_detail::group_by_batch_entry(b);
  auto grad_gate = norm_detail::modulation_grad(gate, input, b, b.factor_rows, b.factor_sums, b.factor_sums_fp32);
  if (b.rows > 0) Backend::run(b);
  return {grad_input, grad_gate.finish(gate)};
}

}  // namespace ltx

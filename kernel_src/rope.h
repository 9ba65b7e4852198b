// Rotary position embeddings for q and k in one launch, two pairings of channels:
//   rotate-half (transformers' apply_rotary_pos_emb): channel i < R/2 pairs with i + R/2,
//     out = x * cos + cat(-x2, x1) * sin;
//   interleaved (diffusers' apply_rotary_emb, LTX-Video and FLUX): channels (2i, 2i+1),
//     out[2i] = x[2i] cos[2i] - x[2i+1] sin[2i], out[2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1].
// Only the first R = cos.size(-1) channels rotate (partial rotary); the rest pass through.
// fp32 math, one rounding to the input dtype.
//
// Layouts: q and k are [B, S, C] (LTX: one "head" of C channels; sequence_dim 1), [B, H, S, D]
// (transformers, FLUX) or [B, S, H, D] (FLUX, sequence_dim = 1), each with any strides but
// a contiguous last dim (transposed views work); k may have fewer heads (GQA). cos and sin
// are [S, R] or [B, S, R] in the input dtype or float32.
#pragma once

#include "common.h"

#include <limits>

namespace ltx {

// One of q or k seen as [B, H, S, D] with element strides for b, h and s.
struct RopeTensor {
  void* out = nullptr;
  const void* in = nullptr;
  int64_t heads = 0;
  int64_t in_b = 0, in_h = 0, in_s = 0;
  int64_t out_b = 0, out_h = 0, out_s = 0;
};

struct RopeArgs {
  at::ScalarType dtype = at::kFloat;
  bool table_fp32 = false;  // cos/sin float32 with fp16/bf16 q and k
  bool interleaved = false;
  bool inverse = false;  // rotate by -theta with the tables' pairing transposed: the backward
  c10::Device device = c10::Device(c10::kCPU);
  RopeTensor q, k;
  const void* cos = nullptr;  // [B or 1, S, R]
  const void* sin = nullptr;
  int64_t table_b = 0, table_s = 0;  // element strides of cos and sin (0 when broadcast)
  int64_t batch = 0, seq = 0, head_dim = 0, rotary_dim = 0;
};

// The LTX-Video attention prologue: q and k [B, S, C] (to_q / to_k outputs) each
// RMS-normalised over all C channels with their own weight (torch.nn.RMSNorm, rounded to
// the input dtype as that module returns), then rotated with interleaved RoPE.
struct QkNormRopeArgs {
  at::ScalarType dtype = at::kFloat;
  bool table_fp32 = false;
  c10::Device device = c10::Device(c10::kCPU);
  void* q_out = nullptr;
  void* k_out = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* q_weight = nullptr;  // [C]
  const void* k_weight = nullptr;
  const void* cos = nullptr;  // [B or 1, S, C]
  const void* sin = nullptr;
  int64_t q_stride = 0, k_stride = 0, q_out_stride = 0, k_out_stride = 0;  // between (b, s) rows
  int64_t table_b = 0, table_s = 0;
  int64_t batch = 0, seq = 0, channels = 0;
  float eps = 0.f, inv_channels = 0.f;
};

void run_rope_cpu(const RopeArgs& args);
void run_qk_norm_rope_cpu(const QkNormRopeArgs& args);
#if defined(CUDA_KERNEL)
void run_rope_cuda(const RopeArgs& args);
void run_qk_norm_rope_cuda(const QkNormRopeArgs& args);
// Widest row the fused kernel keeps in registers: 512 threads x 4 vectors of 16 bytes.
constexpr int64_t kQkNormRopeMaxRowBytes = 512 * 4 * 16;
#endif

struct CpuRope {
  static constexpr c10::DeviceType device = c10::kCPU;
  static constexpr int64_t max_row_bytes = std::numeric_limits<int64_t>::max();
  static void run(const RopeArgs& a) { run_rope_cpu(a); }
  static void run(const QkNormRopeArgs& a) { run_qk_norm_rope_cpu(a); }
};
#if defined(CUDA_KERNEL)
struct CudaRope {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static constexpr int64_t max_row_bytes = kQkNormRopeMaxRowBytes;
  static void run(const RopeArgs& a) { run_rope_cuda(a); }
  static void run(const QkNormRopeArgs& a) { run_qk_norm_rope_cuda(a); }
};
#endif

namespace rope_detail {

// Sizes and strides of t as [B, H, S, D].
struct Bhsd {
  int64_t size[4];
  int64_t stride[4];
};

inline Bhsd as_bhsd(const at::Tensor& t, int64_t sequence_dim, const char* op, const char* arg) {
  TORCH_CHECK(t.dim() == 3 || t.dim() == 4, op, ": ", arg, " must be [B, S, C], [B, H, S, D] or [B, S, H, D], got sizes ",
              t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, ": ", arg, " must be contiguous in its last dim, got strides ",
              t.strides());
  if (t.dim() == 3) {
    TORCH_CHECK(sequence_dim == 1, op, ": sequence_dim must be 1 for a 3-D ", arg, " ([B, S, C]), got ", sequence_dim);
    return {{t.size(0), 1, t.size(1), t.size(2)}, {t.stride(0), 0, t.stride(1), 1}};
  }
  TORCH_CHECK(sequence_dim == 1 || sequence_dim == 2, op, ": sequence_dim must be 1 ([B, S, H, D]) or 2 ([B, H, S, D]), got ",
              sequence_dim);
  const int64_t s = sequence_dim, h = 3 - sequence_dim;
  return {{t.size(0), t.size(h), t.size(s), t.size(3)}, {t.stride(0), t.stride(h), t.stride(s), 1}};
}

inline void fill(RopeTensor& r, const Bhsd& in, const Bhsd& out, const at::Tensor& in_t, at::Tensor& out_t) {
  r.in = in_t.const_data_ptr();
  r.out = out_t.mutable_data_ptr();
  r.heads = in.size[1];
  r.in_b = in.stride[0], r.in_h = in.stride[1], r.in_s = in.stride[2];
  r.out_b = out.stride[0], r.out_h = out.stride[1], r.out_s = out.stride[2];
}

struct Table {
  bool fp32;  // float32 tables with fp16/bf16 q and k
  int64_t batch_stride, seq_stride, dim;
};

// cos and sin: [S, R] or [B, S, R] of x's dtype or float32, one layout for both.
inline Table check_tables(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& x, int64_t batch, int64_t seq,
                          const char* op, const char* x_name = "q") {
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{&cos, "cos"}, {&sin, "sin"}}) {
    check_same_device(*t, x, op, arg, x_name);
    TORCH_CHECK(t->scalar_type() == x.scalar_type() || (t->scalar_type() == at::kFloat && is_16bit(x.scalar_type())),
                op, ": ", arg, " has dtype ", t->scalar_type(), "; expected ", x_name, "'s dtype (", x.scalar_type(), ")",
                x.scalar_type() == at::kDouble ? "" : " or float32");
    TORCH_CHECK(t->dim() == 2 || t->dim() == 3, op, ": ", arg, " must be [S, R] or [B, S, R], got sizes ", t->sizes());
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1, op, ": ", arg, " must be contiguous in its last dim");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.scalar_type() == sin.scalar_type(), op,
              ": cos and sin must share sizes, strides and dtype, got ", cos.sizes(), cos.strides(), " and ", sin.sizes(),
              sin.strides());
  const int64_t table_batch = cos.dim() == 3 ? cos.size(0) : 1;
  TORCH_CHECK(cos.size(-2) == seq && (table_batch == batch || table_batch == 1), op, ": cos has sizes ", cos.sizes(),
              "; expected [S, R] or [B, S, R] with B = ", batch, ", S = ", seq);
  return {cos.scalar_type() == at::kFloat && is_16bit(x.scalar_type()), table_batch > 1 ? cos.stride(0) : 0,
          cos.stride(-2), cos.size(-1)};
}

// q_out may be q and k_out may be k (in place), but neither may share memory with the
// other tensor or with `shared` (tables, weights): threads of other heads and rows still
// read those after an output element is written.
inline void check_outputs_apart(const at::Tensor& q_out, const at::Tensor& k_out, const at::Tensor& q,
                                const at::Tensor& k,
                                std::initializer_list<Named> shared,
                                const char* op) {
  check_disjoint_outputs(q_out, k, op, "q_out", "k");
  check_disjoint_outputs(k_out, q, op, "k_out", "q");
  for (const auto& [t, arg] : shared) {
    check_disjoint_outputs(q_out, *t, op, "q_out", arg);
    check_disjoint_outputs(k_out, *t, op, "k_out", arg);
  }
}

}  // namespace rope_detail

// q_out, k_out = rope(q), rope(k), or with inverse the transpose of that linear map (the
// backward: grads in, grads out); the outputs may be q and k themselves (in place).
template <class Backend>
void rope_apply(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                const at::Tensor& sin, bool interleaved, int64_t sequence_dim, bool inverse) {
  using rope_detail::as_bhsd;
  const char* op = inverse ? "rope_backward" : "rope";
  // the names the op's schema gives q and k
  const char* q_name = inverse ? "grad_q" : "q";
  const char* k_name = inverse ? "grad_k" : "k";
  check_device(q, Backend::device, op, q_name);
  check_float_dtype(q, op, q_name);
  RopeArgs a;
  a.dtype = q.scalar_type();
  a.device = q.device();
  a.interleaved = interleaved;
  a.inverse = inverse;
  const auto qv = as_bhsd(q, sequence_dim, op, q_name);
  a.batch = qv.size[0], a.seq = qv.size[2], a.head_dim = qv.size[3];
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{&k, k_name}, {&q_out, "q_out"}, {&k_out, "k_out"}}) {
    check_same_device(*t, q, op, arg, q_name);
    TORCH_CHECK(t->scalar_type() == a.dtype, op, ": ", arg, " has dtype ", t->scalar_type(), " but ", q_name,
                " has dtype ", a.dtype);
  }
  TORCH_CHECK(k.dim() == q.dim(), op, ": ", k_name, " has sizes ", k.sizes(), " but ", q_name, " has sizes ", q.sizes());
  const auto kv = as_bhsd(k, sequence_dim, op, k_name);
  TORCH_CHECK(kv.size[0] == a.batch && kv.size[2] == a.seq && kv.size[3] == a.head_dim, op, ": ", k_name, " has sizes ",
              k.sizes(), " but ", q_name, " has sizes ", q.sizes(),
              " (batch, sequence and head dim must agree; heads may differ)");
  TORCH_CHECK(q_out.sizes() == q.sizes(), op, ": q_out has sizes ", q_out.sizes(), " but q has sizes ", q.sizes());
  TORCH_CHECK(k_out.sizes() == k.sizes(), op, ": k_out has sizes ", k_out.sizes(), " but k has sizes ", k.sizes());
  check_output_overlap(q_out, {{&q, q_name}, {&k, k_name}, {&cos, "cos"}, {&sin, "sin"}}, op, "q_out");
  check_output_overlap(k_out, {{&q, q_name}, {&k, k_name}, {&cos, "cos"}, {&sin, "sin"}}, op, "k_out");
  check_disjoint_outputs(q_out, k_out, op, "q_out", "k_out");
  rope_detail::check_outputs_apart(q_out, k_out, q, k, {{&cos, "cos"}, {&sin, "sin"}}, op);
  rope_detail::fill(a.q, qv, as_bhsd(q_out, sequence_dim, op, "q_out"), q, q_out);
  rope_detail::fill(a.k, kv, as_bhsd(k_out, sequence_dim, op, "k_out"), k, k_out);

  const rope_detail::Table table = rope_detail::check_tables(cos, sin, q, a.batch, a.seq, op, q_name);
  a.table_fp32 = table.fp32;
  a.table_b = table.batch_stride;
  a.table_s = table.seq_stride;
  a.rotary_dim = table.dim;
  // (an empty head dim rotates nothing: empty tables)
  TORCH_CHECK(a.rotary_dim % 2 == 0 && a.rotary_dim <= a.head_dim && (a.rotary_dim > 0 || a.head_dim == 0), op,
              ": cos's last dim (the rotary dim) must be even and in [2, ", a.head_dim, "], got ", a.rotary_dim);
  a.cos = cos.const_data_ptr();
  a.sin = sin.const_data_ptr();
  if (a.batch * a.seq * a.head_dim > 0) Backend::run(a);
}

template <class Backend>
void rope_out(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
              const at::Tensor& sin, bool interleaved, int64_t sequence_dim) {
  rope_apply<Backend>(q_out, k_out, q, k, cos, sin, interleaved, sequence_dim, /*inverse=*/false);
}

// q_out, k_out = rope(rms_norm(q, q_weight)), rope(rms_norm(k, k_weight)), interleaved;
// q, k [B, S, C] with (b, s) rows of one stride each; the outputs may be q and k.
template <class Backend>
void qk_norm_rope_out(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin,
                      double eps) {
  constexpr const char* op = "qk_norm_rope";
  check_device(q, Backend::device, op, "q");
  check_float_dtype(q, op, "q");
  TORCH_CHECK(q.dim() == 3, op, ": q must be [B, S, C], got sizes ", q.sizes());
  QkNormRopeArgs a;
  a.dtype = q.scalar_type();
  a.device = q.device();
  a.batch = q.size(0), a.seq = q.size(1), a.channels = q.size(2);
  TORCH_CHECK(a.channels % 2 == 0 && a.channels * c10::elementSize(a.dtype) <= Backend::max_row_bytes, op,
              ": C must be even and at most ", Backend::max_row_bytes / c10::elementSize(a.dtype), " for ", a.dtype,
              ", got ", a.channels);
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{&k, "k"}, {&q_out, "q_out"}, {&k_out, "k_out"}}) {
    check_same_device(*t, q, op, arg, "q");
    TORCH_CHECK(t->scalar_type() == a.dtype, op, ": ", arg, " has dtype ", t->scalar_type(), " but q has dtype ", a.dtype);
    TORCH_CHECK(t->sizes() == q.sizes(), op, ": ", arg, " has sizes ", t->sizes(), " but q has sizes ", q.sizes());
  }
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{&q_weight, "q_weight"}, {&k_weight, "k_weight"}}) {
    check_same_device(*t, q, op, arg, "q");
    TORCH_CHECK(t->scalar_type() == a.dtype, op, ": ", arg, " has dtype ", t->scalar_type(), " but q has dtype ", a.dtype);
    TORCH_CHECK(t->dim() == 1 && t->size(0) == a.channels && (t->stride(0) == 1 || a.channels <= 1), op, ": ", arg,
                " must be a contiguous [", a.channels, "], got sizes ", t->sizes());
  }
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  const rope_detail::Table table = rope_detail::check_tables(cos, sin, q, a.batch, a.seq, op);
  TORCH_CHECK(table.dim == a.channels, op, ": cos's last dim must be C = ", a.channels, ", got ", table.dim);
  a.table_fp32 = table.fp32;
  a.table_b = table.batch_stride;
  a.table_s = table.seq_stride;
  check_output_overlap(q_out, {{&q, "q"}, {&k, "k"}, {&cos, "cos"}, {&sin, "sin"}}, op, "q_out");
  check_output_overlap(k_out, {{&q, "q"}, {&k, "k"}, {&cos, "cos"}, {&sin, "sin"}}, op, "k_out");
  check_disjoint_outputs(q_out, k_out, op, "q_out", "k_out");
  rope_detail::check_outputs_apart(q_out, k_out, q, k,
                                   {{&cos, "cos"}, {&sin, "sin"}, {&q_weight, "q_weight"}, {&k_weight, "k_weight"}}, op);
  a.q = q.const_data_ptr(), a.k = k.const_data_ptr();
  a.q_out = q_out.mutable_data_ptr(), a.k_out = k_out.mutable_data_ptr();
  a.q_weight = q_weight.const_data_ptr(), a.k_weight = k_weight.const_data_ptr();
  a.cos = cos.const_data_ptr(), a.sin = sin.const_data_ptr();
  a.q_stride = row_view(q, op, "q").row_stride, a.k_stride = row_view(k, op, "k").row_stride;
  a.q_out_stride = row_view(q_out, op, "q_out").row_stride;
  a.k_out_stride = row_view(k_out, op, "k_out").row_stride;
  a.eps = static_cast<float>(eps);
  a.inv_channels = 1.0f / static_cast<float>(a.channels);
  if (a.batch * a.seq > 0 && a.channels > 0) Backend::run(a);
}

}  // namespace ltx

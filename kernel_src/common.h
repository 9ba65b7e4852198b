// Host-side helpers shared by every op's CUDA and CPU entry points: the one dtype
// dispatch, argument checks with values in their messages, and row geometry.
// Lean on purpose: no torch/all.h (5x slower builds).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>
#include <type_traits>

namespace ltx {

// The dtypes every op takes. One dispatch for the whole package: the body sees
// `scalar_t` as c10::Half, c10::BFloat16 or float.
#define LTX_DISPATCH_FLOAT_TYPES(DTYPE, NAME, ...)                                   \
  [&] {                                                                              \
    switch (DTYPE) {                                                                 \
      case at::ScalarType::Float: {                                                  \
        using scalar_t = float;                                                      \
        return __VA_ARGS__();                                                        \
      }                                                                              \
      case at::ScalarType::Half: {                                                   \
        using scalar_t = c10::Half;                                                  \
        return __VA_ARGS__();                                                        \
      }                                                                              \
      case at::ScalarType::BFloat16: {                                               \
        using scalar_t = c10::BFloat16;                                              \
        return __VA_ARGS__();                                                        \
      }                                                                              \
      default:                                                                       \
        TORCH_CHECK(false, NAME, ": unsupported dtype ", DTYPE,                      \
                    " (expected float32, float16 or bfloat16)");                     \
    }                                                                                \
  }()

// The CPU backend also takes float64 (all of an op's tensors), computed in double: for
// torch.autograd.gradcheck and fp64 references. The CUDA kernels do not.
#define LTX_DISPATCH_CPU_FLOAT_TYPES(DTYPE, NAME, ...) \
  [&] {                                                \
    if ((DTYPE) == at::ScalarType::Double) {           \
      using scalar_t = double;                         \
      return __VA_ARGS__();                            \
    }                                                  \
    return LTX_DISPATCH_FLOAT_TYPES(DTYPE, NAME, __VA_ARGS__); \
  }()

// fp16 or bf16: the input dtypes that may take fp32 weights, tables or outputs beside them.
inline bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// What the CPU twins accumulate in: fp32, or double for float64 tensors.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
struct Type {
  using type = T;
};

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* arg) {
  const at::ScalarType d = t.scalar_type();
  const bool cpu = t.device().is_cpu();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16 || (cpu && d == at::kDouble), op, ": ", arg,
              " has dtype ", d, "; expected float32, float16 or bfloat16",
              cpu ? " (or float64 on the CPU)" : "");
}

inline void check_device(const at::Tensor& t, c10::DeviceType expected, const char* op,
                         const char* arg) {
  TORCH_CHECK(t.device().type() == expected, op, ": ", arg, " is on ", t.device(),
              " but this implementation runs on ", c10::DeviceTypeName(expected),
              " tensors");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* arg_a, const char* arg_b) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", arg_a, " is on ", a.device(), " but ",
              arg_b, " is on ", b.device());
}

// A tensor seen as `rows` rows of `cols` contiguous elements, row r starting at
// data + r * row_stride. Leading dims must collapse into one stride, so slices such
// as qkv[..., :D] work without a copy; anything else is rejected, never copied.
struct RowView {
  int64_t rows;
  int64_t cols;
  int64_t row_stride;  // in elements
};

inline RowView row_view(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.dim() >= 1, op, ": ", arg, " must have at least 1 dim, got a 0-dim tensor");
  const int64_t n = t.dim();
  const int64_t cols = t.size(n - 1);
  TORCH_CHECK(t.stride(n - 1) == 1 || cols <= 1, op, ": ", arg,
              " must be contiguous in its last dim, got stride ", t.stride(n - 1),
              " (call .contiguous() first)");
  if (t.numel() == 0) return {0, cols, cols};  // nothing to stride over
  int64_t rows = 1;
  int64_t row_stride = cols;
  bool have_stride = false;
  // Walk leading dims innermost-first; size-1 dims carry no stride constraint.
  int64_t expected = 0;
  for (int64_t d = n - 2; d >= 0; --d) {
    const int64_t size = t.size(d);
    rows *= size;
    if (size == 1) continue;
    if (!have_stride) {
      row_stride = t.stride(d);
      expected = row_stride * size;
      have_stride = true;
      continue;
    }
    TORCH_CHECK(t.stride(d) == expected, op, ": ", arg, " with sizes ", t.sizes(),
                " and strides ", t.strides(),
                " has leading dims that do not collapse into rows of one stride"
                " (call .contiguous() first)");
    expected *= size;
  }
  TORCH_CHECK(row_stride >= cols || rows <= 1, op, ": ", arg, " has overlapping rows (row stride ",
              row_stride, " < last dim ", cols, ")");
  return {rows, cols, row_stride};
}

// An output must not write one element twice (expanded views) and must not partly
// overlap an input; the very same memory as an input (in place) is fine.
inline void check_output_overlap(const at::Tensor& out, std::initializer_list<const at::Tensor*> inputs,
                                 const char* op, const char* arg) {
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, op, ": ", arg,
              " has elements that share memory (an expanded view?); pass a tensor that owns its memory");
  for (const at::Tensor* in : inputs) {
    if (in == nullptr || !in->defined()) continue;
    TORCH_CHECK(at::get_overlap_status(out, *in) != at::MemOverlapStatus::Partial, op, ": ", arg,
                " partly overlaps an input; outputs may be an input itself or separate memory");
  }
}

// Two tensors that must not share memory at all: two outputs of one op, or an output and
// an input that is still read after the output is written (by other rows or heads).
// (Interleaved slices of one buffer, such as q and k of a fused qkv, are "too hard" to
// tell apart cheaply and pass.)
inline void check_disjoint_outputs(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg_a,
                                   const char* arg_b) {
  const at::MemOverlapStatus status = at::get_overlap_status(a, b);
  TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op, ": ", arg_a,
              " and ", arg_b, " share memory; they must be separate tensors");
}

inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace ltx

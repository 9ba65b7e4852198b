// Host-side helpers shared by every op's CUDA and CPU entry points: the one dtype
// dispatch, argument checks with values in their messages, and row geometry.
// Lean on purpose: no torch/all.h (5x slower builds).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

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

// Memory shared between tensors, told by byte ranges (at::get_overlap_status gives up on
// views that are not dense, which is where the slices of a fused projection live).
namespace overlap_detail {

// The (byte stride, size) of each dim of more than one element; inline storage for the
// usual ranks, so that the checks of every op call allocate nothing.
using StridedDims = c10::SmallVector<std::pair<int64_t, int64_t>, 6>;
inline StridedDims strided_dims(const at::Tensor& t) {
  StridedDims dims;
  const int64_t item = static_cast<int64_t>(t.element_size());
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d) * item, t.size(d));
  }
  return dims;
}

// [first byte, one past the last byte] of t's elements.
inline std::pair<std::uintptr_t, std::uintptr_t> byte_range(const at::Tensor& t) {
  const auto begin = reinterpret_cast<std::uintptr_t>(t.const_data_ptr());
  std::uintptr_t end = begin + t.element_size();
  for (const auto& [stride, size] : strided_dims(t)) end += static_cast<std::uintptr_t>(stride * (size - 1));
  return {begin, end};
}

// The very same elements: one address, element size, sizes and strides (but those of
// size-1 dims, which never move).
inline bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.const_data_ptr() == b.const_data_ptr() && a.element_size() == b.element_size() &&
         a.sizes() == b.sizes() && strided_dims(a) == strided_dims(b);
}

// Within a period of `period` bytes, t's bytes all lie in [start, start + extent) (mod the
// period) when its dims of a stride that is not a multiple of the period span less than
// one period. Returns the extent, or -1 when they span more.
inline int64_t extent_within(const at::Tensor& t, int64_t period) {
  int64_t extent = static_cast<int64_t>(t.element_size());
  for (const auto& [stride, size] : strided_dims(t)) {
    if (stride % period != 0) extent += stride * (size - 1);
  }
  return extent <= period ? extent : -1;
}

// Whether a and b provably share no byte although their ranges overlap: for some period
// (one of their strides), each lies in an interval (mod the period) and the two intervals
// are apart, as column slices of one row-strided buffer are (qkv[..., :D] and qkv[..., D:2D]).
inline bool interleaved_apart(const at::Tensor& a, const at::Tensor& b) {
  const auto a_dims = strided_dims(a), b_dims = strided_dims(b);
  for (const auto* dims : {&a_dims, &b_dims}) {
    for (const auto& [period, size] : *dims) {
      if (period <= 0) continue;
      const int64_t extent_a = extent_within(a, period), extent_b = extent_within(b, period);
      if (extent_a < 0 || extent_b < 0) continue;
      const auto p = static_cast<std::uintptr_t>(period);
      const auto a_start = reinterpret_cast<std::uintptr_t>(a.const_data_ptr()) % p;
      const auto b_start = reinterpret_cast<std::uintptr_t>(b.const_data_ptr()) % p;
      const std::uintptr_t b_after_a = (b_start + p - a_start) % p;  // where b starts, seen from a's start
      if (b_after_a >= static_cast<std::uintptr_t>(extent_a) &&
          p - b_after_a >= static_cast<std::uintptr_t>(extent_b)) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace overlap_detail

enum class Sharing { kNone, kSameView, kPartial };

// kNone: no byte in common (different memory, or provably apart views of one buffer);
// kSameView: the same elements exactly; kPartial: anything else, refused by the checks.
inline Sharing memory_sharing(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) {
    return Sharing::kNone;
  }
  const auto [a_begin, a_end] = overlap_detail::byte_range(a);
  const auto [b_begin, b_end] = overlap_detail::byte_range(b);
  if (a_end <= b_begin || b_end <= a_begin) return Sharing::kNone;
  if (overlap_detail::same_view(a, b)) return Sharing::kSameView;
  return overlap_detail::interleaved_apart(a, b) ? Sharing::kNone : Sharing::kPartial;
}

// Whether each element of t has bytes of its own: with its dims sorted by stride, each
// stride clears the span of the dims inside it. (Some interleavings that also pass that
// test are refused: an output must be plainly non-overlapping.)
inline bool elements_apart(const at::Tensor& t) {
  auto dims = overlap_detail::strided_dims(t);
  std::sort(dims.begin(), dims.end());
  int64_t span = static_cast<int64_t>(t.element_size());
  for (const auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * (size - 1) + span;
  }
  return true;
}

struct Named {
  const at::Tensor* tensor;  // nullptr or undefined: skipped
  const char* name;
};

// An output must not write one element twice (expanded views) and must not share memory
// with an input, but for being that input itself (in place: the same elements exactly).
inline void check_output_overlap(const at::Tensor& out, std::initializer_list<Named> inputs, const char* op,
                                 const char* arg) {
  TORCH_CHECK(out.numel() == 0 || elements_apart(out), op, ": ", arg,
              " has elements that share memory (an expanded view?): sizes ", out.sizes(), " and strides ",
              out.strides(), "; pass a tensor that owns its memory");
  for (const auto& [in, name] : inputs) {
    if (in == nullptr) continue;
    TORCH_CHECK(memory_sharing(out, *in) != Sharing::kPartial, op, ": ", arg, " partly overlaps an input (", name,
                "); an output may be that input itself (the same view: in place) or memory apart from it");
  }
}

// Two tensors that must not share memory at all: two outputs of one op, or an output and
// an input that is still read after the output is written (by other rows or heads).
// Column slices of one buffer, such as q and k of a fused qkv, are apart.
inline void check_disjoint_outputs(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg_a,
                                   const char* arg_b) {
  TORCH_CHECK(memory_sharing(a, b) == Sharing::kNone, op, ": ", arg_a, " and ", arg_b,
              " share memory; they must be separate tensors");
}

inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace ltx

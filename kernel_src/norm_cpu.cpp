// The norm family on the CPU: the twin of norm_forward.cu and norm_backward.cu, same math
// and roundings (fp32 accumulation, the residual sum rounded to the input dtype, one
// rounding at the end; float64 tensors in double), rows spread over threads.
#include "cpu_parallel.h"
#include "fp8_math.h"
#include "norm.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace ltx {
namespace {

// Independent partial sums so that the compiler can vectorise the reduction without
// reassociating one running sum.
constexpr int64_t kLanes = 16;
// Elements per block: each lane sums kBlock / kLanes of them, and the blocks' totals add
// with Kahan compensation, so a sum's error bound does not grow with the row's length.
constexpr int64_t kBlock = 64 * kLanes;

// sum += term, carrying the rounding error in `compensation` (Kahan). An infinite sum
// carries none: inf - inf would turn the next block's sum into NaN.
template <typename A>
[[gnu::always_inline]] inline void add_compensated(A& sum, A& compensation, A term) {
  const A y = term - compensation;
  const A t = sum + y;
  compensation = std::isfinite(t) ? (t - sum) - y : A(0);
  sum = t;
}

// Sum over j < n of term(j), in blocks of lanes (see kBlock).
template <typename A, typename Term>
[[gnu::always_inline]] inline A blocked_sum(int64_t n, Term term) {
  A sum = 0, compensation = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(start + kBlock, n);
    A partial[kLanes] = {};
    int64_t j = start;
    for (; j + kLanes <= end; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) partial[l] += term(j + l);
    }
    for (; j < end; ++j) partial[0] += term(j);
    A block = 0;
    for (int64_t l = 0; l < kLanes; ++l) block += partial[l];
    add_compensated(sum, compensation, block);
  }
  return sum;
}

template <typename A>
[[gnu::always_inline]] inline A sum_of(const A* v, int64_t n, A shift, bool square) {
  return square ? blocked_sum<A>(n, [&](int64_t j) { const A f = v[j] - shift; return f * f; })
                : blocked_sum<A>(n, [&](int64_t j) { return v[j] - shift; });
}

template <typename A>
[[gnu::always_inline]] inline A dot(const A* a, const A* b, int64_t n) {
  return blocked_sum<A>(n, [&](int64_t j) { return a[j] * b[j]; });
}

// LayerNorm's mean, summed as offsets from the row's first element: exactly that element
// for a constant row (whose centred values are then exactly 0, as PyTorch's), and with
// less cancellation than a plain sum where the row sits far from 0.
template <typename A>
[[gnu::always_inline]] inline A row_mean(const A* v, int64_t n, A inv_cols) {
  return v[0] + sum_of<A>(v, n, v[0], false) * inv_cols;
}

template <typename T>
const T* row_of(const void* base, int64_t row, int64_t stride) {
  return base == nullptr ? nullptr : static_cast<const T*>(base) + row * stride;
}

template <typename T>
const T* modulation_row(const Modulation& m, int64_t batch, int64_t token) {
  return m.ptr == nullptr ? nullptr
                          : static_cast<const T*>(m.ptr) + batch * m.batch_stride + token * m.token_stride;
}

// The row's passes have no branch inside a loop, so that GCC vectorises each at -O3 on
// baseline x86-64 (bf16 <-> fp32 conversions are shifts and selects there; fp16's stay
// scalar calls without F16C): the row into fp32 (double) with the residual add, its sums,
// and one pass that writes y, built for the steps a call takes (the rounding before the
// weight, the weight, the modulation) so that it tests none of them per element.
template <typename T, typename W, typename O, bool kCast, bool kWeight, bool kModulate, typename A = acc_t<T>>
LTX_ROW_PASS void write_normed(const NormArgs& a, const A* v, A mean, A rstd, int64_t row, int64_t batch,
                  int64_t token) {
  const W* w = static_cast<const W*>(a.weight);
  const A offset = a.weight_offset;
  const T* scale = modulation_row<T>(a.scale, batch, token);
  const T* shift = modulation_row<T>(a.shift, batch, token);
  O* y = static_cast<O*>(a.out) + row * a.out_stride;
  for (int64_t k = 0; k < a.cols; ++k) {
    A f = (v[k] - mean) * rstd;
    if constexpr (kCast) f = static_cast<A>(static_cast<T>(f));
    if constexpr (kWeight) f *= offset + static_cast<A>(w[k]);
    if constexpr (kModulate) f = f * (1 + static_cast<A>(scale[k])) + static_cast<A>(shift[k]);
    y[k] = static_cast<O>(f);
  }
}

template <typename T, typename W, typename O, typename A = acc_t<T>>
using NormWriter = void (*)(const NormArgs&, const A*, A, A, int64_t, int64_t, int64_t);

template <typename T, typename W, typename O>
NormWriter<T, W, O> normed_writer(const NormArgs& a) {
  const bool cast = a.cast_before_weight, weight = a.weight != nullptr, modulate = a.scale.ptr != nullptr;
  if (modulate) {
    return weight ? cast ? write_normed<T, W, O, true, true, true> : write_normed<T, W, O, false, true, true>
                  : cast ? write_normed<T, W, O, true, false, true> : write_normed<T, W, O, false, false, true>;
  }
  return weight ? cast ? write_normed<T, W, O, true, true, false> : write_normed<T, W, O, false, true, false>
                : cast ? write_normed<T, W, O, true, false, false> : write_normed<T, W, O, false, false, false>;
}

template <typename T, typename W, typename O>
LTX_ROW_PASS void norm_rows(const NormArgs& a, NormWriter<T, W, O> write, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = a.cols;
  const A inv_cols = A(1) / static_cast<A>(n);  // a.inv_cols in fp32
  std::vector<A> buffer(n);                     // the row in fp32 (double), after the residual add
  A* __restrict v = buffer.data();
  // The FP8 output: the fp32 out's row written here (out_stride 0), then quantized into out.
  std::vector<float> fp8_row(a.out_fp8 ? n : 0);
  NormArgs y_args = a;
  if (a.out_fp8) y_args.out = fp8_row.data(), y_args.out_stride = 0;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t batch = r / a.tokens;
    const int64_t token = r - batch * a.tokens;
    const T* x = row_of<T>(a.input, r, a.input_stride);
    const T* res = row_of<T>(a.residual, r, a.residual_stride);
    const T* gate = modulation_row<T>(a.gate, batch, token);
    const A* row = v;
    if (res != nullptr && !a.normed) {  // the gated residual alone: the sum, rounded and stored
      T* res_out = static_cast<T*>(a.residual_out) + r * a.residual_out_stride;
      for (int64_t k = 0; k < n; ++k) {
        res_out[k] = static_cast<T>(static_cast<A>(res[k]) + static_cast<A>(x[k]) * static_cast<A>(gate[k]));
      }
      continue;
    }
    if (res != nullptr) {  // the sum rounded to the dtype, stored and normed
      T* res_out = static_cast<T*>(a.residual_out) + r * a.residual_out_stride;
      if (gate != nullptr) {
        for (int64_t k = 0; k < n; ++k) {
          res_out[k] = static_cast<T>(static_cast<A>(res[k]) + static_cast<A>(x[k]) * static_cast<A>(gate[k]));
          v[k] = static_cast<A>(res_out[k]);  // a T temporary, copied, would keep the loop scalar
        }
      } else {
        for (int64_t k = 0; k < n; ++k) {
          res_out[k] = static_cast<T>(static_cast<A>(res[k]) + static_cast<A>(x[k]));
          v[k] = static_cast<A>(res_out[k]);
        }
      }
    } else if constexpr (std::is_same_v<T, A>) {
      row = x;  // fp32 (double) rows are read as they are
    } else {
      for (int64_t k = 0; k < n; ++k) v[k] = static_cast<A>(x[k]);
    }
    if (!a.normed) continue;  // the gated residual alone

    A mean = 0;
    if (a.kind == NormKind::kLayer) mean = row_mean<A>(row, n, inv_cols);
    const A rstd = A(1) / std::sqrt(sum_of<A>(row, n, mean, true) * inv_cols + a.eps);
    if (a.stats != nullptr) a.stats[2 * r] = static_cast<float>(mean), a.stats[2 * r + 1] = static_cast<float>(rstd);
    write(y_args, row, mean, rstd, r, batch, token);
    if (a.out_fp8) {
      fp8_quantize_row(fp8_row.data(), n, static_cast<c10::Float8_e4m3fn*>(a.out) + r * a.out_stride,
                       a.fp8_scales != nullptr ? a.fp8_scales + r : nullptr, a.fp8_static_scale);
    }
  }
}

template <typename T, typename W, typename O>
void run(const NormArgs& a) {
  // About 32k elements per task: enough work to amortise a thread hand-off.
  const int64_t grain = std::max<int64_t>(1, 32768 / a.cols);
  const NormWriter<T, W, O> write = normed_writer<T, W, O>(a);
  parallel_rows(0, a.rows, grain, [&](int64_t begin, int64_t end) { norm_rows<T, W, O>(a, write, begin, end); });
}

// Rows per column-sum chunk. Fixed, not derived from the thread count, so that the
// sums repeat bit for bit on any machine.
constexpr int64_t kChunkRows = 64;

// Rows [begin, end) of the backward (see NormBackwardArgs); column grads are added to
// factor_acc / shift_acc / gate_acc ([cols] each, or nullptr). As in the forward, each
// pass over the row does one thing without a branch inside, so that it vectorises; the
// arithmetic per element is that of one fused loop.
template <typename T, typename W, typename G, typename A = acc_t<T>>
LTX_ROW_PASS void norm_backward_rows(const NormBackwardArgs& a, int64_t begin, int64_t end, A* factor_acc,
                                     A* shift_acc, A* gate_acc) {
  const int64_t n = a.cols;
  const A inv_cols = A(1) / static_cast<A>(n);  // a.inv_cols in fp32
  std::vector<A> buffers(3 * n);
  A* __restrict centred = buffers.data();  // x - mean, then the normed row
  A* __restrict dy = centred + n;
  A* __restrict dn = dy + n;  // dy times the row's factor, then dx before its rounding, then dr * x
  const W* w = static_cast<const W*>(a.weight);
  const A offset = a.factor_offset;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t batch = r / a.tokens;
    const int64_t token = r - batch * a.tokens;
    const T* x = row_of<T>(a.input, r, a.input_stride);
    const G* g = row_of<G>(a.grad_out, r, a.grad_out_stride);
    const T* extra = row_of<T>(a.grad_extra, r, a.grad_extra_stride);
    const T* scale = modulation_row<T>(a.scale, batch, token);
    for (int64_t k = 0; k < n; ++k) centred[k] = static_cast<A>(x[k]);
    for (int64_t k = 0; k < n; ++k) dy[k] = static_cast<A>(g[k]);
    if (scale != nullptr) {  // the scale is the factor where there is one, else the weight, else 1
      for (int64_t k = 0; k < n; ++k) dn[k] = dy[k] * (offset + static_cast<A>(scale[k]));
    } else if (w != nullptr) {
      for (int64_t k = 0; k < n; ++k) dn[k] = dy[k] * (offset + static_cast<A>(w[k]));
    } else {
      for (int64_t k = 0; k < n; ++k) dn[k] = dy[k];
    }
    const bool layer = a.kind == NormKind::kLayer;
    const bool normed_row = a.normed;  // else the gated residual alone: n = x, dx = dn
    // The forward's statistics (fp32), or computed here: float64 rows always recompute, as
    // fp32 statistics would leave their grads fp32-accurate.
    const float* saved = a.stats != nullptr && !std::is_same_v<A, double> ? a.stats + 2 * r : nullptr;
    const A mean = saved != nullptr ? saved[0] : layer ? row_mean<A>(centred, n, inv_cols) : 0;
    if (mean != A(0)) {  // subtracting 0 would change no bit
      for (int64_t k = 0; k < n; ++k) centred[k] -= mean;
    }
    const A rstd = saved != nullptr ? saved[1]
                   : normed_row ? A(1) / std::sqrt(sum_of<A>(centred, n, 0, true) * inv_cols + a.eps)
                                : A(1);
    const A mean_dn_n = normed_row ? dot(dn, centred, n) * rstd * inv_cols : 0;
    const A mean_dn = layer ? sum_of<A>(dn, n, 0, false) * inv_cols : 0;

    // dn becomes dx before its rounding: without a norm dn as is (an infinite x times a zero
    // mean_dn_n would make it NaN)
    if (normed_row) {
      for (int64_t k = 0; k < n; ++k) dn[k] = rstd * (dn[k] - mean_dn - centred[k] * rstd * mean_dn_n);
    }
    if (extra != nullptr) {
      for (int64_t k = 0; k < n; ++k) dn[k] += static_cast<A>(extra[k]);
    }
    T* dx = static_cast<T*>(a.grad_input) + r * n;
    for (int64_t k = 0; k < n; ++k) dx[k] = static_cast<T>(dn[k]);
    if (const T* gate = modulation_row<T>(a.gate, batch, token); gate != nullptr) {
      // from dx as stored, as gated_residual_backward would read it
      const T* gated = row_of<T>(a.gate_input, r, a.gate_input_stride);
      T* gated_grad = static_cast<T*>(a.gate_input_grad) + r * n;
      for (int64_t k = 0; k < n; ++k) gated_grad[k] = static_cast<T>(static_cast<A>(dx[k]) * static_cast<A>(gate[k]));
      for (int64_t k = 0; k < n; ++k) dn[k] = static_cast<A>(dx[k]) * static_cast<A>(gated[k]);  // dr * x
      if (a.gate_rows != nullptr) {
        T* gate_row = static_cast<T*>(a.gate_rows) + r * n;
        for (int64_t k = 0; k < n; ++k) gate_row[k] = static_cast<T>(dn[k]);
      }
      if (gate_acc != nullptr) {
        for (int64_t k = 0; k < n; ++k) gate_acc[k] += dn[k];
      }
    }
    if (rstd != A(1)) {  // the normed row (times 1 it is the row)
      for (int64_t k = 0; k < n; ++k) centred[k] *= rstd;
    }
    if (a.cast_before_weight) {
      for (int64_t k = 0; k < n; ++k) centred[k] = static_cast<A>(static_cast<T>(centred[k]));
    }
    if (a.factor_rows != nullptr) {
      T* factor_row = static_cast<T*>(a.factor_rows) + r * n;
      for (int64_t k = 0; k < n; ++k) factor_row[k] = static_cast<T>(dy[k] * centred[k]);
    }
    if (factor_acc != nullptr) {
      for (int64_t k = 0; k < n; ++k) factor_acc[k] += dy[k] * centred[k];
    }
    if (a.shift_rows != nullptr) {
      T* shift_row = static_cast<T*>(a.shift_rows) + r * n;
      for (int64_t k = 0; k < n; ++k) shift_row[k] = static_cast<T>(dy[k]);
    }
    if (shift_acc != nullptr) {
      for (int64_t k = 0; k < n; ++k) shift_acc[k] += dy[k];
    }
  }
}

template <typename T, typename W, typename G>
void run_backward(const NormBackwardArgs& a) {
  using A = acc_t<T>;
  const int64_t n = a.cols;
  const int64_t groups = a.rows / a.group_rows;
  const int64_t chunks = (a.group_rows + kChunkRows - 1) / kChunkRows;  // per group
  std::vector<A> factor_partial(a.factor_sums != nullptr ? groups * chunks * n : 0);
  std::vector<A> shift_partial(a.shift_sums != nullptr ? groups * chunks * n : 0);
  std::vector<A> gate_partial(a.gate_sums != nullptr ? groups * chunks * n : 0);
  auto partial_row = [&](std::vector<A>& p, int64_t chunk) { return p.empty() ? nullptr : p.data() + chunk * n; };
  parallel_rows(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t group = c / chunks;
      const int64_t first = group * a.group_rows + (c - group * chunks) * kChunkRows;
      const int64_t last = std::min(first + kChunkRows, (group + 1) * a.group_rows);
      norm_backward_rows<T, W, G>(a, first, last, partial_row(factor_partial, c), partial_row(shift_partial, c),
                                  partial_row(gate_partial, c));
    }
  });
  // The chunks' partial sums in order, in fp32 (double), then stored in the sums' dtype.
  auto add_chunks = [&](const std::vector<A>& partial, auto* sums) {
    std::vector<A> total(n);
    for (int64_t g = 0; g < groups; ++g) {
      std::fill(total.begin(), total.end(), A(0));
      for (int64_t c = 0; c < chunks; ++c) {
        const A* p = partial.data() + (g * chunks + c) * n;
        for (int64_t k = 0; k < n; ++k) total[k] += p[k];
      }
      using S = std::remove_pointer_t<decltype(sums)>;
      for (int64_t k = 0; k < n; ++k) sums[g * n + k] = static_cast<S>(total[k]);
    }
  };
  for (const auto& [partial, sums, fp32] : {std::tuple{&factor_partial, a.factor_sums, a.factor_sums_fp32},
                                            std::tuple{&shift_partial, a.shift_sums, a.shift_sums_fp32},
                                            std::tuple{&gate_partial, a.gate_sums, a.gate_sums_fp32}}) {
    if (sums == nullptr) continue;
    fp32 ? add_chunks(*partial, static_cast<float*>(sums)) : add_chunks(*partial, static_cast<T*>(sums));
  }
}

}  // namespace

void run_norm_backward_cpu(const NormBackwardArgs& a) {
  LTX_DISPATCH_CPU_FLOAT_TYPES(a.dtype, "norm_backward", [&] {
    using T = scalar_t;
    with_weight_types<T>(a.weight_fp32, a.grad_fp32, [&](auto w, auto g) {
      run_backward<T, typename decltype(w)::type, typename decltype(g)::type>(a);
    });
  });
}

void run_norm_cpu(const NormArgs& a) {
  LTX_DISPATCH_CPU_FLOAT_TYPES(a.dtype, "norm", [&] {
    using T = scalar_t;
    if constexpr (!std::is_same_v<T, double>) {  // FP8 outputs refuse float64
      if (a.out_fp8) return a.weight_fp32 ? run<T, float, float>(a) : run<T, T, float>(a);  // y in fp32
    }
    with_weight_types<T>(a.weight_fp32, a.out_fp32, [&](auto w, auto o) {
      run<T, typename decltype(w)::type, typename decltype(o)::type>(a);
    });
  });
}

}  // namespace ltx

// RoPE on the CPU: the twin of rope.cu, same fp32 formulas (double for float64 tensors)
// and one rounding; rows of q and k spread over threads.
#include <ATen/Parallel.h>

#include "rope.h"

#include <cmath>
#include <utility>
#include <vector>

namespace ltx {
namespace {

template <typename T, typename C>
void rotate_rows(const RopeArgs& a, const RopeTensor& t, int64_t begin, int64_t end) {
  const T* in_base = static_cast<const T*>(t.in);
  T* out_base = static_cast<T*>(t.out);
  const int64_t per_batch = t.heads * a.seq;
  const int64_t half = a.rotary_dim / 2;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t b = r / per_batch;
    const int64_t h = (r - b * per_batch) / a.seq;
    const int64_t s = r - b * per_batch - h * a.seq;
    const T* in = in_base + b * t.in_b + h * t.in_h + s * t.in_s;
    T* out = out_base + b * t.out_b + h * t.out_h + s * t.out_s;
    const C* cos = static_cast<const C*>(a.cos) + b * a.table_b + s * a.table_s;
    const C* sin = static_cast<const C*>(a.sin) + b * a.table_b + s * a.table_s;
    using A = acc_t<T>;
    auto f = [](auto v) { return static_cast<A>(v); };
    // The backward (inverse) swaps and negates the sines of each pair.
    auto sines = [&](int64_t first, int64_t second) {
      return a.inverse ? std::pair<A, A>{-f(sin[second]), -f(sin[first])}
                       : std::pair<A, A>{f(sin[first]), f(sin[second])};
    };
    if (a.interleaved) {
      for (int64_t i = 0; i < a.rotary_dim; i += 2) {
        const A x0 = f(in[i]), x1 = f(in[i + 1]);
        const auto [s0, s1] = sines(i, i + 1);
        out[i] = static_cast<T>(x0 * f(cos[i]) - x1 * s0);
        out[i + 1] = static_cast<T>(x1 * f(cos[i + 1]) + x0 * s1);
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const A x0 = f(in[i]), x1 = f(in[i + half]);
        const auto [s0, s1] = sines(i, i + half);
        out[i] = static_cast<T>(x0 * f(cos[i]) - x1 * s0);
        out[i + half] = static_cast<T>(x1 * f(cos[i + half]) + x0 * s1);
      }
    }
    if (out != in) {
      for (int64_t i = a.rotary_dim; i < a.head_dim; ++i) out[i] = in[i];
    }
  }
}

template <typename T, typename C>
void run(const RopeArgs& a) {
  const int64_t grain = std::max<int64_t>(1, 16384 / a.head_dim);
  for (const RopeTensor* t : {&a.q, &a.k}) {
    at::parallel_for(0, a.batch * t->heads * a.seq, grain,
                     [&](int64_t begin, int64_t end) { rotate_rows<T, C>(a, *t, begin, end); });
  }
}

template <typename T, typename C>
void qk_norm_rope_rows(const QkNormRopeArgs& a, bool is_q, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = a.channels;
  const A inv_channels = A(1) / static_cast<A>(n);  // a.inv_channels in fp32
  std::vector<A> normed(n);
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(is_q ? a.q : a.k) + r * (is_q ? a.q_stride : a.k_stride);
    T* y = static_cast<T*>(is_q ? a.q_out : a.k_out) + r * (is_q ? a.q_out_stride : a.k_out_stride);
    const T* w = static_cast<const T*>(is_q ? a.q_weight : a.k_weight);
    const int64_t b = r / a.seq;
    const C* cos = static_cast<const C*>(a.cos) + b * a.table_b + (r - b * a.seq) * a.table_s;
    const C* sin = static_cast<const C*>(a.sin) + b * a.table_b + (r - b * a.seq) * a.table_s;
    A sum_sq = 0;
    for (int64_t i = 0; i < n; ++i) sum_sq += static_cast<A>(x[i]) * static_cast<A>(x[i]);
    const A rstd = A(1) / std::sqrt(sum_sq * inv_channels + a.eps);
    for (int64_t i = 0; i < n; ++i) {
      normed[i] = static_cast<A>(static_cast<T>(static_cast<A>(x[i]) * rstd * static_cast<A>(w[i])));
    }
    for (int64_t i = 0; i < n; i += 2) {
      const A x0 = normed[i], x1 = normed[i + 1];
      y[i] = static_cast<T>(x0 * static_cast<A>(cos[i]) - x1 * static_cast<A>(sin[i]));
      y[i + 1] = static_cast<T>(x1 * static_cast<A>(cos[i + 1]) + x0 * static_cast<A>(sin[i + 1]));
    }
  }
}

template <typename T, typename C>
void run_qk_norm_rope(const QkNormRopeArgs& a) {
  const int64_t grain = std::max<int64_t>(1, 16384 / a.channels);
  for (bool is_q : {true, false}) {
    at::parallel_for(0, a.batch * a.seq, grain,
                     [&](int64_t begin, int64_t end) { qk_norm_rope_rows<T, C>(a, is_q, begin, end); });
  }
}

}  // namespace

void run_qk_norm_rope_cpu(const QkNormRopeArgs& a) {
  LTX_DISPATCH_CPU_FLOAT_TYPES(a.dtype, "qk_norm_rope", [&] {
    return a.table_fp32 ? run_qk_norm_rope<scalar_t, float>(a) : run_qk_norm_rope<scalar_t, scalar_t>(a);
  });
}

void run_rope_cpu(const RopeArgs& a) {
  LTX_DISPATCH_CPU_FLOAT_TYPES(a.dtype, "rope", [&] {
    return a.table_fp32 ? run<scalar_t, float>(a) : run<scalar_t, scalar_t>(a);
  });
}

}  // namespace ltx

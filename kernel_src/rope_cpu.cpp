// RoPE on the CPU: the twin of rope.cu, same fp32 formulas (double for float64 tensors)
// and one rounding; rows of q and k spread over threads.
#include "cpu_parallel.h"
#include "rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace ltx {
namespace {

// Each row pass is built for baseline x86-64 and for AVX2, and the loader picks the one the
// CPU runs (GCC's target_clones): the library still runs on any x86-64, and AVX2's wider
// vectors, without FMA, compute the same bits.
#if defined(__x86_64__)
#define LTX_ROW_PASS __attribute__((target_clones("avx2", "default")))
#else
#define LTX_ROW_PASS
#endif
// What a row pass calls is inlined into it, and so built for its target too.

// The rotation in passes over fp32 (double) buffers, one operation per pass and no branch
// inside a loop, so that GCC vectorises each at -O3 on baseline x86-64 (with the stride, 1
// or 2, known at compile time). The pairs are (first + i S, second + i S): rotate-half
// (0, R/2; S = 1) or interleaved (0, 1; S = 2).
template <int64_t S, typename A, typename In>
[[gnu::always_inline]] inline void load_strided(A* __restrict x, const In* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<A>(in[i * S]);
}

// y[i S] = a[i] cos[i S] + b[i] (sign sin[i S]): sign * sin is sin or its exact negation.
template <int64_t S, typename T, typename C, typename A>
[[gnu::always_inline]] inline void rotate_pass(T* y, const A* __restrict a, const A* __restrict b, const C* cos, const C* sin, A sign, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i * S] = static_cast<T>(a[i] * static_cast<A>(cos[i * S]) + b[i] * (sign * static_cast<A>(sin[i * S])));
  }
}

// out[first] = x0 cos[first] - x1 s0, out[second] = x1 cos[second] + x0 s1, with (s0, s1) the
// sines (sin[first], sin[second]), or for the inverse (the backward) swapped and negated.
// `out` may be `in`: the pairs are read into x0 and x1 before anything is written.
template <int64_t S, typename T, typename C, typename A, typename In>
[[gnu::always_inline]] inline void rotate_pairs(const In* in, T* out, const C* cos, const C* sin, int64_t first, int64_t second, int64_t n,
                  bool inverse, A* x0, A* x1) {
  load_strided<S>(x0, in + first, n);
  load_strided<S>(x1, in + second, n);
  const A one = 1;
  rotate_pass<S>(out + first, x0, x1, cos + first, sin + (inverse ? second : first), inverse ? one : -one, n);
  rotate_pass<S>(out + second, x1, x0, cos + second, sin + (inverse ? first : second), inverse ? -one : one, n);
}

template <typename T, typename C>
LTX_ROW_PASS void rotate_rows(const RopeArgs& a, const RopeTensor& t, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const T* in_base = static_cast<const T*>(t.in);
  T* out_base = static_cast<T*>(t.out);
  const int64_t per_batch = t.heads * a.seq;
  const int64_t pairs = a.rotary_dim / 2;
  std::vector<A> buffer(2 * pairs);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t b = r / per_batch;
    const int64_t h = (r - b * per_batch) / a.seq;
    const int64_t s = r - b * per_batch - h * a.seq;
    const T* in = in_base + b * t.in_b + h * t.in_h + s * t.in_s;
    T* out = out_base + b * t.out_b + h * t.out_h + s * t.out_s;
    const C* cos = static_cast<const C*>(a.cos) + b * a.table_b + s * a.table_s;
    const C* sin = static_cast<const C*>(a.sin) + b * a.table_b + s * a.table_s;
    if (a.interleaved) {
      rotate_pairs<2>(in, out, cos, sin, 0, 1, pairs, a.inverse, buffer.data(), buffer.data() + pairs);
    } else {
      rotate_pairs<1>(in, out, cos, sin, 0, pairs, pairs, a.inverse, buffer.data(), buffer.data() + pairs);
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
    parallel_rows(0, a.batch * t->heads * a.seq, grain,
                     [&](int64_t begin, int64_t end) { rotate_rows<T, C>(a, *t, begin, end); });
  }
}

// Lanes of the sum of squares: independent partial sums that GCC vectorises, where one
// running sum would stay scalar.
constexpr int64_t kLanes = 8;

template <typename T, typename C>
LTX_ROW_PASS void qk_norm_rope_rows(const QkNormRopeArgs& a, bool is_q, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = a.channels;
  const A inv_channels = A(1) / static_cast<A>(n);  // a.inv_channels in fp32
  std::vector<A> buffer(2 * n);
  A* __restrict normed = buffer.data();
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(is_q ? a.q : a.k) + r * (is_q ? a.q_stride : a.k_stride);
    T* y = static_cast<T*>(is_q ? a.q_out : a.k_out) + r * (is_q ? a.q_out_stride : a.k_out_stride);
    const T* w = static_cast<const T*>(is_q ? a.q_weight : a.k_weight);
    const int64_t b = r / a.seq;
    const C* cos = static_cast<const C*>(a.cos) + b * a.table_b + (r - b * a.seq) * a.table_s;
    const C* sin = static_cast<const C*>(a.sin) + b * a.table_b + (r - b * a.seq) * a.table_s;
    for (int64_t i = 0; i < n; ++i) normed[i] = static_cast<A>(x[i]);
    A lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += normed[i + l] * normed[i + l];
    }
    for (; i < n; ++i) lanes[0] += normed[i] * normed[i];
    A sum_sq = 0;
    for (int64_t l = 0; l < kLanes; ++l) sum_sq += lanes[l];
    const A rstd = A(1) / std::sqrt(sum_sq * inv_channels + a.eps);
    for (int64_t k = 0; k < n; ++k) {  // torch.nn.RMSNorm's output, rounded to the dtype
      normed[k] = static_cast<A>(static_cast<T>(normed[k] * rstd * static_cast<A>(w[k])));
    }
    rotate_pairs<2>(normed, y, cos, sin, 0, 1, n / 2, false, buffer.data() + n, buffer.data() + n + n / 2);
  }
}

template <typename T, typename C>
void run_qk_norm_rope(const QkNormRopeArgs& a) {
  const int64_t grain = std::max<int64_t>(1, 16384 / a.channels);
  for (bool is_q : {true, false}) {
    parallel_rows(0, a.batch * a.seq, grain,
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

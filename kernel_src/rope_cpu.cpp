// RoPE on the CPU: the twin of rope.cu, same fp32 formulas (double for float64 tensors)
// and one rounding; rows of q and k spread over threads.
#include "cpu_parallel.h"
#include "rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace ltx {
namespace {

// The rotation in passes over fp32 (double) buffers, one operation per pass and no branch
// inside a loop, so that GCC vectorises each at -O3 on baseline x86-64 (with the stride, 1
// or 2, known at compile time). The pairs are (first + i S, second + i S): rotate-half
// (0, R/2; S = 1) or interleaved (0, 1; S = 2).
template <int64_t S, typename A, typename In>
[[gnu::always_inline]] inline void load_strided(A* __restrict x, const In* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<A>(in[i * S]);
}

// A token's table row as the pairs' two outputs read it: out[first] = x0 c1 + x1 t1,
// out[second] = x1 c2 + x0 t2, the sines (t1, t2) = (-sin[first], sin[second]), or for the
// inverse (the backward) swapped: (sin[second], -sin[first]). Converted once for all of a
// token's heads; a sine times -1 is its exact negation.
template <int64_t S, typename A, typename C>
[[gnu::always_inline]] inline void load_table(const C* cos, const C* sin, int64_t first, int64_t second, int64_t n,
                                              bool inverse, A* __restrict c1, A* __restrict c2, A* __restrict t1,
                                              A* __restrict t2) {
  load_strided<S>(c1, cos + first, n);
  load_strided<S>(c2, cos + second, n);
  load_strided<S>(t1, sin + (inverse ? second : first), n);
  load_strided<S>(t2, sin + (inverse ? first : second), n);
  const A one = 1;
  const A sign1 = inverse ? one : -one, sign2 = -sign1;
  for (int64_t i = 0; i < n; ++i) t1[i] *= sign1;
  for (int64_t i = 0; i < n; ++i) t2[i] *= sign2;
}

// One head's pairs; `out` may be `in`: the pairs are read into x0 and x1 before anything
// is written.
template <int64_t S, typename T, typename A, typename In>
[[gnu::always_inline]] inline void rotate_head(const In* in, T* out, int64_t first, int64_t second, int64_t n,
                                               const A* __restrict c1, const A* __restrict c2, const A* __restrict t1,
                                               const A* __restrict t2, A* __restrict x0, A* __restrict x1) {
  load_strided<S>(x0, in + first, n);
  load_strided<S>(x1, in + second, n);
  for (int64_t i = 0; i < n; ++i) out[first + i * S] = static_cast<T>(x0[i] * c1[i] + x1[i] * t1[i]);
  for (int64_t i = 0; i < n; ++i) out[second + i * S] = static_cast<T>(x1[i] * c2[i] + x0[i] * t2[i]);
}

// Tokens [begin, end): the token's table row, then every head of q and k at that token.
template <int64_t S, typename T, typename C, typename A = acc_t<T>>
[[gnu::always_inline]] inline void rotate_tokens_with(const RopeArgs& a, int64_t first, int64_t second, int64_t begin,
                                                      int64_t end) {
  const int64_t pairs = a.rotary_dim / 2;
  std::vector<A> buffer(6 * pairs);
  A* c1 = buffer.data();
  A *c2 = c1 + pairs, *t1 = c2 + pairs, *t2 = t1 + pairs, *x0 = t2 + pairs, *x1 = x0 + pairs;
  for (int64_t token = begin; token < end; ++token) {
    const int64_t b = token / a.seq;
    const int64_t s = token - b * a.seq;
    const int64_t table = b * a.table_b + s * a.table_s;
    load_table<S>(static_cast<const C*>(a.cos) + table, static_cast<const C*>(a.sin) + table, first, second, pairs,
                  a.inverse, c1, c2, t1, t2);
    for (const RopeTensor* t : {&a.q, &a.k}) {
      for (int64_t h = 0; h < t->heads; ++h) {
        const T* in = static_cast<const T*>(t->in) + b * t->in_b + h * t->in_h + s * t->in_s;
        T* out = static_cast<T*>(t->out) + b * t->out_b + h * t->out_h + s * t->out_s;
        rotate_head<S>(in, out, first, second, pairs, c1, c2, t1, t2, x0, x1);
        if (out != in) {
          for (int64_t i = a.rotary_dim; i < a.head_dim; ++i) out[i] = in[i];
        }
      }
    }
  }
}

template <typename T, typename C>
LTX_ROW_PASS void rotate_tokens(const RopeArgs& a, int64_t begin, int64_t end) {
  if (a.interleaved) {
    rotate_tokens_with<2, T, C>(a, 0, 1, begin, end);
  } else {
    rotate_tokens_with<1, T, C>(a, 0, a.rotary_dim / 2, begin, end);
  }
}

template <typename T, typename C>
void run(const RopeArgs& a) {
  // About 16k elements per task, a token's heads of q and k at a time.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, (a.q.heads + a.k.heads) * a.head_dim));
  parallel_rows(0, a.batch * a.seq, grain, [&](int64_t begin, int64_t end) { rotate_tokens<T, C>(a, begin, end); });
}

// Lanes of the sum of squares: independent partial sums that GCC vectorises, where one
// running sum would stay scalar.
constexpr int64_t kLanes = 8;

template <typename T, typename C>
LTX_ROW_PASS void qk_norm_rope_rows(const QkNormRopeArgs& a, bool is_q, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t n = a.channels;
  const A inv_channels = A(1) / static_cast<A>(n);  // a.inv_channels in fp32
  std::vector<A> buffer(4 * n);
  A* __restrict normed = buffer.data();
  A *c1 = normed + n, *c2 = c1 + n / 2, *t1 = c2 + n / 2, *t2 = t1 + n / 2, *x0 = t2 + n / 2, *x1 = x0 + n / 2;
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
    load_table<2>(cos, sin, 0, 1, n / 2, false, c1, c2, t1, t2);
    rotate_head<2>(normed, y, 0, 1, n / 2, c1, c2, t1, t2, x0, x1);
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

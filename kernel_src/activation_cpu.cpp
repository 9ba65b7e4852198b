// The GELU family on the CPU: the twin of activation.cu, same fp32 formulas and one
// rounding, rows spread over threads; float64 tensors take the exact formulas in double.
#include "cpu_parallel.h"
#include "activation.h"
#include "activation_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace ltx {

// float64 (CPU only, for gradcheck and fp64 references): erf and tanh themselves, where
// fp32 takes activation_math.h's fitted forms; overloads beside those, so that the type
// picks.
inline constexpr double kInvSqrt2 = 0.70710678118654752440;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;
inline constexpr double kSqrt2OverPi = 0.79788456080286535588;
inline constexpr double kTanhCoeff = 0.044715;

inline double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2)); }
inline double gelu_erf_grad(double x) {
  // e^y as 1 + expm1(y): glibc's exp symbol needs 2.29, past manylinux_2_28 (within 1e-16)
  return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * (1.0 + std::expm1(-0.5 * x * x));
}
inline double gelu_tanh(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kTanhCoeff * x * x * x))); }
inline double gelu_tanh_grad(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kTanhCoeff * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kTanhCoeff * x * x);
}

namespace {

template <Gelu GELU, typename A>
[[gnu::always_inline]] inline A gelu(A x) {
  return GELU == Gelu::kTanh ? gelu_tanh(x) : gelu_erf(x);
}

template <Gelu GELU, typename A>
[[gnu::always_inline]] inline A gelu_grad(A x) {
  return GELU == Gelu::kTanh ? gelu_tanh_grad(x) : gelu_erf_grad(x);
}

// gelu(x) and gelu'(x) from one Phi (exact) or one sigmoid (tanh): the two functions' values,
// their shared part evaluated once.
template <Gelu GELU, typename A>
[[gnu::always_inline]] inline void gelu_and_grad(A x, A& f, A& g) {
  if constexpr (std::is_same_v<A, float>) {
    const float shared = GELU == Gelu::kTanh ? gelu_tanh_sigmoid(x) : normal_cdf(x);
    f = x * shared;
    g = GELU == Gelu::kTanh ? gelu_tanh_grad(x, shared) : gelu_erf_grad(x, shared);
  } else {
    f = gelu<GELU>(x);
    g = gelu_grad<GELU>(x);
  }
}

// Phi(x) of m gate elements into s, or with TIMES_X x * Phi(x), the exact GELU, in passes
// over fp32 buffers (n and p: scratch): Q's upper Horner steps, the rest to log2 Phi(-|x|),
// its exp2 reduced, 2^r's polynomial in two parts, then scaled to Phi(-|x|) and Phi. In one
// loop each element is a chain of some 45 dependent operations, more than the out-of-order
// window overlaps: the loop took 1.9x the passes' time (AVX-512, one thread).
template <bool TIMES_X, typename T>
[[gnu::always_inline]] inline void normal_cdf_passes(const T* g, int64_t m, float* __restrict s,
                                                     float* __restrict n, float* __restrict p) {
  constexpr int kSplit = 3;  // 2^r's Horner steps 6..3 in one pass, 2..0 in the next: about even
  for (int64_t i = 0; i < m; ++i) s[i] = normal_cdf<CdfPart::kUpperQ>(static_cast<float>(g[i]));
  for (int64_t i = 0; i < m; ++i) s[i] = normal_cdf<CdfPart::kTail>(static_cast<float>(g[i]), s[i]);
  for (int64_t i = 0; i < m; ++i) s[i] = host_math::exp2_reduce(s[i], n[i]);
  for (int64_t i = 0; i < m; ++i) p[i] = host_math::pow2_poly<6, kSplit>(host_math::kPow2Taylor[7], s[i]);
  for (int64_t i = 0; i < m; ++i) {
    const float x = static_cast<float>(g[i]);
    const float lower = host_math::times_pow2(host_math::pow2_poly<kSplit - 1, 0>(p[i], s[i]), n[i]);
    const float phi = normal_cdf_from_tail(x, lower);
    s[i] = TIMES_X ? x * phi : phi;
  }
}

// Elements per pass: the passes' fp32 buffers stay in L1 whatever the row's length.
constexpr int64_t kChunk = 1024;

// Columns [k, k + m) of one row. Each loop is one pass without a branch, over fp32 buffers
// that alias nothing (out may be the gate or up itself), so that GCC vectorises every one;
// the arithmetic per element is the same as one fused loop's.
template <typename T, Gelu GELU, typename A = acc_t<T>>
LTX_ARITHMETIC_ROW_PASS void forward_chunk(const T* g, const T* u, T* y, int64_t m, A* __restrict f,
                                           A* __restrict n, A* __restrict p) {
  if constexpr (std::is_same_v<A, float> && GELU == Gelu::kErf) {
    normal_cdf_passes</*TIMES_X=*/true>(g, m, f, n, p);
  } else {
    for (int64_t i = 0; i < m; ++i) f[i] = gelu<GELU>(static_cast<A>(g[i]));
  }
  if (u != nullptr) {
    // out may be up itself (the checks refuse a partial overlap): no dependence across elements
#pragma GCC ivdep
    for (int64_t i = 0; i < m; ++i) y[i] = static_cast<T>(f[i] * static_cast<A>(u[i]));
  } else {
    for (int64_t i = 0; i < m; ++i) y[i] = static_cast<T>(f[i]);
  }
}

// dgate = dy * up * gelu'(x) (written to y), dup = dy * gelu(x).
template <typename T, Gelu GELU, typename A = acc_t<T>>
LTX_ARITHMETIC_ROW_PASS void backward_chunk(const T* g, const T* u, const T* dy, T* y, T* du, int64_t m,
                                            A* __restrict d, A* __restrict f, A* __restrict grad, A* __restrict n,
                                            A* __restrict p) {
  for (int64_t i = 0; i < m; ++i) d[i] = static_cast<A>(dy[i]);
  if constexpr (std::is_same_v<A, float> && GELU == Gelu::kErf) {
    // grad holds Phi(x) first: what gelu(x) = x * Phi(x) and gelu'(x) share.
    normal_cdf_passes</*TIMES_X=*/false>(g, m, grad, n, p);
    if (du != nullptr) {
      for (int64_t i = 0; i < m; ++i) {
        const A x = static_cast<A>(g[i]);
        f[i] = d[i] * (x * grad[i]);
        grad[i] = gelu_erf_grad(x, grad[i]);
      }
    } else {
      for (int64_t i = 0; i < m; ++i) grad[i] = gelu_erf_grad(static_cast<float>(g[i]), grad[i]);
    }
  } else if (du != nullptr) {
    for (int64_t i = 0; i < m; ++i) {
      A value;
      gelu_and_grad<GELU>(static_cast<A>(g[i]), value, grad[i]);
      f[i] = d[i] * value;
    }
  } else {
    for (int64_t i = 0; i < m; ++i) grad[i] = gelu_grad<GELU>(static_cast<A>(g[i]));
  }
  if (u != nullptr) {
    for (int64_t i = 0; i < m; ++i) d[i] *= static_cast<A>(u[i]);
  }
  for (int64_t i = 0; i < m; ++i) y[i] = static_cast<T>(d[i] * grad[i]);
  if (du != nullptr) {
    for (int64_t i = 0; i < m; ++i) du[i] = static_cast<T>(f[i]);
  }
}

// n elements from p into the caches, one prefetch per 64-byte line.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 3);
}

template <typename T, Gelu GELU>
void run(const ActivationArgs& a) {
  using A = acc_t<T>;
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
  const T* grad = static_cast<const T*>(a.grad);
  T* out = static_cast<T*>(a.out);
  T* up_grad = static_cast<T*>(a.up_grad);
  // About 8k elements per task: a GELU costs some ten times a norm's element, so a quarter
  // of the norms' grain already outweighs a thread hand-off.
  const int64_t grain = std::max<int64_t>(1, 8192 / a.cols);
  // An input whose rows leave gaps (geglu's two halves, read in turn) loses the hardware
  // prefetchers at every page, and past the L3 the passes waited on memory (geglu fp32
  // 8192x512: 1.4x the time): its next chunk is asked for ahead of the passes. Contiguous
  // rows are left to the hardware, which keeps ahead of them.
  const bool fetch_gate = a.gate_stride != a.cols;
  const bool fetch_up = up != nullptr && a.up_stride != a.cols;
  const bool fetch_grad = grad != nullptr && a.grad_stride != a.cols;
  parallel_rows(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> buffers(5 * kChunk);
    A* const b = buffers.data();
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t k = 0; k < a.cols; k += kChunk) {
        const int64_t m = std::min(kChunk, a.cols - k);
        const bool row_end = k + kChunk >= a.cols;
        const int64_t next_r = row_end ? r + 1 : r, next_k = row_end ? 0 : k + kChunk;
        if (next_r < end) {
          const int64_t next_m = std::min(kChunk, a.cols - next_k);
          if (fetch_gate) prefetch(gate + next_r * a.gate_stride + next_k, next_m);
          if (fetch_up) prefetch(up + next_r * a.up_stride + next_k, next_m);
          if (fetch_grad) prefetch(grad + next_r * a.grad_stride + next_k, next_m);
        }
        const T* g = gate + r * a.gate_stride + k;
        const T* u = up != nullptr ? up + r * a.up_stride + k : nullptr;
        T* y = out + r * a.out_stride + k;
        if (grad == nullptr) {
          forward_chunk<T, GELU>(g, u, y, m, b, b + kChunk, b + 2 * kChunk);
        } else {
          T* du = up_grad != nullptr ? up_grad + r * a.up_grad_stride + k : nullptr;
          backward_chunk<T, GELU>(g, u, grad + r * a.grad_stride + k, y, du, m, b, b + kChunk, b + 2 * kChunk,
                                  b + 3 * kChunk, b + 4 * kChunk);
        }
      }
    }
  });
}

}  // namespace

void run_activation_cpu(const ActivationArgs& a) {
  LTX_DISPATCH_CPU_FLOAT_TYPES(a.dtype, "activation", [&] {
    return a.gelu == Gelu::kTanh ? run<scalar_t, Gelu::kTanh>(a) : run<scalar_t, Gelu::kErf>(a);
  });
}

}  // namespace ltx

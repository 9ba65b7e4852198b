// RoPE on CUDA (see rope.h): one block per (b, s) token rotates every head of q and k;
// each thread loads the token's cos/sin for its unit of N channels once (16-byte vectors
// where alignment allows) and applies them to the heads it owns, so the tables are read
// once per token, not once per head.
#include "cuda_common.cuh"
#include "rope.h"

#include <algorithm>

namespace ltx {
namespace {

constexpr int kUnitThreads = 256;  // threads across one head's channels
constexpr int kMaxBlock = 512;  // fp32 tables of rotate-half need more than 64 registers

template <typename T>
struct RopeRows {
  T* out;
  const T* in;
  int64_t heads;
  int64_t in_b, in_h, in_s, out_b, out_h, out_s;
};

template <typename T, typename C>
struct RopeParams {
  RopeRows<T> q, k;
  const C* cos;  // [B or 1, S, R]
  const C* sin;
  int64_t table_b, table_s;
  int64_t seq;
  int head_dim, rotary_dim;
  bool inverse;
};

// Units of N channels: [x1, x2] at i and i + R/2 (rotate-half), or N/2 interleaved pairs.
// threadIdx.x walks units; threadIdx.y walks groups of HEADS heads (q's, then
// k's). A thread issues its heads' loads before the tables' (which every head row of the
// block shares, so they mostly hit L1/L2): all of them are in flight at once, where a load
// of the tables first and of one head after it paid DRAM latency twice.
template <typename T, typename C, int N, bool ALIGNED, bool INTERLEAVED, int HEADS>
__global__ void __launch_bounds__(kMaxBlock) rope_kernel(const RopeParams<T, C> p) {
  const int64_t b = blockIdx.x / p.seq;
  const int64_t s = blockIdx.x - b * p.seq;
  const C* cos = p.cos + b * p.table_b + s * p.table_s;
  const C* sin = p.sin + b * p.table_b + s * p.table_s;
  const int heads = static_cast<int>(p.q.heads + p.k.heads);
  auto rows = [&](int h, const T*& in, T*& out) {
    const bool is_q = h < p.q.heads;
    const RopeRows<T>& t = is_q ? p.q : p.k;
    const int64_t hh = is_q ? h : h - p.q.heads;
    in = t.in + b * t.in_b + hh * t.in_h + s * t.in_s;
    out = t.out + b * t.out_b + hh * t.out_h + s * t.out_s;
  };

  const int rotary_units = INTERLEAVED ? p.rotary_dim / N : p.rotary_dim / 2 / N;
  // Rotate-half's second element of a pair sits half the rotary dim further on.
  const int second = INTERLEAVED ? 0 : p.rotary_dim / 2;
  for (int u = threadIdx.x; u < rotary_units; u += blockDim.x) {
    const int i = u * N;
    for (int h0 = threadIdx.y * HEADS; h0 < heads; h0 += blockDim.y * HEADS) {
      const T* in[HEADS];
      T* out[HEADS];
      Vec<T, N> x1[HEADS], x2[HEADS];
#pragma unroll
      for (int j = 0; j < HEADS; ++j) {
        if (h0 + j >= heads) continue;
        rows(h0 + j, in[j], out[j]);
        x1[j] = load_n<T, N, ALIGNED>(in[j] + i);
        if constexpr (!INTERLEAVED) x2[j] = load_n<T, N, ALIGNED>(in[j] + i + second);
      }
      const Vec<C, N> c1 = load_n<C, N, ALIGNED>(cos + i), sv1 = load_n<C, N, ALIGNED>(sin + i);
      Vec<C, N> c2, sv2;
      if constexpr (!INTERLEAVED) {
        c2 = load_n<C, N, ALIGNED>(cos + i + second);
        sv2 = load_n<C, N, ALIGNED>(sin + i + second);
      }
#pragma unroll
      for (int j = 0; j < HEADS; ++j) {
        if (h0 + j >= heads) continue;
        Vec<T, N> y1, y2;
        if constexpr (INTERLEAVED) {
          // The backward swaps and negates each pair's sines (the transpose of the rotation).
#pragma unroll
          for (int e = 0; e < N; e += 2) {
            const float s0 = p.inverse ? -to_float(sv1.v[e + 1]) : to_float(sv1.v[e]);
            const float s1 = p.inverse ? -to_float(sv1.v[e]) : to_float(sv1.v[e + 1]);
            const float a = to_float(x1[j].v[e]), o = to_float(x1[j].v[e + 1]);
            y1.v[e] = from_float<T>(a * to_float(c1.v[e]) - o * s0);
            y1.v[e + 1] = from_float<T>(o * to_float(c1.v[e + 1]) + a * s1);
          }
        } else {
          // The backward swaps and negates the halves' sines.
#pragma unroll
          for (int e = 0; e < N; ++e) {
            const float s1 = p.inverse ? -to_float(sv2.v[e]) : to_float(sv1.v[e]);
            const float s2 = p.inverse ? -to_float(sv1.v[e]) : to_float(sv2.v[e]);
            const float a = to_float(x1[j].v[e]), o = to_float(x2[j].v[e]);
            y1.v[e] = from_float<T>(a * to_float(c1.v[e]) - o * s1);
            y2.v[e] = from_float<T>(o * to_float(c2.v[e]) + a * s2);
          }
          store_n<T, N, ALIGNED>(out[j] + i + second, y2);
        }
        store_n<T, N, ALIGNED>(out[j] + i, y1);
      }
    }
  }
  // Channels past the rotary dim pass through (nothing to do in place).
  for (int h = threadIdx.y; h < heads; h += blockDim.y) {
    const T* in;
    T* out;
    rows(h, in, out);
    if (out == in) continue;
    if constexpr (ALIGNED) {
      for (int i = p.rotary_dim + threadIdx.x * N; i < p.head_dim; i += blockDim.x * N) {
        store_n<T, N, true>(out + i, load_n<T, N, true>(in + i));
      }
    } else {
      for (int i = p.rotary_dim + threadIdx.x; i < p.head_dim; i += blockDim.x) out[i] = in[i];
    }
  }
}

template <typename T>
RopeRows<T> rows_of(const RopeTensor& t) {
  return {static_cast<T*>(t.out), static_cast<const T*>(t.in), t.heads, t.in_b, t.in_h, t.in_s,
          t.out_b, t.out_h, t.out_s};
}

template <typename T, typename C, int N>
bool vectorizable(const RopeArgs& a) {
  const int64_t unit = a.interleaved ? a.rotary_dim : a.rotary_dim / 2;
  bool ok = unit % N == 0 && (a.head_dim - a.rotary_dim) % N == 0 && a.table_b % N == 0 && a.table_s % N == 0 &&
            aligned_to(a.cos, N * sizeof(C)) && aligned_to(a.sin, N * sizeof(C));
  for (const RopeTensor* t : {&a.q, &a.k}) {
    ok = ok && aligned_to(t->in, N * sizeof(T)) && aligned_to(t->out, N * sizeof(T));
    for (int64_t s : {t->in_b, t->in_h, t->in_s, t->out_b, t->out_h, t->out_s}) ok = ok && s % N == 0;
  }
  return ok;
}

template <typename T, typename C, bool INTERLEAVED>
void launch(const RopeArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector = vectorizable<T, C, V>(a);
  // Scalar path: one channel (rotate-half) or one pair (interleaved) per unit.
  constexpr int kScalarN = INTERLEAVED ? 2 : 1;
  constexpr int kHeads = INTERLEAVED ? 2 : 1;
  const int n = vector ? V : kScalarN;
  const int64_t units = (INTERLEAVED ? a.rotary_dim : a.rotary_dim / 2) / n;
  // Threads over the units of a head first, then one row of threads per kHeads heads (up
  // to 512 threads). Interleaved takes two heads per thread: LTX's q and k read their
  // [B, S, C] fp32 tables (half the bytes it moves) once; 1.04x faster than one head on
  // the H200. Rotate-half's four table vectors leave no registers for a second head.
  int tx = 1;
  while (tx < units && tx < kUnitThreads) tx *= 2;
  const int64_t heads = a.q.heads + a.k.heads;
  const int ty = static_cast<int>(std::min<int64_t>((heads + kHeads - 1) / kHeads, kMaxBlock / tx));
  const dim3 block(tx, ty);
  const RopeParams<T, C> p{rows_of<T>(a.q), rows_of<T>(a.k), static_cast<const C*>(a.cos), static_cast<const C*>(a.sin),
                           a.table_b, a.table_s, a.seq, static_cast<int>(a.head_dim), static_cast<int>(a.rotary_dim),
                           a.inverse};
  const int64_t blocks = a.batch * a.seq;
  if (blocks == 0 || heads == 0) return;
  if (vector) {
    rope_kernel<T, C, V, true, INTERLEAVED, kHeads><<<blocks, block, 0, stream>>>(p);
  } else {
    rope_kernel<T, C, kScalarN, false, INTERLEAVED, kHeads><<<blocks, block, 0, stream>>>(p);
  }
  check_launch();
}

template <typename T, typename C>
struct QkNormRopeParams {
  T* q_out;
  T* k_out;
  const T* q;  // [B * S rows, C]
  const T* k;
  const T* q_weight;  // [C]
  const T* k_weight;
  const C* cos;  // [B or 1, S, C]
  const C* sin;
  int64_t q_stride, k_stride, q_out_stride, k_out_stride, table_b, table_s;
  int64_t rows, seq;  // rows = B * S per tensor
  int channels;
  float eps, inv_channels;
};

constexpr int kQkCachedVecs = 4;  // the whole row stays in registers (C bounded in rope.h)
constexpr int kQkMaxBlock = 512;  // fp32 tables need more than the 64 registers of 1024 threads

// One (tensor, b, s) row per threads_per_row threads: RMSNorm in fp32, weight, rounding to
// T (what torch.nn.RMSNorm returns), then interleaved RoPE in fp32 and a second rounding.
template <typename T, typename C, int VEC, bool ALIGNED>
__global__ void __launch_bounds__(kQkMaxBlock) qk_norm_rope_kernel(const QkNormRopeParams<T, C> p, int threads_per_row) {
  __shared__ float scratch[32];
  const int rows_per_block = blockDim.x / threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / threads_per_row;
  const int t = threadIdx.x % threads_per_row;
  const bool active = row < 2 * p.rows;  // inactive threads still join the reduction
  const bool is_q = row < p.rows;
  const int64_t r = active ? (is_q ? row : row - p.rows) : 0;
  const T* x = is_q ? p.q + r * p.q_stride : p.k + r * p.k_stride;
  T* y = is_q ? p.q_out + r * p.q_out_stride : p.k_out + r * p.k_out_stride;
  const T* w = is_q ? p.q_weight : p.k_weight;
  const int64_t b = r / p.seq;
  const C* cos = p.cos + b * p.table_b + (r - b * p.seq) * p.table_s;
  const C* sin = p.sin + b * p.table_b + (r - b * p.seq) * p.table_s;
  const int nvec = p.channels / VEC;

  Vec<T, VEC> cached[kQkCachedVecs];
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kQkCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < nvec) {
      cached[k] = load_n<T, VEC, ALIGNED>(x + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum_sq += to_float(cached[k].v[j]) * to_float(cached[k].v[j]);
    }
  }
  sum_sq = row_sum(sum_sq, threads_per_row, scratch);
  if (!active) return;
  const float rstd = rsqrtf(sum_sq * p.inv_channels + p.eps);
#pragma unroll
  for (int k = 0; k < kQkCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (i >= nvec) continue;
    const Vec<T, VEC> wv = load_n<T, VEC, ALIGNED>(w + i * VEC);
    const Vec<C, VEC> c = load_n<C, VEC, ALIGNED>(cos + i * VEC);
    const Vec<C, VEC> sn = load_n<C, VEC, ALIGNED>(sin + i * VEC);
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const float a = to_float(from_float<T>(to_float(cached[k].v[j]) * rstd * to_float(wv.v[j])));
      const float e = to_float(from_float<T>(to_float(cached[k].v[j + 1]) * rstd * to_float(wv.v[j + 1])));
      out.v[j] = from_float<T>(a * to_float(c.v[j]) - e * to_float(sn.v[j]));
      out.v[j + 1] = from_float<T>(e * to_float(c.v[j + 1]) + a * to_float(sn.v[j + 1]));
    }
    store_n<T, VEC, ALIGNED>(y + i * VEC, out);
  }
}

template <typename T, typename C>
void launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  bool vector = a.channels % V == 0 && aligned_to(a.cos, V * sizeof(C)) && aligned_to(a.sin, V * sizeof(C)) &&
                a.table_b % V == 0 && a.table_s % V == 0;
  for (const void* ptr : {a.q, a.k, a.q_weight, a.k_weight, static_cast<const void*>(a.q_out),
                          static_cast<const void*>(a.k_out)}) {
    vector = vector && aligned_to(ptr, 16);
  }
  for (int64_t stride : {a.q_stride, a.k_stride, a.q_out_stride, a.k_out_stride}) vector = vector && stride % V == 0;
  // The scalar path works on pairs, element by element (no alignment assumed).
  const int vec = vector ? V : 2;
  const RowLaunch cfg = row_launch(a.channels / vec, kQkCachedVecs, kQkMaxBlock);
  TORCH_CHECK(static_cast<int64_t>(cfg.threads_per_row) * kQkCachedVecs * vec >= a.channels,
              "qk_norm_rope: C = ", a.channels, " is too wide for the kernel's registers with these alignments");
  const QkNormRopeParams<T, C> p{static_cast<T*>(a.q_out), static_cast<T*>(a.k_out), static_cast<const T*>(a.q),
                                 static_cast<const T*>(a.k), static_cast<const T*>(a.q_weight),
                                 static_cast<const T*>(a.k_weight), static_cast<const C*>(a.cos),
                                 static_cast<const C*>(a.sin), a.q_stride, a.k_stride, a.q_out_stride,
                                 a.k_out_stride, a.table_b, a.table_s, a.batch * a.seq, a.seq,
                                 static_cast<int>(a.channels), a.eps, a.inv_channels};
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (2 * p.rows + rows_per_block - 1) / rows_per_block;
  if (vector) {
    qk_norm_rope_kernel<T, C, V, true><<<blocks, cfg.block, 0, stream>>>(p, cfg.threads_per_row);
  } else {
    qk_norm_rope_kernel<T, C, 2, false><<<blocks, cfg.block, 0, stream>>>(p, cfg.threads_per_row);
  }
  check_launch();
}

}  // namespace

void run_qk_norm_rope_cuda(const QkNormRopeArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "qk_norm_rope", [&] {
    return a.table_fp32 ? launch_qk_norm_rope<scalar_t, float>(a, stream)
                        : launch_qk_norm_rope<scalar_t, scalar_t>(a, stream);
  });
}

void run_rope_cuda(const RopeArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "rope", [&] {
    using T = scalar_t;
    if (a.table_fp32) {
      return a.interleaved ? launch<T, float, true>(a, stream) : launch<T, float, false>(a, stream);
    }
    return a.interleaved ? launch<T, T, true>(a, stream) : launch<T, T, false>(a, stream);
  });
}

}  // namespace ltx

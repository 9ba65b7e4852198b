// RoPE on CUDA (see rope.h): q and k rows in one launch; each thread rotates one unit
// of N channels (16-byte vectors where alignment allows) and copies pass-through ones.
#include "cuda_common.cuh"
#include "rope.h"

namespace ltx {
namespace {

constexpr int kBlock = 256;

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
  int64_t seq, q_rows, k_rows;
  int head_dim, rotary_dim;
};

// One unit of N channels: [x1, x2] at i and i + R/2 (rotate-half), or N/2 interleaved pairs.
template <typename T, typename C, int N, bool ALIGNED, bool INTERLEAVED>
__global__ void __launch_bounds__(kBlock) rope_kernel(const RopeParams<T, C> p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.q_rows + p.k_rows) return;
  const bool is_q = row < p.q_rows;
  const RopeRows<T>& t = is_q ? p.q : p.k;
  const int64_t r = is_q ? row : row - p.q_rows;
  const int64_t per_batch = t.heads * p.seq;
  const int64_t b = r / per_batch;
  const int64_t h = (r - b * per_batch) / p.seq;
  const int64_t s = r - b * per_batch - h * p.seq;
  const T* in = t.in + b * t.in_b + h * t.in_h + s * t.in_s;
  T* out = t.out + b * t.out_b + h * t.out_h + s * t.out_s;
  const C* cos = p.cos + b * p.table_b + s * p.table_s;
  const C* sin = p.sin + b * p.table_b + s * p.table_s;

  const int rotary_units = INTERLEAVED ? p.rotary_dim / N : p.rotary_dim / 2 / N;
  const int half = p.rotary_dim / 2;
  for (int u = threadIdx.x; u < rotary_units; u += blockDim.x) {
    const int i = u * N;
    if constexpr (INTERLEAVED) {
      const Vec<T, N> x = load_n<T, N, ALIGNED>(in + i);
      const Vec<C, N> c = load_n<C, N, ALIGNED>(cos + i);
      const Vec<C, N> sn = load_n<C, N, ALIGNED>(sin + i);
      Vec<T, N> y;
#pragma unroll
      for (int j = 0; j < N; j += 2) {
        const float a = to_float(x.v[j]), e = to_float(x.v[j + 1]);
        y.v[j] = from_float<T>(a * to_float(c.v[j]) - e * to_float(sn.v[j]));
        y.v[j + 1] = from_float<T>(e * to_float(c.v[j + 1]) + a * to_float(sn.v[j + 1]));
      }
      store_n<T, N, ALIGNED>(out + i, y);
    } else {
      const Vec<T, N> x1 = load_n<T, N, ALIGNED>(in + i);
      const Vec<T, N> x2 = load_n<T, N, ALIGNED>(in + i + half);
      const Vec<C, N> c1 = load_n<C, N, ALIGNED>(cos + i), c2 = load_n<C, N, ALIGNED>(cos + i + half);
      const Vec<C, N> s1 = load_n<C, N, ALIGNED>(sin + i), s2 = load_n<C, N, ALIGNED>(sin + i + half);
      Vec<T, N> y1, y2;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float a = to_float(x1.v[j]), e = to_float(x2.v[j]);
        y1.v[j] = from_float<T>(a * to_float(c1.v[j]) - e * to_float(s1.v[j]));
        y2.v[j] = from_float<T>(e * to_float(c2.v[j]) + a * to_float(s2.v[j]));
      }
      store_n<T, N, ALIGNED>(out + i, y1);
      store_n<T, N, ALIGNED>(out + i + half, y2);
    }
  }
  if (out != in) {  // channels past the rotary dim pass through
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
  const int n = vector ? V : kScalarN;
  const int64_t units = (INTERLEAVED ? a.rotary_dim : a.rotary_dim / 2) / n;
  int tx = 1;
  while (tx < units && tx < kBlock) tx *= 2;
  const dim3 block(tx, kBlock / tx);
  const RopeParams<T, C> p{rows_of<T>(a.q), rows_of<T>(a.k), static_cast<const C*>(a.cos), static_cast<const C*>(a.sin),
                           a.table_b, a.table_s, a.seq, a.batch * a.q.heads * a.seq, a.batch * a.k.heads * a.seq,
                           static_cast<int>(a.head_dim), static_cast<int>(a.rotary_dim)};
  const int64_t rows = p.q_rows + p.k_rows;
  if (rows == 0) return;
  const int64_t blocks = (rows + block.y - 1) / block.y;
  if (vector) {
    rope_kernel<T, C, V, true, INTERLEAVED><<<blocks, block, 0, stream>>>(p);
  } else {
    rope_kernel<T, C, kScalarN, false, INTERLEAVED><<<blocks, block, 0, stream>>>(p);
  }
  check_launch();
}

}  // namespace

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

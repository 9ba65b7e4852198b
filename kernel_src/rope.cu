// RoPE on CUDA: the rotary launch (rope_rotate.cuh) and qk_norm_rope, RMSNorm of q and k
// fused with interleaved RoPE.
#include "rope_rotate.cuh"

namespace ltx {
namespace {

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
  uint32_t rows, seq;  // rows = B * S per tensor; 2 * rows < 2^31
  // Pair p (q and k row of one token) is (major, minor) = (p / pairs, p % pairs): (s, b)
  // token-major (pairs = B), else (b, s) (pairs = S).
  IntDivider pairs;
  int channels;
  float eps, inv_channels;
};

constexpr int kQkCachedVecs = 4;  // the whole row stays in registers (C bounded in rope.h)
constexpr int kQkMaxBlock = 512;  // fp32 tables need more than the 64 registers of 1024 threads
// Rows of 64 or 128 threads (C = 2048 or 4096 in 16 bits) share 256-thread blocks: fewer
// blocks a row or 512 threads were slower (docs/decisions.md).
constexpr int kQkSharedRowsBlock = 256;

// One (tensor, b, s) row per threads_per_row threads: RMSNorm in fp32, weight, rounding to
// T (what torch.nn.RMSNorm returns), then interleaved RoPE in fp32 and a second rounding.
// Rows alternate q, k of one token, so the k row reads the tables the q row just brought
// into L2: LTX's fp32 [B, S, C] tables are as large as q and k together, and reading
// them twice from DRAM cost 1.5x the bytes. Tables broadcast over the batch (stride 0)
// order the rows token-major, (s, b, q/k), so all 2B rows of a token read its table row
// while it is in L2.
//
// CACHED vectors a thread hold the row; PRELOAD (one vector a thread, a decode step's rows)
// loads the weight and tables with the row, ahead of the reduction: one memory round trip
// instead of two on a latency-bound row.
template <typename T, typename C, int VEC, bool ALIGNED, int CACHED, bool PRELOAD>
__global__ void __launch_bounds__(kQkMaxBlock) qk_norm_rope_kernel(const QkNormRopeParams<T, C> p, int row_shift) {
  __shared__ float scratch[32];
  // Rows take a power of two of threads, passed as its log: the row's offsets are shifts,
  // masks and one multiply-high ahead of the loads.
  const int threads_per_row = 1 << row_shift;
  const uint32_t row = blockIdx.x * (blockDim.x >> row_shift) + (threadIdx.x >> row_shift);
  const int t = threadIdx.x & (threads_per_row - 1);
  const bool active = row < 2 * p.rows;  // inactive threads still join the reduction
  const bool is_q = row % 2 == 0;
  const uint32_t pair = active ? row / 2 : 0;
  const uint32_t major = p.pairs.div(pair);
  const uint32_t minor = pair - major * p.pairs.divisor;
  const bool token_major = p.table_b == 0;
  const uint32_t b = token_major ? minor : major;
  const uint32_t s = token_major ? major : minor;
  const int64_t r = static_cast<int64_t>(b) * p.seq + s;
  const T* x = is_q ? p.q + r * p.q_stride : p.k + r * p.k_stride;
  T* y = is_q ? p.q_out + r * p.q_out_stride : p.k_out + r * p.k_out_stride;
  const T* w = is_q ? p.q_weight : p.k_weight;
  const C* cos = p.cos + b * p.table_b + s * p.table_s;
  const C* sin = p.sin + b * p.table_b + s * p.table_s;
  const int nvec = p.channels / VEC;

  static_assert(!PRELOAD || CACHED == 1, "qk_norm_rope: the preloading rows take one vector a thread");
  Vec<T, VEC> cached[CACHED], wv[CACHED];
  Vec<C, VEC> c[CACHED], sn[CACHED];
  auto load_operands = [&](int k, int i) {
    wv[k] = load_n<T, VEC, ALIGNED>(w + i * VEC);
    c[k] = load_n<C, VEC, ALIGNED>(cos + i * VEC);
    sn[k] = load_n<C, VEC, ALIGNED>(sin + i * VEC);
  };
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < CACHED; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < nvec) {
      cached[k] = load_n<T, VEC, ALIGNED>(x + i * VEC);
      if constexpr (PRELOAD) load_operands(k, i);
      float f[VEC];
      to_floats(cached[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum_sq += f[j] * f[j];
    }
  }
  sum_sq = row_sum(sum_sq, threads_per_row, scratch);
  if (!active) return;
  const float rstd = rsqrtf(sum_sq * p.inv_channels + p.eps);
#pragma unroll
  for (int k = 0; k < CACHED; ++k) {
    const int i = t + k * threads_per_row;
    if (i >= nvec) continue;
    if constexpr (!PRELOAD) load_operands(k, i);
    float xf[VEC], wf[VEC], cf[VEC], sf[VEC], out[VEC];
    to_floats(cached[k], xf);
    to_floats(wv[k], wf);
    to_floats(c[k], cf);
    to_floats(sn[k], sf);
#pragma unroll
    for (int j = 0; j < VEC; ++j) xf[j] = to_float(from_float<T>(xf[j] * rstd * wf[j]));  // the norm's output
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      out[j] = xf[j] * cf[j] - xf[j + 1] * sf[j];
      out[j + 1] = xf[j + 1] * cf[j + 1] + xf[j] * sf[j + 1];
    }
    store_n<T, VEC, ALIGNED>(y + i * VEC, from_floats<T>(out));
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
  const int64_t rows = a.batch * a.seq;
  TORCH_CHECK(2 * rows <= INT32_MAX, "qk_norm_rope: at most 2^30 - 1 tokens (B * S) on CUDA, got ", rows);
  // A decode step's rows (fewer than two an SM) preload at one vector a thread where a
  // block holds the row.
  const bool preload = !two_rows_per_sm(2 * rows, a.device.index()) && a.channels / vec <= kQkMaxBlock;
  const int per_thread = preload ? 1 : kQkCachedVecs;
  const RowLaunch cfg = row_launch(a.channels / vec, per_thread, kQkMaxBlock, kQkSharedRowsBlock);
  TORCH_CHECK(static_cast<int64_t>(cfg.threads_per_row) * per_thread * vec >= a.channels,
              "qk_norm_rope: C = ", a.channels, " is too wide for the kernel's registers with these alignments");
  const QkNormRopeParams<T, C> p{static_cast<T*>(a.q_out), static_cast<T*>(a.k_out), static_cast<const T*>(a.q),
                                 static_cast<const T*>(a.k), static_cast<const T*>(a.q_weight),
                                 static_cast<const T*>(a.k_weight), static_cast<const C*>(a.cos),
                                 static_cast<const C*>(a.sin), a.q_stride, a.k_stride, a.q_out_stride,
                                 a.k_out_stride, a.table_b, a.table_s, static_cast<uint32_t>(rows),
                                 static_cast<uint32_t>(a.seq), IntDivider(a.table_b == 0 ? a.batch : a.seq),
                                 static_cast<int>(a.channels), a.eps, a.inv_channels};
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (2 * rows + rows_per_block - 1) / rows_per_block;
  const int row_shift = __builtin_ctz(cfg.threads_per_row);
  const auto run = [&](auto kernel) {
    kernel<<<blocks, cfg.block, 0, stream>>>(p, row_shift);
    check_launch();
  };
  if (vector) {
    return preload ? run(qk_norm_rope_kernel<T, C, V, true, 1, true>)
                   : run(qk_norm_rope_kernel<T, C, V, true, kQkCachedVecs, false>);
  }
  return preload ? run(qk_norm_rope_kernel<T, C, 2, false, 1, true>)
                 : run(qk_norm_rope_kernel<T, C, 2, false, kQkCachedVecs, false>);
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
  using rope_cuda::launch;
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "rope", [&] {
    using T = scalar_t;
    if (a.table_fp32) {
      return a.interleaved ? launch<T, float, true>(a, stream) : launch<T, float, false>(a, stream);
    }
    return a.interleaved ? launch<T, T, true>(a, stream) : launch<T, T, false>(a, stream);
  });
}

}  // namespace ltx

// RMSNorm forward on CUDA: one pass over memory. Each row is read once into registers
// (16-byte vectors where alignment allows), reduced in fp32, then scaled and written.
#include "cuda_common.cuh"
#include "rms_norm.h"

namespace ltx {
namespace {

// 16-byte vectors each thread keeps in registers between the reduction and the write.
// Four loads in flight per thread cover DRAM latency, and 4 x 16 B of registers keep a
// 1024-thread block under 64 registers per thread. Rows of more than 4096 vectors
// (bf16 D > 32768) re-read the rest, which then comes from L2.
constexpr int kCachedVecs = 4;
constexpr int kSharedBlock = 128;  // block of rows that fit in a warp
constexpr int kMaxBlock = 1024;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxBlock)
    rms_norm_kernel(T* __restrict__ out,             // [rows, cols], rows out_stride apart
                    const T* __restrict__ x,         // [rows, cols], rows x_stride apart
                    const T* __restrict__ weight,    // [cols] or nullptr
                    RmsNormProblem p, int threads_per_row) {
  __shared__ float scratch[32];
  const int rows_per_block = blockDim.x / threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / threads_per_row;
  const int t = threadIdx.x % threads_per_row;
  // Threads past the last row still take part in the shuffles below.
  const bool active = row < p.rows;
  const int nvec = static_cast<int>(p.cols / VEC);  // cols < 2^31 (checked)
  const T* xr = x + (active ? row : 0) * p.x_stride;
  T* yr = out + (active ? row : 0) * p.out_stride;

  Vec<T, VEC> cached[kCachedVecs];
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < nvec) {
      cached[k] = load_vec<T, VEC>(xr, i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = to_float(cached[k].v[j]);
        sum_sq += f * f;
      }
    }
  }
  for (int i = t + kCachedVecs * threads_per_row; active && i < nvec; i += threads_per_row) {
    const Vec<T, VEC> v = load_vec<T, VEC>(xr, i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(v.v[j]);
      sum_sq += f * f;
    }
  }
  sum_sq = threads_per_row > 32 ? block_sum(sum_sq, scratch) : group_sum(sum_sq, threads_per_row);
  if (!active) return;
  const float rstd = rsqrtf(sum_sq * p.inv_cols + p.eps);

  auto write = [&](const Vec<T, VEC>& v, int i) {
    Vec<T, VEC> y;
    if (weight != nullptr) {
      const Vec<T, VEC> w = load_vec<T, VEC>(weight, i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.v[j] = from_float<T>(to_float(v.v[j]) * rstd * to_float(w.v[j]));
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.v[j] = from_float<T>(to_float(v.v[j]) * rstd);
    }
    store_vec<T, VEC>(yr, i, y);
  };
#pragma unroll
  for (int k = 0; k < kCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (i < nvec) write(cached[k], i);
  }
  for (int i = t + kCachedVecs * threads_per_row; i < nvec; i += threads_per_row) {
    write(load_vec<T, VEC>(xr, i), i);
  }
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n && p < kMaxBlock) p *= 2;
  return p;
}

// Launch shape: threads_per_row is a power of two covering the row with at most
// kCachedVecs vectors each (up to 1024 threads). Rows of more than a warp get a block
// each (block_sum reduces the whole block); rows of a warp or less share 128-thread
// blocks and reduce with shuffles inside their lane group.
struct RmsNormLaunch {
  int threads_per_row;
  int block;
};

RmsNormLaunch rms_norm_launch(int64_t nvec) {
  const int tpr = next_pow2((nvec + kCachedVecs - 1) / kCachedVecs);
  return {tpr, tpr > 32 ? tpr : kSharedBlock};
}

template <typename T, int VEC>
void launch(T* out, const T* x, const T* weight, const RmsNormProblem& p, cudaStream_t stream) {
  const RmsNormLaunch cfg = rms_norm_launch(p.cols / VEC);
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (p.rows + rows_per_block - 1) / rows_per_block;
  rms_norm_kernel<T, VEC><<<blocks, cfg.block, 0, stream>>>(out, x, weight, p, cfg.threads_per_row);
  check_launch();
}

template <typename T>
void launch_rms_norm(T* out, const T* x, const T* weight, const RmsNormProblem& p, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector_ok = p.cols % V == 0 && p.x_stride % V == 0 && p.out_stride % V == 0 &&
                         aligned_to(out, 16) && aligned_to(x, 16) &&
                         (weight == nullptr || aligned_to(weight, 16));
  if (vector_ok) {
    launch<T, V>(out, x, weight, p, stream);
  } else {
    launch<T, 1>(out, x, weight, p, stream);
  }
}

}  // namespace

void rms_norm_out_cuda(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                       double eps) {
  const RmsNormProblem p = check_rms_norm(out, input, weight, eps, c10::DeviceType::CUDA);
  if (p.rows == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.device().index());
  LTX_DISPATCH_FLOAT_TYPES(input.scalar_type(), "rms_norm", [&] {
    launch_rms_norm<scalar_t>(out.mutable_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                              weight ? weight->const_data_ptr<scalar_t>() : nullptr, p, stream);
  });
}

}  // namespace ltx

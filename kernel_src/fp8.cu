// FP8 quantization on CUDA (see fp8.h): a row per lane group, warp or block, as its width
// needs. Each thread keeps up to kCachedVecs 16-byte vectors of its row in registers from
// the amax reduction to the write, re-reading any further ones (from L1/L2); rows that are
// not 16-byte aligned take the scalar path. Reductions and stores: fp8_cuda.cuh.
#include "cuda_common.cuh"
#include "fp8.h"
#include "fp8_cuda.cuh"

namespace ltx {
namespace {

constexpr int kCachedVecs = 4;
constexpr int kMaxBlock = 1024;

template <typename T>
struct Fp8Params {
  const T* input;            // [rows, cols], rows input_stride apart
  uint8_t* out;              // [rows, cols] contiguous
  float* scales;             // [rows] or nullptr (static)
  const float* static_scale; // or nullptr (dynamic)
  int64_t rows, input_stride, cols;
  int nvec;                  // vectors per row
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxBlock) quantize_fp8_kernel(const Fp8Params<T> p, int row_shift) {
  __shared__ float scratch[32];
  const int threads_per_row = 1 << row_shift;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> row_shift) + (threadIdx.x >> row_shift);
  const int t = threadIdx.x & (threads_per_row - 1);
  // Threads past the last row still take part in the block's reduction.
  const bool active = row < p.rows;
  const T* x = p.input + (active ? row : 0) * p.input_stride;
  Vec<T, VEC> cached[kCachedVecs];
#pragma unroll
  for (int k = 0; k < kCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < p.nvec) cached[k] = load_vec<T, VEC>(x, i);
  }
  float scale;
  if (p.static_scale != nullptr) {
    scale = *p.static_scale;
  } else {
    float amax = 0.f;
    auto take = [&](const Vec<T, VEC>& v) {
      float f[VEC];
      to_floats(v, f);
      amax = fp8_amax_of(amax, f);
    };
#pragma unroll
    for (int k = 0; k < kCachedVecs; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < p.nvec) take(cached[k]);
    }
    for (int i = t + kCachedVecs * threads_per_row; active && i < p.nvec; i += threads_per_row) {
      take(load_vec<T, VEC>(x, i));
    }
    scale = fp8_scale_of(row_amax(amax, threads_per_row, scratch));
    if (active && t == 0) p.scales[row] = scale;
  }
  if (!active) return;
  uint8_t* q = p.out + row * p.cols;
  auto write = [&](const Vec<T, VEC>& v, int i) {
    float f[VEC];
    to_floats(v, f);
    store_fp8<VEC>(q, i, f, scale);
  };
#pragma unroll
  for (int k = 0; k < kCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (i < p.nvec) write(cached[k], i);
  }
  for (int i = t + kCachedVecs * threads_per_row; i < p.nvec; i += threads_per_row) write(load_vec<T, VEC>(x, i), i);
}

template <typename T>
void launch(const Fp8Args& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector = a.cols % V == 0 && a.input_stride % V == 0 && aligned_to(a.input, 16);
  const int vec = vector ? V : 1;
  const RowLaunch cfg = row_launch(a.cols / vec, kCachedVecs, kMaxBlock);
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(blocks <= INT32_MAX, "quantize_fp8: too many rows for one launch (", a.rows, ")");
  const Fp8Params<T> p{static_cast<const T*>(a.input), a.out, a.scales, a.static_scale, a.rows, a.input_stride,
                       a.cols, static_cast<int>(a.cols / vec)};
  const int shift = __builtin_ctz(cfg.threads_per_row);
  if (vector) {
    quantize_fp8_kernel<T, V><<<static_cast<unsigned>(blocks), cfg.block, 0, stream>>>(p, shift);
  } else {
    quantize_fp8_kernel<T, 1><<<static_cast<unsigned>(blocks), cfg.block, 0, stream>>>(p, shift);
  }
  check_launch();
}

}  // namespace

void check_fp8_cuda_capability(const char* op, c10::Device device) {
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  const int major = device_attribute<cudaDevAttrComputeCapabilityMajor>(index);
  const int minor = device_attribute<cudaDevAttrComputeCapabilityMinor>(index);
  TORCH_CHECK(major * 10 + minor >= 89, op, ": FP8 needs a GPU of compute capability 8.9 or newer (found ", major, ".",
              minor, ")");
}

void run_quantize_fp8_cuda(const Fp8Args& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "quantize_fp8", [&] { launch<scalar_t>(a, stream); });
}

}  // namespace ltx

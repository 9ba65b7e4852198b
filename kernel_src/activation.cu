// The GELU family on CUDA (see activation.h): each thread takes 16-byte vectors of a column.
#include "activation.h"
#include "activation_math.h"
#include "cuda_common.cuh"

namespace ltx {
namespace {

constexpr int kBlock = 256;

template <typename T>
struct ActivationParams {
  T* out;          // [rows, cols], rows out_stride apart
  const T* gate;   // [rows, cols]
  const T* up;     // [rows, cols] or nullptr
  const T* grad;   // [rows, cols] (BACKWARD)
  T* up_grad;      // [rows, cols] (BACKWARD with up)
  int64_t out_stride, gate_stride, up_stride, grad_stride, up_grad_stride;
  int64_t rows;
  int vecs_per_row;
};

template <typename T, int VEC, Gelu GELU, bool HAS_UP, bool BACKWARD>
__device__ __forceinline__ void activation_vec(const ActivationParams<T>& p, int64_t row, int col) {
  const Vec<T, VEC> g = load_vec<T, VEC>(p.gate + row * p.gate_stride, col);
  Vec<T, VEC> u, dy;
  if constexpr (HAS_UP) u = load_vec<T, VEC>(p.up + row * p.up_stride, col);
  if constexpr (BACKWARD) dy = load_vec<T, VEC>(p.grad + row * p.grad_stride, col);
  float x[VEC], up[VEC], d[VEC], y[VEC], du[VEC];
  to_floats(g, x);
  if constexpr (HAS_UP) to_floats(u, up);
  if constexpr (BACKWARD) to_floats(dy, d);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float up_j = HAS_UP ? up[j] : 1.f;
    if constexpr (BACKWARD) {
      y[j] = d[j] * up_j * (GELU == Gelu::kTanh ? gelu_tanh_grad(x[j]) : gelu_erf_grad(x[j]));
      if constexpr (HAS_UP) du[j] = d[j] * (GELU == Gelu::kTanh ? gelu_tanh(x[j]) : gelu_erf(x[j]));
    } else {
      y[j] = (GELU == Gelu::kTanh ? gelu_tanh(x[j]) : gelu_erf(x[j])) * up_j;
    }
  }
  store_vec<T, VEC>(p.out + row * p.out_stride, col, from_floats<T>(y));
  if constexpr (BACKWARD && HAS_UP) store_vec<T, VEC>(p.up_grad + row * p.up_grad_stride, col, from_floats<T>(du));
}

// Threads tile [rows, vecs]: threadIdx.x walks a row's vectors, threadIdx.y its rows, so
// no thread divides an index (a 64-bit division per element cost bandwidth:
// docs/decisions.md).
template <typename T, int VEC, Gelu GELU, bool HAS_UP, bool BACKWARD>
__global__ void __launch_bounds__(kBlock) activation_kernel(const ActivationParams<T> p) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= p.vecs_per_row) return;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < p.rows; row += row_step) {
    activation_vec<T, VEC, GELU, HAS_UP, BACKWARD>(p, row, col);
  }
}

template <typename T, Gelu GELU, bool HAS_UP, bool BACKWARD>
void launch(const ActivationArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  auto ok_ptr = [](const void* ptr) { return ptr == nullptr || aligned_to(ptr, 16); };
  bool vector = a.cols % V == 0 && ok_ptr(a.out) && ok_ptr(a.gate) && ok_ptr(a.up) && ok_ptr(a.grad) &&
                ok_ptr(a.up_grad);
  for (int64_t stride : {a.out_stride, a.gate_stride, a.up_stride, a.grad_stride, a.up_grad_stride}) {
    vector = vector && stride % V == 0;
  }
  const int vec = vector ? V : 1;
  const ActivationParams<T> p{static_cast<T*>(a.out), static_cast<const T*>(a.gate), static_cast<const T*>(a.up),
                              static_cast<const T*>(a.grad), static_cast<T*>(a.up_grad),
                              a.out_stride, a.gate_stride, a.up_stride, a.grad_stride, a.up_grad_stride,
                              a.rows, static_cast<int>(a.cols / vec)};
  const RowTiling tiling = row_tiling(a.rows, p.vecs_per_row, kBlock);
  if (vector) {
    activation_kernel<T, V, GELU, HAS_UP, BACKWARD><<<tiling.grid, tiling.block, 0, stream>>>(p);
  } else {
    activation_kernel<T, 1, GELU, HAS_UP, BACKWARD><<<tiling.grid, tiling.block, 0, stream>>>(p);
  }
  check_launch();
}

template <typename T, Gelu GELU>
void launch_gelu(const ActivationArgs& a, cudaStream_t stream) {
  const bool has_up = a.up != nullptr;
  if (a.grad != nullptr) {
    return has_up ? launch<T, GELU, true, true>(a, stream) : launch<T, GELU, false, true>(a, stream);
  }
  return has_up ? launch<T, GELU, true, false>(a, stream) : launch<T, GELU, false, false>(a, stream);
}

}  // namespace

void run_activation_cuda(const ActivationArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "activation", [&] {
    return a.gelu == Gelu::kTanh ? launch_gelu<scalar_t, Gelu::kTanh>(a, stream)
                                 : launch_gelu<scalar_t, Gelu::kErf>(a, stream);
  });
}

}  // namespace ltx

// The GELU family on CUDA (see activation.h): one thread per 16-byte output vector.
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
  int64_t out_stride, gate_stride, up_stride;
  int64_t rows;
  int vecs_per_row;
};

template <typename T, int VEC, Gelu GELU, bool HAS_UP>
__global__ void __launch_bounds__(kBlock) activation_kernel(const ActivationParams<T> p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  const int64_t row = idx / p.vecs_per_row;
  if (row >= p.rows) return;
  const int col = static_cast<int>(idx - row * p.vecs_per_row);
  const Vec<T, VEC> g = load_vec<T, VEC>(p.gate + row * p.gate_stride, col);
  Vec<T, VEC> u;
  if constexpr (HAS_UP) u = load_vec<T, VEC>(p.up + row * p.up_stride, col);
  Vec<T, VEC> y;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float x = to_float(g.v[j]);
    float f = GELU == Gelu::kTanh ? gelu_tanh(x) : gelu_erf(x);
    if constexpr (HAS_UP) f *= to_float(u.v[j]);
    y.v[j] = from_float<T>(f);
  }
  store_vec<T, VEC>(p.out + row * p.out_stride, col, y);
}

template <typename T, Gelu GELU, bool HAS_UP>
void launch(const ActivationArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  auto ok_ptr = [](const void* ptr) { return ptr == nullptr || aligned_to(ptr, 16); };
  const bool vector = a.cols % V == 0 && a.out_stride % V == 0 && a.gate_stride % V == 0 &&
                      a.up_stride % V == 0 && ok_ptr(a.out) && ok_ptr(a.gate) && ok_ptr(a.up);
  const int vec = vector ? V : 1;
  const ActivationParams<T> p{static_cast<T*>(a.out), static_cast<const T*>(a.gate), static_cast<const T*>(a.up),
                              a.out_stride, a.gate_stride, a.up_stride, a.rows, static_cast<int>(a.cols / vec)};
  const int64_t blocks = (a.rows * p.vecs_per_row + kBlock - 1) / kBlock;
  if (vector) {
    activation_kernel<T, V, GELU, HAS_UP><<<blocks, kBlock, 0, stream>>>(p);
  } else {
    activation_kernel<T, 1, GELU, HAS_UP><<<blocks, kBlock, 0, stream>>>(p);
  }
  check_launch();
}

}  // namespace

void run_activation_cuda(const ActivationArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  const bool has_up = a.up != nullptr;
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "activation", [&] {
    if (a.gelu == Gelu::kTanh) {
      return has_up ? launch<scalar_t, Gelu::kTanh, true>(a, stream) : launch<scalar_t, Gelu::kTanh, false>(a, stream);
    }
    return has_up ? launch<scalar_t, Gelu::kErf, true>(a, stream) : launch<scalar_t, Gelu::kErf, false>(a, stream);
  });
}

}  // namespace ltx

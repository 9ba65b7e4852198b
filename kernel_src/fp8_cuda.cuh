// FP8 output on CUDA, shared by the quantize kernel (fp8.cu) and the norm kernels' FP8 mode
// (norm_forward.cuh): a row's amax over its threads and e4m3 stores, the math of fp8_math.h.
// Conversion by cuda_fp8.h, saturating (every arch: below sm_89 it is emulated, and the ops
// refuse those GPUs anyway).
#pragma once

#include "cuda_common.cuh"
#include "fp8_math.h"

#include <cuda_fp8.h>

#include <type_traits>

namespace ltx {

// The norm kernels' FP8 output element (their O): an e4m3 byte, beside the row's scale.
struct Fp8E4m3 {
  uint8_t bits;
};
template <typename O>
constexpr bool kFp8Out = std::is_same_v<O, Fp8E4m3>;

// FP8 kernels run on sm_89 and newer (the ops refuse older GPUs). Ada (sm_89) runs the sm_80
// build (compute_90 PTX cannot serve it), so only the sm_75 build's bodies are a trap, with no
// build time or registers spent on code that cannot run.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kFp8Arch = false;
#else
constexpr bool kFp8Arch = true;
#endif


// fp8_amax_step over one row's threads, as row_sum adds them (cuda_common.cuh's
// row_reduce): every thread of the row gets the result.
struct Fp8AmaxStep {
  __device__ __forceinline__ float operator()(float running, float a) const { return fp8_amax_step(running, a); }
};
__device__ __forceinline__ float row_amax(float v, int threads_per_row, float* scratch) {
  return row_reduce(v, threads_per_row, scratch, Fp8AmaxStep{});
}

// Stores VEC e4m3 bytes of f / scale at vector i of `row`, packed into 32-bit words in
// registers (an array of bytes went through local memory on sm_80, where the conversion is
// emulated).
template <int VEC>
__device__ __forceinline__ void store_fp8(uint8_t* row, int i, const float (&f)[VEC], float scale) {
  uint32_t words[(VEC + 3) / 4] = {};
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const uint32_t byte = __nv_cvt_float_to_fp8(fp8_scaled(f[j], scale), __NV_SATFINITE, __NV_E4M3);
    words[j / 4] |= byte << (8 * (j % 4));
  }
  if constexpr (VEC == 8) {
    reinterpret_cast<uint2*>(row)[i] = make_uint2(words[0], words[1]);
  } else if constexpr (VEC == 4) {
    reinterpret_cast<uint32_t*>(row)[i] = words[0];
  } else {
    static_assert(VEC == 1, "fp8 stores: 1, 4 or 8 bytes");
    row[i] = static_cast<uint8_t>(words[0]);
  }
}
template <int VEC>
__device__ __forceinline__ void store_fp8(Fp8E4m3* row, int i, const float (&f)[VEC], float scale) {
  store_fp8<VEC>(reinterpret_cast<uint8_t*>(row), i, f, scale);
}

// The running amax of a row's values f.
template <int VEC>
__device__ __forceinline__ float fp8_amax_of(float amax, const float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) amax = fp8_amax_step(amax, fabsf(f[j]));
  return amax;
}

// A row's FP8 scale: *static_scale, or made from the amax of the row's y, which y_of(v, i, f)
// computes for each vector v (index i) that each_vec hands this thread, and stored at
// scales[row] by the thread that `writes`.
template <int VEC, typename YOf, typename EachVec>
__device__ __forceinline__ float row_fp8_scale(const YOf& y_of, const EachVec& each_vec, int threads_per_row,
                                               float* scratch, const float* static_scale, float* scales,
                                               int64_t row, bool writes) {
  if (static_scale != nullptr) return *static_scale;
  float amax = 0.f;
  each_vec([&](const auto& v, int i) {
    float f[VEC];
    y_of(v, i, f);
    amax = fp8_amax_of(amax, f);
  });
  const float scale = fp8_scale_of(row_amax(amax, threads_per_row, scratch));
  if (writes) scales[row] = scale;
  return scale;
}

}  // namespace ltx

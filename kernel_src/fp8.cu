// FP8 quantization on CUDA (see fp8.h): a row per lane group, warp or block, as its width
// needs. Each thread keeps up to kCachedVecs 16-byte vectors of its row in registers from
// the amax reduction to the write (the input's vectors, or the GELU's fp32 values),
// re-reading and recomputing any further ones (from L1/L2); rows that are not 16-byte
// aligned take the scalar path. Reductions and stores: fp8_cuda.cuh.
#include "activation_math.h"
#include "cuda_common.cuh"
#include "fp8.h"
#include "fp8_cuda.cuh"

#include <algorithm>
#include <type_traits>

namespace ltx {
namespace {

// Vectors a thread keeps from the amax to the write (the kernel's KEEP): four, or fewer for
// GELU rows without up's (launch_keeping).
constexpr int kCachedVecs = 4;
// The input's rows fit 64 registers at 1024 threads; GELU rows keep fp32 values (twice a
// 16-bit vector's registers) and up's, at 512 threads (128 registers).
template <Fp8Source S>
constexpr int kMaxBlock = S == Fp8Source::kInput ? 1024 : 512;

template <typename T>
struct Fp8Params {
  const T* input;            // [rows, cols], rows input_stride apart
  const T* up;               // [rows, cols], rows up_stride apart, or nullptr
  uint8_t* out;              // [rows, cols] contiguous
  float* scales;             // [rows] or nullptr (static)
  const float* static_scale; // or nullptr (dynamic)
  int64_t rows, input_stride, up_stride, cols;
  int nvec;                  // vectors per row
};

template <int VEC>
struct Floats {
  float f[VEC];
};

// A vector's fp32 values from its loaded x (and up's): the input's, or (gelu(x) [* up]) as
// activation.cu computes them before its rounding.
template <typename T, int VEC, Fp8Source S, bool HAS_UP>
__device__ __forceinline__ void vector_values(const Vec<T, VEC>& xv, const Vec<T, VEC>& uv, float (&f)[VEC]) {
  to_floats(xv, f);
  if constexpr (S != Fp8Source::kInput) {
    float u[VEC];
    if constexpr (HAS_UP) to_floats(uv, u);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float g = S == Fp8Source::kGeluTanh ? gelu_tanh(f[j]) : gelu_erf(f[j]);
      f[j] = HAS_UP ? g * u[j] : g;
    }
  }
}

// Vector i of the row's fp32 values.
template <typename T, int VEC, Fp8Source S, bool HAS_UP>
__device__ __forceinline__ void row_values(const T* x, const T* up, int i, float (&f)[VEC]) {
  vector_values<T, VEC, S, HAS_UP>(load_vec<T, VEC>(x, i), HAS_UP ? load_vec<T, VEC>(up, i) : Vec<T, VEC>{}, f);
}

template <typename T, int VEC, Fp8Source S, bool HAS_UP, int KEEP>
__global__ void __launch_bounds__(kMaxBlock<S>) quantize_fp8_kernel(const Fp8Params<T> p, int row_shift) {
  if constexpr (!kFp8Arch) {
    __trap();
    return;
  }
  __shared__ float scratch[32];
  const int threads_per_row = 1 << row_shift;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> row_shift) + (threadIdx.x >> row_shift);
  const int t = threadIdx.x & (threads_per_row - 1);
  // Threads past the last row still take part in the block's reduction.
  const bool active = row < p.rows;
  const T* x = p.input + (active ? row : 0) * p.input_stride;
  const T* up = HAS_UP ? p.up + (active ? row : 0) * p.up_stride : nullptr;
  // The input's vectors, converted again for the write; a GELU's values, computed once.
  constexpr bool kKeepsInput = S == Fp8Source::kInput;
  using Kept = std::conditional_t<kKeepsInput, Vec<T, VEC>, Floats<VEC>>;
  Kept kept[KEEP];
  // 16-bit GELU rows load every kept vector ahead of the first GELU: in one loop each
  // vector's load waited for the GELU of the one before it, a memory round trip a vector.
  // (fp32 rows with up's would take a block fewer an SM for it.)
  constexpr bool kLoadsAhead = !kKeepsInput && sizeof(T) == 2;
  constexpr int kAhead = kLoadsAhead ? KEEP : 1;
  Vec<T, VEC> xs[kAhead], ups[kLoadsAhead && HAS_UP ? KEEP : 1];
  if constexpr (kLoadsAhead) {
#pragma unroll
    for (int k = 0; k < KEEP; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < p.nvec) {
        xs[k] = load_vec<T, VEC>(x, i);
        if constexpr (HAS_UP) ups[k] = load_vec<T, VEC>(up, i);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < KEEP; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < p.nvec) {
      if constexpr (kKeepsInput) kept[k] = load_vec<T, VEC>(x, i);
      else if constexpr (kLoadsAhead) vector_values<T, VEC, S, HAS_UP>(xs[k], ups[HAS_UP ? k : 0], kept[k].f);
      else row_values<T, VEC, S, HAS_UP>(x, up, i, kept[k].f);
    }
  }
  auto kept_values = [&](const Kept& v, float (&f)[VEC]) {
    if constexpr (kKeepsInput) {
      to_floats(v, f);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = v.f[j];
    }
  };
  float amax = 0.f;
  if (p.static_scale == nullptr) {
    float f[VEC];
#pragma unroll
    for (int k = 0; k < KEEP; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < p.nvec) {
        kept_values(kept[k], f);
        amax = fp8_amax_of(amax, f);
      }
    }
    for (int i = t + KEEP * threads_per_row; active && i < p.nvec; i += threads_per_row) {
      row_values<T, VEC, S, HAS_UP>(x, up, i, f);
      amax = fp8_amax_of(amax, f);
    }
  }
  const Fp8Divisor divisor =
      row_fp8_divisor(amax, threads_per_row, scratch, p.static_scale, p.scales, row, active && t == 0);
  if (!active) return;
  uint8_t* q = p.out + row * p.cols;
  // 16-bit rows of 16-byte vectors (the models') split the write by the quotient rule; fp32
  // GELU and unaligned rows spill so.
  constexpr bool kSplitRule = sizeof(T) == 2 && VEC * sizeof(T) == 16;
  with_quotient_rule<kSplitRule>(divisor, [&](auto rule) {
    constexpr Fp8Rule M = decltype(rule)::value;
    float f[VEC];
#pragma unroll
    for (int k = 0; k < KEEP; ++k) {
      const int i = t + k * threads_per_row;
      if (i < p.nvec) {
        kept_values(kept[k], f);
        store_fp8<VEC, M>(q, i, f, divisor);
      }
    }
    for (int i = t + KEEP * threads_per_row; i < p.nvec; i += threads_per_row) {
      row_values<T, VEC, S, HAS_UP>(x, up, i, f);
      store_fp8<VEC, M>(q, i, f, divisor);
    }
  });
}

template <typename T, int VEC, Fp8Source S, bool HAS_UP, int KEEP>
void launch_rows(const Fp8Params<T>& p, cudaStream_t stream) {
  const RowLaunch cfg = row_launch(p.nvec, KEEP, kMaxBlock<S>);
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (p.rows + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(blocks <= INT32_MAX, "quantize_fp8: too many rows for one launch (", p.rows, ")");
  const int shift = __builtin_ctz(cfg.threads_per_row);
  quantize_fp8_kernel<T, VEC, S, HAS_UP, KEEP><<<static_cast<unsigned>(blocks), cfg.block, 0, stream>>>(p, shift);
  check_launch();
}

// GELU rows without up's keep at most 16 fp32 values a thread (16-bit rows: two vectors, 40
// registers against 60 at four, more warps an SM to hide the loads) where 512 threads hold
// the whole row that way. Rows with up's keep four vectors (at two, their registers would fit
// no block more an SM).
constexpr int kGeluKeptFloats = 16;
template <typename T, int VEC, Fp8Source S, bool HAS_UP>
void launch_keeping(const Fp8Params<T>& p, cudaStream_t stream) {
  constexpr int kKeep = std::min(kCachedVecs, kGeluKeptFloats / VEC);
  if constexpr (S != Fp8Source::kInput && !HAS_UP && kKeep < kCachedVecs) {
    if (p.nvec <= kKeep * kMaxBlock<S>) return launch_rows<T, VEC, S, HAS_UP, kKeep>(p, stream);
  }
  launch_rows<T, VEC, S, HAS_UP, kCachedVecs>(p, stream);
}

template <typename T, Fp8Source S, bool HAS_UP>
void launch(const Fp8Args& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector = a.cols % V == 0 && a.input_stride % V == 0 && aligned_to(a.input, 16) &&
                      (!HAS_UP || (a.up_stride % V == 0 && aligned_to(a.up, 16)));
  const int vec = vector ? V : 1;
  const Fp8Params<T> p{static_cast<const T*>(a.input), static_cast<const T*>(a.up), a.out, a.scales,
                       a.static_scale, a.rows, a.input_stride, a.up_stride, a.cols, static_cast<int>(a.cols / vec)};
  if (vector) {
    launch_keeping<T, V, S, HAS_UP>(p, stream);
  } else {
    launch_keeping<T, 1, S, HAS_UP>(p, stream);
  }
}

template <typename T, Fp8Source S>
void launch_gelu(const Fp8Args& a, cudaStream_t stream) {
  return a.up != nullptr ? launch<T, S, true>(a, stream) : launch<T, S, false>(a, stream);
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
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "quantize_fp8", [&] {
    switch (a.source) {
      case Fp8Source::kInput: return launch<scalar_t, Fp8Source::kInput, false>(a, stream);
      case Fp8Source::kGeluErf: return launch_gelu<scalar_t, Fp8Source::kGeluErf>(a, stream);
      case Fp8Source::kGeluTanh: return launch_gelu<scalar_t, Fp8Source::kGeluTanh>(a, stream);
    }
  });
}

}  // namespace ltx

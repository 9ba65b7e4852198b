// The norm family on CUDA (see norm.h): one pass over memory per op. Each row is read
// once into registers (16-byte vectors where alignment allows), reduced in fp32, then
// scaled and written with one rounding.
#include "cuda_common.cuh"
#include "norm.h"

#include <type_traits>

namespace ltx {
namespace {

// 16-byte vectors each thread keeps in registers between the reduction and the write.
// Four loads in flight per thread cover DRAM latency, and 4 x 16 B of registers keep a
// 1024-thread block under its 64 registers per thread. Rows of more than
// max_block * 4 vectors re-read the rest, which then comes from L2.
constexpr int kCachedVecs = 4;

// What an instantiation fuses around the norm (unused operands compile away):
// RESIDUAL, a residual (+ gate) add before the norm with the sum stored; MODULATE,
// * (1 + scale) + shift after it. The plain norm fits 64 registers, so it may use
// 1024-thread blocks (bf16 rows up to D = 32768 stay in registers); fused variants
// need more registers: 512 threads, 128 registers.
constexpr int max_block(bool residual, bool modulate) { return residual || modulate ? 512 : 1024; }

template <typename T, typename W, typename O>
struct NormParams {
  O* out;             // [rows, cols], rows out_stride apart; nullptr for kNone
  T* residual_out;    // [rows, cols] or nullptr
  const T* input;     // [rows, cols]
  const T* residual;  // [rows, cols] or nullptr
  const W* weight;    // [cols] or nullptr
  const T* gate;      // per (batch, token) rows, see Modulation; nullptr if unused
  const T* scale;
  const T* shift;
  int64_t gate_batch, gate_token, scale_batch, scale_token, shift_batch, shift_token;
  int64_t rows, tokens;
  int64_t input_stride, residual_stride, out_stride, residual_out_stride;
  int cols;
  float eps, inv_cols, weight_offset;
  bool cast_before_weight;
};

template <typename T, typename W, typename O, int VEC, NormKind KIND, bool RESIDUAL, bool MODULATE>
__global__ void __launch_bounds__(max_block(RESIDUAL, MODULATE)) norm_kernel(const NormParams<T, W, O> p, int threads_per_row) {
  __shared__ float scratch[32];
  const int rows_per_block = blockDim.x / threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / threads_per_row;
  const int t = threadIdx.x % threads_per_row;
  // Threads past the last row still take part in the reductions.
  const bool active = row < p.rows;
  const int64_t r = active ? row : 0;
  const int64_t batch = r / p.tokens;
  const int64_t token = r - batch * p.tokens;
  const int nvec = p.cols / VEC;

  const T* x = p.input + r * p.input_stride;
  const T* res = RESIDUAL ? p.residual + r * p.residual_stride : nullptr;
  T* res_out = RESIDUAL ? p.residual_out + r * p.residual_out_stride : nullptr;
  const T* gate = RESIDUAL && p.gate ? p.gate + batch * p.gate_batch + token * p.gate_token : nullptr;
  // Vectors past the cache are read again: the stored sum when the op makes one.
  const T* reread = res_out ? res_out : x;

  // The row's value: input, or residual + input (* gate) rounded to T and stored.
  auto load_row = [&](int i) {
    Vec<T, VEC> v = load_vec<T, VEC>(x, i);
    if constexpr (RESIDUAL) {
      const Vec<T, VEC> rv = load_vec<T, VEC>(res, i);
      if (gate != nullptr) {
        const Vec<T, VEC> g = load_vec<T, VEC>(gate, i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = from_float<T>(to_float(rv.v[j]) + to_float(v.v[j]) * to_float(g.v[j]));
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = from_float<T>(to_float(rv.v[j]) + to_float(v.v[j]));
      }
      store_vec<T, VEC>(res_out, i, v);
    }
    return v;
  };
  auto sum_of = [](const Vec<T, VEC>& v, float shift, bool square) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(v.v[j]) - shift;
      s += square ? f * f : f;
    }
    return s;
  };

  Vec<T, VEC> cached[kCachedVecs];
  // LayerNorm takes the mean first and then the centred square sum (as PyTorch, no
  // cancellation); RMSNorm takes the square sum in the first pass.
  constexpr bool kSquareFirst = KIND == NormKind::kRms;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < kCachedVecs; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < nvec) {
      cached[k] = load_row(i);
      acc += sum_of(cached[k], 0.f, kSquareFirst);
    }
  }
  for (int i = t + kCachedVecs * threads_per_row; active && i < nvec; i += threads_per_row) {
    acc += sum_of(load_row(i), 0.f, kSquareFirst);
  }
  if constexpr (KIND == NormKind::kNone) {
    return;
  } else {
    float mean = 0.f;
    float sum_sq = row_sum(acc, threads_per_row, scratch);
    if constexpr (KIND == NormKind::kLayer) {
      mean = sum_sq * p.inv_cols;
      acc = 0.f;
#pragma unroll
      for (int k = 0; k < kCachedVecs; ++k) {
        const int i = t + k * threads_per_row;
        if (active && i < nvec) acc += sum_of(cached[k], mean, true);
      }
      for (int i = t + kCachedVecs * threads_per_row; active && i < nvec; i += threads_per_row) {
        acc += sum_of(load_vec<T, VEC>(reread, i), mean, true);
      }
      sum_sq = row_sum(acc, threads_per_row, scratch);
    }
    if (!active) return;
    const float rstd = rsqrtf(sum_sq * p.inv_cols + p.eps);

    O* y_row = p.out + r * p.out_stride;
    const T* scale = MODULATE ? p.scale + batch * p.scale_batch + token * p.scale_token : nullptr;
    const T* shift = MODULATE ? p.shift + batch * p.shift_batch + token * p.shift_token : nullptr;
    auto write = [&](const Vec<T, VEC>& v, int i) {
      Vec<W, VEC> w;
      Vec<T, VEC> sc, sh;
      if (p.weight != nullptr) w = load_vec<W, VEC>(p.weight, i);
      if constexpr (MODULATE) {
        sc = load_vec<T, VEC>(scale, i);
        sh = load_vec<T, VEC>(shift, i);
      }
      Vec<O, VEC> y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float f = (to_float(v.v[j]) - mean) * rstd;
        if (p.cast_before_weight) f = to_float(from_float<T>(f));
        if (p.weight != nullptr) f *= p.weight_offset + to_float(w.v[j]);
        if constexpr (MODULATE) f = f * (1.f + to_float(sc.v[j])) + to_float(sh.v[j]);
        y.v[j] = from_float<O>(f);
      }
      store_vec<O, VEC>(y_row, i, y);
    };
#pragma unroll
    for (int k = 0; k < kCachedVecs; ++k) {
      const int i = t + k * threads_per_row;
      if (i < nvec) write(cached[k], i);
    }
    for (int i = t + kCachedVecs * threads_per_row; i < nvec; i += threads_per_row) {
      write(load_vec<T, VEC>(reread, i), i);
    }
  }
}

template <typename T, typename W, typename O>
NormParams<T, W, O> make_params(const NormArgs& a) {
  return {static_cast<O*>(a.out),
          static_cast<T*>(a.residual_out),
          static_cast<const T*>(a.input),
          static_cast<const T*>(a.residual),
          static_cast<const W*>(a.weight),
          static_cast<const T*>(a.gate.ptr),
          static_cast<const T*>(a.scale.ptr),
          static_cast<const T*>(a.shift.ptr),
          a.gate.batch_stride, a.gate.token_stride, a.scale.batch_stride, a.scale.token_stride,
          a.shift.batch_stride, a.shift.token_stride,
          a.rows, a.tokens,
          a.input_stride, a.residual_stride, a.out_stride, a.residual_out_stride,
          static_cast<int>(a.cols),
          a.eps, a.inv_cols, a.weight_offset, a.cast_before_weight};
}

// Whether every pointer and stride allows VEC-wide accesses.
template <typename T, typename W, typename O, int VEC>
bool vectorizable(const NormArgs& a) {
  auto ok_ptr = [](const void* p, std::size_t bytes) { return p == nullptr || aligned_to(p, bytes); };
  auto ok_stride = [](int64_t s) { return s % VEC == 0; };
  const std::size_t tb = VEC * sizeof(T);
  return a.cols % VEC == 0 && ok_stride(a.input_stride) && ok_stride(a.residual_stride) &&
         ok_stride(a.out_stride) && ok_stride(a.residual_out_stride) &&
         ok_stride(a.gate.batch_stride) && ok_stride(a.gate.token_stride) &&
         ok_stride(a.scale.batch_stride) && ok_stride(a.scale.token_stride) &&
         ok_stride(a.shift.batch_stride) && ok_stride(a.shift.token_stride) &&
         ok_ptr(a.input, tb) && ok_ptr(a.residual, tb) && ok_ptr(a.residual_out, tb) &&
         ok_ptr(a.gate.ptr, tb) && ok_ptr(a.scale.ptr, tb) && ok_ptr(a.shift.ptr, tb) &&
         ok_ptr(a.weight, VEC * sizeof(W)) && ok_ptr(a.out, VEC * sizeof(O));
}

template <typename T, typename W, typename O, NormKind KIND, bool RESIDUAL, bool MODULATE>
void launch(const NormArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector = vectorizable<T, W, O, V>(a);
  const int vec = vector ? V : 1;
  const RowLaunch cfg = row_launch(a.cols / vec, kCachedVecs, max_block(RESIDUAL, MODULATE));
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  const NormParams<T, W, O> p = make_params<T, W, O>(a);
  if (vector) {
    norm_kernel<T, W, O, V, KIND, RESIDUAL, MODULATE><<<blocks, cfg.block, 0, stream>>>(p, cfg.threads_per_row);
  } else {
    norm_kernel<T, W, O, 1, KIND, RESIDUAL, MODULATE><<<blocks, cfg.block, 0, stream>>>(p, cfg.threads_per_row);
  }
  check_launch();
}

}  // namespace

void run_norm_cuda(const NormArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  const bool residual = a.residual != nullptr;
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm", [&] {
    using T = scalar_t;
    if (a.kind == NormKind::kNone) return launch<T, T, T, NormKind::kNone, true, false>(a, stream);
    if (a.scale.ptr != nullptr) {  // AdaLN, after a gated residual or not
      if (a.kind == NormKind::kLayer) {
        return residual ? launch<T, T, T, NormKind::kLayer, true, true>(a, stream)
                        : launch<T, T, T, NormKind::kLayer, false, true>(a, stream);
      }
      return residual ? launch<T, T, T, NormKind::kRms, true, true>(a, stream)
                      : launch<T, T, T, NormKind::kRms, false, true>(a, stream);
    }
    // RMSNorm with a weight of the input dtype or fp32, after a residual add or not.
    auto rms = [&](auto with_residual) {
      constexpr bool R = decltype(with_residual)::value;
      if (a.weight_fp32 && a.out_fp32) return launch<T, float, float, NormKind::kRms, R, false>(a, stream);
      if (a.weight_fp32) return launch<T, float, T, NormKind::kRms, R, false>(a, stream);
      return launch<T, T, T, NormKind::kRms, R, false>(a, stream);
    };
    return residual ? rms(std::true_type{}) : rms(std::false_type{});
  });
}

}  // namespace ltx

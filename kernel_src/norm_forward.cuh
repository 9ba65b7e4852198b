// The norm family's forward on CUDA (see norm.h): one pass over memory per op. Each row is
// read once into registers (16-byte vectors where alignment allows), reduced in fp32, then
// scaled and written with one rounding. The kernels and the launch choice live here, in
// ltx::norm_cuda, for norm_forward.cu and the tuning harness benchmarks/norm_variants.cu.
// The measurements behind the launch constants, and the alternatives they beat, are rows
// of docs/decisions.md.
#pragma once

#include "cuda_common.cuh"
#include "fp8_cuda.cuh"
#include "norm.h"

#include <algorithm>
#include <array>
#include <type_traits>

namespace ltx::norm_cuda {

// What an instantiation fuses around the norm (unused operands compile away):
// RESIDUAL, a residual (+ gate) add before the norm with the sum stored; MODULATE,
// * (1 + scale) + shift after it. The plain norm fits 64 registers, so it may use
// 1024-thread blocks (bf16 rows up to D = 32768 stay in registers); fused variants
// need more registers: 512 threads, 128 registers.
constexpr int max_block(bool residual, bool modulate) { return residual || modulate ? 512 : 1024; }

// Vectors a thread caches from the reduction to the write, by launch:
//   1  residual rows of up to kOneVecThreads vectors, at two or more rows per SM;
//   2  rows without a residual of up to 2 * kTwoVecThreads vectors, at few rows per SM;
//   4  (kCachedVecs) everything else, re-reading what does not fit (from L2);
//   8  (kDecodeCachedVecs) the fused ops' fp32 rows (512 threads) at most one per SM that
//      four vectors a thread do not cover;
//   8  (kWideCachedVecs) plain RMSNorm rows too wide for four, in rms_norm_wide_row_kernel.

// Four loads in flight cover DRAM latency, and 4 x 16 B keep 1024 threads within 64 registers.
constexpr int kCachedVecs = 4;
// A decode row is latency-bound: held whole, with its write operands, it takes one memory
// round trip, where four vectors a thread re-read the rest (up to three times: LayerNorm
// after a residual add). At up to 128 registers one block fits an SM: at most one row per
// SM. In 16 bits (rows past 16384 elements) eight vectors with their write operands spill
// (docs/decisions.md).
constexpr int kDecodeCachedVecs = 8;
// Residual rows: at four vectors, loads first, they take 78-104 registers (sm_90: one
// 512-thread block an SM), at one at most 48 (docs/decisions.md).
constexpr int kOneVecThreads = 256;
// Blocks per SM of one-vector rows: an unweighted row fits 32 registers, a full SM; the
// weighted fused add would spill there (docs/decisions.md).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kOneVecMinBlocks = 4;  // sm_75 holds 1024 threads per SM (64 registers)
constexpr int kOneVecUnweightedMinBlocks = 4;
#else
constexpr int kOneVecMinBlocks = 5;
constexpr int kOneVecUnweightedMinBlocks = 8;
#endif
// Two-vector rows: twice the threads a row of the four-vector launch has, in at most 40
// registers (1536 threads per SM) with the write operands loaded before the reduction.
constexpr int kTwoVecThreads = 512;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kTwoVecMinBlocks = 2;  // 1024 threads per SM
#else
constexpr int kTwoVecMinBlocks = 3;
#endif

// Whether AdaLN RMS's scale and shift load with the row (two vectors a thread): on sm_90 in
// 16 bits only, where it fits the 40-register bound (docs/decisions.md). `arch` is
// __CUDA_ARCH__ in the kernel and the device's compute capability x 100 on the host.
template <typename T>
__host__ __device__ constexpr bool modulated_preload(int arch, NormKind kind) {
  return arch >= 900 && kind == NormKind::kRms && sizeof(T) == 2;
}
#ifdef __CUDA_ARCH__
constexpr int kDeviceArch = __CUDA_ARCH__;
#else
constexpr int kDeviceArch = 0;  // the host pass: no kernel body runs there
#endif

template <typename T, typename W, typename O>
struct NormParams {
  O* out;             // [rows, cols], rows out_stride apart; nullptr without a norm
  T* residual_out;    // [rows, cols] or nullptr
  float2* stats;      // [rows] (mean, rstd) or nullptr
  const T* input;     // [rows, cols]
  const T* residual;  // [rows, cols] or nullptr
  const W* weight;    // [cols] or nullptr
  const T* gate;      // per (batch, token) rows, see Modulation; nullptr if unused
  const T* scale;
  const T* shift;
  int64_t gate_batch, gate_token, scale_batch, scale_token, shift_batch, shift_token;
  int64_t rows;
  IntDivider tokens;  // row r is (r / tokens, r % tokens); rows < 2^31 (see make_params)
  int64_t input_stride, residual_stride, out_stride, residual_out_stride;
  int cols;
  float eps, inv_cols, weight_offset;
  bool cast_before_weight;
};
// The FP8 output mode (O = Fp8E4m3): out holds e4m3 bytes, each row's y (the fp32 value an
// fp32 out would hold) divided by the row's scale (fp8_math.h). A specialization, so that the
// other outputs' parameters (and kernels) stay as they are.
template <typename T, typename W>
struct NormParams<T, W, Fp8E4m3> : NormParams<T, W, uint8_t> {
  float* scales;              // [rows], or nullptr (static)
  const float* static_scale;  // one element, or nullptr (dynamic)
};

// CACHED vectors a thread stay in registers; with one or two (the launches of
// kOneVecThreads and kTwoVecThreads above), the row has at most CACHED * threads_per_row
// vectors and nothing is re-read. A minimum of 0 blocks is none: an explicit 1 costs the
// four-vector residual kernels registers (docs/decisions.md).
constexpr int bound_threads(int cached, bool residual, bool modulate) {
  return cached == 1 ? kOneVecThreads : cached == 2 ? kTwoVecThreads : max_block(residual, modulate);
}
// Rows whose write takes no weight (AdaLN's) fit 32 registers at one vector a thread.
// LayerNorm's residual rows also make their first element (the mean's offset) ahead of
// the sum: in 32 registers they spill, so they take the weighted rows' bound.
// FP8 outputs (FP8) keep the cached vectors' y in fp32 from the amax to the write and convert
// (emulated on sm_80): at the one- and two-vector bounds they spill, so they take fewer
// blocks per SM (the launch, and so the result, is unchanged). At four vectors an explicit
// minimum of one block keeps ptxas from holding the 512-thread kernels to 64 registers with
// spills (they take up to 88 on sm_90).
constexpr int kFp8OneVecMinBlocks = 4;  // 64 registers at 256 threads
constexpr int kFp8TwoVecMinBlocks = 2;  // 64 registers at 512 threads
// Two-vector rows after a residual add (decode rows, kPreloadsDecodeWeight below) spill at
// the two-vector bound too: they take FP8's.
constexpr int bound_min_blocks(int cached, bool weighted, bool layer_residual, bool fp8, bool residual) {
  if (cached == 1 && fp8) return kFp8OneVecMinBlocks;
  if (cached == 1) return weighted || layer_residual ? kOneVecMinBlocks : kOneVecUnweightedMinBlocks;
  if (cached == 2 && (fp8 || residual)) return kFp8TwoVecMinBlocks;
  return cached == 2 ? kTwoVecMinBlocks : fp8 ? 1 : 0;
}

// The row's value after a residual add: residual + x (* gate if gated; else gate is not
// read), rounded to T.
template <typename T, int VEC>
__device__ __forceinline__ void add_residual(Vec<T, VEC>& v, const Vec<T, VEC>& residual, const Vec<T, VEC>& gate,
                                             bool gated) {
#pragma unroll
  for (int j = 0; j < VEC; ++j)
    v.v[j] = from_float<T>(gated ? to_float(residual.v[j]) + to_float(v.v[j]) * to_float(gate.v[j])
                                 : to_float(residual.v[j]) + to_float(v.v[j]));
}

// A vector's sum of (x - shift), or of its squares, in element order.
template <typename T, int VEC>
__device__ __forceinline__ float vec_sum(const Vec<T, VEC>& v, float shift, bool square) {
  float f[VEC];
  to_floats(v, f);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    f[j] -= shift;
    s += square ? f[j] * f[j] : f[j];
  }
  return s;
}

// The element's factor after the norm: RMSNorm's weight_offset + weight, or AdaLN's 1 + scale.
__device__ __forceinline__ float weight_factor(float weight_offset, float w) { return weight_offset + w; }
__device__ __forceinline__ float scale_factor(float scale) { return 1.f + scale; }

// normed_y's steps from the factors (weight_factor or scale_factor of each element) and
// AdaLN's shift, given as they are or staged (norm_fp8_warp_row_kernel).
template <typename T, bool MODULATE, int VEC>
__device__ __forceinline__ void normed_y_by_factors(float (&f)[VEC], const float (&factor)[VEC],
                                                    const float (&shf)[VEC], float mean, float rstd, bool cast,
                                                    bool weighted) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    f[j] = (f[j] - mean) * rstd;
    // AdaLN's rows have no weight to round before: the flag's predicated rounding would
    // still take two issue slots an element.
    if (!MODULATE && cast) f[j] = to_float(from_float<T>(f[j]));
    if (weighted) f[j] *= factor[j];
    if constexpr (MODULATE) f[j] = f[j] * factor[j] + shf[j];
  }
}

// A vector's y from its elements f: normed (mean, rstd), rounded to T first (cast), weighted
// or modulated, as norm_kernel's write makes it before the output's rounding: the FP8
// outputs' y, which must be the fp32 output's bits. (That write keeps its own copy of these
// steps: through normed_y its unvectorized LayerNorm AdaLN rows spill on sm_80.)
template <typename T, bool MODULATE, int VEC>
__device__ __forceinline__ void normed_y(float (&f)[VEC], const float (&wf)[VEC], const float (&scf)[VEC],
                                         const float (&shf)[VEC], float mean, float rstd, bool cast, bool weighted,
                                         float weight_offset) {
  float factor[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    if constexpr (MODULATE) factor[j] = scale_factor(scf[j]);
    else factor[j] = weighted ? weight_factor(weight_offset, wf[j]) : 0.f;
  }
  normed_y_by_factors<T, MODULATE>(f, factor, shf, mean, rstd, cast, weighted);
}

template <typename T, typename W, typename O, int VEC, int CACHED, NormKind KIND, bool RESIDUAL, bool MODULATE>
__global__ void __launch_bounds__(bound_threads(CACHED, RESIDUAL, MODULATE),
                                  bound_min_blocks(CACHED, /*weighted=*/!MODULATE,
                                                   KIND == NormKind::kLayer && RESIDUAL, kFp8Out<O>, RESIDUAL))
    norm_kernel(const NormParams<T, W, O> p, int row_shift) {
  if constexpr (kFp8Out<O> && !kFp8Arch) {
    __trap();
    return;
  }
  __shared__ float scratch[2][32];  // one per row reduction (LayerNorm's two)
  // Rows take a power of two of threads, passed as its log: the divisions below compile to
  // shifts and masks ahead of the loads.
  const int threads_per_row = 1 << row_shift;
  const int rows_per_block = blockDim.x / threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / threads_per_row;
  const int t = threadIdx.x % threads_per_row;
  // Threads past the last row still take part in the reductions.
  const bool active = row < p.rows;
  const int64_t r = active ? row : 0;
  const uint32_t batch = p.tokens.div(static_cast<uint32_t>(r));
  const uint32_t token = static_cast<uint32_t>(r) - batch * p.tokens.divisor;
  const int nvec = p.cols / VEC;

  const T* x = p.input + r * p.input_stride;
  const T* res = RESIDUAL ? p.residual + r * p.residual_stride : nullptr;
  T* res_out = RESIDUAL ? p.residual_out + r * p.residual_out_stride : nullptr;
  const T* gate = RESIDUAL && p.gate ? p.gate + batch * p.gate_batch + token * p.gate_token : nullptr;
  // Vectors past the cache are read again: the stored sum when the op makes one.
  const T* reread = res_out ? res_out : x;

  // The row's value: input, or residual + input (* gate) rounded to T (and stored).
  auto load_row = [&](int i, bool store) {
    Vec<T, VEC> v = load_vec<T, VEC>(x, i);
    if constexpr (RESIDUAL) {
      const Vec<T, VEC> rv = load_vec<T, VEC>(res, i);
      // The gate's branch outside the sum: the one- and two-vector rows' kernels sit at
      // their register bounds.
      if (gate != nullptr) add_residual(v, rv, load_vec<T, VEC>(gate, i), true);
      else add_residual(v, rv, rv, false);
      if (store) store_vec<T, VEC>(res_out, i, v);
    }
    return v;
  };

  Vec<T, VEC> cached[CACHED];
  constexpr bool kReread = CACHED == kCachedVecs;  // the other launches cover the row
  // AdaLN takes no weight (launch asserts it): without the weight's registers its
  // four-vector kernel holds 62-63 registers, not 69-72 (sm_90; docs/decisions.md).
  constexpr bool kWeighted = !MODULATE;  // AdaLN's write takes no weight
  const bool weighted = kWeighted && p.weight != nullptr;
  // One vector a thread, two or, in plain RMSNorm, four with a weight of 16-byte vectors (or,
  // on sm_90, AdaLN RMS's 16-bit scale and shift): the write operands of the cached vectors
  // load with them, so that their latency overlaps the row's rather than following the
  // reduction. Loaded in the write phase, each weight load waits on the previous store (the
  // output may alias the weight): four L2 round trips after the barrier on sm_90
  // (docs/decisions.md).
  // FP8 AdaLN rows at four vectors preload their scale and shift too: their 512-thread
  // kernel holds one block an SM at up to 128 registers, and the amax pass otherwise waits
  // on four loads of them in turn after the reductions. So do the fp32 decode rows at
  // eight vectors (kDecodeCachedVecs): their only round trip is the row's. (The tuning
  // harness's 16-bit rows at eight would spill so.)
  constexpr bool kDecodeRow = CACHED == kDecodeCachedVecs && sizeof(T) == 4;
  // Rows of several full vectors after a residual add load the row, residual and gate of
  // every vector before the first sum (a store or the gate's branch between two vectors
  // would make each wait for the one before), and their write operands after the
  // reductions, in the registers those free.
  constexpr bool kLoadsFirst = RESIDUAL && (kDecodeRow || (CACHED == kCachedVecs && VEC * sizeof(T) == 16));
  constexpr bool kPreload =
      CACHED == 1 || kDecodeRow || kLoadsFirst ||
      (CACHED == 2 && ((MODULATE && modulated_preload<T>(kDeviceArch, KIND)) || (kWeighted && VEC * sizeof(W) == 16))) ||
      (CACHED == kCachedVecs && !RESIDUAL && !MODULATE && kWeighted && VEC * sizeof(W) == 16) ||
      (CACHED == kCachedVecs && MODULATE && kFp8Out<O>);
  constexpr int kPre = kPreload ? CACHED : 1;
  Vec<W, VEC> pre_w[kPre];
  Vec<T, VEC> pre_scale[kPre], pre_shift[kPre];
  const T* scale = MODULATE ? p.scale + batch * p.scale_batch + token * p.scale_token : nullptr;
  const T* shift = MODULATE ? p.shift + batch * p.shift_batch + token * p.shift_token : nullptr;
  if constexpr (kPreload && !kLoadsFirst) {
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (!active || i >= nvec) continue;
      if (weighted) pre_w[k] = load_vec<W, VEC>(p.weight, i);
      if constexpr (MODULATE) {
        pre_scale[k] = load_vec<T, VEC>(scale, i);
        pre_shift[k] = load_vec<T, VEC>(shift, i);
      }
    }
  }
  // LayerNorm takes the mean first and then the centred square sum (as PyTorch, no
  // cancellation); RMSNorm takes the square sum in the first pass. LayerNorm's mean sums
  // offsets from the row's first element, which every thread reads: for a constant row
  // the mean is exactly that element and the centred row exactly 0, as in PyTorch. A
  // residual row's first element is made from its operands; as residual_out may be one of
  // them, the cached vectors' sums are stored only after the first reduction, whose
  // barrier (shuffles within a warp) follows every thread's read.
  constexpr bool kSquareFirst = KIND == NormKind::kRms;
  constexpr bool kShifted = KIND == NormKind::kLayer;
  constexpr bool kStoreLate = kShifted && RESIDUAL;
  if constexpr (kLoadsFirst) {
    // 16-bit vectors are loaded as 32-bit words (Held) and made vectors only after every
    // load is out: loaded as vectors of 16-bit values, each was copied after its predicated
    // load, and that copy, waiting for the load, came before the next load (fp16's SASS on
    // sm_80 and sm_90).
    constexpr bool kWords = sizeof(T) == 2 && sizeof(Vec<T, VEC>) == sizeof(uint4);
    using Held = std::conditional_t<kWords, uint4, Vec<T, VEC>>;
    const auto load_held = [](const T* base, int i) { return reinterpret_cast<const Held*>(base)[i]; };
    const auto as_vec = [](const Held& held) {
      if constexpr (kWords) return vec_of_bits<T, VEC>(held);
      else return held;
    };
    Held xw[CACHED], rw[CACHED], gw[CACHED];
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < nvec) {
        if constexpr (kWords) xw[k] = load_held(x, i);
        else cached[k] = load_held(x, i);  // fp32: straight into the cache (its loads issue first)
        rw[k] = load_held(res, i);
      }
    }
    if (gate != nullptr) {
#pragma unroll
      for (int k = 0; k < CACHED; ++k) {
        const int i = t + k * threads_per_row;
        if (active && i < nvec) gw[k] = load_held(gate, i);
      }
    }
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (!active || i >= nvec) continue;
      if constexpr (kWords) cached[k] = as_vec(xw[k]);
      add_residual(cached[k], as_vec(rw[k]), as_vec(gw[k]), gate != nullptr);
    }
    if constexpr (!kStoreLate) {
#pragma unroll
      for (int k = 0; k < CACHED; ++k) {
        const int i = t + k * threads_per_row;
        if (active && i < nvec) store_vec<T, VEC>(res_out, i, cached[k]);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < nvec) cached[k] = load_row(i, !kStoreLate);
    }
  }
  float first = 0.f;
  if constexpr (kShifted) {
    if constexpr (RESIDUAL) {
      first = gate != nullptr ? to_float(from_float<T>(to_float(res[0]) + to_float(x[0]) * to_float(gate[0])))
                              : to_float(from_float<T>(to_float(res[0]) + to_float(x[0])));
    } else {
      first = to_float(x[0]);
    }
  }
  float acc = 0.f, compensation = 0.f;
#pragma unroll
  for (int k = 0; k < CACHED; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < nvec) acc += vec_sum(cached[k], first, kSquareFirst);
  }
  // fp32 rows re-read past the cache sum with compensation (long rows; docs/numerics.md);
  // 16-bit rows' plain sums stay below their rounding, and the compensation's register
  // would spill on sm_75.
  for (int i = t + CACHED * threads_per_row; kReread && active && i < nvec; i += threads_per_row) {
    const float term = vec_sum(load_row(i, true), first, kSquareFirst);
    if constexpr (std::is_same_v<T, float>) add_compensated(acc, compensation, term);
    else acc += term;
  }
  float mean = 0.f;
  float sum_sq = row_sum(acc, threads_per_row, scratch[0]);
  if constexpr (kStoreLate) {
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < nvec) store_vec<T, VEC>(res_out, i, cached[k]);
    }
  }
  if constexpr (KIND == NormKind::kLayer) {
    mean = first + sum_sq * p.inv_cols;
    acc = 0.f, compensation = 0.f;
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < nvec) acc += vec_sum(cached[k], mean, true);
    }
    for (int i = t + CACHED * threads_per_row; kReread && active && i < nvec; i += threads_per_row) {
      const float term = vec_sum(load_vec<T, VEC>(reread, i), mean, true);
      if constexpr (std::is_same_v<T, float>) add_compensated(acc, compensation, term);
      else acc += term;
    }
    sum_sq = row_sum(acc, threads_per_row, scratch[1]);
  }
  if constexpr (kLoadsFirst) {  // the ops keep residual_out off the weight, scale and shift
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (!active || i >= nvec) continue;
      if (weighted) pre_w[k] = load_vec<W, VEC>(p.weight, i);
      if constexpr (MODULATE) pre_scale[k] = load_vec<T, VEC>(scale, i), pre_shift[k] = load_vec<T, VEC>(shift, i);
    }
  }
  // The write operands of vector i: the cached vector k's preloads, or (re-read vectors,
  // k < 0, and launches without preloads) loaded.
  const auto write_operands = [&](int i, int k, Vec<W, VEC>& w, Vec<T, VEC>& sc, Vec<T, VEC>& sh) {
    bool preloaded = false;
    if constexpr (kPreload) {
      preloaded = k >= 0;
      if (preloaded) {
        if constexpr (kWeighted) w = pre_w[k];
        if constexpr (MODULATE) sc = pre_scale[k], sh = pre_shift[k];
      }
    }
    if (!preloaded) {
      if (weighted) w = load_vec<W, VEC>(p.weight, i);
      if constexpr (MODULATE) {
        sc = load_vec<T, VEC>(scale, i);
        sh = load_vec<T, VEC>(shift, i);
      }
    }
  };
  if constexpr (kFp8Out<O>) {
    // The FP8 output (no statistics: launch asserts it). y of vector i in fp32, as the other
    // outputs' write below makes it: the cached vector k (its write operands preloaded) or
    // one re-read (k < 0). The cached vectors' y is made once, kept for the amax and the
    // write (kKeepsY); re-read vectors make theirs again for the write. Inactive threads take
    // part in the amax reduction.
    const float rstd = rsqrtf(sum_sq * p.inv_cols + p.eps);
    const auto y_of = [&](const Vec<T, VEC>& v, int i, int k, float (&f)[VEC]) {
      Vec<W, VEC> w;
      Vec<T, VEC> sc, sh;
      write_operands(i, k, w, sc, sh);
      float wf[VEC], scf[VEC], shf[VEC];
      to_floats(v, f);
      if (weighted) to_floats(w, wf);
      if constexpr (MODULATE) to_floats(sc, scf), to_floats(sh, shf);
      normed_y<T, MODULATE>(f, wf, scf, shf, mean, rstd, p.cast_before_weight, weighted, p.weight_offset);
    };
    // 16-bit rows with an fp32 weight at four vectors a thread spill keeping y within the
    // 1024-thread bound's 64 registers: they make the cached vectors' y again for the write.
    // So do the decode rows' eight vectors, whose write operands fill the registers.
    constexpr bool kKeepsY = !kDecodeRow &&
                             !(CACHED == kCachedVecs && !RESIDUAL && !MODULATE && sizeof(T) == 2 && sizeof(W) == 4);
    float y[kKeepsY ? CACHED : 1][VEC];
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (active && i < nvec) {
        float(&f)[VEC] = y[kKeepsY ? k : 0];
        y_of(cached[k], i, k, f);
        amax = fp8_amax_of(amax, f);
      }
    }
    for (int i = t + CACHED * threads_per_row; kReread && active && p.static_scale == nullptr && i < nvec;
         i += threads_per_row) {
      float f[VEC];
      y_of(load_vec<T, VEC>(reread, i), i, -1, f);
      amax = fp8_amax_of(amax, f);
    }
    __shared__ float amax_scratch[32];
    const Fp8Divisor divisor =
        row_fp8_divisor(amax, threads_per_row, amax_scratch, p.static_scale, p.scales, r, active && t == 0);
    if (!active) return;
    uint8_t* y_row = p.out + r * p.out_stride;
    // The rows that make y again spill (sm_80) with the write split by the quotient rule.
    with_quotient_rule<kKeepsY>(divisor, [&](auto rule) {
      constexpr Fp8Rule M = decltype(rule)::value;
#pragma unroll
      for (int k = 0; k < CACHED; ++k) {
        const int i = t + k * threads_per_row;
        if (i >= nvec) continue;
        if constexpr (!kKeepsY) y_of(cached[k], i, k, y[0]);
        store_fp8<VEC, M>(y_row, i, y[kKeepsY ? k : 0], divisor);
      }
      for (int i = t + CACHED * threads_per_row; kReread && i < nvec; i += threads_per_row) {
        float f[VEC];
        y_of(load_vec<T, VEC>(reread, i), i, -1, f);
        store_fp8<VEC, M>(y_row, i, f, divisor);
      }
    });
  } else {
    if (!active) return;
    const float rstd = rsqrtf(sum_sq * p.inv_cols + p.eps);
    if (p.stats != nullptr && t == 0) p.stats[r] = make_float2(mean, rstd);

    O* y_row = p.out + r * p.out_stride;
    // Vector i, the cached vector k (its write operands preloaded) or one re-read (k < 0).
    auto write = [&](const Vec<T, VEC>& v, int i, int k) {
      Vec<W, VEC> w;
      Vec<T, VEC> sc, sh;
      write_operands(i, k, w, sc, sh);
      float f[VEC], wf[VEC], scf[VEC], shf[VEC];
      to_floats(v, f);
      if (weighted) to_floats(w, wf);
      if constexpr (MODULATE) to_floats(sc, scf), to_floats(sh, shf);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        f[j] = (f[j] - mean) * rstd;
        if (p.cast_before_weight) f[j] = to_float(from_float<T>(f[j]));
        if (weighted) f[j] *= p.weight_offset + wf[j];
        if constexpr (MODULATE) f[j] = f[j] * (1.f + scf[j]) + shf[j];
      }
      store_vec<O, VEC>(y_row, i, from_floats<O>(f));
    };
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
      const int i = t + k * threads_per_row;
      if (i < nvec) write(cached[k], i, k);
    }
    for (int i = t + CACHED * threads_per_row; kReread && i < nvec; i += threads_per_row) {
      write(load_vec<T, VEC>(reread, i), i, -1);
    }
  }
}

// The FP8 output of rows, without a residual add, that the fp32 output's launch gives two
// warps of four cached vectors a thread (LTX's 2048 wide in 16 bits), as a warp a row: lane l
// does the work of that launch's threads l and l + 32, in their order, so that y is the fp32
// output's bit for bit: each thread's sum, each warp's butterfly, then row_reduce's butterfly
// over the two warps' sums, where the lanes past them add 0. No barrier between the passes
// (the block kernel waits at two a row, the amax's included), and more rows in flight per SM.
// The row's fp32 y does not fit the registers: it is made again for the write. Wider rows
// (four warps, 16 vectors a lane) and the gated residual's rows ran slower so
// (docs/decisions.md).
constexpr int kFp8WarpRowBlock = 256;
constexpr int kFp8WarpRowVirt = 2;
// 64 registers for eight vectors a lane.
constexpr int kFp8WarpRowMinBlocks = 4;

// The sum of VIRT warps' per-lane values as row_reduce adds them (every lane gets it).
template <int VIRT>
__device__ __forceinline__ float virtual_warps_sum(const float (&acc)[VIRT]) {
  float w[VIRT];
#pragma unroll
  for (int v = 0; v < VIRT; ++v) w[v] = group_sum(acc[v], 32) + 0.f;  // + lane VIRT's 0 (-0 to +0)
#pragma unroll
  for (int offset = VIRT / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int v = 0; v < offset; ++v) w[v] = w[v] + w[v + offset];
  }
  return w[0];
}

// STAGED: the rows of a block share their write operands (RMSNorm's weight; AdaLN's scale and
// shift of one batch entry, launch_fp8_warp_rows checks), which the block stages once in
// shared memory as fp32 factors (weight_factor, scale_factor) and shifts, in float4 planes
// that a warp reads without bank conflicts: a 16-byte load per four elements where each lane
// loaded and converted its 16-bit operands, and made the factor, in both passes.
constexpr int kFp8WarpRowMaxCols = kCachedVecs * kFp8WarpRowVirt * 32 * 8;  // 16-bit rows of 2048

// Operand plane `plane` of vector i's VEC fp32 values, from the staged float4 planes.
template <int VEC>
__device__ __forceinline__ void staged_values(const float4* staged, int plane, int i, float (&f)[VEC]) {
  constexpr int kVecs = kFp8WarpRowMaxCols / VEC;
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    const float4 v = staged[(plane * (VEC / 4) + q) * kVecs + i];
    f[4 * q] = v.x, f[4 * q + 1] = v.y, f[4 * q + 2] = v.z, f[4 * q + 3] = v.w;
  }
}

// RMSNorm's weight and the Llama order's rounding before it are template flags (WEIGHTED,
// CAST): as run-time flags their predicated multiply-add and rounding took issue slots in
// every element of the amax and write loops.
template <typename T, typename W, int VEC, NormKind KIND, bool MODULATE, bool WEIGHTED, bool CAST, bool STAGED>
__global__ void __launch_bounds__(kFp8WarpRowBlock, kFp8WarpRowMinBlocks)
    norm_fp8_warp_row_kernel(const NormParams<T, W, Fp8E4m3> p) {
  static_assert(!(MODULATE && WEIGHTED) && (!CAST || (!MODULATE && sizeof(T) == 2)));
  static_assert(!STAGED || MODULATE || WEIGHTED, "staged operands are a weight or a scale and shift");
  static_assert(VEC % 4 == 0 && kFp8WarpRowMaxCols / VEC >= kCachedVecs * kFp8WarpRowVirt * 32);
  if constexpr (!kFp8Arch) {
    __trap();
    return;
  }
  constexpr int VIRT = kFp8WarpRowVirt;
  constexpr int CACHED = kCachedVecs;
  constexpr int kThreadsPerRow = VIRT * 32;  // the fp32 output's launch
  // Ada's build (sm_80's code, FP8 conversion emulated) spills staging AdaLN's operands: it
  // loads them as the unstaged rows do.
  constexpr bool kStaged = STAGED && (kDeviceArch >= 900 || !MODULATE);
  constexpr int kPlanes = kStaged ? (MODULATE ? 2 : 1) : 0;
  __shared__ float4 staged[kPlanes > 0 ? kPlanes * kFp8WarpRowMaxCols / 4 : 1];
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  // Warps past the last row take part in the staging, then leave.
  const bool active = row < p.rows;
  if (!kStaged && !active) return;  // the whole warp
  const uint32_t batch = p.tokens.div(static_cast<uint32_t>(active ? row : 0));
  const uint32_t token = static_cast<uint32_t>(active ? row : 0) - batch * p.tokens.divisor;
  const int nvec = p.cols / VEC;
  const T* x = p.input + (active ? row : 0) * p.input_stride;
  const T* scale = MODULATE ? p.scale + batch * p.scale_batch + token * p.scale_token : nullptr;
  const T* shift = MODULATE ? p.shift + batch * p.shift_batch + token * p.shift_token : nullptr;
  // Thread v * 32 + lane's vector k.
  const auto index = [&](int v, int k) { return v * 32 + lane + k * kThreadsPerRow; };
  Vec<T, VEC> cached[VIRT][CACHED];
#pragma unroll
  for (int k = 0; k < CACHED; ++k) {
#pragma unroll
    for (int v = 0; v < VIRT; ++v) {
      if (active && index(v, k) < nvec) cached[v][k] = load_vec<T, VEC>(x, index(v, k));
    }
  }
  if constexpr (kStaged) {
    // The block's first row names its operands (every row's, launch_fp8_warp_rows checks).
    const uint32_t first = blockIdx.x * (blockDim.x / 32);
    const uint32_t first_batch = p.tokens.div(first);
    const uint32_t first_token = first - first_batch * p.tokens.divisor;
    constexpr int kVecs = kFp8WarpRowMaxCols / VEC;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      float a[VEC], b[VEC];
      if constexpr (MODULATE) {
        to_floats(load_vec<T, VEC>(p.scale + first_batch * p.scale_batch + first_token * p.scale_token, i), a);
        to_floats(load_vec<T, VEC>(p.shift + first_batch * p.shift_batch + first_token * p.shift_token, i), b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] = scale_factor(a[j]);
      } else {
        to_floats(load_vec<W, VEC>(p.weight, i), a);
#pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] = weight_factor(p.weight_offset, a[j]);
      }
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        staged[q * kVecs + i] = make_float4(a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
        if constexpr (MODULATE) {
          staged[(VEC / 4 + q) * kVecs + i] = make_float4(b[4 * q], b[4 * q + 1], b[4 * q + 2], b[4 * q + 3]);
        }
      }
    }
    __syncthreads();
    if (!active) return;  // the whole warp
  }
  // norm_kernel's sums: LayerNorm's mean of offsets from the first element, then the centred
  // square sum; RMSNorm's square sum.
  const auto row_sum_of = [&](float shift_by, bool square) {
    float acc[VIRT];
#pragma unroll
    for (int v = 0; v < VIRT; ++v) {
      acc[v] = 0.f;
#pragma unroll
      for (int k = 0; k < CACHED; ++k) {
        if (index(v, k) < nvec) acc[v] += vec_sum(cached[v][k], shift_by, square);
      }
    }
    return virtual_warps_sum(acc);
  };
  float mean = 0.f;
  float sum_sq;
  if constexpr (KIND == NormKind::kLayer) {
    const float first = to_float(x[0]);
    mean = first + row_sum_of(first, false) * p.inv_cols;
    sum_sq = row_sum_of(mean, true);
  } else {
    sum_sq = row_sum_of(0.f, true);
  }
  const float rstd = rsqrtf(sum_sq * p.inv_cols + p.eps);
  const auto y_of = [&](const Vec<T, VEC>& v, int i, float (&f)[VEC]) {
    to_floats(v, f);
    if constexpr (kStaged) {
      float factor[VEC], shf[VEC];
      staged_values<VEC>(staged, 0, i, factor);
      if constexpr (MODULATE) staged_values<VEC>(staged, 1, i, shf);
      normed_y_by_factors<T, MODULATE>(f, factor, shf, mean, rstd, CAST, WEIGHTED);
    } else {
      float wf[VEC], scf[VEC], shf[VEC];
      if constexpr (WEIGHTED) to_floats(load_vec<W, VEC>(p.weight, i), wf);
      if constexpr (MODULATE) to_floats(load_vec<T, VEC>(scale, i), scf), to_floats(load_vec<T, VEC>(shift, i), shf);
      normed_y<T, MODULATE>(f, wf, scf, shf, mean, rstd, CAST, WEIGHTED, p.weight_offset);
    }
  };
  float amax = 0.f;
  if (p.static_scale == nullptr) {
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
#pragma unroll
      for (int v = 0; v < VIRT; ++v) {
        float f[VEC];
        if (index(v, k) < nvec) y_of(cached[v][k], index(v, k), f), amax = fp8_amax_of(amax, f);
      }
    }
  }
  const Fp8Divisor divisor = row_fp8_divisor(amax, 32, nullptr, p.static_scale, p.scales, row, lane == 0);
  uint8_t* y_row = p.out + row * p.out_stride;
  with_quotient_rule<true>(divisor, [&](auto rule) {
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
#pragma unroll
      for (int v = 0; v < VIRT; ++v) {
        float f[VEC];
        if (index(v, k) < nvec) {
          y_of(cached[v][k], index(v, k), f);
          store_fp8<VEC, decltype(rule)::value>(y_row, index(v, k), f, divisor);
        }
      }
    }
  });
}

template <typename T, typename W, typename O>
NormParams<T, W, O> make_params(const NormArgs& a) {
  if constexpr (kFp8Out<O>) {
    return {make_params<T, W, uint8_t>(a), a.fp8_scales, a.fp8_static_scale};
  } else {
    // Rows find their (batch, token) operands by a 32-bit division.
    const bool per_row_operands = a.scale.ptr != nullptr || a.gate.ptr != nullptr;
    TORCH_CHECK(!per_row_operands || a.rows <= INT32_MAX, "norm: AdaLN and the gated residual take at most ",
                "2^31 - 1 rows on CUDA, got ", a.rows);
    return {static_cast<O*>(a.out),
            static_cast<T*>(a.residual_out),
            reinterpret_cast<float2*>(a.stats),
            static_cast<const T*>(a.input),
            static_cast<const T*>(a.residual),
            static_cast<const W*>(a.weight),
            static_cast<const T*>(a.gate.ptr),
            static_cast<const T*>(a.scale.ptr),
            static_cast<const T*>(a.shift.ptr),
            a.gate.batch_stride, a.gate.token_stride, a.scale.batch_stride, a.scale.token_stride,
            a.shift.batch_stride, a.shift.token_stride,
            a.rows, IntDivider(per_row_operands ? a.tokens : 1),
            a.input_stride, a.residual_stride, a.out_stride, a.residual_out_stride,
            static_cast<int>(a.cols),
            a.eps, a.inv_cols, a.weight_offset, a.cast_before_weight};
  }
}

// The gated residual alone (no norm follows, so nothing to reduce): elementwise, tiled as
// the activations are (threadIdx.x over a row's vectors, threadIdx.y over rows, no index
// divided), so that a few wide rows spread over every SM rather than walking one block
// each (one row of 16384 held one SM). The sum rounds as norm_kernel's.
constexpr int kGatedResidualBlock = 256;
// ONE_PASS: the grid's rows of threads cover the rows, offsets in 32 bits (launch_gated_residual
// checks that they fit), no loop: a latency-bound call (a decode step) pays for every
// instruction ahead of its loads. Otherwise 64-bit offsets and passes over the rows.
template <typename T, int VEC, bool ONE_PASS>
__global__ void __launch_bounds__(kGatedResidualBlock) gated_residual_kernel(const NormParams<T, T, T> p) {
  using Index = std::conditional_t<ONE_PASS, int, int64_t>;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.cols / VEC) return;
  const Index row_step = static_cast<Index>(gridDim.y) * blockDim.y;
  for (Index r = static_cast<Index>(blockIdx.y) * blockDim.y + threadIdx.y; r < p.rows; r += row_step) {
    const uint32_t batch = p.tokens.div(static_cast<uint32_t>(r));
    const uint32_t token = static_cast<uint32_t>(r) - batch * p.tokens.divisor;
    Vec<T, VEC> v = load_vec<T, VEC>(p.input + r * static_cast<Index>(p.input_stride), i);
    const Vec<T, VEC> rv = load_vec<T, VEC>(p.residual + r * static_cast<Index>(p.residual_stride), i);
    const Vec<T, VEC> g = load_vec<T, VEC>(
        p.gate + static_cast<Index>(batch) * static_cast<Index>(p.gate_batch) +
            static_cast<Index>(token) * static_cast<Index>(p.gate_token), i);
    add_residual(v, rv, g, true);
    store_vec<T, VEC>(p.residual_out + r * static_cast<Index>(p.residual_out_stride), i, v);
    if constexpr (ONE_PASS) break;
  }
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

// Plain RMSNorm rows (a weight; no residual, AdaLN or statistics) of the two-vector
// launch with a block each: a kernel of their own, its operands restricted pointers (the
// row and the weight load by the read-only path) and the Llama order's rounding a template
// flag, where the general kernel tests its options at run time (docs/decisions.md). In
// place (out == input) stays correct despite __restrict__: a block reads all of its row
// before the reduction's barrier and writes it after.
template <typename T, typename W, typename O, int VEC, bool CAST>
__global__ void __launch_bounds__(kTwoVecThreads, kTwoVecMinBlocks)
    rms_norm_row_kernel(const T* __restrict__ input, const W* __restrict__ weight, O* __restrict__ out,
                        int64_t input_stride, int64_t out_stride, int nvec, float eps, float inv_cols,
                        float weight_offset) {
  __shared__ float scratch[32];
  const int i0 = threadIdx.x, i1 = threadIdx.x + blockDim.x;
  const bool has0 = i0 < nvec, has1 = i1 < nvec;
  const T* x = input + blockIdx.x * input_stride;
  Vec<T, VEC> x0{}, x1{};
  Vec<W, VEC> w0{}, w1{};
  if (has0) x0 = load_vec<T, VEC>(x, i0);
  if (has1) x1 = load_vec<T, VEC>(x, i1);
  if (has0) w0 = load_vec<W, VEC>(weight, i0);
  if (has1) w1 = load_vec<W, VEC>(weight, i1);
  float f0[VEC], f1[VEC];
  to_floats(x0, f0);
  to_floats(x1, f1);
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum_sq += f0[j] * f0[j];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum_sq += f1[j] * f1[j];
  // Without the rounding, the row takes its weight before the reduction: x * w * rstd in
  // the registers x held, and the weight's loads issue before the barrier. Used after it,
  // ptxas sinks them past it, onto the row's latency path (docs/decisions.md).
  auto weigh = [&](float (&f)[VEC], const Vec<W, VEC>& w) {
    float wf[VEC];
    to_floats(w, wf);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] *= weight_offset + wf[j];
  };
  if constexpr (!CAST) weigh(f0, w0), weigh(f1, w1);
  const float rstd = rsqrtf(block_sum(sum_sq, scratch) * inv_cols + eps);
  O* y = out + blockIdx.x * out_stride;
  auto write = [&](float (&f)[VEC], const Vec<W, VEC>& w, int i) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] *= rstd;
    if constexpr (CAST && kPackedMul<T> && std::is_same_v<W, T> && std::is_same_v<O, T>) {
      if (weight_offset == 0.f) return store_vec<O, VEC>(y, i, mul_rounded(from_floats<T>(f), w));
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (CAST) f[j] = to_float(from_float<T>(f[j]));
    }
    if constexpr (CAST) weigh(f, w);
    store_vec<O, VEC>(y, i, from_floats<O>(f));
  };
  if (has0) write(f0, w0, i0);
  if (has1) write(f1, w1, i1);
}

// A row kernel (norm_kernel, norm_lean_kernel's shared blocks) over the rows, as `cfg` lays
// them out in blocks.
template <typename T, typename W, typename O>
void launch_norm_rows(void (*kernel)(NormParams<T, W, O>, int), const NormArgs& a, const RowLaunch& cfg,
                      cudaStream_t stream) {
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  kernel<<<blocks, cfg.block, 0, stream>>>(make_params<T, W, O>(a), __builtin_ctz(cfg.threads_per_row));
  check_launch();
}

// The norm family's lean rows: 16-bit rows out in their own dtype (and the row statistics
// where asked for, as norm_kernel's), whose options are all template flags (the op: KIND,
// RESIDUAL, MODULATE; WEIGHTED; the Llama order's CAST) and whose offsets are 32-bit, where
// norm_kernel tests its options at run time and offsets in 64 bits: latency-bound rows (decode steps, rows of up to 512 elements) spend
// their time in those instructions (docs/decisions.md). PER vectors a thread; a row takes a
// block (BLOCK_ROWS: as many whole warps as cover it) or a group of 2^row_shift threads (a
// warp or less) in blocks of several rows. Every load of a row precedes the reduction and
// every store follows it, but the residual sum's: residual_out may be the residual or the
// input, and out the input. After a residual add the AdaLN rows (RESIDUAL and MODULATE) are
// the gated residual's, with a gate; fused_add_rms_norm's have none. The weight, scale and
// shift load by the read-only path: no output overlaps them, but out may be scale or shift
// themselves, each element written by the thread that read it, after it (lean_rows keeps out
// off the weight).
constexpr int kLeanThreads = 512;
template <typename T, int VEC, int PER, bool BLOCK_ROWS, NormKind KIND, bool RESIDUAL, bool MODULATE, bool WEIGHTED,
          bool CAST>
__global__ void __launch_bounds__(kLeanThreads)
    norm_lean_kernel(const NormParams<T, T, T> p, int row_shift) {
  static_assert(!(MODULATE && WEIGHTED) && (!CAST || WEIGHTED));
  constexpr bool kGated = RESIDUAL && MODULATE;
  constexpr bool kLayer = KIND == NormKind::kLayer;
  __shared__ float scratch[2][32];
  const int threads = BLOCK_ROWS ? blockDim.x : 1 << row_shift;
  const int t = BLOCK_ROWS ? threadIdx.x : threadIdx.x & (threads - 1);
  const int row = BLOCK_ROWS ? blockIdx.x : (blockIdx.x * blockDim.x + threadIdx.x) >> row_shift;
  // Threads past the last row take part in the reduction (a group may share a warp).
  const bool active = BLOCK_ROWS || row < static_cast<int>(p.rows);
  const int nvec = p.cols / VEC;
  const auto has = [&](int k) { return active && t + k * threads < nvec; };

  Vec<T, VEC> v[PER], w[WEIGHTED ? PER : 1], sc[MODULATE ? PER : 1], sh[MODULATE ? PER : 1];
  // Offsets within 32 bits (lean_rows checks it).
  const T* x = p.input + row * static_cast<int>(p.input_stride);
  const T* res = RESIDUAL ? p.residual + row * static_cast<int>(p.residual_stride) : nullptr;
  T* res_out = RESIDUAL ? p.residual_out + row * static_cast<int>(p.residual_out_stride) : nullptr;
  const T *gate = nullptr, *scale = nullptr, *shift = nullptr;
  if constexpr (MODULATE) {
    const uint32_t batch = p.tokens.div(static_cast<uint32_t>(row));
    const uint32_t token = static_cast<uint32_t>(row) - batch * p.tokens.divisor;
    if constexpr (kGated) gate = p.gate + batch * p.gate_batch + token * p.gate_token;
    scale = p.scale + batch * p.scale_batch + token * p.scale_token;
    shift = p.shift + batch * p.shift_batch + token * p.shift_token;
  }
  Vec<T, VEC> rv[RESIDUAL ? PER : 1], gv[kGated ? PER : 1];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = t + k * threads;
    if (!has(k)) continue;
    if constexpr (WEIGHTED) w[k] = load_vec_read_only<T, VEC>(p.weight, i);
    v[k] = load_vec<T, VEC>(x, i);
    if constexpr (RESIDUAL) rv[k] = load_vec<T, VEC>(res, i);
    if constexpr (kGated) gv[k] = load_vec<T, VEC>(gate, i);
    if constexpr (MODULATE) sc[k] = load_vec_read_only<T, VEC>(scale, i), sh[k] = load_vec_read_only<T, VEC>(shift, i);
  }
  // LayerNorm sums offsets from the row's first element (norm_kernel's, see there).
  float first = 0.f;
  if constexpr (kLayer) {
    if (active) {
      first = RESIDUAL ? to_float(from_float<T>(to_float(res[0]) + to_float(x[0]) * (kGated ? to_float(gate[0]) : 1.f)))
                       : to_float(x[0]);
    }
  }
  if constexpr (RESIDUAL) {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      if (!has(k)) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float added = kGated ? to_float(v[k].v[j]) * to_float(gv[k].v[j]) : to_float(v[k].v[j]);
        v[k].v[j] = from_float<T>(to_float(rv[k].v[j]) + added);
      }
    }
  }
  // The sums, stored once the row's loads are done; LayerNorm's wait for the first reduction,
  // as every lane reads the row's first element.
  const auto store_sums = [&] {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      if (has(k)) store_vec<T, VEC>(res_out, t + k * threads, v[k]);
    }
  };
  if constexpr (RESIDUAL && !kLayer) store_sums();
  const auto reduce = [&](float acc, float* slots) { return BLOCK_ROWS ? block_sum(acc, slots) : group_reduce<Add, true>(acc, threads); };
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    if (has(k)) acc += vec_sum(v[k], first, !kLayer);
  }
  acc = reduce(acc, scratch[0]);
  float mean = 0.f;
  if constexpr (kLayer) {
    if constexpr (RESIDUAL) {
      // Every lane's read of the row's first element precedes the store of its vector.
      if constexpr (!BLOCK_ROWS) __syncwarp();
      store_sums();
    }
    mean = first + acc * p.inv_cols;
    acc = 0.f;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      if (has(k)) acc += vec_sum(v[k], mean, true);
    }
    acc = reduce(acc, scratch[1]);
  }
  const float rstd = rsqrtf(acc * p.inv_cols + p.eps);
  if (p.stats != nullptr && active && t == 0) p.stats[row] = make_float2(mean, rstd);
  T* y = p.out + row * static_cast<int>(p.out_stride);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = t + k * threads;
    if (!has(k)) continue;
    float f[VEC];
    to_floats(v[k], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = (kLayer ? f[j] - mean : f[j]) * rstd;
    if constexpr (CAST && kPackedMul<T>) {
      if (p.weight_offset == 0.f) {
        store_vec<T, VEC>(y, i, mul_rounded(from_floats<T>(f), w[k]));
        continue;
      }
    }
    float wf[VEC], scf[VEC], shf[VEC];
    if constexpr (WEIGHTED) to_floats(w[k], wf);
    if constexpr (MODULATE) to_floats(sc[k], scf), to_floats(sh[k], shf);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (CAST) f[j] = to_float(from_float<T>(f[j]));
      if constexpr (WEIGHTED) f[j] *= p.weight_offset + wf[j];
      if constexpr (MODULATE) f[j] = f[j] * (1.f + scf[j]) + shf[j];
    }
    store_vec<T, VEC>(y, i, from_floats<T>(f));
  }
}

// Whether norm_lean_kernel can take the rows: 16-bit, of 16-byte vectors, an output of their
// dtype, offsets within 32 bits; a weight of their dtype that the norm does not
// overwrite (a one-row call may name it as out: the kernel orders the loads and stores of a
// thread, not of the row's threads); a gate exactly where the op has one.
template <typename T, typename W, typename O, bool RESIDUAL, bool MODULATE>
bool lean_rows(const NormArgs& a, bool vector) {
  if constexpr (sizeof(T) != 2 || !std::is_same_v<W, T> || !std::is_same_v<O, T>) {
    return false;
  } else {
    const int64_t reach = std::max({a.input_stride, a.out_stride, a.residual_stride, a.residual_out_stride, a.cols});
    // + 128: a block's groups past the last row make their offsets too
    return vector && a.out != a.weight && (a.gate.ptr != nullptr) == (RESIDUAL && MODULATE) &&
           (a.rows + 128) * reach <= INT32_MAX;
  }
}

// norm_lean_kernel over the rows at PER vectors a thread: BLOCK_ROWS, a block a row of as few
// whole warps as cover it; otherwise row_launch's lane groups of at most a warp, rows sharing
// blocks of `block` threads.
template <typename T, int PER, bool BLOCK_ROWS, NormKind KIND, bool RESIDUAL, bool MODULATE>
void launch_lean_rows(const NormArgs& a, cudaStream_t stream, int block = 128) {
  constexpr int V = kVec16<T>;
  const int64_t nvec = a.cols / V;
  const auto run = [&](auto kernel) {
    if constexpr (BLOCK_ROWS) {
      const int64_t threads = ((nvec + PER - 1) / PER + 31) / 32 * 32;
      TORCH_INTERNAL_ASSERT(threads <= kLeanThreads, "norm lean rows: ", nvec, " vectors at ", PER, " a thread");
      kernel<<<static_cast<unsigned>(a.rows), static_cast<unsigned>(threads), 0, stream>>>(make_params<T, T, T>(a), 0);
      check_launch();
    } else {
      RowLaunch cfg = row_launch(nvec, PER, 32);
      TORCH_INTERNAL_ASSERT(cfg.threads_per_row * PER >= nvec && block <= kLeanThreads, "norm lean rows: ", nvec,
                            " vectors at ", PER, " a thread on a warp, blocks of ", block);
      cfg.block = std::max(block, cfg.threads_per_row);
      launch_norm_rows(kernel, a, cfg, stream);
    }
  };
  if constexpr (!MODULATE) {
    if (a.weight != nullptr) {
      if (a.cast_before_weight) return run(norm_lean_kernel<T, V, PER, BLOCK_ROWS, KIND, RESIDUAL, false, true, true>);
      return run(norm_lean_kernel<T, V, PER, BLOCK_ROWS, KIND, RESIDUAL, false, true, false>);
    }
  }
  run(norm_lean_kernel<T, V, PER, BLOCK_ROWS, KIND, RESIDUAL, MODULATE, false, false>);
}

// The lean rows' production layout: a vector a thread, rows of a warp or less sharing
// 128-thread blocks (as row_launch's); LayerNorm's rows of up to two vectors a lane a warp
// at two a thread, sharing such blocks (its two reductions, mean then variance, each cost a
// block barrier on a block's row; RMSNorm's one gains nothing); wider rows a block each;
// past 512 vectors (the block's bound) two or four vectors a thread, which plain RMSNorm's
// rows never reach (see launch).
template <typename T, NormKind KIND, bool RESIDUAL, bool MODULATE>
void launch_lean(const NormArgs& a, int64_t nvec, cudaStream_t stream) {
  if (nvec <= 32) return launch_lean_rows<T, 1, false, KIND, RESIDUAL, MODULATE>(a, stream);
  if constexpr (KIND == NormKind::kLayer) {
    if (nvec <= 64) return launch_lean_rows<T, 2, false, KIND, RESIDUAL, MODULATE>(a, stream);
  }
  if (nvec <= kLeanThreads) return launch_lean_rows<T, 1, true, KIND, RESIDUAL, MODULATE>(a, stream);
  if constexpr (RESIDUAL || MODULATE) {
    if (nvec <= 2 * kLeanThreads) return launch_lean_rows<T, 2, true, KIND, RESIDUAL, MODULATE>(a, stream);
    return launch_lean_rows<T, 4, true, KIND, RESIDUAL, MODULATE>(a, stream);
  }
  TORCH_INTERNAL_ASSERT(false, "norm lean rows: plain RMSNorm rows of ", nvec, " vectors");
}

// Eight keep a row of up to 8192 vectors in registers, where four re-read its tail
// (docs/decisions.md).
constexpr int kWideCachedVecs = 8;
// Weight vectors the wide row kernel loads ahead of its writes: four spill in 16 bits
// (docs/decisions.md).
constexpr int kWideWeightAhead = 2;
// Further vectors a thread of a wide row stages in dynamic shared memory (up to 128 KB a
// block: all of it on sm_80 and sm_90, 99 KB on sm_86 and sm_89, none on sm_75, which has
// no cp.async): the whole row stays on its SM. Rows the device cannot stage keep four
// vectors and re-read their tail (docs/decisions.md).
constexpr int kWideStagedVecs = 8;
// Wide rows only where the weight and output are of the input's type: with 32-byte vectors of
// an fp32 weight or output, eight vectors a thread spill.
template <typename T, typename W, typename O>
constexpr bool kWideRows = std::is_same_v<W, T> && std::is_same_v<O, T>;
// Dynamic shared memory the wide rows of `nvec` vectors stage past the registers of a
// block of plain rows (0 when they fit in registers).
inline std::size_t wide_staged_bytes(int64_t nvec) {
  return static_cast<std::size_t>(std::max<int64_t>(nvec - kWideCachedVecs * max_block(false, false), 0)) * 16;
}

// Plain RMSNorm's wide rows (kWideCachedVecs), a block a row, with a weight of the input's
// type (WEIGHTED) or none. The output may alias the weight, so a weight load waits for the
// stores before it: the kernel loads kWideWeightAhead vectors ahead of its writes, the
// first with the row. STAGED rows hold up to kWideCachedVecs more vectors a thread in
// dynamic shared memory (see kWideStagedVecs), copied there without registers. In place
// (out == input) stays correct as above. Past-the-end vectors stay out of the sum (zeroing
// them spilled).
template <typename T, int VEC, bool WEIGHTED, bool CAST, bool STAGED>
__global__ void __launch_bounds__(max_block(false, false))
    rms_norm_wide_row_kernel(const T* __restrict__ input, const T* weight, T* out, int64_t input_stride,
                             int64_t out_stride, int nvec, float eps, float inv_cols, float weight_offset) {
  __shared__ float scratch[32];
  extern __shared__ uint4 staged_storage[];
  Vec<T, VEC>* staged = reinterpret_cast<Vec<T, VEC>*>(staged_storage);  // vector i at i - kWideCachedVecs * blockDim.x
  // The launch stages rows on sm_80 and later only (copy_to_shared): a trap before.
  constexpr bool kStaged = STAGED && kDeviceArch >= 800;
  if (STAGED && !kStaged) __trap();
  constexpr int kVecs = kStaged ? 2 * kWideCachedVecs : kWideCachedVecs;
  const T* x = input + blockIdx.x * input_stride;
  const int cached_end = kWideCachedVecs * blockDim.x;
  Vec<T, VEC> row[kWideCachedVecs];
  Vec<T, VEC> w[kWideWeightAhead];
#pragma unroll
  for (int k = 0; k < kWideCachedVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) row[k] = load_vec<T, VEC>(x, i);
  }
#pragma unroll
  for (int k = kWideCachedVecs; k < kVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) copy_to_shared(staged + (i - cached_end), x + static_cast<int64_t>(i) * VEC);
  }
#pragma unroll
  for (int k = 0; k < kWideWeightAhead; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (WEIGHTED && i < nvec) w[k] = load_vec<T, VEC>(weight, i);
  }
  // Vector k of this thread's part of the row (i < nvec); the inner test keeps row's index
  // in range where k is a staged vector.
  auto vec_at = [&](int k, int i) { return k < kWideCachedVecs ? row[k < kWideCachedVecs ? k : 0] : staged[i - cached_end]; };
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= nvec) break;
    if (kStaged && k == kWideCachedVecs) wait_shared_copies();
    float f[VEC];
    to_floats(vec_at(k, i), f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum_sq += f[j] * f[j];
  }
  const float rstd = rsqrtf(block_sum(sum_sq, scratch) * inv_cols + eps);
  T* y = out + blockIdx.x * out_stride;
  // PAIRED: the Llama order without a weight offset multiplies the rounded row by the weight
  // in 16-bit pairs (mul_rounded: the same result, the write in three instructions an
  // element instead of six, sm_90 SASS; docs/decisions.md).
  const auto write_row = [&](auto paired) {
    constexpr bool PAIRED = decltype(paired)::value;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i >= nvec) break;
      float f[VEC];
      to_floats(vec_at(k, i), f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] *= rstd;
      if constexpr (PAIRED) {
        store_vec<T, VEC>(y, i, mul_rounded(from_floats<T>(f), w[k % kWideWeightAhead]));
      } else {
        float wf[VEC];
        if constexpr (WEIGHTED) to_floats(w[k % kWideWeightAhead], wf);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if constexpr (WEIGHTED && CAST) f[j] = to_float(from_float<T>(f[j]));
          if constexpr (WEIGHTED) f[j] *= weight_offset + wf[j];
        }
        store_vec<T, VEC>(y, i, from_floats<T>(f));
      }
      const int next = i + kWideWeightAhead * blockDim.x;
      if (WEIGHTED && k + kWideWeightAhead < kVecs && next < nvec) {
        w[k % kWideWeightAhead] = load_vec<T, VEC>(weight, next);
      }
    }
  };
  if constexpr (WEIGHTED && CAST && kPackedMul<T>) {
    if (weight_offset == 0.f) return write_row(std::true_type{});
  }
  write_row(std::false_type{});
}

// A block a row: the two-vector rows (cached == 2, with a weight) or the wide rows
// (kWideCachedVecs).
template <typename T, typename W, typename O, int VEC>
void launch_rms_norm_rows(const NormArgs& a, int cached, int block, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(a.stats == nullptr && (a.weight != nullptr || cached == kWideCachedVecs),
                        "rms_norm rows: no statistics, and a weight for two vectors a thread");
  TORCH_CHECK(a.rows <= INT32_MAX, "rms_norm: at most 2^31 - 1 rows of ", a.cols, " on CUDA, got ", a.rows);
  const std::size_t staged = cached == kWideCachedVecs ? wide_staged_bytes(a.cols / VEC) : 0;
  const auto run = [&](auto kernel) {
    if (staged > 0) {  // asks for the shared memory beyond 48 KB
      TORCH_CHECK(max_blocks_per_sm(reinterpret_cast<const void*>(kernel), a.device.index(), block, staged) > 0,
                  "rms_norm: a row of ", a.cols, " does not fit one SM");
    }
    kernel<<<static_cast<unsigned>(a.rows), block, staged, stream>>>(static_cast<const T*>(a.input), static_cast<const W*>(a.weight),
                                         static_cast<O*>(a.out), a.input_stride, a.out_stride,
                                         static_cast<int>(a.cols / VEC), a.eps, a.inv_cols, a.weight_offset);
    check_launch();
  };
  // Rounding an fp32 row to fp32 changes nothing: no second fp32 instantiation.
  const bool cast = sizeof(T) == 2 && a.cast_before_weight;
  if constexpr (kWideRows<T, W, O>) {
    if (cached == kWideCachedVecs) {
      const auto wide = [&](auto staged_rows) {
        constexpr bool S = decltype(staged_rows)::value;
        if (a.weight == nullptr) return run(rms_norm_wide_row_kernel<T, VEC, false, false, S>);
        if constexpr (sizeof(T) == 2) {
          if (cast) return run(rms_norm_wide_row_kernel<T, VEC, true, true, S>);
        }
        return run(rms_norm_wide_row_kernel<T, VEC, true, false, S>);
      };
      return staged > 0 ? wide(std::true_type{}) : wide(std::false_type{});
    }
  }
  TORCH_INTERNAL_ASSERT(cached == 2, "rms_norm rows: two or ", kWideCachedVecs, " vectors a thread");
  if constexpr (sizeof(T) == 2) {
    if (cast) return run(rms_norm_row_kernel<T, W, O, VEC, true>);
  }
  run(rms_norm_row_kernel<T, W, O, VEC, false>);
}

// The FP8 output of the rows launch_rms_norm_rows takes (a block a row): y as the fp32 out's
// row kernel makes it, so the same kernel's order: each thread's vectors i = threadIdx.x +
// k * blockDim.x summed in turn, then block_sum. The two-vector rows (WIDE false, any T,
// a weight) weigh before the reduction, (x * w) * rstd, or round x * rstd to T first (CAST);
// the wide rows (WIDE, fp32 only: 16-bit rows have no wide fp32-out launch) take
// (x * rstd) * w, without a weight too. Two vectors stay in registers, the wide rows' others
// are read again (L1, L2): these rows are rare in FP8 (fp32 input wider than 8192).
// The minimum of one block keeps ptxas from holding the kernel to 32 registers with spills.
template <typename T, typename W, int VEC, bool CAST, bool WIDE>
__global__ void __launch_bounds__(max_block(false, false), 1)
    rms_norm_row_fp8_kernel(const T* __restrict__ input, const W* __restrict__ weight, uint8_t* __restrict__ out,
                            int64_t input_stride, int64_t out_stride, int nvec, float eps, float inv_cols,
                            float weight_offset, float* __restrict__ scales, const float* __restrict__ static_scale) {
  static_assert(!WIDE || (std::is_same_v<T, float> && !CAST), "rms_norm FP8 rows: wide rows are fp32");
  if constexpr (!kFp8Arch) {
    __trap();
    return;
  }
  constexpr int kHeld = 2;  // the two-vector launch's whole row
  __shared__ float scratch[32], amax_scratch[32];
  const T* x = input + blockIdx.x * input_stride;
  Vec<T, VEC> held[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) held[k] = load_vec<T, VEC>(x, i);
  }
  const auto each_vec = [&](auto&& take) {
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nvec) take(held[k], i);
    }
    for (int i = threadIdx.x + kHeld * blockDim.x; WIDE && i < nvec; i += blockDim.x) take(load_vec<T, VEC>(x, i), i);
  };
  float sum_sq = 0.f;
  each_vec([&](const Vec<T, VEC>& v, int) {
    float f[VEC];
    to_floats(v, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum_sq += f[j] * f[j];
  });
  const float rstd = rsqrtf(block_sum(sum_sq, scratch) * inv_cols + eps);
  const auto y_of = [&](const Vec<T, VEC>& v, int i, float (&f)[VEC]) {
    float wf[VEC] = {};
    to_floats(v, f);
    if (weight != nullptr) to_floats(load_vec<W, VEC>(weight, i), wf);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (WIDE) {
        f[j] *= rstd;
        if (weight != nullptr) f[j] *= weight_offset + wf[j];
      } else if constexpr (CAST) {
        f[j] = to_float(from_float<T>(f[j] * rstd)) * (weight_offset + wf[j]);
      } else {
        f[j] = f[j] * (weight_offset + wf[j]) * rstd;
      }
    }
  };
  // The held vectors' y is made once, kept in fp32 for the amax and the write; a wide row's
  // further vectors make theirs again for the write.
  float held_y[kHeld][VEC];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) {
      y_of(held[k], i, held_y[k]);
      amax = fp8_amax_of(amax, held_y[k]);
    }
  }
  for (int i = threadIdx.x + kHeld * blockDim.x; WIDE && static_scale == nullptr && i < nvec; i += blockDim.x) {
    float f[VEC];
    y_of(load_vec<T, VEC>(x, i), i, f);
    amax = fp8_amax_of(amax, f);
  }
  const Fp8Divisor divisor =
      row_fp8_divisor(amax, blockDim.x, amax_scratch, static_scale, scales, blockIdx.x, threadIdx.x == 0);
  uint8_t* y = out + blockIdx.x * out_stride;
  with_quotient_rule<true>(divisor, [&](auto rule) {
    constexpr Fp8Rule M = decltype(rule)::value;
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nvec) store_fp8<VEC, M>(y, i, held_y[k], divisor);
    }
    for (int i = threadIdx.x + kHeld * blockDim.x; WIDE && i < nvec; i += blockDim.x) {
      float f[VEC];
      y_of(load_vec<T, VEC>(x, i), i, f);
      store_fp8<VEC, M>(y, i, f, divisor);
    }
  });
}

template <typename T, typename W, int VEC>
void launch_rms_norm_rows_fp8(const NormArgs& a, int cached, int block, cudaStream_t stream) {
  TORCH_CHECK(a.rows <= INT32_MAX, "rms_norm_fp8: at most 2^31 - 1 rows of ", a.cols, " on CUDA, got ", a.rows);
  const auto run = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(a.rows), block, 0, stream>>>(
        static_cast<const T*>(a.input), static_cast<const W*>(a.weight), static_cast<uint8_t*>(a.out), a.input_stride,
        a.out_stride, static_cast<int>(a.cols / VEC), a.eps, a.inv_cols, a.weight_offset, a.fp8_scales,
        a.fp8_static_scale);
    check_launch();
  };
  if constexpr (kWideRows<T, W, float>) {
    if (cached == kWideCachedVecs) return run(rms_norm_row_fp8_kernel<T, W, VEC, false, true>);
  }
  TORCH_INTERNAL_ASSERT(cached == 2 && a.weight != nullptr, "rms_norm_fp8 rows: two vectors a thread, a weight");
  if constexpr (sizeof(T) == 2) {
    if (a.cast_before_weight) return run(rms_norm_row_fp8_kernel<T, W, VEC, true, false>);
  }
  run(rms_norm_row_fp8_kernel<T, W, VEC, false, false>);
}

// norm_fp8_warp_row_kernel over the rows, a warp each.
template <typename T, typename W, int VEC, NormKind KIND, bool MODULATE>
void launch_fp8_warp_rows(const NormArgs& a, cudaStream_t stream) {
  constexpr int rows_per_block = kFp8WarpRowBlock / 32;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  const auto run = [&](auto kernel) {
    kernel<<<blocks, kFp8WarpRowBlock, 0, stream>>>(make_params<T, W, Fp8E4m3>(a));
    check_launch();
  };
  if constexpr (!MODULATE) {
    // fp32 rows round to themselves: CAST changes nothing there.
    constexpr bool kRounds = sizeof(T) == 2;
    const bool cast = kRounds && a.cast_before_weight;
    if (a.weight != nullptr) {  // every row's weight: staged
      if (cast) return run(norm_fp8_warp_row_kernel<T, W, VEC, KIND, false, true, kRounds, true>);
      return run(norm_fp8_warp_row_kernel<T, W, VEC, KIND, false, true, false, true>);
    }
    if (cast) return run(norm_fp8_warp_row_kernel<T, W, VEC, KIND, false, false, kRounds, false>);
    return run(norm_fp8_warp_row_kernel<T, W, VEC, KIND, false, false, false, false>);
  } else {
    // AdaLN's scale and shift are the block's rows' own where they have no token stride and
    // the block's rows lie in one batch entry (or every entry's are the same).
    const bool one_entry = a.scale.token_stride == 0 && a.shift.token_stride == 0 &&
                           (a.tokens % rows_per_block == 0 || (a.scale.batch_stride == 0 && a.shift.batch_stride == 0));
    if (one_entry) return run(norm_fp8_warp_row_kernel<T, W, VEC, KIND, true, false, false, true>);
    run(norm_fp8_warp_row_kernel<T, W, VEC, KIND, true, false, false, false>);
  }
}

// Rows of at most this many vectors (512 elements in 16 bits) take the lean kernel at any
// batch (docs/decisions.md).
constexpr int kLeanNarrowVecs = 64;
// From this many rows per SM, four vectors a thread beat two (docs/decisions.md).
constexpr int kTwoVecRowsPerSm = 64;
// Rows of at most 128 vectors (D <= 1024 in 16 bits) take two vectors a thread at any batch:
// 40 registers keep more rows per SM in flight than the four-vector kernel's 47. AdaLN only up
// to 16 vectors, or up to 128 where its scale and shift preload and the row fills its threads
// (a power of two of vectors) (docs/decisions.md).
constexpr bool two_vec_any_batch(bool modulate, bool preloads_modulation, int64_t nvec) {
  if (!modulate) return nvec <= 128;
  const bool fills_threads = (nvec & (nvec - 1)) == 0;
  return nvec <= 16 || (preloads_modulation && nvec <= 128 && fills_threads);
}
// Weighted rows after a residual add, fewer than two per SM (decode steps), that the lean
// kernel does not take (fp32 rows or weight, a norm written over the weight) run the
// two-vector kernel at one vector a thread: it loads the weight with the row, where the
// four-vector kernel loads it after the reduction, one memory round trip more on a
// latency-bound row (docs/decisions.md).
template <typename W, int V, bool RESIDUAL, bool MODULATE>
constexpr bool kPreloadsDecodeWeight = RESIDUAL && !MODULATE && V * sizeof(W) == 16;
// Plain fp32 rows of four vectors share blocks of this many threads; 16-bit and fused rows
// were slower so (docs/decisions.md).
constexpr int kFp32FourVecBlock = 512;

// The gated residual alone: gated_residual_kernel over the rows (see row_tiling).
template <typename T>
void launch_gated_residual(const NormArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector = vectorizable<T, T, T, V>(a);
  const int64_t nvec = a.cols / (vector ? V : 1);
  if (a.rows == 0 || nvec == 0) return;
  TORCH_CHECK(nvec <= INT32_MAX, "gated_residual: rows of at most 2^31 - 1 elements on CUDA, got ", a.cols);
  TORCH_INTERNAL_ASSERT(a.gate.ptr != nullptr, "gated_residual: the kernel reads a gate");
  const RowTiling tiling = row_tiling(a.rows, nvec, kGatedResidualBlock);
  const auto run = [&](auto kernel) {
    kernel<<<tiling.grid, tiling.block, 0, stream>>>(make_params<T, T, T>(a));
    check_launch();
  };
  // One pass where the grid's rows of threads cover the rows and every offset fits in 32 bits.
  const int64_t batches = (a.rows + a.tokens - 1) / a.tokens;
  const int64_t row_stride = std::max({a.input_stride, a.residual_stride, a.residual_out_stride});
  const bool one_pass = vector && tiling.grid.y * static_cast<int64_t>(tiling.block.y) >= a.rows &&
                        offsets_fit_int32({{a.rows, row_stride}, {a.cols, 1}}) &&
                        offsets_fit_int32({{batches, a.gate.batch_stride}, {a.tokens, a.gate.token_stride}, {a.cols, 1}});
  if (one_pass) return run(gated_residual_kernel<T, V, true>);
  return vector ? run(gated_residual_kernel<T, V, false>) : run(gated_residual_kernel<T, 1, false>);
}

// The production launch of norm_kernel's instantiation <KIND, RESIDUAL, MODULATE>,
// or of the plain RMSNorm row kernels.
template <typename T, typename W, typename O, NormKind KIND, bool RESIDUAL, bool MODULATE>
void launch(const NormArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  // The FP8 output takes the fp32 out's launch, so that y is that run's fp32 value bit for
  // bit (the launch fixes each row's kernel and summation order).
  using LO = std::conditional_t<kFp8Out<O>, float, O>;
  TORCH_INTERNAL_ASSERT(!kFp8Out<O> || a.stats == nullptr, "norm: the FP8 output has no statistics");
  TORCH_INTERNAL_ASSERT(!MODULATE || !a.cast_before_weight, "norm: AdaLN rounds before no weight");
  const bool vector = vectorizable<T, W, LO, V>(a);
  const int vec = vector ? V : 1;
  const int64_t nvec = a.cols / vec;
  const int64_t sms = sm_count(a.device.index());
  const bool many_rows = two_rows_per_sm(a.rows, a.device.index());
  const int arch = 100 * device_attribute<cudaDevAttrComputeCapabilityMajor>(a.device.index()) +
                   10 * device_attribute<cudaDevAttrComputeCapabilityMinor>(a.device.index());
  const bool preloads_modulation = MODULATE && modulated_preload<T>(arch, KIND);
  // Lean rows (norm_lean_kernel, launch_lean's layout): rows of up to kLeanNarrowVecs
  // vectors at any batch; fused_add_rms_norm's rows (a residual add without a gate) of up to
  // 2048 vectors at any batch; the AdaLN rows' (after a gated residual or not) of up to 2048
  // at fewer than two rows per SM (decode steps). Plain RMSNorm's wider rows keep
  // rms_norm_row_kernel, so that its rows with and without a weight sum in one order; the
  // lean kernel writes AdaLN's statistics, so that its output does not change with whether
  // autograd saves them.
  if constexpr (sizeof(T) == 2 && std::is_same_v<W, T> && std::is_same_v<O, T>) {
    constexpr bool kAnyBatch = RESIDUAL && !MODULATE;
    if (lean_rows<T, W, O, RESIDUAL, MODULATE>(a, vector) && nvec <= 4 * kLeanThreads &&
        (nvec <= kLeanNarrowVecs || kAnyBatch || (MODULATE && !many_rows))) {
      return launch_lean<T, KIND, RESIDUAL, MODULATE>(a, nvec, stream);
    }
  }
  // Vectors a thread caches: the kernel instantiation (see kOneVecThreads, kTwoVecThreads).
  int cached = kCachedVecs;
  if (RESIDUAL && vector && many_rows && nvec <= kOneVecThreads) {
    cached = 1;
  } else if (kPreloadsDecodeWeight<W, V, RESIDUAL, MODULATE> && vector && !many_rows &&
             a.weight != nullptr && nvec <= 2 * kTwoVecThreads) {
    cached = 2;
  } else if (!RESIDUAL && vector && nvec <= 2 * kTwoVecThreads &&
             (a.rows < kTwoVecRowsPerSm * sms || two_vec_any_batch(MODULATE, preloads_modulation, nvec))) {
    cached = 2;
  } else if (KIND == NormKind::kRms && !RESIDUAL && !MODULATE && kWideRows<T, W, LO> && vector &&
             a.stats == nullptr && nvec > kCachedVecs * (many_rows ? kTwoVecThreads : max_block(false, false)) &&
             nvec <= (kWideCachedVecs + kWideStagedVecs) * max_block(false, false) &&
             (wide_staged_bytes(nvec) == 0 ||
              (arch >= 800 && wide_staged_bytes(nvec) + 32 * sizeof(float) <= max_shared_per_block(a.device.index())))) {
    cached = kWideCachedVecs;
  } else if (sizeof(T) == 4 && (RESIDUAL || MODULATE) && vector && a.rows <= sms &&
             nvec > kCachedVecs * max_block(RESIDUAL, MODULATE) && nvec <= kDecodeCachedVecs * max_block(RESIDUAL, MODULATE)) {
    cached = kDecodeCachedVecs;
  }
  // Otherwise fewer rows than two per SM (decode-size batches) are latency-bound: one
  // vector per thread of the four-vector kernel spreads each row over more threads
  // (128x16384 bf16 takes 1024-thread rows); large batches want four (docs/decisions.md).
  const int per_thread = (cached == kCachedVecs || (RESIDUAL && cached == 2)) && !many_rows ? 1 : cached;
  const bool fp32_four_vec_rows = !RESIDUAL && !MODULATE && sizeof(T) == 4 && per_thread == kCachedVecs;
  const RowLaunch cfg = row_launch(nvec, per_thread, bound_threads(cached, RESIDUAL, MODULATE),
                                   fp32_four_vec_rows ? kFp32FourVecBlock : 0);
  if constexpr (kFp8Out<O> && !RESIDUAL) {
    // FP8 rows that the fp32 output gives two warps of four cached vectors a thread, the
    // whole row in registers: a warp a row, the same sums (norm_fp8_warp_row_kernel).
    if (vector && per_thread == kCachedVecs && cached == kCachedVecs &&
        cfg.threads_per_row == kFp8WarpRowVirt * 32 && nvec <= cached * cfg.threads_per_row) {
      return launch_fp8_warp_rows<T, W, V, KIND, MODULATE>(a, stream);
    }
  }
  if constexpr (KIND == NormKind::kRms && !RESIDUAL && !MODULATE) {
    const bool row_kernel = (cached == 2 && a.weight != nullptr) || cached == kWideCachedVecs;
    if (row_kernel && cfg.threads_per_row == cfg.block && a.stats == nullptr) {
      if constexpr (kFp8Out<O>) return launch_rms_norm_rows_fp8<T, W, V>(a, cached, cfg.block, stream);
      else return launch_rms_norm_rows<T, W, O, V>(a, cached, cfg.block, stream);
    }
  }
  TORCH_INTERNAL_ASSERT(!MODULATE || a.weight == nullptr, "norm: AdaLN takes no weight");
  const auto run = [&](auto kernel) { launch_norm_rows(kernel, a, cfg, stream); };
  if constexpr (sizeof(T) == 4 && (RESIDUAL || MODULATE)) {
    if (cached == kDecodeCachedVecs) {
      TORCH_INTERNAL_ASSERT(cfg.threads_per_row * kDecodeCachedVecs >= nvec && cfg.block == cfg.threads_per_row,
                            "norm: a decode row of ", nvec, " vectors on ", cfg.threads_per_row, " threads");
      return run(norm_kernel<T, W, O, V, kDecodeCachedVecs, KIND, RESIDUAL, MODULATE>);
    }
  }
  if constexpr (RESIDUAL) {
    if (cached == 1) return run(norm_kernel<T, W, O, V, 1, KIND, RESIDUAL, MODULATE>);
    if constexpr (kPreloadsDecodeWeight<W, V, RESIDUAL, MODULATE>) {
      if (cached == 2) return run(norm_kernel<T, W, O, V, 2, KIND, RESIDUAL, MODULATE>);
    }
  } else {
    if (cached == 2) return run(norm_kernel<T, W, O, V, 2, KIND, RESIDUAL, MODULATE>);
  }
  if (vector) {
    run(norm_kernel<T, W, O, V, kCachedVecs, KIND, RESIDUAL, MODULATE>);
  } else {
    run(norm_kernel<T, W, O, 1, kCachedVecs, KIND, RESIDUAL, MODULATE>);
  }
}

}  // namespace ltx::norm_cuda

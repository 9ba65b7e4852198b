// The norm family's forward on CUDA (see norm.h): one pass over memory per op. Each row is
// read once into registers (16-byte vectors where alignment allows), reduced in fp32, then
// scaled and written with one rounding. The kernels and the launch choice live here, in
// ltx::norm_cuda, for norm_forward.cu and the tuning harness benchmarks/norm_variants.cu.
#pragma once

#include "cuda_common.cuh"
#include "norm.h"

#include <algorithm>
#include <array>
#include <type_traits>

namespace ltx::norm_cuda {

// 16-byte vectors each thread keeps in registers between the reduction and the write.
// Four loads in flight per thread cover DRAM latency, and 4 x 16 B of registers keep a
// 1024-thread block under its 64 registers per thread. Rows of more than
// max_block * 4 vectors re-read the rest, which then comes from L2.
constexpr int kCachedVecs = 4;
// Plain RMSNorm rows too wide for four vectors a thread on two blocks per SM (over
// kCachedVecs * kTwoVecThreads vectors at two or more rows per SM, kCachedVecs * 1024 below;
// at most 8192: D <= 65536 in 16 bits, 32768 in fp32) keep eight vectors a thread, the
// whole row in registers, in rms_norm_wide_row_kernel: 512 threads a row up to 4096
// vectors (two blocks per SM), 1024 above. Four vectors took them on 1024 threads, one
// block per SM, re-reading past 4096 vectors from L2. H200, one build, with a weight, us:
// four vectors / the general kernel at eight / rms_norm_wide_row_kernel (compile): bf16
// 8192x65536 687-693 / 581-587 / 523-537 (743), fp16 8192x65536 672-679 / 578-584 /
// 554-555 (740), fp32 8192x32768 656-668 / 552-569 / 518-526 (505), bf16 8192x32768
// 293-295 / 268-269 / 265 (261), fp32 8192x16384 273-274 / 266-267 / 264-265 (256), bf16
// 8192x24576 244 / 218 / 198 (192), bf16 128x65536 13.3 / 13.3 / 12.3 (17.7). Eight
// vectors on 256 threads lost at 2048 vectors: fp32 32768x8192 516-522 / 531-536 us, bf16
// 8192x16384 134-135 / 135-137. The Llama order's weight multiply in 16-bit pairs
// (mul_rounded), against conversions to fp32 and back, two runs each: fp16 8192x65536
// 553.7-562.7 -> 522.9-527.4 us (quack 518.3), bf16 531.4-531.9 -> 522.4-527.6 (quack
// 521.2). A row over a cluster of 2-16 blocks, each staging its slice in shared memory
// with cp.async (quack's layout), took 0.97-1.02x this kernel's time at 16 bits: dropped.
constexpr int kWideCachedVecs = 8;
// Weight vectors the wide row kernel loads ahead of its writes: bf16 8192x65536 548-562 us
// at one, 523-537 at two; four spill in 16 bits.
constexpr int kWideWeightAhead = 2;
// Rows of up to kWideStagedVecs more vectors a thread (16384 vectors: D = 65536 in fp32,
// 131072 in 16 bits) keep the rest in dynamic shared memory, up to 128 KB a block, where
// the device grants it (sm_80 and sm_90 all of it; sm_86 and sm_89 99 KB, rows up to 14520
// vectors; no cp.async on sm_75): the whole row stays on its SM. Rows the device cannot
// stage keep four vectors and the re-read. Four vectors re-read past 4096 from L2:
// fp32 8192x65536 1527-1548 us (66% of copy; compile 1557).
constexpr int kWideStagedVecs = 8;
// Only where the weight and output are of the input's type (16-byte vectors): with an fp32
// weight or output of a 16-bit input (32-byte vectors) the general kernel at eight vectors
// spilled. Such rows keep four vectors.
template <typename T, typename W, typename O>
constexpr bool kWideRows = std::is_same_v<W, T> && std::is_same_v<O, T>;
// The residual variants load two or three vectors (input, residual, gate) per vector they
// cache and store the sum: at four vectors a thread they take 62-64 registers (sm_90), so
// few rows are resident. Rows of at most kOneVecThreads vectors (D <= 2048 in 16 bits,
// 1024 in fp32) take one vector a thread instead, at most 48 registers (kOneVecMinBlocks
// blocks per SM; 32 without a weight, below), their write operands loaded before the
// reduction. H200, bf16, sweeps of one build (four vectors / one): gated_residual_adaln
// rms [2,2688,2048] 31.4 / 28.4 us, [2,21504,2048] 199.2 / 196.9 us; gated_residual
// [2,2688,2048] 18.7 / 18.0 us, fused_add_rms_norm 8192x2048 40.7 / 39.3 us. Rows without
// a residual were slower so (adaln rms [2,21504,2048] 94 -> 137 us, rms_norm 5376x2048
// 13.2 -> 15.9 us).
constexpr int kOneVecThreads = 256;
// Without a weight (AdaLN's modulate, the gated residual alone) a one-vector row fits 32
// registers: eight blocks, a full SM of 2048 threads; the weighted fused add would spill
// there and keeps kOneVecMinBlocks. H200, bf16, sweeps of one build, five blocks / eight:
// gated_residual_adaln rms [2,2688,2048] 26.4 / 24.2 us (compile 25.3), [2,5376,2048]
// 48.9 / 45.4, [2,21504,2048] 184.7 / 172.5 (compile 186.3). At five blocks LayerNorm's
// one-vector rows, waiting at two barriers with no loads in flight, lost to four vectors
// from 128 rows per SM ([2,21504,2048] 216.5 / 207.1 us); at eight they win at every
// batch: four vectors / one, [2,10752,2048] 95.7 / 89.2 us, [2,21504,2048] 182.0 / 175.9.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kOneVecMinBlocks = 4;  // sm_75 holds 1024 threads per SM (64 registers)
constexpr int kOneVecUnweightedMinBlocks = 4;
#else
constexpr int kOneVecMinBlocks = 5;
constexpr int kOneVecUnweightedMinBlocks = 8;
#endif
// Rows without a residual, of at most 2 * kTwoVecThreads vectors (D <= 8192 in 16 bits,
// 4096 in fp32), take two vectors a thread below kTwoVecRowsPerSm rows per SM: twice the
// threads a row of the four-vector launch has, each with its write operands (a weight of
// 16-byte vectors: 16-bit, or fp32 with fp32 input) loaded before the reduction, in at
// most 40 registers (1536 threads per SM). H200, one build, four vectors (one below two
// rows per SM) / two: rms_norm bf16 128x4096 3.3 / 3.0 us, 1024x2048 5.5 / 4.5 us,
// 4096x4096 20.5 / 19.7 us, 8192x4096 36.7 / 36.5 us; adaln rms [2,2688,2048] 16.6 / 14.9
// us. From 64 rows per SM four are faster (rms_norm 32768x4096 134.6 / 137.9 us, adaln rms
// [2,21504,2048] 89.3 / 99.9 us). Rows of 512 threads (D > 4096 in 16 bits, 2048 in fp32),
// one build, four vectors / two: rms_norm bf16 128x8192 4.29 / 3.78 us (Liger 3.47),
// 32x8192 3.61 / 3.02, 2048x8192 20.90 / 20.49, 4096x8192 37.18 / 38.14 (Liger 36.50);
// fp32 128x4096 4.13 / 3.59 (Liger 3.27), 2048x4096 20.04 / 19.02, 4096x4096 36.54 / 35.36,
// 8192x4096 69.17 / 68.70. The fp32 weight's preload, against the previous build: fp32
// 1024x2048 6.62 -> 6.22 us (Liger 6.12), 128x2048 3.34 -> 2.82. An fp32 weight of a
// 16-bit input (32-byte vectors) stays unloaded: 42-50 registers.
constexpr int kTwoVecThreads = 512;
// Plain fp32 norms' four-vector rows (many rows per SM) share blocks of this many threads
// (two 256-thread rows at D = 4096). H200, one build, a block a row / 512 threads: rms_norm
// fp32 32768x4096 267.0 / 262.9 us (compile 255.6), 32768x8192 516.0 / 515.4 (its rows fill
// 512 threads); with the weight loaded with the row (kPreload below) 264.2-264.8 / 260.6-260.9.
// Not for 16-bit rows or the fused variants, which it slowed: rms_norm bf16 32768x4096
// 134.4 / 138.2 us (weight with the row: 133.0 / 134.4), adaln_rms [2,21504,2048] 87.6 /
// 93.1, adaln_layer 88.2 / 98.9, fused_add_rms_norm bf16 8192x4096 70.1 / 76.0.
constexpr int kFp32FourVecBlock = 512;
constexpr int kTwoVecRowsPerSm = 64;
// AdaLN RMS's scale and shift load with the two cached vectors on sm_90, in 16 bits (H200,
// bf16, [2,2688,2048]: 15.0 -> 14.0 us, as Liger's); compiled for sm_80, the fp16 kernel
// then spills at the 40-register bound, and so does the fp32 kernel on sm_90. `arch` is
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
// Plain norms' rows of at most 128 vectors (D <= 1024 in 16 bits, 512 in fp32: per-head
// and small models' norms) take two vectors a thread at any batch: the two-vector kernel's
// 40 registers keep more rows per SM in flight than the four-vector kernel's 47. AdaLN
// LayerNorm's only up to 16 vectors: wider, it lost so. H200, four vectors / two: rms_norm
// bf16 648720x128 84.9 / 81.7 us, 162180x512 83.3 / 80.6, 81090x1024 84.8 / 81.7,
// 163840x1024 168.4 / 162.1, fp32 81090x512 84.8 / 82.6; adaln rms [8,40544,128] 50.3 /
// 46.2 (layer 51.3 / 51.4), layer [8,10136,1024] 92.0 / 97.2, [8,20272,512] 90.9 / 95.2.
// AdaLN RMS's too where its scale and shift load with the row (`modulated_preload`), when
// the row fills its threads (a power of two of vectors): [2,8192,1024] 21.3 / 18.7 us
// (Liger 19.2), [8,10136,1024] 90.4 / 82.9 (Liger 84.9), [8,20272,512] 90.1 / 82.2; with 96
// vectors, half the threads holding one, [2,16384,768] 29.2 / 31.5.
constexpr bool two_vec_any_batch(bool modulate, bool preloads_modulation, int64_t nvec) {
  if (!modulate) return nvec <= 128;
  const bool fills_threads = (nvec & (nvec - 1)) == 0;
  return nvec <= 16 || (preloads_modulation && nvec <= 128 && fills_threads);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kTwoVecMinBlocks = 2;  // 1024 threads per SM
#else
constexpr int kTwoVecMinBlocks = 3;
#endif

// What an instantiation fuses around the norm (unused operands compile away):
// RESIDUAL, a residual (+ gate) add before the norm with the sum stored; MODULATE,
// * (1 + scale) + shift after it. The plain norm fits 64 registers, so it may use
// 1024-thread blocks (bf16 rows up to D = 32768 stay in registers); fused variants
// need more registers: 512 threads, 128 registers.
constexpr int max_block(bool residual, bool modulate) { return residual || modulate ? 512 : 1024; }
// Dynamic shared memory the wide rows of `nvec` vectors stage past the registers of a
// block of plain rows (0 when they fit in registers).
inline std::size_t wide_staged_bytes(int64_t nvec) {
  return static_cast<std::size_t>(std::max<int64_t>(nvec - kWideCachedVecs * max_block(false, false), 0)) * 16;
}

template <typename T, typename W, typename O>
struct NormParams {
  O* out;             // [rows, cols], rows out_stride apart; nullptr for kNone
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

// CACHED vectors a thread stay in registers; with one or two (the launches of
// kOneVecThreads and kTwoVecThreads above), the row has at most CACHED * threads_per_row
// vectors and nothing is re-read. A minimum of 0 blocks is none: an explicit 1 took the
// four-vector residual kernels from 76-78 to 80-84 registers on sm_90 (gated_residual_adaln
// [2,2688,2048] 31.4 -> 35.8 us).
constexpr int bound_threads(int cached, bool residual, bool modulate) {
  return cached == 1 ? kOneVecThreads : cached == 2 ? kTwoVecThreads : max_block(residual, modulate);
}
// Whether an instantiation's write takes a weight: AdaLN has none, and the gated residual
// alone (kNone) stops after the row's sum. Without one, a one-vector row fits 32 registers.
__host__ __device__ constexpr bool writes_weight(NormKind kind, bool modulate) { return !modulate && kind != NormKind::kNone; }
constexpr int bound_min_blocks(int cached, bool weighted) {
  if (cached == 1) return weighted ? kOneVecMinBlocks : kOneVecUnweightedMinBlocks;
  return cached == 2 ? kTwoVecMinBlocks : 0;
}

template <typename T, typename W, typename O, int VEC, int CACHED, NormKind KIND, bool RESIDUAL, bool MODULATE>
__global__ void __launch_bounds__(bound_threads(CACHED, RESIDUAL, MODULATE),
                                  bound_min_blocks(CACHED, writes_weight(KIND, MODULATE)))
    norm_kernel(const NormParams<T, W, O> p, int row_shift) {
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
    float f[VEC];
    to_floats(v, f);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      f[j] -= shift;
      s += square ? f[j] * f[j] : f[j];
    }
    return s;
  };

  Vec<T, VEC> cached[CACHED];
  constexpr bool kReread = CACHED == kCachedVecs;  // the other launches cover the row
  // AdaLN takes no weight (launch asserts it): without the weight's registers the AdaLN
  // kernel of four vectors a thread held 62-63 registers, not 69-72 (sm_90; H200, bf16,
  // bench_ops runs before and after: adaln rms [2,21504,2048] 103.0 -> 91.6 us, layer
  // 113.2 -> 99.5 us, rms [2,2688,2048] 17.8 -> 16.8 us).
  constexpr bool kWeighted = writes_weight(KIND, MODULATE);
  const bool weighted = kWeighted && p.weight != nullptr;
  // One vector a thread, two or, in plain RMSNorm, four with a weight of 16-byte vectors (or,
  // on sm_90, AdaLN RMS's 16-bit scale and shift): the write operands of the cached vectors
  // load with them, so that their latency overlaps the row's rather than following the
  // reduction. Loaded in the write phase, each weight load waits on the previous store (the
  // output may alias the weight): four L2 round trips after the barrier on sm_90. H200,
  // rms_norm, one build, as then / loaded with the row: bf16 32768x4096 134.8 / 133.0 us,
  // 32768x8192 267.6 / 264.5, 8192x16384 138.2 / 134.5, 16384x4096 69.3 / 67.6; fp32
  // 32768x4096 262.1 / 260.8 (at 512-thread blocks), 32768x8192 515.4 / 513.8. Loading them
  // all after the barrier, before the first store, was no faster (fp32 20% slower).
  constexpr bool kPreload =
      CACHED == 1 ||
      (CACHED == 2 && ((MODULATE && modulated_preload<T>(kDeviceArch, KIND)) || (kWeighted && VEC * sizeof(W) == 16))) ||
      (CACHED == kCachedVecs && !RESIDUAL && !MODULATE && kWeighted && VEC * sizeof(W) == 16);
  constexpr int kPre = kPreload ? CACHED : 1;
  Vec<W, VEC> pre_w[kPre];
  Vec<T, VEC> pre_scale[kPre], pre_shift[kPre];
  const T* scale = MODULATE ? p.scale + batch * p.scale_batch + token * p.scale_token : nullptr;
  const T* shift = MODULATE ? p.shift + batch * p.shift_batch + token * p.shift_token : nullptr;
  if constexpr (kPreload) {
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
  // cancellation); RMSNorm takes the square sum in the first pass.
  constexpr bool kSquareFirst = KIND == NormKind::kRms;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < CACHED; ++k) {
    const int i = t + k * threads_per_row;
    if (active && i < nvec) {
      cached[k] = load_row(i);
      acc += sum_of(cached[k], 0.f, kSquareFirst);
    }
  }
  for (int i = t + CACHED * threads_per_row; kReread && active && i < nvec; i += threads_per_row) {
    acc += sum_of(load_row(i), 0.f, kSquareFirst);
  }
  if constexpr (KIND == NormKind::kNone) {
    return;
  } else {
    float mean = 0.f;
    float sum_sq = row_sum(acc, threads_per_row, scratch[0]);
    if constexpr (KIND == NormKind::kLayer) {
      mean = sum_sq * p.inv_cols;
      acc = 0.f;
#pragma unroll
      for (int k = 0; k < CACHED; ++k) {
        const int i = t + k * threads_per_row;
        if (active && i < nvec) acc += sum_of(cached[k], mean, true);
      }
      for (int i = t + CACHED * threads_per_row; kReread && active && i < nvec; i += threads_per_row) {
        acc += sum_of(load_vec<T, VEC>(reread, i), mean, true);
      }
      sum_sq = row_sum(acc, threads_per_row, scratch[1]);
    }
    if (!active) return;
    const float rstd = rsqrtf(sum_sq * p.inv_cols + p.eps);
    if (p.stats != nullptr && t == 0) p.stats[r] = make_float2(mean, rstd);

    O* y_row = p.out + r * p.out_stride;
    // Vector i, the cached vector k (its write operands preloaded) or one re-read (k < 0).
    auto write = [&](const Vec<T, VEC>& v, int i, int k) {
      Vec<W, VEC> w;
      Vec<T, VEC> sc, sh;
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

template <typename T, typename W, typename O>
NormParams<T, W, O> make_params(const NormArgs& a) {
  // Rows find their (batch, token) operands by a 32-bit division.
  const bool per_row_operands = a.scale.ptr != nullptr || a.gate.ptr != nullptr;
  TORCH_CHECK(!per_row_operands || a.rows <= INT32_MAX, "norm: AdaLN and the gated residual take at most 2^31 - 1 ",
              "rows on CUDA, got ", a.rows);
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
// flag, where the general kernel tests its options at run time. H200, one build, the
// general kernel / this one, us: rms_norm bf16 128x4096 2.95 / 2.57 (Liger 2.67), 32x8192
// 2.90 / 2.57 (2.80), 128x8192 3.63 / 3.25 (3.47), 1024x2048 4.32 / 4.02 (4.19), 2048x8192
// 19.63 / 19.38 (19.93), 8192x8192 70.86 / 68.73 (70.67); Llama order 128x4096 2.94 /
// 2.72, with its weight multiply in 16-bit pairs (mul_rounded) 2.7 -> 2.5 (1024x2048 4.1
// -> 4.0, 4096x4096 18.8 -> 18.4); fp32 weight 3.41 / 2.74; fp32 128x4096 3.47 / 3.30
// (3.24). In place (out == input) stays correct despite __restrict__: a block reads all of
// its row before the reduction's barrier and writes it after.
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
  // ptxas sinks them past it, onto the row's latency path (128x4096 bf16: 2.72 us, 2.68
  // with a weight offset, against 2.57 and 2.55).
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
  // element instead of six, sm_90 SASS). H200: see kWideCachedVecs.
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

// An instantiation of norm_kernel over the rows, as `cfg` lays them out in blocks.
template <typename T, typename W, typename O>
void launch_norm_rows(void (*kernel)(NormParams<T, W, O>, int), const NormArgs& a, const RowLaunch& cfg,
                      cudaStream_t stream) {
  const int rows_per_block = cfg.block / cfg.threads_per_row;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  kernel<<<blocks, cfg.block, 0, stream>>>(make_params<T, W, O>(a), __builtin_ctz(cfg.threads_per_row));
  check_launch();
}

template <typename T, typename W, typename O, NormKind KIND, bool RESIDUAL, bool MODULATE>
void launch(const NormArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vector = vectorizable<T, W, O, V>(a);
  const int vec = vector ? V : 1;
  const int64_t nvec = a.cols / vec;
  const int64_t sms = sm_count(a.device.index());
  const bool many_rows = two_rows_per_sm(a.rows, a.device.index());
  const int arch = 100 * device_attribute<cudaDevAttrComputeCapabilityMajor>(a.device.index()) +
                   10 * device_attribute<cudaDevAttrComputeCapabilityMinor>(a.device.index());
  const bool preloads_modulation = MODULATE && modulated_preload<T>(arch, KIND);
  // Vectors a thread caches: the kernel instantiation (see kOneVecThreads, kTwoVecThreads).
  int cached = kCachedVecs;
  if (RESIDUAL && vector && many_rows && nvec <= kOneVecThreads) {
    cached = 1;
  } else if (!RESIDUAL && vector && nvec <= 2 * kTwoVecThreads &&
             (a.rows < kTwoVecRowsPerSm * sms || two_vec_any_batch(MODULATE, preloads_modulation, nvec))) {
    cached = 2;
  } else if (KIND == NormKind::kRms && !RESIDUAL && !MODULATE && kWideRows<T, W, O> && vector &&
             a.stats == nullptr && nvec > kCachedVecs * (many_rows ? kTwoVecThreads : max_block(false, false)) &&
             nvec <= (kWideCachedVecs + kWideStagedVecs) * max_block(false, false) &&
             (wide_staged_bytes(nvec) == 0 ||
              (arch >= 800 && wide_staged_bytes(nvec) + 32 * sizeof(float) <= max_shared_per_block(a.device.index())))) {
    cached = kWideCachedVecs;
  }
  // Otherwise fewer rows than two per SM (decode-size batches) are latency-bound: one
  // vector per thread of the four-vector kernel spreads each row over more threads
  // (128x16384 bf16 takes 1024-thread rows; large batches want four: 36 us against 70 us
  // at 8192x4096).
  const int per_thread = cached == kCachedVecs && !many_rows ? 1 : cached;
  const bool fp32_four_vec_rows = !RESIDUAL && !MODULATE && sizeof(T) == 4 && per_thread == kCachedVecs;
  const RowLaunch cfg = row_launch(nvec, per_thread, bound_threads(cached, RESIDUAL, MODULATE),
                                   fp32_four_vec_rows ? kFp32FourVecBlock : 0);
  if constexpr (KIND == NormKind::kRms && !RESIDUAL && !MODULATE) {
    const bool row_kernel = (cached == 2 && a.weight != nullptr) || cached == kWideCachedVecs;
    if (row_kernel && cfg.threads_per_row == cfg.block && a.stats == nullptr) {
      return launch_rms_norm_rows<T, W, O, V>(a, cached, cfg.block, stream);
    }
  }
  TORCH_INTERNAL_ASSERT(!MODULATE || a.weight == nullptr, "norm: AdaLN takes no weight");
  const auto run = [&](auto kernel) { launch_norm_rows(kernel, a, cfg, stream); };
  if constexpr (RESIDUAL) {
    if (cached == 1) return run(norm_kernel<T, W, O, V, 1, KIND, RESIDUAL, MODULATE>);
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

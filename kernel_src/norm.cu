// The norm family on CUDA (see norm.h): one pass over memory per op. Each row is read
// once into registers (16-byte vectors where alignment allows), reduced in fp32, then
// scaled and written with one rounding.
#include "cuda_common.cuh"
#include "norm.h"

#include <algorithm>
#include <array>
#include <type_traits>

namespace ltx {
namespace {

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


// ---------------------------------------------------------------------------------------
// Backward (see NormBackwardArgs). A block owns a column slice of bwd_vecs vectors per
// thread and walks a fixed set of rows of one group, keeping its slice of x and dy in
// registers and adding its slice of the column grads into fp32 shared memory (each thread
// its own slots: no atomics, no races); it then writes one partial row per column grad,
// which column_sum_kernel adds up in a fixed order. Rows wider than one slice are split over
// blockIdx.x: on sm_90 the slices of a row are one cluster's blocks, which exchange their
// row sums through distributed shared memory; elsewhere (or past 8 slices) each block
// reads the whole row for the row sums (the other slices' reads partly hit L2).
//
// Bytes in flight come from loads per thread: four 16-byte vectors of x and of dy per
// thread (32 elements in 16 bits: 128-thread rows at D = 4096, four blocks per SM; 16 in
// fp32), two when fp32 grads of a 16-bit input make each dy vector 32 bytes, eight single
// elements on the unaligned path. More would spill beside the fp32 factor, and so do four
// with the gated residual's loads (three column grads): it takes two. One 16-byte vector
// per thread on 512-thread rows (84 registers, one block per SM), even with the next row
// prefetched, took 1.5x as long on the H200.
__host__ __device__ constexpr int bwd_vecs(int vec, int grad_bytes, int accs) {
  return vec == 1 ? 8 : accs == 3 || vec * grad_bytes > 16 ? 2 : 4;
}
// Shared-memory floats per thread: its elements for each column grad side by side, and 16
// bytes of padding, so that the 16-byte accesses of 8 consecutive threads fall in distinct
// banks (36 or 68 floats: 4 banks apart; 20 or 52: 20 apart; 28: 28 apart; 12, 20 or 28 on
// the scalar path).
__host__ __device__ constexpr int bwd_thread_floats(int vec, int grad_bytes, int accs) {
  return accs * bwd_vecs(vec, grad_bytes, accs) * vec + 4;
}
constexpr int kBwdMaxBlock = 256;
// Two blocks of 256 threads per SM bound the registers at 128 (no spills at 32 elements).
constexpr int kBwdMinBlocks = 2;
// AdaLN's backward kernels load their first row before the scale on sm_90 only: compiled
// for sm_75 or sm_80, two or three of them then spill at the 128-register bound.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kBwdModulatedFirstRowEarly = false;
#else
constexpr bool kBwdModulatedFirstRowEarly = true;
#endif
// Values one row reduction of the backward sums at most (LayerNorm's).
constexpr int kBwdRowSums = 3;
// Column grads summed in shared memory: the weight's or scale's, AdaLN's shift, and
// (gated) the gate's.
__host__ __device__ constexpr int bwd_accs(NormKind kind, bool modulate, bool gated) {
  return gated ? 3 : modulate && kind != NormKind::kNone ? 2 : 1;
}
// Threads on one row slice: two or three column accumulators take half as many, so that a
// block of one row slice takes at most 36 KB of shared memory with two, 51 KB with three
// (beyond 48 KB on request, which max_blocks_per_sm makes).
constexpr int bwd_row_threads(int accs) { return accs >= 2 ? kBwdMaxBlock / 2 : kBwdMaxBlock; }

template <typename T, typename W, typename G>
struct NormBwdParams {
  T* grad_input;  // [rows, cols] contiguous
  const G* grad_out;
  const T* input;
  const T* grad_extra;
  const W* weight;
  const T* scale;
  const float2* stats;  // the forward's (mean, rstd) per row, or nullptr
  T* factor_rows;
  T* shift_rows;
  float* factor_partial;  // [groups, gridDim.y, cols]
  float* shift_partial;
  // The gated residual before the norm (GATED; see NormBackwardArgs).
  const T* gate;
  const T* gate_input;
  T* gate_input_grad;
  T* gate_rows;
  float* gate_partial;
  int64_t gate_batch, gate_token, gate_input_stride;
  int64_t scale_batch, scale_token;
  int64_t group_rows;
  int64_t input_stride, grad_out_stride, grad_extra_stride;
  int cols;
  float eps, inv_cols, weight_offset;
  bool cast_before_weight;
  // More than 1: the row's slices are the blocks of one cluster, which add their row sums
  // through each other's shared memory (sm_90) rather than each reading the whole row.
  int cluster_blocks;
};

// Sums N values over one row's threads at once (one pair of barriers for all of them). A
// block may hold several rows (consecutive runs of threads): each sums its own warps.
template <int N>
__device__ __forceinline__ void row_sums(float (&v)[N], int threads_per_row, float (*scratch)[32]) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = group_sum(v[j], threads_per_row < 32 ? threads_per_row : 32);
  if (threads_per_row <= 32) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, row_warps = threads_per_row / 32;
  const int first_warp = warp & -row_warps;  // row_warps is a power of two
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) scratch[j][warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = group_sum(lane < row_warps ? scratch[j][first_warp + lane] : 0.f, 32);
}

// Adds the block sums v (a block holds one row) over the `blocks` blocks of the cluster:
// each puts its own in `mine` (shared memory), then in every warp lane r reads block r's
// and the same shuffle tree adds them, so that every block gets the same bits. Alternate
// two `mine` buffers: a block writes one again only after the next barrier, which every
// block reaches after its reads.
template <int N>
__device__ __forceinline__ void add_cluster_sums(float (&v)[N], float* mine, int blocks) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) mine[j] = v[j];
  }
  cluster_barrier();
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = group_sum(lane < blocks ? load_cluster_shared(mine + j, lane) : 0.f, 32);
}

template <typename T, typename W, typename G, int VEC, NormKind KIND, bool MODULATE, bool GATED>
__global__ void __launch_bounds__(kBwdMaxBlock, kBwdMinBlocks)
    norm_backward_kernel(const NormBwdParams<T, W, G> p, int threads_per_row, int slices) {
  // Column-grad sums, per thread kAccs x kElems floats and padding: dy * n, (AdaLN) dy and
  // (gated) dr * input.
  extern __shared__ float4 column_acc_storage[];
  float* column_acc = reinterpret_cast<float*>(column_acc_storage);
  __shared__ float scratch[kBwdRowSums][32];
  __shared__ float cluster_sums[2][kBwdRowSums];
  constexpr int kAccs = bwd_accs(KIND, MODULATE, GATED);
  constexpr int kVecs = bwd_vecs(VEC, sizeof(G), kAccs);
  constexpr bool kLayer = KIND == NormKind::kLayer;
  constexpr bool kNormed = KIND != NormKind::kNone;  // kNone: n = x, dx = dy * g
  const int rows_per_block = blockDim.x / threads_per_row;
  const int row_in_block = threadIdx.x / threads_per_row;
  const int t = threadIdx.x % threads_per_row;
  const int nvec = p.cols / VEC;
  const int slice = blockIdx.x;
  const int64_t group_first = static_cast<int64_t>(blockIdx.z) * p.group_rows;

  // Vector k of this thread in column chunk c (chunk `slice` is the block's own).
  auto vec_index = [&](int chunk, int k) { return (chunk * kVecs + k) * threads_per_row + t; };
  const int slice_cols = threads_per_row * kVecs * VEC;
  const bool accumulate = p.factor_partial != nullptr || p.shift_partial != nullptr || p.gate_partial != nullptr;
  // This thread's slots in accumulator `which`: its elements side by side (16-byte
  // accesses), the accumulators at fixed offsets from one base, so that the compiler may
  // move one's shared-memory loads above the other's stores.
  constexpr int kElems = kVecs * VEC;
  constexpr int kThreadFloats = bwd_thread_floats(VEC, sizeof(G), kAccs);
  auto slots = [&](int which) { return column_acc + threadIdx.x * kThreadFloats + which * kElems; };
  // The VEC slots at s (16-byte aligned where VEC is a multiple of 4).
  auto read_slots = [](const float* s, float (&v)[VEC]) {
    if constexpr (VEC % 4 == 0) {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        const float4 a = reinterpret_cast<const float4*>(s)[q];
        v[4 * q] = a.x, v[4 * q + 1] = a.y, v[4 * q + 2] = a.z, v[4 * q + 3] = a.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = s[j];
    }
  };
  // Adds v into the slots of vector k.
  auto add_slots = [&](int which, int k, const float (&v)[VEC]) {
    float* s = slots(which) + k * VEC;
    if constexpr (VEC % 4 == 0) {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        float4 a = reinterpret_cast<float4*>(s)[q];
        a.x += v[4 * q], a.y += v[4 * q + 1], a.z += v[4 * q + 2], a.w += v[4 * q + 3];
        reinterpret_cast<float4*>(s)[q] = a;
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[j] += v[j];
    }
  };
  if (accumulate) {
#pragma unroll
    for (int which = 0; which < kAccs; ++which) {
#pragma unroll
      for (int e = 0; e < kVecs * VEC; ++e) slots(which)[e] = 0.f;
    }
  }

  // The factor g at vector i: weight_offset + weight, weight_offset + scale (scale_row:
  // the row's scale), or 1.
  auto load_factor = [&](const T* scale_row, int i, float (&f)[VEC]) {
    if constexpr (MODULATE) {
      to_floats(load_vec<T, VEC>(scale_row, i), f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] += p.weight_offset;
    } else if (p.weight != nullptr) {
      to_floats(load_vec<W, VEC>(p.weight, i), f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] += p.weight_offset;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = 1.f;
    }
  };
  // A group is one batch entry (launch_backward asserts it), so the scale row of a token
  // takes no 64-bit division per row.
  const T* batch_scale = MODULATE ? p.scale + static_cast<int64_t>(blockIdx.z) * p.scale_batch : nullptr;
  auto scale_row_of = [&](int64_t token) { return MODULATE ? batch_scale + token * p.scale_token : nullptr; };
  // The factor over this thread's own vectors in fp32, loaded once: it is the same for
  // every row of the block (the weight, or a scale per batch entry, which is the block's
  // group) unless the scale varies per token. Half the per-element work of the loop was
  // loading and converting it twice per row.
  const bool factor_per_row = MODULATE && p.scale_token != 0;
  float own_factor[kVecs][VEC];
  auto load_own_factor = [&](int64_t token) {
    const T* scale_row = scale_row_of(token);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = vec_index(slice, k);
      if (i < nvec) load_factor(scale_row, i, own_factor[k]);
    }
  };
  // The block's slice of its current row. Unconditional loads (no branch per vector): an
  // inactive row reads the group's first row and vectors past the row end read its last
  // vector; neither is used.
  Vec<T, VEC> xs[kVecs];
  Vec<G, VEC> dys[kVecs];
  auto load_slice = [&](int64_t token) {
    const int64_t r = group_first + token;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = min(vec_index(slice, k), nvec - 1);
      xs[k] = load_vec<T, VEC>(p.input + r * p.input_stride, i);
      dys[k] = load_vec<G, VEC>(p.grad_out + r * p.grad_out_stride, i);
    }
  };
  // The first row's loads go out before the factor's, whose conversion would hold them back
  // (H200, bf16, same run: rms_norm backward 8192x4096 61.5 -> 60.9 us, 2048x4096 24.3 ->
  // 23.0, 128x4096 8.6 -> 8.2, adaln rms [2,2688,2048] 29.0 -> 27.9). Not in the gated
  // kernels (gated_residual_adaln's), which it slowed: rms [2,21504,2048] 298.7 -> 346.1 us,
  // layer 319.6 -> 356.6, rms [2,2688,2048] 51.6 -> 56.6 (another run).
  constexpr bool kFirstRowEarly = !GATED && (!MODULATE || kBwdModulatedFirstRowEarly);
  const int64_t first_base = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  // The row within the group of this thread at walk step base (an inactive row: the first).
  auto token_at = [&](int64_t base) { return base + row_in_block < p.group_rows ? base + row_in_block : 0; };
  if (kFirstRowEarly) load_slice(token_at(first_base));
  if (!factor_per_row) load_own_factor(0);

  // Sums over the row: its threads, then (clustered) the blocks of its other slices.
  const bool clustered = p.cluster_blocks > 1;
  int cluster_round = 0;
  auto sum_row = [&](auto& sums) {
    row_sums(sums, threads_per_row, scratch);
    if (clustered) add_cluster_sums(sums, cluster_sums[cluster_round++ % 2], p.cluster_blocks);
  };

  const int64_t row_step = static_cast<int64_t>(gridDim.y) * rows_per_block;

  // Trip count uniform over the block: every thread joins every row reduction.
  for (int64_t base = first_base; base < p.group_rows; base += row_step) {
    const bool active = base + row_in_block < p.group_rows;
    const int64_t token = token_at(base);
    const int64_t r = group_first + token;
    const T* x = p.input + r * p.input_stride;
    const G* dy = p.grad_out + r * p.grad_out_stride;
    if (!kFirstRowEarly || base != first_base) load_slice(token);
    if (factor_per_row && active) load_own_factor(token);
    const T* scale_row = scale_row_of(factor_per_row ? token : 0);
    // Rows of more than a warp wait at the barriers of their row sums with no loads in
    // flight. The block's next row, asked into L2 now, keeps DRAM busy meanwhile (H200,
    // bf16: adaln rms [2,21504,2048] 159 -> 146 us, rms 32768x8192 443 -> 409 us). The
    // gated residual, with no row sums, and rows within a warp were slower with it, and
    // so was a prefetch two rows ahead. The saved statistics' line too: loaded from DRAM,
    // they would hold up the write pass (adaln layer [2,21504,2048] 157 -> 153 us).
    const int64_t next = base + row_step + row_in_block;
    constexpr bool kMayHaveStats = kNormed && MODULATE;
    if (kNormed && threads_per_row > 32 && next < p.group_rows) {
      const int first_col = slice * slice_cols, cols = min(slice_cols, p.cols - first_col);
      const int64_t next_r = group_first + next;
      prefetch_l2(p.input + next_r * p.input_stride + first_col, cols * sizeof(T), t, threads_per_row);
      prefetch_l2(p.grad_out + next_r * p.grad_out_stride + first_col, cols * sizeof(G), t, threads_per_row);
      if (GATED) {
        prefetch_l2(p.gate_input + next_r * p.gate_input_stride + first_col, cols * sizeof(T), t, threads_per_row);
      }
      if (kMayHaveStats && p.stats != nullptr && t == 0) prefetch_l2(p.stats + next_r, sizeof(float2), 0, 1);
    }

    // Calls fn(x, dy, factor) in fp32 for every vector of the row this thread covers: its
    // own slice from registers, then (unclustered) the other slices from memory.
    auto for_row = [&](auto&& fn) {
      if (!active) return;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (vec_index(slice, k) >= nvec) continue;
        float xf[VEC], df[VEC];
        to_floats(xs[k], xf);
        to_floats(dys[k], df);
        fn(xf, df, own_factor[k]);
      }
      for (int c = 0; !clustered && c < slices; ++c) {
        if (c == slice) continue;
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
          const int i = vec_index(c, k);
          if (i >= nvec) continue;
          float xf[VEC], df[VEC], f[VEC];
          to_floats(load_vec<T, VEC>(x, i), xf);
          to_floats(load_vec<G, VEC>(dy, i), df);
          load_factor(scale_row, i, f);
          fn(xf, df, f);
        }
      }
    };

    float mean = 0.f, rstd = 1.f, mean_dn_n = 0.f, mean_dn = 0.f;
    // AdaLN's backward may have the forward's statistics: one reduction then, of the dn
    // sums alone (sum of dn * centred, and LayerNorm's sum of dn). The centred sum is taken
    // as sum(dn * x) - mean * sum(dn), so that the sums wait for no statistic (adaln layer
    // [2,21504,2048] 153 -> 150 us); its rounding grows with |mean| / std, to about 1e-5
    // of dn at 1000 (CPU study in docs/performance.md), far below bf16's.
    if (kMayHaveStats && p.stats != nullptr) {
      const float2 saved = p.stats[r];
      if constexpr (kLayer) mean = saved.x;  // RMSNorm's is 0: known at compile time
      rstd = saved.y;
      constexpr int kSums = kLayer ? 2 : 1;
      float s[kSums] = {};
      for_row([&](const float (&xf)[VEC], const float (&df)[VEC], const float (&f)[VEC]) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float dn = df[j] * f[j];
          s[0] += dn * xf[j];
          if constexpr (kLayer) s[1] += dn;
        }
      });
      sum_row(s);
      if constexpr (kLayer) s[0] = fmaf(-mean, s[1], s[0]);
      mean_dn_n = s[0] * rstd * p.inv_cols;
      mean_dn = kLayer ? s[kSums - 1] * p.inv_cols : 0.f;
    } else if constexpr (kNormed) {
      if constexpr (kLayer) {
        float s[1] = {0.f};
        for_row([&](const float (&xf)[VEC], const float (&)[VEC], const float (&)[VEC]) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) s[0] += xf[j];
        });
        sum_row(s);
        mean = s[0] * p.inv_cols;
      }
      // Square sum of the centred row, sum of dn * centred, and (LayerNorm) sum of dn.
      constexpr int kSums = kLayer ? 3 : 2;
      float s[kSums] = {};
      for_row([&](const float (&xf)[VEC], const float (&df)[VEC], const float (&f)[VEC]) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float c = xf[j] - mean;
          const float dn = df[j] * f[j];
          s[0] += c * c;
          s[1] += dn * c;
          if constexpr (kLayer) s[kSums - 1] += dn;
        }
      });
      sum_row(s);
      rstd = rsqrtf(s[0] * p.inv_cols + p.eps);
      mean_dn_n = s[1] * rstd * p.inv_cols;
      mean_dn = kLayer ? s[kSums - 1] * p.inv_cols : 0.f;
    }
    if (!active) continue;
    // LayerNorm's dx = rstd * (dn - mean_dn - n * mean_dn_n) and n = (x - mean) * rstd as
    // two FMAs each (RMSNorm's mean_dn and mean are 0: its forms stay). Folding the mean
    // into an FMA adds an error of about 2^-24 * |mean| / std to n, below that of x's own
    // rounding.
    const float neg_mean_rstd = -mean * rstd, dn_scale = rstd * mean_dn_n, neg_mean_dn = -rstd * mean_dn;
    const int64_t out_row = r * p.cols;
    const T* extra = p.grad_extra != nullptr ? p.grad_extra + r * p.grad_extra_stride : nullptr;
    const T* gated = GATED ? p.gate_input + r * p.gate_input_stride : nullptr;
    const T* gate_row =
        GATED ? p.gate + static_cast<int64_t>(blockIdx.z) * p.gate_batch + token * p.gate_token : nullptr;
    // The write pass, with the Llama-order rounding and the extra grad chosen once per row
    // rather than predicated per element.
    auto write_row = [&](auto round_normed, auto add_extra) {
      // The extra grads all in flight at once: loaded in the loop, each would wait behind
      // the previous vector's stores, which the compiler cannot prove apart from them.
      Vec<T, VEC> extras[decltype(add_extra)::value ? kVecs : 1];
      if constexpr (decltype(add_extra)::value) {
#pragma unroll
        for (int k = 0; k < kVecs; ++k) extras[k] = load_vec<T, VEC>(extra, min(vec_index(slice, k), nvec - 1));
      }
      [[maybe_unused]] Vec<T, VEC> gated_vecs[GATED ? kVecs : 1];
      if constexpr (GATED) {
#pragma unroll
        for (int k = 0; k < kVecs; ++k) gated_vecs[k] = load_vec<T, VEC>(gated, min(vec_index(slice, k), nvec - 1));
      }
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        const int i = vec_index(slice, k);
        if (i >= nvec) continue;
        float xf[VEC], df[VEC], ex[VEC];
        to_floats(xs[k], xf);
        to_floats(dys[k], df);
        if constexpr (decltype(add_extra)::value) to_floats(extras[k], ex);
        float g[VEC], normed[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float dn = df[j] * own_factor[k][j];
          normed[j] = !kNormed ? xf[j] : kLayer ? fmaf(xf[j], rstd, neg_mean_rstd) : xf[j] * rstd;
          // kNone takes dn as is: an infinite x times a zero mean_dn_n would make it NaN.
          g[j] = !kNormed ? dn
                 : kLayer  ? fmaf(-normed[j], dn_scale, fmaf(dn, rstd, neg_mean_dn))
                           : rstd * (dn - normed[j] * mean_dn_n);
          if constexpr (decltype(add_extra)::value) g[j] += ex[j];
        }
        const Vec<T, VEC> grad_stored = from_floats<T>(g);
        store_vec<T, VEC>(p.grad_input + out_row, i, grad_stored);
        if constexpr (GATED) {
          // gated_residual_backward's pass on grad_input as stored: dr * gate, dr * input.
          float dr[VEC], gate_f[VEC], input_f[VEC], dr_gate[VEC], dr_input[VEC];
          to_floats(grad_stored, dr);
          to_floats(load_vec<T, VEC>(gate_row, i), gate_f);
          to_floats(gated_vecs[k], input_f);
#pragma unroll
          for (int j = 0; j < VEC; ++j) dr_gate[j] = dr[j] * gate_f[j], dr_input[j] = dr[j] * input_f[j];
          store_vec<T, VEC>(p.gate_input_grad + out_row, i, from_floats<T>(dr_gate));
          if (accumulate) add_slots(2, k, dr_input);
          if (p.gate_rows != nullptr) store_vec<T, VEC>(p.gate_rows + out_row, i, from_floats<T>(dr_input));
        }
        if constexpr (decltype(round_normed)::value) to_floats(from_floats<T>(normed), normed);
        float dy_n[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) dy_n[j] = df[j] * normed[j];
        if (accumulate) {
          add_slots(0, k, dy_n);
          if constexpr (kAccs >= 2) add_slots(1, k, df);
        }
        if constexpr (MODULATE) {
          if (p.factor_rows != nullptr) store_vec<T, VEC>(p.factor_rows + out_row, i, from_floats<T>(dy_n));
          if (p.shift_rows != nullptr) store_vec<T, VEC>(p.shift_rows + out_row, i, from_floats<T>(df));
        }
      }
    };
    // Rounding a float input to float changes nothing: one variant fewer.
    const bool round_normed = p.cast_before_weight && !std::is_same_v<T, float>;
    using Yes = std::true_type;
    using No = std::false_type;
    if (round_normed) {
      extra != nullptr ? write_row(Yes{}, Yes{}) : write_row(Yes{}, No{});
    } else {
      extra != nullptr ? write_row(No{}, Yes{}) : write_row(No{}, No{});
    }
  }

  // No block of the cluster may leave while another may still read its row sums.
  if (clustered) cluster_barrier();
  if (!accumulate) return;
  // This block's partial column sums, one row per column grad. Thread t of row rr takes its
  // vectors rr, rr + rows_per_block, ..., adds each over the block's rows in order and
  // stores it as one vector, where a loop of a column per thread took a division per
  // column and a 4-byte store (H200, bf16, same run, with the first row's threads taking
  // every vector: rms_norm backward 8192x4096 64.5 -> 60.9 us, 128x4096 10.7 -> 8.2,
  // 2048x4096 26.3 -> 23.0, adaln rms [2,2688,2048] 31.1 -> 27.9; spread over the rows as
  // here, another run: adaln rms [2,21504,2048] 146.6 -> 139.0, rms 648720x128 131.3 ->
  // 128.1, where a block holds four or 32 rows).
  __syncthreads();
  float* const partials[3] = {p.factor_partial, p.shift_partial, p.gate_partial};
  const int64_t partial_row = (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * p.cols;
  for (int k = row_in_block; k < kVecs; k += rows_per_block) {
    const int i = vec_index(slice, k);
    if (i >= nvec) continue;
#pragma unroll
    for (int which = 0; which < kAccs; ++which) {
      if (partials[which] == nullptr) continue;
      // Vector k of thread t of each row.
      const float* own = column_acc + t * kThreadFloats + which * kElems + k * VEC;
      Vec<float, VEC> sum;
      read_slots(own, sum.v);
      for (int rr = 1; rr < rows_per_block; ++rr) {
        float other[VEC];
        read_slots(own + rr * threads_per_row * kThreadFloats, other);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum.v[j] += other[j];
      }
      store_vec<float, VEC>(partials[which] + partial_row, i, sum);
    }
  }
}

// sums[g, c] = sum over b of partial[g, b, c], b in order, rounded once to the sums' dtype
// (fp32 or T). A block takes 32 columns, VEC per thread, and splits the partial rows over
// threadIdx.y; the threads' sums then add in a fixed order. blockIdx.z picks the column
// grad (weight or scale, then shift, then gate): all in one launch.
constexpr int kSumCols = 32, kSumThreads = 512;

struct ColumnSums {
  const float* partial[3];
  void* sums[3];
  bool fp32[3];
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kSumThreads) column_sum_kernel(const ColumnSums grads, int partial_rows, int cols) {
  constexpr int kRowThreads = kSumThreads * VEC / kSumCols;  // blockDim.y
  constexpr int kSegments = kSumThreads / kSumCols;
  __shared__ float4 tile_storage[kRowThreads * kSumCols / 4];
  float(*tile)[kSumCols] = reinterpret_cast<float(*)[kSumCols]>(tile_storage);
  const int first_col = blockIdx.x * kSumCols + threadIdx.x * VEC;
  // Selected, not indexed: a parameter array indexed at run time is copied to the stack.
  auto pick = [](const auto (&field)[3]) { return blockIdx.z == 0 ? field[0] : blockIdx.z == 1 ? field[1] : field[2]; };
  const float* group = pick(grads.partial) + static_cast<int64_t>(blockIdx.y) * partial_rows * cols;
  float acc[VEC] = {};
  if (first_col < cols) {
    // 16-byte loads, eight in flight per thread (the adds keep their order): the partial
    // rows are read once, so bytes in flight set the time.
#pragma unroll 8
    for (int b = threadIdx.y; b < partial_rows; b += kRowThreads) {
      const Vec<float, VEC> v = load_vec<float, VEC>(group + static_cast<int64_t>(b) * cols + first_col, 0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += v.v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) tile[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
  __syncthreads();
  // Every thread adds VEC of the kRowThreads sums of one column, then one thread per
  // column adds those: a fixed order.
  const int t = threadIdx.y * blockDim.x + threadIdx.x, col = t % kSumCols, segment = t / kSumCols;
  float part = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) part += tile[segment * VEC + j][col];
  __syncthreads();
  tile[segment][col] = part;
  __syncthreads();
  const int out_col = blockIdx.x * kSumCols + t;
  if (t >= kSumCols || out_col >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kSegments; ++s) total += tile[s][t];
  const int64_t out = static_cast<int64_t>(blockIdx.y) * cols + out_col;
  void* sums = pick(grads.sums);
  if (pick(grads.fp32)) {
    static_cast<float*>(sums)[out] = total;
  } else {
    static_cast<T*>(sums)[out] = from_float<T>(total);
  }
}

template <typename T, typename W, typename G, NormKind KIND, bool MODULATE, bool GATED = false>
void launch_backward(const NormBackwardArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  auto ok_ptr = [](const void* ptr, std::size_t bytes) { return ptr == nullptr || aligned_to(ptr, bytes); };
  const std::size_t tb = V * sizeof(T);
  const bool vector = a.cols % V == 0 && a.input_stride % V == 0 && a.grad_out_stride % V == 0 &&
                      a.grad_extra_stride % V == 0 && a.scale.batch_stride % V == 0 &&
                      a.scale.token_stride % V == 0 && ok_ptr(a.input, tb) && ok_ptr(a.grad_input, tb) &&
                      ok_ptr(a.grad_extra, tb) && ok_ptr(a.scale.ptr, tb) && ok_ptr(a.factor_rows, tb) &&
                      ok_ptr(a.shift_rows, tb) && ok_ptr(a.weight, V * sizeof(W)) &&
                      ok_ptr(a.grad_out, V * sizeof(G)) && a.gate.batch_stride % V == 0 &&
                      a.gate.token_stride % V == 0 && a.gate_input_stride % V == 0 && ok_ptr(a.gate.ptr, tb) &&
                      ok_ptr(a.gate_input, tb) && ok_ptr(a.gate_input_grad, tb) && ok_ptr(a.gate_rows, tb);
  const int vec = vector ? V : 1;
  const int64_t nvec = a.cols / vec;
  constexpr int accs = bwd_accs(KIND, MODULATE, GATED);
  const int vecs_per_thread = bwd_vecs(vec, sizeof(G), accs);
  const RowLaunch cfg = row_launch(nvec, vecs_per_thread, bwd_row_threads(accs));
  const int64_t slice_vecs = static_cast<int64_t>(cfg.threads_per_row) * vecs_per_thread;
  const int slices = static_cast<int>((nvec + slice_vecs - 1) / slice_vecs);
  const int device = a.device.index();
  const bool sums = a.factor_sums != nullptr || a.shift_sums != nullptr || a.gate_sums != nullptr;
  const std::size_t thread_shared = sums ? bwd_thread_floats(vec, sizeof(G), accs) * sizeof(float) : 0;
  const auto kernel = vector ? norm_backward_kernel<T, W, G, V, KIND, MODULATE, GATED>
                             : norm_backward_kernel<T, W, G, 1, KIND, MODULATE, GATED>;
  // Every block writes a partial row per column grad, which column_sum_kernel reads back.
  // With column sums, rows of 64 threads share a block, up to four at a time, for a quarter
  // of those partial rows, as long as as many threads stay resident per SM (16-bit AdaLN's
  // two grads take 68 KB for four rows: on the H200 two such blocks fit, on sm_75 or sm_86
  // the shared memory would cut the resident threads, so they keep a row per block). H200,
  // bf16, same run: adaln rms [2,2688,2048] 44.7 -> 36.1 us, [2,21504,2048] 165 -> 159 us,
  // the gated residual's [2,21504,2048] 151 -> 144 us; adaln layer [2,21504,2048], whose
  // rows then wait for each other at two barriers per row, 195 -> 196 us. Rows without
  // sums are not helped. Rows of 128 threads with one or two column grads (D = 4096 in 16
  // bits) pair up in 256-thread blocks, as many threads per SM: rms_norm backward
  // 8192x4096 66.4 -> 64.3 us, 4096x4096 42.4 -> 40.2, 2048x4096 30.0 -> 27.3, 128x4096
  // 13.3 -> 11.5, 32768x4096 210.4 -> 208.2 (same run); adaln rms [2,2688,4096] 49.6 ->
  // 46.3 us, layer 50.0 -> 46.6 (another run). Not with three (gated_residual_adaln's
  // 128-thread rows at D = 2048): rms [2,21504,2048] 306.2 -> 317.5 us, layer 322.1 -> 332.7.
  auto blocks_per_sm = [&](int threads) {
    return max_blocks_per_sm(reinterpret_cast<const void*>(kernel), device, threads, threads * thread_shared);
  };
  int block = cfg.block;
  const std::size_t shared_room = max_shared_per_block(device) - sizeof(float[kBwdRowSums][32 + 2]);
  const int shared_row_threads = accs == 3 ? 64 : 128;
  while (sums && slices == 1 && cfg.threads_per_row <= shared_row_threads && block < 4 * cfg.threads_per_row &&
         2 * block <= kBwdMaxBlock && 2 * block * thread_shared <= shared_room &&
         2 * blocks_per_sm(2 * block) >= blocks_per_sm(block)) {
    block *= 2;
  }
  const int rows_per_block = block / cfg.threads_per_row;
  const int64_t groups = a.rows / a.group_rows;
  // The kernel loads a per-batch AdaLN scale once per block: its groups are batch entries.
  TORCH_INTERNAL_ASSERT(!MODULATE || a.group_rows == a.tokens, "norm backward: AdaLN groups of ", a.group_rows,
                        " rows with ", a.tokens, " tokens per batch entry");
  const std::size_t shared = block * thread_shared;

  // One wave of blocks, each walking its share of the rows (each adds one partial row per
  // column grad, so no more blocks than fit at once).
  int64_t resident_rows = static_cast<int64_t>(sm_count(device)) * blocks_per_sm(block) / slices;
  // Rows wider than one block: on sm_90 and later, with the kernel's code built for sm_90 or
  // later (the cluster helpers; max_active_clusters says 0 otherwise), its slices form a
  // cluster (up to the portable 8) and exchange their row sums, so that each block reads
  // only its own slice (else each reads the whole row for the sums, and the wider the row
  // the more it re-reads). The gated residual takes no row sums.
  bool clustered = KIND != NormKind::kNone && slices > 1 && slices <= 8 &&
                   device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 9;
  if (clustered) {
    TORCH_INTERNAL_ASSERT(rows_per_block == 1, "norm backward: a cluster's blocks hold one row each");
    const int clusters = max_active_clusters(reinterpret_cast<const void*>(kernel), device, slices, block, shared);
    clustered = clusters > 0;  // else the slices' blocks re-read the row
    if (clustered) resident_rows = clusters;
  }
  const int64_t wanted = std::max<int64_t>(1, resident_rows / groups);
  const int row_blocks = static_cast<int>(std::min<int64_t>(
      {wanted, (a.group_rows + rows_per_block - 1) / rows_per_block, 65535}));
  TORCH_CHECK(groups <= 65535, "norm backward: ", groups, " batch entries is more than one launch takes (65535)");

  // The column grads summed, each into its own partial rows: the weight's or scale's, the
  // shift's, the gate's.
  struct ColumnGrad {
    void* sums;
    bool fp32;
    float* partial;
  };
  std::array<ColumnGrad, 3> column_grads{{{a.factor_sums, a.factor_sums_fp32, nullptr},
                                          {a.shift_sums, a.shift_sums_fp32, nullptr},
                                          {a.gate_sums, a.gate_sums_fp32, nullptr}}};
  // With one row block the partial rows are the sums themselves, if they are fp32.
  const bool sums_direct = row_blocks == 1 && std::all_of(column_grads.begin(), column_grads.end(), [](auto& g) {
                             return g.sums == nullptr || g.fp32;
                           });
  at::Tensor partial;
  if (sums) {
    const int64_t per = groups * row_blocks * a.cols;
    const auto buffers = std::count_if(column_grads.begin(), column_grads.end(), [](auto& g) { return g.sums; });
    if (!sums_direct) partial = at::empty({buffers * per}, at::TensorOptions().device(a.device).dtype(at::kFloat));
    float* next = sums_direct ? nullptr : partial.mutable_data_ptr<float>();
    for (ColumnGrad& g : column_grads) {
      if (g.sums == nullptr) continue;
      g.partial = sums_direct ? static_cast<float*>(g.sums) : next;
      if (!sums_direct) next += per;
    }
  }
  const NormBwdParams<T, W, G> p{static_cast<T*>(a.grad_input), static_cast<const G*>(a.grad_out),
                                 static_cast<const T*>(a.input), static_cast<const T*>(a.grad_extra),
                                 static_cast<const W*>(a.weight), static_cast<const T*>(a.scale.ptr),
                                 reinterpret_cast<const float2*>(a.stats),
                                 static_cast<T*>(a.factor_rows), static_cast<T*>(a.shift_rows),
                                 column_grads[0].partial, column_grads[1].partial,
                                 static_cast<const T*>(a.gate.ptr), static_cast<const T*>(a.gate_input),
                                 static_cast<T*>(a.gate_input_grad), static_cast<T*>(a.gate_rows),
                                 column_grads[2].partial, a.gate.batch_stride, a.gate.token_stride,
                                 a.gate_input_stride,
                                 a.scale.batch_stride, a.scale.token_stride, a.group_rows,
                                 a.input_stride, a.grad_out_stride, a.grad_extra_stride, static_cast<int>(a.cols),
                                 a.eps, a.inv_cols, a.weight_offset, a.cast_before_weight,
                                 clustered ? slices : 1};
  const dim3 grid(slices, row_blocks, static_cast<unsigned>(groups));
  if (clustered) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_launch(grid, block, shared, stream, slices, attribute);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p, cfg.threads_per_row, slices));
  } else {
    kernel<<<grid, block, shared, stream>>>(p, cfg.threads_per_row, slices);
  }
  check_launch();
  if (sums && !sums_direct) {
    ColumnSums grads{};
    unsigned count = 0;
    for (const ColumnGrad& g : column_grads) {
      if (g.sums == nullptr) continue;
      grads.partial[count] = g.partial, grads.sums[count] = g.sums, grads.fp32[count] = g.fp32;
      ++count;
    }
    const dim3 sum_grid(static_cast<unsigned>((a.cols + kSumCols - 1) / kSumCols), static_cast<unsigned>(groups), count);
    // The partial buffers are fresh allocations with rows of cols floats: 16-byte aligned
    // when cols is a multiple of 4.
    constexpr int kSumVec = 4;
    if (a.cols % kSumVec == 0) {
      const dim3 block(kSumCols / kSumVec, kSumThreads * kSumVec / kSumCols);
      column_sum_kernel<T, kSumVec><<<sum_grid, block, 0, stream>>>(grads, row_blocks, static_cast<int>(a.cols));
    } else {
      const dim3 block(kSumCols, kSumThreads / kSumCols);
      column_sum_kernel<T, 1><<<sum_grid, block, 0, stream>>>(grads, row_blocks, static_cast<int>(a.cols));
    }
    check_launch();
  }
}

}  // namespace

void run_norm_backward_cuda(const NormBackwardArgs& a) {
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm_backward", [&] {
    using T = scalar_t;
    if (a.gate.ptr != nullptr) {  // the gated residual, then AdaLN
      TORCH_INTERNAL_ASSERT(a.kind != NormKind::kNone && a.scale.ptr != nullptr);
      return a.kind == NormKind::kLayer ? launch_backward<T, T, T, NormKind::kLayer, true, true>(a, stream)
                                        : launch_backward<T, T, T, NormKind::kRms, true, true>(a, stream);
    }
    if (a.scale.ptr != nullptr) {  // AdaLN, or the gated residual (kNone)
      switch (a.kind) {
        case NormKind::kLayer: return launch_backward<T, T, T, NormKind::kLayer, true>(a, stream);
        case NormKind::kRms: return launch_backward<T, T, T, NormKind::kRms, true>(a, stream);
        case NormKind::kNone: return launch_backward<T, T, T, NormKind::kNone, true>(a, stream);
      }
    }
    with_weight_types<T>(a.weight_fp32, a.grad_fp32, [&](auto w, auto g) {
      launch_backward<T, typename decltype(w)::type, typename decltype(g)::type, NormKind::kRms, false>(a, stream);
    });
  });
}

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
      with_weight_types<T>(a.weight_fp32, a.out_fp32, [&](auto w, auto o) {
        launch<T, typename decltype(w)::type, typename decltype(o)::type, NormKind::kRms, R, false>(a, stream);
      });
    };
    return residual ? rms(std::true_type{}) : rms(std::false_type{});
  });
}

}  // namespace ltx

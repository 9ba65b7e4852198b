// The norm family's backward on CUDA (see NormBackwardArgs in norm.h). A block owns a
// column slice of bwd_vecs vectors per thread (one at few rows, a row a block) and walks a
// fixed set of rows of one group, keeping its slice of x and dy in registers and adding its
// slice of the column grads into fp32 shared memory (each thread its own slots: no atomics,
// no races); it then writes one partial row per column grad, which column_sum_kernel (or,
// at up to eight partial rows, few_column_sum_kernel; on sm_90 a programmatic dependent
// launch) adds up in a fixed order (a grid of one row block writes the sums themselves; the
// gated residual alone at few rows takes gate_backward_columns_kernel instead, or with a
// gate row per input row gate_backward_rows_kernel). Rows wider than one slice are split
// over blockIdx.x: on sm_90 the slices of a row are one cluster's blocks, which exchange
// their row sums through distributed shared memory; elsewhere (or past 8 slices) each block
// reads the whole row for the row sums (the other slices' reads partly hit L2). Few rows of
// up to 512 vectors, a block a row, take norm_backward_row_kernel instead. The measurements
// behind the launch constants, and the alternatives they beat, are rows of
// docs/decisions.md.
#include "cuda_common.cuh"
#include "norm.h"

#include <algorithm>
#include <array>
#include <type_traits>

namespace ltx {
namespace {

// Bytes in flight come from loads per thread: four 16-byte vectors of x and of dy per
// thread (32 elements in 16 bits: 128-thread rows at D = 4096, four blocks per SM; 16 in
// fp32), two when fp32 grads of a 16-bit input make each dy vector 32 bytes, eight single
// elements on the unaligned path. More would spill beside the fp32 factor, and so do four
// with the gated residual's loads (three column grads): it takes two. One vector a thread
// on 512-thread rows (84 registers, one block per SM) was slower at many rows; at few rows
// it is the layout (kBwdFewRowsBlock, docs/decisions.md).
__host__ __device__ constexpr int bwd_vecs(int vec, int grad_bytes, int accs) {
  return vec == 1 ? 8 : accs == 3 || vec * grad_bytes > 16 ? 2 : 4;
}
// Shared-memory floats per thread at `vecs` vectors a thread: its elements for each column
// grad side by side, and 16 bytes of padding, so that the 16-byte accesses of 8 consecutive
// threads fall in distinct banks (36 or 68 floats: 4 banks apart; 20 or 52: 20 apart; 28: 28
// apart; 12, 20 or 28 on the scalar path or at one vector a thread).
__host__ __device__ constexpr int bwd_thread_floats(int vecs, int vec, int accs) { return accs * vecs * vec + 4; }
constexpr int kBwdMaxBlock = 256;
// At most one row an SM (few rows: decode steps, small batches) a thread takes one vector:
// the SMs have room for them, and a thread's chain of dependent instructions, which sets a
// lone row's time, is a quarter as long. A row takes one block of up to kBwdFewRowsBlock
// threads; on sm_90 a wider one takes five to eight slices that form one cluster, of
// kBwdFewRowsSlice threads up to 1024 vectors and twice that up to 2048, so that its
// instructions spread over as many SMs (narrower rows split into two to four slices lose
// more to the cluster's exchange of row sums than they gain: docs/decisions.md).
constexpr int kBwdFewRowsBlock = 512;
constexpr int kBwdFewRowsSlice = 128;
constexpr int kBwdMaxCluster = 8;  // the portable cluster size
// One block's group of up to four rows is faster as a block a row and a second launch for the
// column sums (the row kernel's chain of instructions is shorter); of sixteen it is not.
constexpr int kBwdRowKernelGroupRows = 4;
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
// Column grads summed in shared memory: the weight's, scale's or (the gated residual alone)
// gate's, AdaLN's shift, and (gated) the gate's.
__host__ __device__ constexpr int bwd_accs(bool normed, bool modulate, bool gated) {
  return gated ? 3 : modulate && normed ? 2 : 1;
}
// Threads on one row slice: two or three column accumulators take half as many, so that a
// block of one row slice takes at most 36 KB of shared memory with two, 51 KB with three
// (beyond 48 KB on request, which max_blocks_per_sm makes).
constexpr int bwd_row_threads(int accs) { return accs >= 2 ? kBwdMaxBlock / 2 : kBwdMaxBlock; }

// Stores a vector of column sums at vector i of the row `row_offset` elements into `sums`:
// fp32 as summed, or (rounded) rounded to T, the buffer then holding the grad of dtype T.
template <typename T, int VEC>
__device__ __forceinline__ void store_sums(float* sums, int64_t row_offset, int i, const Vec<float, VEC>& v,
                                           bool rounded) {
  if (rounded) {
    store_vec<T, VEC>(reinterpret_cast<T*>(sums) + row_offset, i, from_floats<T>(v.v));
  } else {
    store_vec<float, VEC>(sums + row_offset, i, v);
  }
}

template <typename T, typename W, typename G>
struct NormBwdParams {
  T* grad_input;          // [rows, cols] contiguous
  const G* grad_out;      // [rows, cols], rows grad_out_stride apart
  const T* input;         // [rows, cols], rows input_stride apart
  const T* grad_extra;    // [rows, cols], rows grad_extra_stride apart, or nullptr
  const W* weight;        // [cols] or nullptr
  const T* scale;         // per (batch, token) rows, see Modulation; nullptr without one
  const float2* stats;    // [rows] the forward's (mean, rstd), or nullptr
  T* factor_rows;         // [rows, cols] contiguous, or nullptr
  T* shift_rows;          // [rows, cols] contiguous, or nullptr
  float* factor_partial;  // [groups, gridDim.y, cols], or nullptr
  float* shift_partial;   // [groups, gridDim.y, cols], or nullptr
  // The gated residual before the norm (GATED; see NormBackwardArgs).
  const T* gate;          // per (batch, token) rows
  const T* gate_input;    // [rows, cols], rows gate_input_stride apart
  T* gate_input_grad;     // [rows, cols] contiguous
  T* gate_rows;           // [rows, cols] contiguous, or nullptr
  float* gate_partial;    // [groups, gridDim.y, cols], or nullptr
  // Bit k set: partial k (factor, shift, gate) is the grad's [groups, cols] sums of dtype T
  // itself (one row block: no column_sum_kernel), rounded here.
  unsigned rounded_partials;
  int64_t gate_batch, gate_token, gate_input_stride;
  int64_t scale_batch, scale_token;
  int64_t group_rows;
  int64_t input_stride, grad_out_stride, grad_extra_stride;
  int cols;
  float eps, inv_cols, factor_offset;
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

// A normed row's sums over a thread's VEC elements, dn = dy * g. Given the forward's
// statistics: sum dn * x and (LayerNorm) sum dn, the centred sum then taken as sum(dn * x)
// - mean * sum(dn), so that the sums wait for no statistic (docs/decisions.md); its
// rounding grows with |mean| / std, to about 1e-5 of dn at 1000 (CPU study in
// docs/performance.md), far below bf16's.
template <NormKind KIND, int VEC, int N>
__device__ __forceinline__ void add_saved_sums(float (&s)[N], const float (&xf)[VEC], const float (&df)[VEC],
                                               const float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float dn = df[j] * f[j];
    s[0] += dn * xf[j];
    if constexpr (KIND == NormKind::kLayer) s[1] += dn;
  }
}

// Without statistics: the square sum of the row centred on `mean` (LayerNorm's from a first
// pass, RMSNorm's 0), sum dn * centred and (LayerNorm) sum dn.
template <NormKind KIND, int VEC, int N>
__device__ __forceinline__ void add_centred_sums(float (&s)[N], const float (&xf)[VEC], const float (&df)[VEC],
                                                 const float (&f)[VEC], float mean) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float c = xf[j] - mean;
    const float dn = df[j] * f[j];
    s[0] += c * c;
    s[1] += dn * c;
    if constexpr (KIND == NormKind::kLayer) s[N - 1] += dn;
  }
}

// A normed row's statistics and dn means (mean_dn_n: of dn * n; mean_dn: LayerNorm's of dn),
// from its summed row sums; mean 0 and rstd 1 before any (the gated residual alone).
struct RowMeans {
  float mean = 0.f, rstd = 1.f, mean_dn_n = 0.f, mean_dn = 0.f;
};
__host__ __device__ constexpr int saved_sums(NormKind kind) { return kind == NormKind::kLayer ? 2 : 1; }
__host__ __device__ constexpr int centred_sums(NormKind kind) { return kind == NormKind::kLayer ? 3 : 2; }

// From the forward's (mean, rstd) and add_saved_sums' row sums.
template <NormKind KIND>
__device__ __forceinline__ RowMeans saved_means(float2 stats, float (&s)[saved_sums(KIND)], float inv_cols) {
  constexpr bool kLayer = KIND == NormKind::kLayer;
  RowMeans m;
  if constexpr (kLayer) m.mean = stats.x;  // RMSNorm's is 0: known at compile time
  m.rstd = stats.y;
  if constexpr (kLayer) s[0] = fmaf(-m.mean, s[1], s[0]);
  m.mean_dn_n = s[0] * m.rstd * inv_cols;
  m.mean_dn = kLayer ? s[saved_sums(KIND) - 1] * inv_cols : 0.f;
  return m;
}

// From add_centred_sums' row sums about `mean`.
template <NormKind KIND>
__device__ __forceinline__ RowMeans centred_means(float mean, const float (&s)[centred_sums(KIND)], float inv_cols,
                                                  float eps) {
  RowMeans m;
  m.mean = mean;
  m.rstd = rsqrtf(s[0] * inv_cols + eps);
  m.mean_dn_n = s[1] * m.rstd * inv_cols;
  m.mean_dn = KIND == NormKind::kLayer ? s[centred_sums(KIND) - 1] * inv_cols : 0.f;
  return m;
}

// A normed row's dx: LayerNorm's dx = rstd * (dn - mean_dn - n * mean_dn_n) and n = (x -
// mean) * rstd as two FMAs each (RMSNorm's mean_dn and mean are 0: its forms stay). Folding
// the mean into an FMA adds an error of about 2^-24 * |mean| / std to n, below that of x's
// own rounding.
template <NormKind KIND>
struct RowGrad {
  static constexpr bool kLayer = KIND == NormKind::kLayer;
  float rstd, mean_dn_n, neg_mean_rstd, dn_scale, neg_mean_dn;

  __device__ explicit RowGrad(const RowMeans& m)
      : rstd(m.rstd),
        mean_dn_n(m.mean_dn_n),
        neg_mean_rstd(-m.mean * m.rstd),
        dn_scale(m.rstd * m.mean_dn_n),
        neg_mean_dn(-m.rstd * m.mean_dn) {}
  __device__ float normed(float x) const { return kLayer ? fmaf(x, rstd, neg_mean_rstd) : x * rstd; }
  __device__ float grad(float dn, float n) const {
    return kLayer ? fmaf(-n, dn_scale, fmaf(dn, rstd, neg_mean_dn)) : rstd * (dn - n * mean_dn_n);
  }
};

// gated_residual_adaln's pass on a row's grad as stored (dr, the summed row's grad): writes
// the gated input's grad dr * gate; returns the gate's grad dr * input (for its column sums,
// or its rows with a gate per token).
template <typename T, typename W, typename G, int VEC>
__device__ __forceinline__ Vec<float, VEC> gated_pass(const NormBwdParams<T, W, G>& p, int64_t out_row, int i,
                                                      const Vec<T, VEC>& dr_stored, const Vec<T, VEC>& gate,
                                                      const Vec<T, VEC>& input) {
  float dr[VEC], gate_f[VEC], input_f[VEC], dr_gate[VEC];
  Vec<float, VEC> dr_input;
  to_floats(dr_stored, dr);
  to_floats(gate, gate_f);
  to_floats(input, input_f);
#pragma unroll
  for (int j = 0; j < VEC; ++j) dr_gate[j] = dr[j] * gate_f[j], dr_input.v[j] = dr[j] * input_f[j];
  store_vec<T, VEC>(p.gate_input_grad + out_row, i, from_floats<T>(dr_gate));
  return dr_input;
}

// NORMED: the row was normalised; without it (the gated residual alone) n = x, dx = dy * g
// and KIND is unused.
// VECS: vectors a thread (bwd_vecs, or one for few rows).
template <typename T, typename W, typename G, int VEC, NormKind KIND, bool MODULATE, bool GATED, bool NORMED, int VECS>
__global__ void __launch_bounds__(VECS == 1 ? kBwdFewRowsBlock : kBwdMaxBlock, VECS == 1 ? 1 : kBwdMinBlocks)
    norm_backward_kernel(const NormBwdParams<T, W, G> p, int threads_per_row, int slices) {
  griddep_launch_dependents();  // the column sums' launch may start (and wait for this kernel)
  // Column-grad sums, per thread kAccs x kElems floats and padding: dy * n, (AdaLN) dy and
  // (gated) dr * input.
  extern __shared__ float4 column_acc_storage[];
  float* column_acc = reinterpret_cast<float*>(column_acc_storage);
  __shared__ float scratch[kBwdRowSums][32];
  __shared__ float cluster_sums[2][kBwdRowSums];
  constexpr int kAccs = bwd_accs(NORMED, MODULATE, GATED);
  constexpr int kVecs = VECS;
  constexpr bool kLayer = KIND == NormKind::kLayer;
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
  constexpr int kThreadFloats = bwd_thread_floats(kVecs, VEC, kAccs);
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

  // The factor g of a loaded scale or weight vector: factor_offset + it, in fp32.
  auto factor_of = [&](const auto& loaded, float (&f)[VEC]) {
    to_floats(loaded, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] += p.factor_offset;
  };
  // The factor g at vector i: factor_offset + weight, factor_offset + scale (scale_row:
  // the row's scale), or 1.
  auto load_factor = [&](const T* scale_row, int i, float (&f)[VEC]) {
    if constexpr (MODULATE) {
      factor_of(load_vec<T, VEC>(scale_row, i), f);
    } else if (p.weight != nullptr) {
      factor_of(load_vec<W, VEC>(p.weight, i), f);
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
  // Every vector's load goes out before the first conversion (unconditional loads, vectors
  // past the row end reading its last one): converting each vector as it loads, under its
  // own branch, would make each load wait for the one before.
  auto load_own_factor = [&](int64_t token) {
    const T* scale_row = scale_row_of(token);
    Vec<T, VEC> scale_vecs[MODULATE ? kVecs : 1];
    Vec<W, VEC> weight_vecs[MODULATE ? 1 : kVecs];
    const bool weighted = !MODULATE && p.weight != nullptr;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = min(vec_index(slice, k), nvec - 1);
      if constexpr (MODULATE) scale_vecs[k] = load_vec<T, VEC>(scale_row, i);
      else if (weighted) weight_vecs[k] = load_vec<W, VEC>(p.weight, i);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if constexpr (MODULATE) {
        factor_of(scale_vecs[k], own_factor[k]);
      } else if (weighted) {
        factor_of(weight_vecs[k], own_factor[k]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) own_factor[k][j] = 1.f;
      }
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
  // The first row's loads go out before the factor's, whose conversion would hold them
  // back; not in the gated kernels (gated_residual_adaln's), which it slowed
  // (docs/decisions.md).
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
    // flight: the block's next row, asked into L2 now, keeps DRAM busy meanwhile, and so
    // does the saved statistics' line, which from DRAM would hold up the write pass. The
    // gated residual alone (no row sums) and rows within a warp were slower with it, and so
    // was a prefetch two rows ahead (docs/decisions.md).
    const int64_t next = base + row_step + row_in_block;
    constexpr bool kMayHaveStats = NORMED && MODULATE;
    if (NORMED && threads_per_row > 32 && next < p.group_rows) {
      const int first_col = slice * slice_cols, cols = min(slice_cols, p.cols - first_col);
      const int64_t next_r = group_first + next;
      prefetch_l2(p.input + next_r * p.input_stride + first_col, cols * sizeof(T), t, threads_per_row);
      prefetch_l2(p.grad_out + next_r * p.grad_out_stride + first_col, cols * sizeof(G), t, threads_per_row);
      if (GATED) {
        prefetch_l2(p.gate_input + next_r * p.gate_input_stride + first_col, cols * sizeof(T), t, threads_per_row);
      }
      if (kMayHaveStats && p.stats != nullptr && t == 0) prefetch_l2(p.stats + next_r, sizeof(float2), 0, 1);
    }

    // Adds fn(x, dy, factor) in fp32 over every vector of the row this thread covers into
    // sums: its own slice from registers, then (unclustered) the other slices from memory,
    // each slice's part added with Kahan compensation, so that a wide row's sums keep an
    // error bound that does not grow with its width.
    auto for_row = [&](auto& sums, auto&& fn) {
      constexpr int N = std::extent_v<std::remove_reference_t<decltype(sums)>>;
      if (!active) return;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (vec_index(slice, k) >= nvec) continue;
        float xf[VEC], df[VEC];
        to_floats(xs[k], xf);
        to_floats(dys[k], df);
        fn(sums, xf, df, own_factor[k]);
      }
      float compensation[N] = {};
      for (int c = 0; !clustered && c < slices; ++c) {
        if (c == slice) continue;
        float part[N] = {};
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
          const int i = vec_index(c, k);
          if (i >= nvec) continue;
          float xf[VEC], df[VEC], f[VEC];
          to_floats(load_vec<T, VEC>(x, i), xf);
          to_floats(load_vec<G, VEC>(dy, i), df);
          load_factor(scale_row, i, f);
          fn(part, xf, df, f);
        }
#pragma unroll
        for (int j = 0; j < N; ++j) add_compensated(sums[j], compensation[j], part[j]);
      }
    };

    // AdaLN's backward may have the forward's statistics: one reduction then, of the dn
    // sums alone (add_saved_sums).
    RowMeans means;
    if (kMayHaveStats && p.stats != nullptr) {
      const float2 saved = p.stats[r];
      float s[saved_sums(KIND)] = {};
      for_row(s, [&](auto& sums, const float (&xf)[VEC], const float (&df)[VEC], const float (&f)[VEC]) {
        add_saved_sums<KIND>(sums, xf, df, f);
      });
      sum_row(s);
      means = saved_means<KIND>(saved, s, p.inv_cols);
    } else if constexpr (NORMED) {
      float mean = 0.f;
      if constexpr (kLayer) {
        // Offsets from the row's first element, as the forward sums them (norm_forward.cuh).
        const float first = to_float(x[0]);
        float s[1] = {0.f};
        for_row(s, [&](auto& sums, const float (&xf)[VEC], const float (&)[VEC], const float (&)[VEC]) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) sums[0] += xf[j] - first;
        });
        sum_row(s);
        mean = first + s[0] * p.inv_cols;
      }
      float s[centred_sums(KIND)] = {};
      for_row(s, [&](auto& sums, const float (&xf)[VEC], const float (&df)[VEC], const float (&f)[VEC]) {
        add_centred_sums<KIND>(sums, xf, df, f, mean);
      });
      sum_row(s);
      means = centred_means<KIND>(mean, s, p.inv_cols, p.eps);
    }
    if (!active) continue;
    const RowGrad<KIND> row(means);
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
          normed[j] = NORMED ? row.normed(xf[j]) : xf[j];
          // Without a norm, dn as is: an infinite x times a zero mean_dn_n would make it NaN.
          g[j] = NORMED ? row.grad(dn, normed[j]) : dn;
          if constexpr (decltype(add_extra)::value) g[j] += ex[j];
        }
        const Vec<T, VEC> grad_stored = from_floats<T>(g);
        store_vec<T, VEC>(p.grad_input + out_row, i, grad_stored);
        if constexpr (GATED) {
          const Vec<float, VEC> dr_input = gated_pass(p, out_row, i, grad_stored, load_vec<T, VEC>(gate_row, i),
                                                      gated_vecs[k]);
          if (accumulate) add_slots(2, k, dr_input.v);
          if (p.gate_rows != nullptr) store_vec<T, VEC>(p.gate_rows + out_row, i, from_floats<T>(dr_input.v));
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
  // column and a 4-byte store (docs/decisions.md).
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
      store_sums<T, VEC>(partials[which], partial_row, i, sum, p.rounded_partials >> which & 1);
    }
  }
}

// Few rows of the normed ops (at most one row an SM, rows of up to kBwdFewRowsBlock
// vectors): a block a row, a vector a thread, block (token, group). A row's
// time is its threads' chain of dependent instructions, so everything norm_backward_kernel
// decides at run time for its walk over rows is gone: no row loop, division, shared-memory
// column accumulators or second barrier; every load (x, dy, the factor, the extra grad, the
// saved statistics) goes out before the row sums, and each thread writes its vector of the
// column grads (the block's partial row, or with one row a group the sums themselves, or the
// per-token rows) straight from registers. STATS: AdaLN's saved (mean, rstd). GATED: the
// gated residual before AdaLN (gated_residual_adaln's pass on the stored grad, see
// norm_backward_kernel). The math is norm_backward_kernel's.
template <typename T, typename W, typename G, int VEC, NormKind KIND, bool MODULATE, bool STATS, bool GATED>
__global__ void __launch_bounds__(kBwdFewRowsBlock) norm_backward_row_kernel(const NormBwdParams<T, W, G> p) {
  static_assert((!STATS && !GATED) || MODULATE, "norm backward rows: statistics and gates come with AdaLN");
  griddep_launch_dependents();
  constexpr bool kLayer = KIND == NormKind::kLayer;
  // The row sums' slots, and (LayerNorm without statistics) the mean's, apart: the row
  // sums' writes then need no barrier after the mean's reads.
  __shared__ float scratch[kBwdRowSums + 1][32];
  const int i = threadIdx.x;
  const bool has = i < p.cols / VEC;
  const int64_t token = blockIdx.x, r = static_cast<int64_t>(blockIdx.y) * p.group_rows + token;
  const T* x = p.input + r * p.input_stride;
  Vec<T, VEC> xv{};
  Vec<G, VEC> dyv{};
  Vec<T, VEC> ev{};
  Vec<T, VEC> sv{};
  Vec<W, VEC> wv{};
  Vec<T, VEC> gate_v{}, gated_v{};
  if (has) {
    xv = load_vec<T, VEC>(x, i);
    dyv = load_vec<G, VEC>(p.grad_out + r * p.grad_out_stride, i);
    if constexpr (MODULATE) {
      sv = load_vec<T, VEC>(p.scale + static_cast<int64_t>(blockIdx.y) * p.scale_batch + token * p.scale_token, i);
    } else if (p.weight != nullptr) {
      wv = load_vec<W, VEC>(p.weight, i);
    }
    if (p.grad_extra != nullptr) ev = load_vec<T, VEC>(p.grad_extra + r * p.grad_extra_stride, i);
    if constexpr (GATED) {
      gate_v = load_vec<T, VEC>(p.gate + static_cast<int64_t>(blockIdx.y) * p.gate_batch + token * p.gate_token, i);
      gated_v = load_vec<T, VEC>(p.gate_input + r * p.gate_input_stride, i);
    }
  }
  const float2 saved = STATS ? p.stats[r] : make_float2(0.f, 1.f);
  // LayerNorm without statistics sums offsets from the row's first element, as the forward.
  const float first = kLayer && !STATS ? to_float(x[0]) : 0.f;

  float xf[VEC], df[VEC], f[VEC];
  to_floats(xv, xf);
  to_floats(dyv, df);
  if constexpr (MODULATE) {
    to_floats(sv, f);
  } else if (p.weight != nullptr) {
    to_floats(wv, f);
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = MODULATE || p.weight != nullptr ? f[j] + p.factor_offset : 1.f;

  // Threads past the row end join each block reduction with nothing added.
  RowMeans means;
  if constexpr (STATS) {
    float s[saved_sums(KIND)] = {};
    if (has) add_saved_sums<KIND>(s, xf, df, f);
    block_sums(s, scratch);
    means = saved_means<KIND>(saved, s, p.inv_cols);
  } else {
    float mean = 0.f;
    if constexpr (kLayer) {
      float s[1] = {0.f};
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[0] += has ? xf[j] - first : 0.f;
      block_sums(s, scratch + kBwdRowSums);
      mean = first + s[0] * p.inv_cols;
    }
    float s[centred_sums(KIND)] = {};
    if (has) add_centred_sums<KIND>(s, xf, df, f, mean);
    block_sums(s, scratch);
    means = centred_means<KIND>(mean, s, p.inv_cols, p.eps);
  }
  if (!has) return;
  const RowGrad<KIND> row(means);
  float g[VEC], normed[VEC], ex[VEC];
  to_floats(ev, ex);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    normed[j] = row.normed(xf[j]);
    g[j] = row.grad(df[j] * f[j], normed[j]);
    if (p.grad_extra != nullptr) g[j] += ex[j];
  }
  const int64_t out_row = r * p.cols;
  const Vec<T, VEC> grad_stored = from_floats<T>(g);
  store_vec<T, VEC>(p.grad_input + out_row, i, grad_stored);
  if constexpr (GATED) {
    const Vec<float, VEC> dr_input = gated_pass(p, out_row, i, grad_stored, gate_v, gated_v);
    if (p.gate_partial != nullptr) store_sums<T, VEC>(p.gate_partial, out_row, i, dr_input, p.rounded_partials >> 2 & 1);
    if (p.gate_rows != nullptr) store_vec<T, VEC>(p.gate_rows + out_row, i, from_floats<T>(dr_input.v));
  }
  // Rounding a float input to float changes nothing.
  if (p.cast_before_weight && !std::is_same_v<T, float>) to_floats(from_floats<T>(normed), normed);
  Vec<float, VEC> dy_n;
#pragma unroll
  for (int j = 0; j < VEC; ++j) dy_n.v[j] = df[j] * normed[j];
  // One row a block: the block's partial row is row r of the group's rows (with one row a
  // group, the sums).
  if (p.factor_partial != nullptr) store_sums<T, VEC>(p.factor_partial, out_row, i, dy_n, p.rounded_partials & 1);
  if constexpr (MODULATE) {
    Vec<float, VEC> dyf;
#pragma unroll
    for (int j = 0; j < VEC; ++j) dyf.v[j] = df[j];
    if (p.shift_partial != nullptr) store_sums<T, VEC>(p.shift_partial, out_row, i, dyf, p.rounded_partials >> 1 & 1);
    if (p.factor_rows != nullptr) store_vec<T, VEC>(p.factor_rows + out_row, i, from_floats<T>(dy_n.v));
    if (p.shift_rows != nullptr) store_vec<T, VEC>(p.shift_rows + out_row, i, from_floats<T>(df));
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

// ColumnSums' field of the column grad blockIdx.z. Selected, not indexed: a parameter array
// indexed at run time is copied to the stack.
template <typename F>
__device__ __forceinline__ F pick_grad(const F (&field)[3]) {
  return blockIdx.z == 0 ? field[0] : blockIdx.z == 1 ? field[1] : field[2];
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kSumThreads) column_sum_kernel(const ColumnSums grads, int partial_rows, int cols) {
  griddep_wait();
  constexpr int kRowThreads = kSumThreads * VEC / kSumCols;  // blockDim.y
  constexpr int kSegments = kSumThreads / kSumCols;
  __shared__ float4 tile_storage[kRowThreads * kSumCols / 4];
  float(*tile)[kSumCols] = reinterpret_cast<float(*)[kSumCols]>(tile_storage);
  const int first_col = blockIdx.x * kSumCols + threadIdx.x * VEC;
  const float* group = pick_grad(grads.partial) + static_cast<int64_t>(blockIdx.y) * partial_rows * cols;
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
  void* sums = pick_grad(grads.sums);
  if (pick_grad(grads.fp32)) {
    static_cast<float*>(sums)[out] = total;
  } else {
    static_cast<T*>(sums)[out] = from_float<T>(total);
  }
}

// column_sum_kernel's sums over at most kFewPartialRows partial rows (few rows): a thread
// adds one vector of columns over them in order, every load out first, and writes the
// sums, with none of column_sum_kernel's shared-memory tile or barriers (its split of many
// partial rows over threads).
constexpr int kFewPartialRows = 8, kFewSumThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kFewSumThreads) few_column_sum_kernel(const ColumnSums grads, int partial_rows,
                                                                        int cols) {
  griddep_wait();
  const int first_col = (blockIdx.x * kFewSumThreads + threadIdx.x) * VEC;
  if (first_col >= cols) return;
  const float* group = pick_grad(grads.partial) + static_cast<int64_t>(blockIdx.y) * partial_rows * cols + first_col;
  Vec<float, VEC> parts[kFewPartialRows];
#pragma unroll
  for (int b = 0; b < kFewPartialRows; ++b) {
    if (b < partial_rows) parts[b] = load_vec<float, VEC>(group + static_cast<int64_t>(b) * cols, 0);
  }
  Vec<float, VEC> total = parts[0];
#pragma unroll
  for (int b = 1; b < kFewPartialRows; ++b) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) total.v[j] += b < partial_rows ? parts[b].v[j] : 0.f;
  }
  store_sums<T, VEC>(static_cast<float*>(pick_grad(grads.sums)), static_cast<int64_t>(blockIdx.y) * cols + first_col, 0,
                    total, !pick_grad(grads.fp32));
}

// The gated residual alone at few rows in all, the gate's grad summed over each group's
// (batch entry's) rows: a thread owns one column vector of its group and walks rows
// threadIdx.y, threadIdx.y + blockDim.y, ..., four at a time with their loads all out
// first; the blockDim.y sums of a column then add in a fixed order in shared memory and are
// written as the column grad itself. The row blocks of norm_backward_kernel would need a
// second launch (column_sum_kernel) or walk the rows one block-wide step after another.
// blockDim.x: 8 vectors (on the vector path 128 bytes of a row); 32, a quarter of the
// blocks, was slower (docs/decisions.md).
constexpr int kGateColumnThreads = 8;
constexpr int kGateRowsAhead = 4;       // rows a thread has in flight
constexpr int kGateMaxRowThreads = 16;  // blockDim.y
// Up to this many rows in all the column kernel runs: at most two steps of four rows a
// thread. At 256 rows a group its steps were slower than the row blocks' two launches;
// many groups of few rows would make many blocks of few threads (measured: one group).
constexpr int64_t kGateColumnRows = 2 * kGateRowsAhead * kGateMaxRowThreads;

template <typename T>
struct GateColumnParams {
  T* grad_input;          // [rows, cols] contiguous: grad_out * gate
  const T* grad_out;      // [rows, cols], rows grad_out_stride apart
  const T* input;         // [rows, cols], rows input_stride apart
  const T* gate;          // a row per group, gate_batch apart (a group's rows share it)
  float* gate_sums;       // [groups, cols] sums of grad_out * input: fp32, or T when rounded
  int64_t gate_batch, group_rows, input_stride, grad_out_stride;
  int cols;
  bool rounded;
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kGateColumnThreads * kGateMaxRowThreads)
    gate_backward_columns_kernel(const GateColumnParams<T> p) {
  extern __shared__ float4 column_storage[];
  float* column = reinterpret_cast<float*>(column_storage);  // [blockDim.y][blockDim.x * VEC]
  const int nvec = p.cols / VEC;
  const int i = blockIdx.x * kGateColumnThreads + threadIdx.x;
  const int64_t group_first = static_cast<int64_t>(blockIdx.y) * p.group_rows;
  const T* gate = p.gate + static_cast<int64_t>(blockIdx.y) * p.gate_batch;
  Vec<float, VEC> acc{};
  if (i < nvec) {
    // Converted where used: a conversion here would hold the rows' loads back.
    const Vec<T, VEC> gate_vec = load_vec<T, VEC>(gate, i);
    for (int64_t base = threadIdx.y; base < p.group_rows; base += kGateRowsAhead * blockDim.y) {
      Vec<T, VEC> xs[kGateRowsAhead], dys[kGateRowsAhead];
      // Unconditional loads: a row past the group's end reads its last row, unused.
#pragma unroll
      for (int u = 0; u < kGateRowsAhead; ++u) {
        const int64_t token = min(base + u * blockDim.y, p.group_rows - 1), r = group_first + token;
        xs[u] = load_vec<T, VEC>(p.input + r * p.input_stride, i);
        dys[u] = load_vec<T, VEC>(p.grad_out + r * p.grad_out_stride, i);
      }
#pragma unroll
      for (int u = 0; u < kGateRowsAhead; ++u) {
        const int64_t token = base + u * blockDim.y;
        if (token >= p.group_rows) break;
        float xf[VEC], df[VEC], gf[VEC], g[VEC];
        to_floats(xs[u], xf);
        to_floats(dys[u], df);
        to_floats(gate_vec, gf);
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] = df[j] * gf[j], acc.v[j] += df[j] * xf[j];
        store_vec<T, VEC>(p.grad_input + (group_first + token) * p.cols, i, from_floats<T>(g));
      }
    }
  }
  const int row_floats = kGateColumnThreads * VEC;
#pragma unroll
  for (int j = 0; j < VEC; ++j) column[threadIdx.y * row_floats + threadIdx.x * VEC + j] = acc.v[j];
  __syncthreads();
  if (threadIdx.y != 0 || i >= nvec) return;
  for (int y = 1; y < blockDim.y; ++y) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc.v[j] += column[y * row_floats + threadIdx.x * VEC + j];
  }
  store_sums<T, VEC>(p.gate_sums, static_cast<int64_t>(blockIdx.y) * p.cols, i, acc, p.rounded);
}

// Runs the gated residual's backward on gate_backward_columns_kernel where it takes it (see
// kGateColumnRows): returns whether it did.
template <typename T>
bool launch_gate_columns(const NormBackwardArgs& a, bool vector, cudaStream_t stream) {
  if (a.factor_sums == nullptr || a.factor_rows != nullptr || a.rows > kGateColumnRows) return false;
  // The gate's grad is column sums only where a group's rows share one gate row.
  TORCH_INTERNAL_ASSERT(a.factor_offset == 0.f && a.grad_extra == nullptr && a.group_rows == a.tokens &&
                        a.scale.token_stride == 0);
  constexpr int V = kVec16<T>;
  const int vec = vector ? V : 1;
  // Row threads for four rows each, up to kGateMaxRowThreads (then two steps).
  int row_threads = 1;
  while (row_threads < kGateMaxRowThreads && row_threads * kGateRowsAhead < a.group_rows) row_threads *= 2;
  const GateColumnParams<T> p{static_cast<T*>(a.grad_input), static_cast<const T*>(a.grad_out),
                              static_cast<const T*>(a.input), static_cast<const T*>(a.scale.ptr),
                              static_cast<float*>(a.factor_sums), a.scale.batch_stride, a.group_rows,
                              a.input_stride, a.grad_out_stride, static_cast<int>(a.cols), !a.factor_sums_fp32};
  const dim3 grid(static_cast<unsigned>((a.cols / vec + kGateColumnThreads - 1) / kGateColumnThreads),
                  static_cast<unsigned>(a.rows / a.group_rows));
  const dim3 block(kGateColumnThreads, row_threads);
  const std::size_t shared = static_cast<std::size_t>(row_threads) * kGateColumnThreads * vec * sizeof(float);
  if (vector) {
    gate_backward_columns_kernel<T, V><<<grid, block, shared, stream>>>(p);
  } else {
    gate_backward_columns_kernel<T, 1><<<grid, block, shared, stream>>>(p);
  }
  check_launch();
  return true;
}

// The gated residual alone with a gate row per input row (decode steps' [B, 1, D] gates, a
// gate per token) at few rows in all: both grads are elementwise, dy * gate into grad_input
// and dy * input into the gate's rows, a thread a vector, block (columns, token, group), with
// none of norm_backward_kernel's walk over rows or shared-memory slots. Offsets within 32
// bits (launch_gate_rows checks it): a decode step's time is its chain of instructions.
template <typename T>
struct GateRowParams {
  T* grad_input;      // [rows, cols] contiguous: grad_out * gate
  T* gate_rows;       // [rows, cols] contiguous: grad_out * input
  const T* grad_out;  // [rows, cols], rows grad_out_stride apart
  const T* input;     // [rows, cols], rows input_stride apart
  const T* gate;      // row (group, token) at group * gate_batch + token * gate_token
  int gate_batch, gate_token, group_rows, input_stride, grad_out_stride, cols;
};
constexpr int kGateRowThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kGateRowThreads) gate_backward_rows_kernel(const GateRowParams<T> p) {
  const int i = blockIdx.x * kGateRowThreads + threadIdx.x;
  if (i >= p.cols / VEC) return;
  const int token = blockIdx.y, group = blockIdx.z, r = group * p.group_rows + token;
  const Vec<T, VEC> dyv = load_vec<T, VEC>(p.grad_out + r * p.grad_out_stride, i);
  const Vec<T, VEC> xv = load_vec<T, VEC>(p.input + r * p.input_stride, i);
  const Vec<T, VEC> gv = load_vec<T, VEC>(p.gate + group * p.gate_batch + token * p.gate_token, i);
  float df[VEC], xf[VEC], gf[VEC], dx[VEC], dg[VEC];
  to_floats(dyv, df);
  to_floats(xv, xf);
  to_floats(gv, gf);
#pragma unroll
  for (int j = 0; j < VEC; ++j) dx[j] = df[j] * gf[j], dg[j] = df[j] * xf[j];
  store_vec<T, VEC>(p.grad_input + r * p.cols, i, from_floats<T>(dx));
  store_vec<T, VEC>(p.gate_rows + r * p.cols, i, from_floats<T>(dg));
}

// Runs the gated residual's backward on gate_backward_rows_kernel where it takes it: the
// gate's grad per row, at most kGateColumnRows rows (the decode steps it was timed on; more
// rows keep norm_backward_kernel), offsets within 32 bits. Returns whether it did.
template <typename T>
bool launch_gate_rows(const NormBackwardArgs& a, bool vector, cudaStream_t stream) {
  if (a.factor_rows == nullptr || a.rows > kGateColumnRows) return false;
  const int64_t groups = a.rows / a.group_rows;
  const int64_t reach = std::max({a.rows * std::max({a.input_stride, a.grad_out_stride, a.cols}),
                                  groups * a.scale.batch_stride + a.group_rows * a.scale.token_stride});
  if (reach > INT32_MAX) return false;
  TORCH_INTERNAL_ASSERT(a.factor_offset == 0.f && a.grad_extra == nullptr && a.factor_sums == nullptr &&
                        a.shift_rows == nullptr);
  constexpr int V = kVec16<T>;
  const int vec = vector ? V : 1;
  const auto narrow = [](int64_t v) { return static_cast<int>(v); };
  const GateRowParams<T> p{static_cast<T*>(a.grad_input), static_cast<T*>(a.factor_rows),
                           static_cast<const T*>(a.grad_out), static_cast<const T*>(a.input),
                           static_cast<const T*>(a.scale.ptr), narrow(a.scale.batch_stride),
                           narrow(a.scale.token_stride), narrow(a.group_rows), narrow(a.input_stride),
                           narrow(a.grad_out_stride), narrow(a.cols)};
  const dim3 grid(static_cast<unsigned>((a.cols / vec + kGateRowThreads - 1) / kGateRowThreads),
                  static_cast<unsigned>(a.group_rows), static_cast<unsigned>(groups));
  if (vector) {
    gate_backward_rows_kernel<T, V><<<grid, kGateRowThreads, 0, stream>>>(p);
  } else {
    gate_backward_rows_kernel<T, 1><<<grid, kGateRowThreads, 0, stream>>>(p);
  }
  check_launch();
  return true;
}

template <typename T, typename W, typename G, NormKind KIND, bool MODULATE, bool GATED = false, bool NORMED = true>
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
  if constexpr (!NORMED) {
    if (launch_gate_columns<T>(a, vector, stream) || launch_gate_rows<T>(a, vector, stream)) return;
  }
  constexpr int accs = bwd_accs(NORMED, MODULATE, GATED);
  const int device = a.device.index();
  const bool sums = a.factor_sums != nullptr || a.shift_sums != nullptr || a.gate_sums != nullptr;
  const std::size_t shared_room = max_shared_per_block(device) - sizeof(float[kBwdRowSums][32 + 2]);
  using Kernel = void (*)(NormBwdParams<T, W, G>, int, int);
  struct Layout {
    Kernel kernel;
    RowLaunch cfg;
    int slices, block;
    std::size_t thread_shared;
  };
  auto blocks_per_sm = [&](const Layout& lay, int threads) {
    return max_blocks_per_sm(reinterpret_cast<const void*>(lay.kernel), device, threads, threads * lay.thread_shared);
  };
  // The launch at `vecs` vectors a thread (one: few rows, a row's slices of up to
  // `few_threads` threads).
  auto layout = [&](int vecs, int few_threads = kBwdFewRowsBlock) {
    Layout lay{};
    lay.kernel = vector ? norm_backward_kernel<T, W, G, V, KIND, MODULATE, GATED, NORMED, bwd_vecs(V, sizeof(G), accs)>
                        : norm_backward_kernel<T, W, G, 1, KIND, MODULATE, GATED, NORMED, bwd_vecs(1, sizeof(G), accs)>;
    if constexpr (NORMED) {  // one vector a thread: the normed ops' vector path only
      if (vecs == 1) lay.kernel = norm_backward_kernel<T, W, G, V, KIND, MODULATE, GATED, NORMED, 1>;
    }
    lay.cfg = row_launch(nvec, vecs, vecs == 1 ? few_threads : bwd_row_threads(accs));
    const int64_t slice_vecs = static_cast<int64_t>(lay.cfg.threads_per_row) * vecs;
    lay.slices = static_cast<int>((nvec + slice_vecs - 1) / slice_vecs);
    lay.thread_shared = sums ? bwd_thread_floats(vecs, vec, accs) * sizeof(float) : 0;
    lay.block = lay.cfg.block;
    // Every block writes a partial row per column grad, which column_sum_kernel reads back.
    // With column sums, rows of 64 threads share a block, up to four at a time, for a
    // quarter of those partial rows, as long as as many threads stay resident per SM (16-bit
    // AdaLN's two grads take 68 KB for four rows: on the H200 two such blocks fit, on sm_75
    // or sm_86 the shared memory would cut the resident threads, so they keep a row per
    // block). Rows without sums are not helped. Rows of 128 threads with one or two column
    // grads (D = 4096 in 16 bits) pair up in 256-thread blocks, as many threads per SM; with
    // three (gated_residual_adaln's 128-thread rows at D = 2048) that was slower
    // (docs/decisions.md).
    const int shared_row_threads = accs == 3 ? 64 : 128;
    while (vecs > 1 && sums && lay.slices == 1 && lay.cfg.threads_per_row <= shared_row_threads &&
           lay.block < 4 * lay.cfg.threads_per_row && 2 * lay.block <= kBwdMaxBlock &&
           2 * lay.block * lay.thread_shared <= shared_room &&
           2 * blocks_per_sm(lay, 2 * lay.block) >= blocks_per_sm(lay, lay.block)) {
      lay.block *= 2;
    }
    return lay;
  };
  Layout chosen = layout(bwd_vecs(vec, sizeof(G), accs));
  // Clusters: sm_90 and later, with the kernel's code built for sm_90 or later (the cluster
  // helpers; max_active_clusters says 0 otherwise).
  const bool cluster_arch = device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 9;
  // At most one row an SM, rows of up to kBwdFewRowsBlock vectors (kBwdMaxCluster slices
  // of up to 2 x kBwdFewRowsSlice threads where clusters are) take one vector a thread,
  // unless the group's rows, which one block of the wider layout holds, would then need
  // several blocks (and a column_sum_kernel launch after them).
  const int few_threads = !cluster_arch || nvec <= kBwdFewRowsBlock      ? kBwdFewRowsBlock
                          : nvec <= kBwdMaxCluster * kBwdFewRowsSlice ? kBwdFewRowsSlice
                                                                      : 2 * kBwdFewRowsSlice;
  const int64_t few_vecs = cluster_arch ? kBwdMaxCluster * 2 * kBwdFewRowsSlice : kBwdFewRowsBlock;
  bool row_kernel = false;
  if (NORMED && vector && nvec <= few_vecs && a.rows <= sm_count(device)) {
    const Layout few = layout(1, few_threads);
    const auto block_rows = [](const Layout& lay) { return lay.block / lay.cfg.threads_per_row; };
    const bool one_block = sums && chosen.slices == 1 && a.group_rows <= block_rows(chosen);
    // A group of more than kBwdRowKernelGroupRows rows that one block holds stays in that
    // block, which writes the column sums without a second launch.
    const bool row_group = few.slices == 1 && a.group_rows <= kBwdRowKernelGroupRows;
    if (!one_block || a.group_rows <= block_rows(few) || row_group) {
      chosen = few;
      // A row of one block: norm_backward_row_kernel's, the same layout without the general
      // kernel's walk over rows (docs/decisions.md).
      row_kernel = few.slices == 1 && (!one_block || row_group);
    }
  }
  const Kernel kernel = chosen.kernel;
  const RowLaunch cfg = chosen.cfg;
  const int slices = chosen.slices, block = chosen.block;
  const std::size_t thread_shared = chosen.thread_shared;
  const int rows_per_block = block / cfg.threads_per_row;
  const int64_t groups = a.rows / a.group_rows;
  // The kernel loads a per-batch AdaLN scale once per block: its groups are batch entries.
  TORCH_INTERNAL_ASSERT(!MODULATE || a.group_rows == a.tokens, "norm backward: AdaLN groups of ", a.group_rows,
                        " rows with ", a.tokens, " tokens per batch entry");
  const std::size_t shared = block * thread_shared;

  // One wave of blocks, each walking its share of the rows (each adds one partial row per
  // column grad, so no more blocks than fit at once).
  int64_t resident_rows = static_cast<int64_t>(sm_count(device)) * blocks_per_sm(chosen, block) / slices;
  // Rows wider than one block: where clusters are, its slices form one and exchange their
  // row sums, so that each block reads only its own slice (else each reads the whole row for
  // the sums, and the wider the row the more it re-reads). The gated residual alone takes no
  // row sums.
  bool clustered = NORMED && slices > 1 && slices <= kBwdMaxCluster && cluster_arch;
  if (clustered) {
    TORCH_INTERNAL_ASSERT(rows_per_block == 1, "norm backward: a cluster's blocks hold one row each");
    const int clusters = max_active_clusters(reinterpret_cast<const void*>(kernel), device, slices, block, shared);
    clustered = clusters > 0;  // else the slices' blocks re-read the row
    if (clustered) resident_rows = clusters;
  }
  const int64_t wanted = std::max<int64_t>(1, resident_rows / groups);
  // norm_backward_row_kernel: a block a row, a partial row each (a.rows <= the SMs).
  const int row_blocks = row_kernel ? static_cast<int>(a.group_rows)
                                    : static_cast<int>(std::min<int64_t>(
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
  // With one row block the partial rows are the sums themselves: the kernel writes them
  // (16-bit ones rounded), and column_sum_kernel, a second launch, is not needed.
  const bool sums_direct = row_blocks == 1;
  unsigned rounded_partials = 0;
  at::Tensor partial;
  if (sums) {
    const int64_t per = groups * row_blocks * a.cols;
    const auto buffers = std::count_if(column_grads.begin(), column_grads.end(), [](auto& g) { return g.sums; });
    if (!sums_direct) partial = at::empty({buffers * per}, at::TensorOptions().device(a.device).dtype(at::kFloat));
    float* next = sums_direct ? nullptr : partial.mutable_data_ptr<float>();
    for (std::size_t k = 0; k < column_grads.size(); ++k) {
      ColumnGrad& g = column_grads[k];
      if (g.sums == nullptr) continue;
      g.partial = sums_direct ? static_cast<float*>(g.sums) : next;
      if (sums_direct && !g.fp32) rounded_partials |= 1u << k;
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
                                 column_grads[2].partial, rounded_partials, a.gate.batch_stride, a.gate.token_stride,
                                 a.gate_input_stride,
                                 a.scale.batch_stride, a.scale.token_stride, a.group_rows,
                                 a.input_stride, a.grad_out_stride, a.grad_extra_stride, static_cast<int>(a.cols),
                                 a.eps, a.inv_cols, a.factor_offset, a.cast_before_weight,
                                 clustered ? slices : 1};
  const dim3 grid(slices, row_blocks, static_cast<unsigned>(groups));
  if (row_kernel) {
    const auto run = [&](auto kernel) {
      const unsigned threads = static_cast<unsigned>((nvec + 31) / 32 * 32);
      kernel<<<dim3(static_cast<unsigned>(a.group_rows), static_cast<unsigned>(groups)), threads, 0, stream>>>(p);
    };
    if constexpr (NORMED) {
      if (MODULATE && a.stats != nullptr) {
        run(norm_backward_row_kernel<T, W, G, V, KIND, MODULATE, MODULATE, GATED>);
      } else {
        run(norm_backward_row_kernel<T, W, G, V, KIND, MODULATE, false, GATED>);
      }
    }
  } else if (clustered) {
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
    // On sm_90 and later the sums' launch is a programmatic dependent launch: its blocks
    // start while the row blocks run and wait for them (griddep_wait), so that its launch
    // latency overlaps theirs (docs/decisions.md).
    const int cols = static_cast<int>(a.cols);
    const auto launch_sums = [&](auto kernel, dim3 grid, dim3 block) {
      if (cluster_arch && runs_sm90_code(reinterpret_cast<const void*>(kernel), device)) {
        cudaLaunchAttribute attribute;
        const cudaLaunchConfig_t config = pdl_launch(grid, block, stream, attribute);
        C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, grads, row_blocks, cols));
      } else {
        kernel<<<grid, block, 0, stream>>>(grads, row_blocks, cols);
      }
    };
    if (row_blocks <= kFewPartialRows) {
      const int vec = a.cols % kSumVec == 0 ? kSumVec : 1;
      const dim3 grid(static_cast<unsigned>((a.cols / vec + kFewSumThreads - 1) / kFewSumThreads),
                      static_cast<unsigned>(groups), count);
      if (vec == kSumVec) {
        launch_sums(few_column_sum_kernel<T, kSumVec>, grid, dim3(kFewSumThreads));
      } else {
        launch_sums(few_column_sum_kernel<T, 1>, grid, dim3(kFewSumThreads));
      }
    } else if (a.cols % kSumVec == 0) {
      launch_sums(column_sum_kernel<T, kSumVec>, sum_grid, dim3(kSumCols / kSumVec, kSumThreads * kSumVec / kSumCols));
    } else {
      launch_sums(column_sum_kernel<T, 1>, sum_grid, dim3(kSumCols, kSumThreads / kSumCols));
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
    if (!a.normed) {  // the gated residual alone: the gate as the scale, no norm (KIND unused)
      TORCH_INTERNAL_ASSERT(a.scale.ptr != nullptr && a.gate.ptr == nullptr);
      return launch_backward<T, T, T, NormKind::kRms, true, false, /*NORMED=*/false>(a, stream);
    }
    if (a.gate.ptr != nullptr) {  // the gated residual, then AdaLN
      TORCH_INTERNAL_ASSERT(a.scale.ptr != nullptr);
      return a.kind == NormKind::kLayer ? launch_backward<T, T, T, NormKind::kLayer, true, true>(a, stream)
                                        : launch_backward<T, T, T, NormKind::kRms, true, true>(a, stream);
    }
    if (a.scale.ptr != nullptr) {  // AdaLN
      return a.kind == NormKind::kLayer ? launch_backward<T, T, T, NormKind::kLayer, true>(a, stream)
                                        : launch_backward<T, T, T, NormKind::kRms, true>(a, stream);
    }
    with_weight_types<T>(a.weight_fp32, a.grad_fp32, [&](auto w, auto g) {
      launch_backward<T, typename decltype(w)::type, typename decltype(g)::type, NormKind::kRms, false>(a, stream);
    });
  });
}

}  // namespace ltx

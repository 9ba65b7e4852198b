// RoPE on CUDA (see rope.h): one block per (b, s) token (or per group of its heads, see
// launch) rotates every head of q and k; each thread loads the token's cos/sin for its unit
// of N channels once (8- or 16-byte vectors where alignment allows) and applies them to the
// heads it owns, so the tables are read once per token, not once per head. The kernel and
// its launch live here, in ltx::rope_cuda, for rope.cu and the tuning harness
// benchmarks/rope_variants.cu.
#pragma once

#include "cuda_common.cuh"
#include "rope.h"

#include <algorithm>

namespace ltx::rope_cuda {

constexpr int kUnitThreads = 256;  // threads across one head's channels
constexpr int64_t kMaxGridY = 65535;
constexpr int kMaxBlock = 512;  // fp32 tables of rotate-half need more than 64 registers
// The whole-groups kernel (see rope_kernel) takes a token of 32 + 8 heads, two a row of
// threads, in one 320-thread block; four such blocks per SM (51 registers) keep enough
// loads in flight.
constexpr int kWholeGroupsBlock = 320;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kWholeGroupsMinBlocks = 3;  // sm_75 holds 1024 threads per SM
#else
constexpr int kWholeGroupsMinBlocks = 4;
#endif
constexpr int max_block(bool whole_groups) { return whole_groups ? kWholeGroupsBlock : kMaxBlock; }

template <typename T>
struct RopeRows {
  T* out;
  const T* in;
  int64_t heads;
  int64_t in_b, in_h, in_s, out_b, out_h, out_s;
};

template <typename T, typename C>
struct RopeParams {
  RopeRows<T> q, k;
  const C* cos;  // [B or 1, S, R]
  const C* sin;
  int64_t table_b, table_s;
  IntDivider seq;  // block x is token (x / seq, x % seq); B * S < 2^31 (the grid's bound)
  int head_dim, rotary_dim;
  bool inverse;
};

// The token's rows of one head, h over q's heads then k's: the per-token parts of the
// offsets are added once per block, so a head costs a select and one multiply-add.
template <typename T>
struct TokenRows {
  const T* q_in;
  T* q_out;
  const T* k_in;
  T* k_out;
  int64_t q_heads, q_in_h, q_out_h, k_in_h, k_out_h;

  __device__ TokenRows(const RopeRows<T>& q, const RopeRows<T>& k, int64_t b, int64_t s)
      : q_in(q.in + b * q.in_b + s * q.in_s),
        q_out(q.out + b * q.out_b + s * q.out_s),
        k_in(k.in + b * k.in_b + s * k.in_s),
        k_out(k.out + b * k.out_b + s * k.out_s),
        q_heads(q.heads),
        q_in_h(q.in_h),
        q_out_h(q.out_h),
        k_in_h(k.in_h),
        k_out_h(k.out_h) {}

  __device__ const T* in(int64_t h) const { return h < q_heads ? q_in + h * q_in_h : k_in + (h - q_heads) * k_in_h; }
  __device__ T* out(int64_t h) const { return h < q_heads ? q_out + h * q_out_h : k_out + (h - q_heads) * k_out_h; }

  // Heads h0, h0 + 1, ... of one tensor: its rows from h0's on, a head stride apart.
  struct Group {
    const T* in;
    T* out;
    int64_t in_h, out_h;
  };
  __device__ Group group(int64_t h0) const {
    return h0 < q_heads ? Group{in(h0), out(h0), q_in_h, q_out_h} : Group{in(h0), out(h0), k_in_h, k_out_h};
  }
};

// The fp32 cos/sin of one unit of N channels, converted once and applied to every head
// of the thread. Rotate-half pairs channel i (x1) with i + R/2 (x2):
//   y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2;
// interleaved pairs (2i, 2i + 1) inside the unit (only c1 and s1 used):
//   y[2i] = x[2i] c[2i] - x[2i+1] s[2i], y[2i+1] = x[2i+1] c[2i+1] + x[2i] s[2i+1].
// The inverse (the backward) is the transposed map: the pair's sines swap and negate.
template <int N, bool INTERLEAVED>
struct UnitTables {
  float c1[N], s1[N], c2[N], s2[N];

  template <typename C, bool ALIGNED>
  __device__ void load(const C* cos, const C* sin, int i, int second, bool inverse) {
    float sa[N], sb[N];
    to_floats(load_n<C, N, ALIGNED>(cos + i), c1);
    to_floats(load_n<C, N, ALIGNED>(sin + i), sa);
    if constexpr (INTERLEAVED) {
#pragma unroll
      for (int e = 0; e < N; e += 2) {
        s1[e] = inverse ? -sa[e + 1] : sa[e];
        s1[e + 1] = inverse ? -sa[e] : sa[e + 1];
      }
    } else {
      to_floats(load_n<C, N, ALIGNED>(cos + i + second), c2);
      to_floats(load_n<C, N, ALIGNED>(sin + i + second), sb);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        s1[e] = inverse ? -sb[e] : sa[e];
        s2[e] = inverse ? -sa[e] : sb[e];
      }
    }
  }

  template <typename T>
  __device__ void rotate(const Vec<T, N>& x1, const Vec<T, N>& x2, Vec<T, N>& y1, Vec<T, N>& y2) const {
    float a[N], o[N], r1[N], r2[N];
    to_floats(x1, a);
    if constexpr (INTERLEAVED) {
#pragma unroll
      for (int e = 0; e < N; e += 2) {
        r1[e] = a[e] * c1[e] - a[e + 1] * s1[e];
        r1[e + 1] = a[e + 1] * c1[e + 1] + a[e] * s1[e + 1];
      }
    } else {
      to_floats(x2, o);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        r1[e] = a[e] * c1[e] - o[e] * s1[e];
        r2[e] = o[e] * c2[e] + a[e] * s2[e];
      }
      y2 = from_floats<T>(r2);
    }
    y1 = from_floats<T>(r1);
  }
};

// One block per (b, s) token, blockIdx.y and blockIdx.z. The x threads of the token's
// gridDim.z blocks walk the head's units of N channels (pairs at i and i + R/2 for
// rotate-half, N/2 adjacent pairs for interleaved);
// the rows of threads of the token's gridDim.y blocks walk groups of HEADS heads (q's,
// then k's). A thread issues its first heads' loads before the tables' (which every head
// row of the block shares, so they mostly hit L1/L2), so DRAM latency is paid once; it
// converts the tables once for all the heads it rotates.
// WHOLE_GROUPS: q's and k's head counts are multiples of HEADS, so a thread's heads lie in
// one tensor, a head stride apart, and none is missing: no per-head select or test.
template <typename T, typename C, int N, bool ALIGNED, bool INTERLEAVED, int HEADS, bool WHOLE_GROUPS>
__global__ void __launch_bounds__(max_block(WHOLE_GROUPS), WHOLE_GROUPS ? kWholeGroupsMinBlocks : 0)
    rope_kernel(const RopeParams<T, C> p) {
  const uint32_t b = p.seq.div(blockIdx.x);
  const uint32_t s = blockIdx.x - b * p.seq.divisor;
  const C* cos = p.cos + b * p.table_b + s * p.table_s;
  const C* sin = p.sin + b * p.table_b + s * p.table_s;
  const TokenRows<T> rows(p.q, p.k, b, s);
  const int heads = static_cast<int>(p.q.heads + p.k.heads);

  const int rotary_units = INTERLEAVED ? p.rotary_dim / N : p.rotary_dim / 2 / N;
  // Rotate-half's second element of a pair sits half the rotary dim further on.
  const int second = INTERLEAVED ? 0 : p.rotary_dim / 2;
  for (int u = blockIdx.z * blockDim.x + threadIdx.x; u < rotary_units; u += gridDim.z * blockDim.x) {
    const int i = u * N;
    UnitTables<N, INTERLEAVED> tables;
    const int first = (blockIdx.y * blockDim.y + threadIdx.y) * HEADS;
    for (int h0 = first; h0 < heads; h0 += gridDim.y * blockDim.y * HEADS) {
      const auto group = rows.group(h0);  // used only with WHOLE_GROUPS
      auto row_in = [&](int j) { return WHOLE_GROUPS ? group.in + j * group.in_h : rows.in(h0 + j); };
      auto row_out = [&](int j) { return WHOLE_GROUPS ? group.out + j * group.out_h : rows.out(h0 + j); };
      Vec<T, N> x1[HEADS], x2[HEADS];
#pragma unroll
      for (int j = 0; j < HEADS; ++j) {
        if (!WHOLE_GROUPS && h0 + j >= heads) continue;
        const T* in = row_in(j);
        x1[j] = load_n<T, N, ALIGNED>(in + i);
        if constexpr (!INTERLEAVED) x2[j] = load_n<T, N, ALIGNED>(in + i + second);
      }
      if (h0 == first) tables.template load<C, ALIGNED>(cos, sin, i, second, p.inverse);
#pragma unroll
      for (int j = 0; j < HEADS; ++j) {
        if (!WHOLE_GROUPS && h0 + j >= heads) continue;
        Vec<T, N> y1, y2;
        tables.rotate(x1[j], x2[j], y1, y2);
        T* out = row_out(j);
        store_n<T, N, ALIGNED>(out + i, y1);
        if constexpr (!INTERLEAVED) store_n<T, N, ALIGNED>(out + i + second, y2);
      }
    }
  }
  // Channels past the rotary dim pass through (nothing to do in place). Most models rotate
  // every channel: return before the loop rather than set up its per-head pointers for
  // nothing (docs/decisions.md).
  if (p.rotary_dim == p.head_dim) return;
  for (int h = blockIdx.y * blockDim.y + threadIdx.y; h < heads; h += gridDim.y * blockDim.y) {
    const T* in = rows.in(h);
    T* out = rows.out(h);
    if (out == in) continue;
    if constexpr (ALIGNED) {
      for (int i = p.rotary_dim + (blockIdx.z * blockDim.x + threadIdx.x) * N; i < p.head_dim;
           i += gridDim.z * blockDim.x * N) {
        store_n<T, N, true>(out + i, load_n<T, N, true>(in + i));
      }
    } else {
      for (int i = p.rotary_dim + blockIdx.z * blockDim.x + threadIdx.x; i < p.head_dim; i += gridDim.z * blockDim.x) {
        out[i] = in[i];
      }
    }
  }
}

// Rotate-half's lean rows: every channel rotating, a head's 8-byte units over the block's x
// threads (one unit each) and HEADS heads a row of threads, a token's heads over gridDim.y
// blocks, one group a row: no loop, pass-through or per-head select, where rope_kernel's
// general code costs a latency-bound token (a decode step) most of its time. TAILS: a
// tensor's head count need not be a multiple of HEADS, its last group short of heads. The
// math is rope_kernel's (UnitTables).
template <typename T, typename C, int N, int HEADS, bool TAILS>
__global__ void __launch_bounds__(kWholeGroupsBlock, kWholeGroupsMinBlocks)
    rope_lean_kernel(const RopeParams<T, C> p) {
  const int g = blockIdx.y * blockDim.y + threadIdx.y;
  const int q_heads = static_cast<int>(p.q.heads), heads = q_heads + static_cast<int>(p.k.heads);
  int h0 = g * HEADS, count = HEADS;
  if constexpr (TAILS) {
    const int q_groups = (q_heads + HEADS - 1) / HEADS;
    h0 = g < q_groups ? g * HEADS : q_heads + (g - q_groups) * HEADS;
    count = (g < q_groups ? q_heads : heads) - h0;
  }
  if (h0 >= heads || count <= 0) return;  // the last block's rows past the heads
  const uint32_t b = p.seq.div(blockIdx.x);
  const uint32_t s = blockIdx.x - b * p.seq.divisor;
  const auto group = TokenRows<T>(p.q, p.k, b, s).group(h0);
  const int second = p.rotary_dim / 2;
  const int i = threadIdx.x * N;
  Vec<T, N> x1[HEADS], x2[HEADS];
#pragma unroll
  for (int j = 0; j < HEADS; ++j) {
    if (TAILS && j >= count) continue;
    x1[j] = load_n<T, N, true>(group.in + j * group.in_h + i);
    x2[j] = load_n<T, N, true>(group.in + j * group.in_h + i + second);
  }
  UnitTables<N, false> tables;
  tables.template load<C, true>(p.cos + b * p.table_b + s * p.table_s, p.sin + b * p.table_b + s * p.table_s, i,
                                second, p.inverse);
#pragma unroll
  for (int j = 0; j < HEADS; ++j) {
    if (TAILS && j >= count) continue;
    Vec<T, N> y1, y2;
    tables.rotate(x1[j], x2[j], y1, y2);
    T* out = group.out + j * group.out_h;
    store_n<T, N, true>(out + i, y1);
    store_n<T, N, true>(out + i + second, y2);
  }
}

// Interleaved RoPE's lean rows: every channel rotating and q and k of equal head counts
// (LTX-Video's [B, S, C] q and k, FLUX's heads), a thread rotates one unit of N channels of
// q's head h and of k's head h with one conversion of the tables; the block's x threads
// (and gridDim.z blocks) over a head's units, its rows of threads over the heads. No loop,
// pass-through or per-head select, and 32-bit offsets (pairs_rope checks that they fit):
// a latency-bound token (a decode step) pays for every instruction ahead of its loads.
template <typename T, typename C, int N>
__global__ void __launch_bounds__(kUnitThreads) rope_pairs_kernel(const RopeParams<T, C> p) {
  const int h = blockIdx.y * blockDim.y + threadIdx.y;
  const int i = (blockIdx.z * blockDim.x + threadIdx.x) * N;
  if (h >= p.q.heads || i >= p.rotary_dim) return;
  const int b = static_cast<int>(p.seq.div(blockIdx.x));
  const int s = static_cast<int>(blockIdx.x) - b * static_cast<int>(p.seq.divisor);
  auto offset = [&](int64_t sb, int64_t ss, int64_t sh) {
    return b * static_cast<int>(sb) + s * static_cast<int>(ss) + h * static_cast<int>(sh) + i;
  };
  const Vec<T, N> q = load_n<T, N, true>(p.q.in + offset(p.q.in_b, p.q.in_s, p.q.in_h));
  const Vec<T, N> k = load_n<T, N, true>(p.k.in + offset(p.k.in_b, p.k.in_s, p.k.in_h));
  const int table = b * static_cast<int>(p.table_b) + s * static_cast<int>(p.table_s);
  UnitTables<N, true> tables;
  tables.template load<C, true>(p.cos + table, p.sin + table, i, 0, p.inverse);
  Vec<T, N> y, unused;
  tables.rotate(q, q, y, unused);
  store_n<T, N, true>(p.q.out + offset(p.q.out_b, p.q.out_s, p.q.out_h), y);
  tables.rotate(k, k, y, unused);
  store_n<T, N, true>(p.k.out + offset(p.k.out_b, p.k.out_s, p.k.out_h), y);
}

template <typename T>
RopeRows<T> rows_of(const RopeTensor& t) {
  return {static_cast<T*>(t.out), static_cast<const T*>(t.in), t.heads, t.in_b, t.in_h, t.in_s,
          t.out_b, t.out_h, t.out_s};
}

template <typename T, typename C>
RopeParams<T, C> params_of(const RopeArgs& a) {
  return {rows_of<T>(a.q), rows_of<T>(a.k), static_cast<const C*>(a.cos), static_cast<const C*>(a.sin),
          a.table_b, a.table_s, IntDivider(a.seq), static_cast<int>(a.head_dim), static_cast<int>(a.rotary_dim),
          a.inverse};
}

// Blocks a token's `groups` of heads spread over, rows of at most `max_rows` groups: at
// least `wanted`, and as many as give every row of threads one group (heads past a block's
// rows spread over more blocks, not over passes of its rows, whose second pass the other
// rows would idle through); no empty blocks, and past the grid's y bound further passes.
inline int64_t head_blocks_for(int64_t groups, int64_t max_rows, int64_t wanted) {
  return std::min<int64_t>({std::max<int64_t>(wanted, (groups + max_rows - 1) / max_rows), groups, kMaxGridY});
}

template <typename T, typename C, int N>
bool vectorizable(const RopeArgs& a) {
  const int64_t unit = a.interleaved ? a.rotary_dim : a.rotary_dim / 2;
  bool ok = unit % N == 0 && (a.head_dim - a.rotary_dim) % N == 0 && a.table_b % N == 0 && a.table_s % N == 0 &&
            aligned_to(a.cos, N * sizeof(C)) && aligned_to(a.sin, N * sizeof(C));
  for (const RopeTensor* t : {&a.q, &a.k}) {
    ok = ok && aligned_to(t->in, N * sizeof(T)) && aligned_to(t->out, N * sizeof(T));
    for (int64_t s : {t->in_b, t->in_h, t->in_s, t->out_b, t->out_h, t->out_s}) ok = ok && s % N == 0;
  }
  return ok;
}

// The tokens (B * S) of a launch's grid x, within its bound; 0 where there is nothing to do.
inline int64_t grid_tokens(const RopeArgs& a) {
  const int64_t tokens = a.batch * a.seq;
  if (a.q.heads + a.k.heads == 0) return 0;
  TORCH_CHECK(tokens <= INT32_MAX, "rope: at most 2^31 - 1 tokens (B * S) on CUDA, got ", tokens);
  return tokens;
}

template <typename T, typename C, bool INTERLEAVED, int N, int HEADS, bool WHOLE_GROUPS = false>
void launch_with(const RopeArgs& a, cudaStream_t stream, int head_blocks = 1) {
  // Threads over the units of a head first, then one row of threads per HEADS heads (up
  // to the kernel's block bound), the heads spread over head_blocks blocks a token. Fewer
  // tokens than two per SM (decode) also spread a head's units over blocks, up to one unit
  // a thread, while the grid has fewer blocks than two per SM: one wide head (an
  // interleaved head of 16384 channels) otherwise walks its units in one block.
  const int64_t units = (INTERLEAVED ? a.rotary_dim : a.rotary_dim / 2) / N;
  int tx = 1;
  while (tx < units && 2 * tx <= std::min(kUnitThreads, max_block(WHOLE_GROUPS))) tx *= 2;
  const int64_t heads = a.q.heads + a.k.heads;
  const int64_t blocks = grid_tokens(a);
  if (blocks == 0) return;
  const int64_t groups = (heads + HEADS - 1) / HEADS;
  const int64_t max_rows = max_block(WHOLE_GROUPS) / tx;
  head_blocks = static_cast<int>(head_blocks_for(groups, max_rows, head_blocks));
  const int64_t groups_per_block = (groups + head_blocks - 1) / head_blocks;
  const int ty = static_cast<int>(std::min<int64_t>(groups_per_block, max_rows));
  const RopeParams<T, C> p = params_of<T, C>(a);
  constexpr bool kAligned = N > (INTERLEAVED ? 2 : 1);
  int unit_blocks = 1;
  if (!two_rows_per_sm(blocks, a.device.index())) {
    const int64_t sms = sm_count(a.device.index());
    const int64_t spare = std::max<int64_t>(1, 2 * sms / (blocks * head_blocks));
    unit_blocks = static_cast<int>(std::min<int64_t>((units + tx - 1) / tx, spare));
  }
  const dim3 grid(static_cast<unsigned>(blocks), head_blocks, unit_blocks);
  rope_kernel<T, C, N, kAligned, INTERLEAVED, HEADS, WHOLE_GROUPS><<<grid, dim3(tx, ty), 0, stream>>>(p);
  check_launch();
}

// rope_lean_kernel over the tokens, a token's heads over at least `head_blocks` blocks (as
// many as hold a group a row of threads). The caller checks lean_rope.
template <typename T, typename C, int N, int HEADS, bool TAILS>
void launch_lean(const RopeArgs& a, cudaStream_t stream, int head_blocks) {
  const int tx = static_cast<int>(a.rotary_dim / 2 / N);
  const int64_t groups = TAILS ? (a.q.heads + HEADS - 1) / HEADS + (a.k.heads + HEADS - 1) / HEADS
                               : (a.q.heads + a.k.heads) / HEADS;
  const int64_t tokens = grid_tokens(a);
  if (tokens == 0) return;
  // lean_rope keeps the groups within the grid's y bound: a group a row, one pass
  const int64_t blocks = head_blocks_for(groups, kWholeGroupsBlock / tx, head_blocks);
  const int rows = static_cast<int>((groups + blocks - 1) / blocks);
  rope_lean_kernel<T, C, N, HEADS, TAILS><<<dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(blocks)),
                                            dim3(tx, rows), 0, stream>>>(params_of<T, C>(a));
  check_launch();
}

// Whether rope_lean_kernel takes the heads at HEADS a row: every channel rotating, a head's
// units within one row of threads, a block a group at most within the grid's y bound (a
// tensor's last group may be short of heads: TAILS; the caller checks the alignment of
// N-wide units).
template <int N, int HEADS>
bool lean_rope(const RopeArgs& a) {
  const int64_t groups = (a.q.heads + HEADS - 1) / HEADS + (a.k.heads + HEADS - 1) / HEADS;
  return a.rotary_dim == a.head_dim && a.rotary_dim > 0 && a.rotary_dim / 2 / N <= kUnitThreads &&
         groups <= kMaxGridY;
}

// Whether rope_pairs_kernel takes an interleaved call at `unit_threads` (launch_pairs):
// every channel rotating, q and k of equal head counts, every offset of q, k, their outputs
// and the tables within 32 bits, a grid within its y and z bounds (the caller checks the
// alignment of N-wide units).
template <int N>
bool pairs_rope(const RopeArgs& a, int unit_threads) {
  bool ok = a.rotary_dim == a.head_dim && a.rotary_dim > 0 && a.q.heads == a.k.heads && a.q.heads <= kMaxGridY &&
            a.rotary_dim / N <= unit_threads * kMaxGridY &&
            offsets_fit_int32({{a.batch, a.table_b}, {a.seq, a.table_s}, {a.rotary_dim, 1}});
  for (const RopeTensor* t : {&a.q, &a.k}) {
    ok = ok && offsets_fit_int32({{a.batch, t->in_b}, {a.seq, t->in_s}, {t->heads, t->in_h}, {a.head_dim, 1}}) &&
         offsets_fit_int32({{a.batch, t->out_b}, {a.seq, t->out_s}, {t->heads, t->out_h}, {a.head_dim, 1}});
  }
  return ok;
}

// rope_pairs_kernel over the tokens: a head's units over at most `unit_threads` threads (and
// further blocks past them), a token's heads over rows of threads up to kUnitThreads in all,
// further heads over further blocks. The caller checks pairs_rope.
template <typename T, typename C, int N>
void launch_pairs(const RopeArgs& a, cudaStream_t stream, int unit_threads) {
  const int64_t units = a.rotary_dim / N;
  const int64_t tokens = grid_tokens(a);
  if (tokens == 0) return;
  const int64_t unit_blocks = (units + unit_threads - 1) / unit_threads;
  const int tx = static_cast<int>((units + unit_blocks - 1) / unit_blocks);
  const int64_t head_blocks = head_blocks_for(a.q.heads, kUnitThreads / tx, 1);
  const int rows = static_cast<int>((a.q.heads + head_blocks - 1) / head_blocks);
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(head_blocks),
                  static_cast<unsigned>(unit_blocks));
  rope_pairs_kernel<T, C, N><<<grid, dim3(tx, rows), 0, stream>>>(params_of<T, C>(a));
  check_launch();
}

// A decode step's interleaved heads spread their units over blocks of this many threads:
// more SMs issue a latency-bound token's loads; past decode the general kernel was faster
// (docs/decisions.md).
constexpr int kPairsDecodeUnitThreads = 64;

// A decode step's tokens (fewer than two an SM) spread their heads over this many blocks,
// a head a thread: more SMs issue the loads of a latency-bound token (docs/decisions.md).
constexpr int kLeanDecodeHeadBlocks = 8;

template <typename T, typename C, bool INTERLEAVED>
void launch(const RopeArgs& a, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  if constexpr (INTERLEAVED) {
    // Two heads per thread: LTX's q and k read their [B, S, C] fp32 tables (half the
    // bytes it moves) once, where one head a thread read them twice (docs/decisions.md).
    // A decode step's tokens (fewer than two an SM) take q's head and k's a thread on the
    // lean kernel, where their counts match, a head's units over blocks of
    // kPairsDecodeUnitThreads threads.
    if (vectorizable<T, C, V>(a)) {
      const bool decode = !two_rows_per_sm(a.batch * a.seq, a.device.index());
      if (decode && pairs_rope<V>(a, kPairsDecodeUnitThreads)) {
        return launch_pairs<T, C, V>(a, stream, kPairsDecodeUnitThreads);
      }
      return launch_with<T, C, true, V, 2>(a, stream);
    }
    return launch_with<T, C, true, 2, 2>(a, stream);  // one pair per unit, unaligned
  } else {
    // 8-byte units (fp32 too): two heads a thread have 32 bytes in flight and convert
    // their two table vectors once for both. Every channel rotating, the lean kernel takes
    // the heads: one a thread at decode (fewer than two tokens an SM, over
    // kLeanDecodeHeadBlocks blocks a token), two a thread past it (a tensor's odd head count
    // a last group of one). Otherwise rope_kernel at two heads a thread, a decode token's
    // heads over four blocks, whole groups at even head counts. Four-head units and 16-byte
    // units of one head were slower (benchmarks/rope_variants.py, docs/decisions.md).
    constexpr int kHalfVec = V / 2;
    if (!vectorizable<T, C, kHalfVec>(a)) return launch_with<T, C, false, 1, 1>(a, stream);  // unaligned
    const bool decode = !two_rows_per_sm(a.batch * a.seq, a.device.index());
    if (decode && lean_rope<kHalfVec, 1>(a)) {
      return launch_lean<T, C, kHalfVec, 1, false>(a, stream, kLeanDecodeHeadBlocks);
    }
    if (!decode && lean_rope<kHalfVec, 2>(a)) {
      if (a.q.heads % 2 == 0 && a.k.heads % 2 == 0) return launch_lean<T, C, kHalfVec, 2, false>(a, stream, 1);
      return launch_lean<T, C, kHalfVec, 2, true>(a, stream, 1);
    }
    const int head_blocks = decode ? 4 : 1;
    if (a.q.heads % 2 == 0 && a.k.heads % 2 == 0) {
      return launch_with<T, C, false, kHalfVec, 2, true>(a, stream, head_blocks);
    }
    return launch_with<T, C, false, kHalfVec, 2>(a, stream, head_blocks);
  }
}

}  // namespace ltx::rope_cuda

// Device-side helpers shared by every CUDA kernel: 16-byte vectors of fp16/bf16/fp32,
// fp32 conversion, warp and block reductions, and the launch-side stream/guard glue.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace ltx {

// N elements of T moved as one aligned access: 16 bytes compile to one LDG.128/STG.128.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements per 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return static_cast<T>(v);
}

// The N elements of v in fp32. bf16 pairs unpack with one integer op per element (a shift
// and a mask), where element-wise conversion takes one and a half.
template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&out)[N]) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && N % 2 == 0) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(v.v);
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      out[2 * j] = __uint_as_float(pairs[j] << 16);
      out[2 * j + 1] = __uint_as_float(pairs[j] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(v.v[j]);
  }
}

// N floats rounded to T (round to nearest even), as one vector.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> from_floats(const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int j = 0; j < N; ++j) v.v[j] = from_float<T>(in[j]);
  return v;
}

// a * b element-wise, each product rounded once to T, in one instruction per pair (fp16
// and bf16, N even): the exact product of two 16-bit floats fits fp32's significand, so
// this equals rounding float(a) * float(b), which takes four conversions and a multiply
// more. sm_75 has no bf16 arithmetic: its bf16 pairs go through fp32, with the same result.
template <typename T>
constexpr bool kPackedMul = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> mul_rounded(const Vec<T, N>& a, const Vec<T, N>& b) {
  static_assert(kPackedMul<T> && N % 2 == 0, "mul_rounded: pairs of fp16 or bf16");
  using Pair = std::conditional_t<std::is_same_v<T, c10::Half>, __half2, __nv_bfloat162>;
  Vec<T, N> r;
  const Pair* pa = reinterpret_cast<const Pair*>(a.v);
  const Pair* pb = reinterpret_cast<const Pair*>(b.v);
  Pair* pr = reinterpret_cast<Pair*>(r.v);
#pragma unroll
  for (int j = 0; j < N / 2; ++j) pr[j] = __hmul2(pa[j], pb[j]);
  return r;
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* base, int vec_index) {
  return reinterpret_cast<const Vec<T, N>*>(base)[vec_index];
}

// A 16-byte vector from its bits, as loaded or held in 32-bit words.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> vec_of_bits(const uint4& bits) {
  static_assert(sizeof(Vec<T, N>) == sizeof(uint4), "vec_of_bits: 16-byte vectors");
  Vec<T, N> v;
  *reinterpret_cast<uint4*>(&v) = bits;
  return v;
}

// A 16-byte vector by the read-only (non-coherent) path, as a __restrict__ const operand
// loads: only for memory that no thread of the kernel writes before this read.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_read_only(const T* base, int vec_index) {
  return vec_of_bits<T, N>(__ldg(reinterpret_cast<const uint4*>(base) + vec_index));
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* base, int vec_index, const Vec<T, N>& v) {
  reinterpret_cast<Vec<T, N>*>(base)[vec_index] = v;
}

// 16 bytes from global to shared memory, not through registers (sm_80 and later: an
// asynchronous copy; wait_shared_copies makes a thread's own copies visible to it).
__device__ __forceinline__ void copy_to_shared(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
#else
  __trap();  // no asynchronous copy before sm_80: callers stage rows there only
#endif
}

__device__ __forceinline__ void wait_shared_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// N elements at p: one vector access when ALIGNED (p aligned to the Vec), else N loads.
template <typename T, int N, bool ALIGNED>
__device__ __forceinline__ Vec<T, N> load_n(const T* p) {
  if constexpr (ALIGNED) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
  } else {
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) v.v[j] = p[j];
    return v;
  }
}

template <typename T, int N, bool ALIGNED>
__device__ __forceinline__ void store_n(T* p, const Vec<T, N>& v) {
  if constexpr (ALIGNED) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = v.v[j];
  }
}

// Asks L2 for `bytes` from p (one prefetch per 128-byte line), spread over `threads`
// threads of which this is `thread`: no registers wait for it, so it keeps DRAM busy while
// the threads are held at a barrier.
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes, int thread, int threads) {
  const char* line = static_cast<const char*>(p);
  for (int offset = thread * 128; offset < bytes; offset += threads * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line + offset));
  }
}

// Thread-block clusters (sm_90 and later): the blocks of one cluster run at the same time
// and read each other's shared memory. Launches choose them only on such devices.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LTX_CLUSTERS 1
#endif

// Every thread of every block of the cluster arrives, then waits for all: shared-memory
// writes before it are visible to the whole cluster after it.
__device__ __forceinline__ void cluster_barrier() {
#ifdef LTX_CLUSTERS
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// The float at `local` (in this block's shared memory) of block `rank` of the cluster.
__device__ __forceinline__ float load_cluster_shared(const float* local, int rank) {
#ifdef LTX_CLUSTERS
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  float value;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote) : "memory");
  return value;
#else
  __trap();
  return 0.f;
#endif
}

// sum += term, carrying the rounding error in `compensation` (Kahan): a thread's running
// sum over a long row keeps an error bound that does not grow with the row's length. An
// infinite sum carries none (inf - inf would turn the next term's sum into NaN).
__device__ __forceinline__ void add_compensated(float& sum, float& compensation, float term) {
  const float y = term - compensation;
  const float t = sum + y;
  compensation = isfinite(t) ? (t - sum) - y : 0.f;
  sum = t;
}

// The row reductions below combine with `op` (a sum; the FP8 amax in fp8_cuda.cuh), each
// thread's value first: op(v, the other lane's).
struct Add {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// op over aligned groups of `width` lanes (a power of two <= 32); every lane gets the result.
// UNROLLED: the five steps of a warp unrolled, those past the width skipped (the same order):
// a width known only at run time then costs no loop counter and branch a step, which a row
// of a warp or less pays on its critical path; in norm_kernel and the backward the unrolled
// steps spill, so the loop stays the default.
template <class Op = Add, bool UNROLLED = false>
__device__ __forceinline__ float group_reduce(float v, int width, Op op = {}) {
  if constexpr (UNROLLED) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      if (offset < width) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
  } else {
    for (int offset = width / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ float group_sum(float v, int width) { return group_reduce(v, width); }

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory that no other reduction of
// the kernel writes: no barrier guards its reuse, one fewer on a latency-bound row.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  v = group_sum(v, 32);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return group_sum(v, 32);
}

// block_sum of N values at once, with one barrier for all of them: scratch[j] holds value
// j's 32 floats.
template <int N>
__device__ __forceinline__ void block_sums(float (&v)[N], float (*scratch)[32]) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = group_sum(v[j], 32);
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) scratch[j][warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = group_sum(lane < warps ? scratch[j][lane] : 0.f, 32);
}

// op over one row's threads: a lane group of up to a warp, or the row's warps, where a
// block holds rows of threads_per_row consecutive threads (each row's result from its own
// slots of `scratch`, 32 floats as block_sum's). Lanes past the row's warps add 0, which
// is op's identity for a sum and for an amax of magnitudes.
template <class Op = Add>
__device__ __forceinline__ float row_reduce(float v, int threads_per_row, float* scratch, Op op = {}) {
  if (threads_per_row <= 32) return group_reduce(v, threads_per_row, op);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int row_warps = threads_per_row / 32;  // a power of two
  v = group_reduce(v, 32, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < row_warps ? scratch[(warp & -row_warps) + lane] : 0.f;
  return group_reduce(v, 32, op);
}

__device__ __forceinline__ float row_sum(float v, int threads_per_row, float* scratch) {
  return row_reduce(v, threads_per_row, scratch);
}

// n / d for 0 <= n < 2^31 by a multiply-high, an add and a shift, with d's magic number
// made on the host (Granlund and Montgomery): a 64-bit division is a call of some 70
// instructions that a kernel otherwise runs ahead of its first load.
struct IntDivider {
  uint32_t divisor = 1, magic = 1, shift = 0;

  IntDivider() = default;
  explicit IntDivider(int64_t d) : divisor(static_cast<uint32_t>(d)) {
    TORCH_INTERNAL_ASSERT(d >= 1 && d <= INT32_MAX, "IntDivider: divisor ", d);
    while ((uint64_t{1} << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, magic) + n) >> shift; }
};

// Whether every element offset of a view (the sum over its dims of index * stride) fits in
// 32 bits, for kernels that index in int: the largest is each dim's last index (strides are
// non-negative). A view with an empty dim has no offsets; its launch returns first.
struct Extent {
  int64_t size, stride;
};
inline bool offsets_fit_int32(std::initializer_list<Extent> dims) {
  int64_t last = 0;
  for (const Extent& d : dims) last += (d.size - 1) * d.stride;
  return last <= INT32_MAX;
}

// Launch shape of a row-reduction kernel: threads_per_row is a power of two covering the
// row with at most `per_thread` vectors each (up to max_threads). Rows of more than a warp
// get a block each, or share blocks of `shared_block` threads where a launch asks for them
// (row_sum adds each row's own warps); rows of a warp or less share 128-thread blocks and
// reduce with shuffles inside their lane group.
struct RowLaunch {
  int threads_per_row;
  int block;
};

inline RowLaunch row_launch(int64_t vecs_per_row, int per_thread, int max_threads, int shared_block = 0) {
  const int64_t wanted = (vecs_per_row + per_thread - 1) / per_thread;
  int tpr = 1;
  while (tpr < wanted && tpr < max_threads) tpr *= 2;
  return {tpr, tpr > 32 ? std::max(tpr, shared_block) : 128};
}

// Launch shape of an elementwise kernel over [rows, vecs] that divides no index: threadIdx.x
// walks a row's vectors (a power of two, up to `threads`), the block's other threads the next
// rows (threadIdx.y); at most 65535 row groups (gridDim.y), threads loop over the rest.
struct RowTiling {
  dim3 grid, block;
};

inline RowTiling row_tiling(int64_t rows, int64_t vecs, int threads) {
  int tx = 1;
  while (tx < threads && tx < vecs) tx *= 2;
  const dim3 block(tx, threads / tx);
  const int64_t row_groups = (rows + block.y - 1) / block.y;
  return {dim3(static_cast<unsigned>((vecs + tx - 1) / tx), static_cast<unsigned>(std::min<int64_t>(row_groups, 65535))),
          block};
}

inline void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

// Launch-shape queries, each made once per device (and kernel, block, shared size): a
// launch path that asks the driver on every call adds host time to every op call.
template <cudaDeviceAttr kAttribute>
inline int device_attribute(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  TORCH_CHECK(device >= 0 && device < static_cast<int>(cache.size()), "CUDA device index ", device, " out of range");
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device));
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// The most shared memory one block may take (static and dynamic), beyond 48 KB on request.
inline int max_shared_per_block(int device) {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
}

// Whether `rows` independent rows (tokens) give every SM of `device` at least two. Fewer
// (decode-size batches) are latency-bound: the row ops then spread a row over more threads.
inline bool two_rows_per_sm(int64_t rows, int device) {
  return rows >= 2 * static_cast<int64_t>(sm_count(device));
}

// Resident blocks per SM of `kernel` on the current device, which must be `device`. Dynamic
// shared memory beyond 48 KB (less the kernel's static) is granted per kernel only on
// request: the first query of a size above what the kernel has been granted asks for it,
// so ask this before launching.
inline int max_blocks_per_sm(const void* kernel, int device, int block, std::size_t shared) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, std::size_t>, int> cache;
  static std::map<std::pair<const void*, int>, std::size_t> granted;
  const auto key = std::make_tuple(kernel, device, block, shared);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  std::size_t& most = granted[{kernel, device}];
  if (shared > most) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    most = shared;
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block, shared));
  cache.emplace(key, blocks);
  return blocks;
}

// A cudaLaunchKernelEx config with one launch attribute, which must outlive the config.
inline cudaLaunchConfig_t launch_with(dim3 grid, dim3 block, std::size_t shared, cudaStream_t stream,
                                      cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = shared, config.stream = stream;
  config.attrs = &attribute, config.numAttrs = 1;
  return config;
}

// A launch in clusters of `cluster` blocks along x (sm_90 and later), for
// cudaLaunchKernelEx; `attribute` holds the cluster shape and must outlive the config.
inline cudaLaunchConfig_t cluster_launch(dim3 grid, int block, std::size_t shared, cudaStream_t stream, int cluster,
                                         cudaLaunchAttribute& attribute) {
  attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = 1;
  return launch_with(grid, dim3(block), shared, stream, attribute);
}

// Programmatic dependent launch (sm_90 and later): a kernel launched with pdl_launch may
// start while the kernel before it in the stream runs, once every block of that kernel has
// called griddep_launch_dependents (or exited); its griddep_wait holds it until that kernel
// has finished and its writes are visible. Both compile to nothing below sm_90, so a
// dependent launch needs code built for sm_90 or later (runs_sm90_code).
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// `attribute` must outlive the config.
inline cudaLaunchConfig_t pdl_launch(dim3 grid, dim3 block, cudaStream_t stream, cudaLaunchAttribute& attribute) {
  attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return launch_with(grid, block, 0, stream, attribute);
}

// Whether `kernel` runs code compiled for sm_90 or later on the current device: not where
// it came from older PTX (a build without capability 9.0, JIT-compiled for a newer GPU).
inline bool runs_sm90_code(const void* kernel, int device) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  cudaFuncAttributes compiled{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&compiled, kernel));
  return cache.emplace(key, compiled.ptxVersion >= 90).first->second;
}

// Clusters of `cluster` blocks (along x) of `kernel` resident at once on `device`, which
// must be current (sm_90 and later); call max_blocks_per_sm first for the shared memory.
// 0 when the kernel's code came from PTX older than sm_90 (a build without capability 9.0,
// JIT-compiled for a newer GPU): it was compiled without LTX_CLUSTERS.
inline int max_active_clusters(const void* kernel, int device, int cluster, int block, std::size_t shared) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int, std::size_t>, int> cache;
  const auto key = std::make_tuple(kernel, device, cluster, block, shared);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int clusters = 0;
  if (runs_sm90_code(kernel, device)) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_launch(dim3(cluster), block, shared, nullptr, cluster, attribute);
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  }
  cache.emplace(key, clusters);
  return clusters;
}

}  // namespace ltx

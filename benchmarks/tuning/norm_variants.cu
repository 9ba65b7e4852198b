// Candidate launches of the norm family's rows (RMSNorm plain or after a residual add as
// fused_add_rms_norm, a weight of the input's dtype or none; AdaLN after a gated residual or
// not, in bf16 or fp32), and of rms_norm_fp8's rows (FP8 out, an fp32 scale a row), beside the
// production one, built on norm_forward.cuh (the kernels and
// launch code norm_forward.cu runs), as a torch op library:
//   torch.ops.norm_variants.run(x, weight, out, eps, cast_before_weight, cached, per_thread, block)
//   torch.ops.norm_variants.run_residual(x, residual, weight, out, residual_out, eps,
//                                        cast_before_weight, cached, per_thread, block)
//   torch.ops.norm_variants.run_fp8(x, weight, eps, cast_before_weight, cached, per_thread,
//                                   block) -> (q, scales)
//   torch.ops.norm_variants.run_adaln(x, scale, shift, out, eps, norm, cached, per_thread, block)
//   torch.ops.norm_variants.run_gated_adaln(residual, x, gate, scale, shift, residual_out, out,
//                                           eps, norm, cached, per_thread, block)
// cached = 0 is `launch` (what the package runs); kLean is norm_lean_kernel (16-bit rows) at
// per_thread vectors a thread, rows sharing blocks of `block` threads (0: a block a row);
// kMultiRow (weighted RMSNorm rows of a warp or less, 16-bit) is multi_row_kernel at
// per_thread rows a lane group in blocks of `block` threads; -B
// (plain rows) is rms_norm_row_kernel on blocks of B threads, a row each. Otherwise
// `norm_kernel` with `cached` 16-byte vectors a thread (1, 2 or 4; AdaLN's rows also 8), each row over the power
// of two of threads that
// covers it at `per_thread` vectors a thread (0: `cached`), and rows sharing blocks of
// `block` threads (0: a block a row, or 128 threads for rows of a warp or less). The kernels'
// register bounds are production's (bound_threads, bound_min_blocks): a variant tunes the
// launch, not the kernel.
// norm_variants.py builds and times them.
#include "fp8.h"
#include "norm_forward.cuh"

#include <torch/library.h>

namespace ltx {
namespace norm_variants {

using namespace norm_cuda;

template <typename T, typename W, typename O, int CACHED, bool RESIDUAL, NormKind KIND = NormKind::kRms,
          bool MODULATE = false>
void launch_variant(const NormArgs& a, cudaStream_t stream, int per_thread, int block) {
  constexpr int V = kVec16<T>;
  using LO = std::conditional_t<kFp8Out<O>, float, O>;  // FP8 rows take the fp32 out's test, as launch does
  TORCH_CHECK((vectorizable<T, W, LO, V>(a)), "norm_variants: 16-byte aligned rows only");
  constexpr int kMaxThreads = bound_threads(CACHED, RESIDUAL, MODULATE);  // the kernel's __launch_bounds__
  const int64_t nvec = a.cols / V;
  RowLaunch cfg = row_launch(nvec, per_thread > 0 ? per_thread : CACHED, kMaxThreads, block);
  // Rows of a warp or less share 128-thread blocks in production; a variant may ask for others.
  if (block > 0 && cfg.threads_per_row <= 32) cfg.block = block;
  // Only the four-vector kernel re-reads what its registers do not hold.
  TORCH_CHECK(CACHED == kCachedVecs || cfg.threads_per_row * CACHED >= nvec, "norm_variants: ", CACHED,
              " vectors a thread on at most ", kMaxThreads, " threads do not cover ", nvec, " vectors");
  TORCH_CHECK(cfg.block <= kMaxThreads, "norm_variants: blocks of at most ", kMaxThreads, " threads at ", CACHED,
              " vectors a thread");
  launch_norm_rows(norm_kernel<T, W, O, V, CACHED, KIND, RESIDUAL, MODULATE>, a, cfg, stream);
}

constexpr int kLean = 100;

// norm_lean_kernel at `per` vectors a thread, rows sharing blocks of `block` threads (0: a
// block a row).
template <typename T, typename W, typename O, NormKind KIND, bool RESIDUAL, bool MODULATE>
void launch_lean_variant(const NormArgs& a, cudaStream_t stream, int per, int block) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<W, T> && std::is_same_v<O, T>) {
    TORCH_CHECK((lean_rows<T, W, O, RESIDUAL, MODULATE>(a, vectorizable<T, W, O, kVec16<T>>(a))),
                "norm_variants: rows the lean kernel does not take");
    switch (per * 10 + (block == 0)) {
      case 11: return launch_lean_rows<T, 1, true, KIND, RESIDUAL, MODULATE>(a, stream);
      case 21: return launch_lean_rows<T, 2, true, KIND, RESIDUAL, MODULATE>(a, stream);
      case 41: return launch_lean_rows<T, 4, true, KIND, RESIDUAL, MODULATE>(a, stream);
      case 10: return launch_lean_rows<T, 1, false, KIND, RESIDUAL, MODULATE>(a, stream, block);
      default: TORCH_CHECK(false, "norm_variants: lean rows a block each at 1, 2 or 4 vectors a thread, sharing "
                                  "blocks at one");
    }
  }
  TORCH_CHECK(false, "norm_variants: lean rows are 16-bit, their weight and output of the input's dtype");
}

constexpr int kMultiRow = 101;

// RMSNorm rows of a warp or less with a weight (plain or after a residual add, in the
// Llama order), ROWS consecutive rows a lane group in blocks of `blockDim.x` threads: the
// loads of ROWS rows in flight in a thread, the weight loaded once for them, their
// reductions interleaved (inductor's layout for rows of 256: four rows a one-warp program).
template <typename T, int VEC, int ROWS, bool RESIDUAL>
__global__ void __launch_bounds__(kLeanThreads) multi_row_kernel(const NormParams<T, T, T> p, int row_shift) {
  const int threads = 1 << row_shift;
  const int t = threadIdx.x & (threads - 1);
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> row_shift) * ROWS;
  const bool has = t < p.cols / VEC;
  const auto ok = [&](int r) { return has && row0 + r < static_cast<int>(p.rows); };
  Vec<T, VEC> w{}, v[ROWS], rv[RESIDUAL ? ROWS : 1];
  if (has) w = load_vec_read_only<T, VEC>(p.weight, t);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (!ok(r)) continue;
    v[r] = load_vec<T, VEC>(p.input + (row0 + r) * static_cast<int>(p.input_stride), t);
    if constexpr (RESIDUAL) rv[r] = load_vec<T, VEC>(p.residual + (row0 + r) * static_cast<int>(p.residual_stride), t);
  }
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if constexpr (RESIDUAL) {
      if (ok(r)) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[r].v[j] = from_float<T>(to_float(rv[r].v[j]) + to_float(v[r].v[j]));
        store_vec<T, VEC>(p.residual_out + (row0 + r) * static_cast<int>(p.residual_out_stride), t, v[r]);
      }
    }
    acc[r] = ok(r) ? vec_sum(v[r], 0.f, true) : 0.f;
  }
  for (int offset = threads / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (!ok(r)) continue;
    const float rstd = rsqrtf(acc[r] * p.inv_cols + p.eps);
    float f[VEC];
    to_floats(v[r], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] *= rstd;
    store_vec<T, VEC>(p.out + (row0 + r) * static_cast<int>(p.out_stride), t, mul_rounded(from_floats<T>(f), w));
  }
}

// multi_row_kernel at `rows` rows a lane group in blocks of `block` threads.
template <typename T, typename W, typename O, bool RESIDUAL>
void launch_multi_row(const NormArgs& a, cudaStream_t stream, int rows, int block) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<W, T> && std::is_same_v<O, T>) {
    constexpr int V = kVec16<T>;
    const int64_t nvec = a.cols / V;
    TORCH_CHECK((lean_rows<T, W, O, RESIDUAL, false>(a, vectorizable<T, W, O, V>(a))) && nvec <= 32 &&
                    a.weight != nullptr && a.cast_before_weight && a.weight_offset == 0.f && block % 32 == 0 &&
                    block <= kLeanThreads,
                "norm_variants: multi-row lane groups take weighted Llama-order rows of a warp or less, "
                "blocks of whole warps");
    const int shift = 32 - __builtin_clz(static_cast<unsigned>(std::max<int64_t>(nvec, 2) - 1));
    const int64_t rows_per_block = (block >> shift) * rows;
    const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
    const auto run = [&](auto kernel) {
      kernel<<<blocks, block, 0, stream>>>(make_params<T, T, T>(a), shift);
      check_launch();
    };
    switch (rows) {
      case 1: return run(multi_row_kernel<T, V, 1, RESIDUAL>);
      case 2: return run(multi_row_kernel<T, V, 2, RESIDUAL>);
      case 4: return run(multi_row_kernel<T, V, 4, RESIDUAL>);
      case 8: return run(multi_row_kernel<T, V, 8, RESIDUAL>);
      default: TORCH_CHECK(false, "norm_variants: 1, 2, 4 or 8 rows a lane group");
    }
  }
  TORCH_CHECK(false, "norm_variants: multi-row lane groups are 16-bit, their weight and output of the input's dtype");
}

// The AdaLN rows (no weight; after a gated residual or not): production or lean, or
// norm_kernel's launches (any cached).
template <typename T, NormKind KIND, bool RESIDUAL>
void launch_modulated(const NormArgs& a, cudaStream_t stream, int cached, int per_thread, int block) {
  switch (cached) {
    case 0: return launch<T, T, T, KIND, RESIDUAL, true>(a, stream);
    case kLean: return launch_lean_variant<T, T, T, KIND, RESIDUAL, true>(a, stream, per_thread, block);
    case 1: return launch_variant<T, T, T, 1, RESIDUAL, KIND, true>(a, stream, per_thread, block);
    case 2: return launch_variant<T, T, T, 2, RESIDUAL, KIND, true>(a, stream, per_thread, block);
    case 4: return launch_variant<T, T, T, 4, RESIDUAL, KIND, true>(a, stream, per_thread, block);
    // a decode row of up to 8 x 512 vectors held in registers (fp32 rows past 2048 vectors
    // re-read their tail at four)
    case 8: return launch_variant<T, T, T, 8, RESIDUAL, KIND, true>(a, stream, per_thread, block);
    default: TORCH_CHECK(false, "norm_variants: AdaLN rows at 0, 1, 2, 4, 8 or kLean, not ", cached);
  }
}

// W, O: the 16-bit rows' (the input's dtype) or rms_norm_fp8's (an fp32 weight, as the op
// makes it, and the FP8 out).
template <typename T, typename W, typename O, bool RESIDUAL>
void launch_any(const NormArgs& a, cudaStream_t stream, int cached, int per_thread, int block) {
  if constexpr (!RESIDUAL && !kFp8Out<O>) {
    if (cached < 0) {  // rms_norm_row_kernel, a block of -cached threads a row, two vectors each
      const int block = -cached;
      TORCH_CHECK(block % 32 == 0 && block <= kTwoVecThreads && 2 * block >= a.cols / kVec16<T> && a.weight != nullptr,
                  "norm_variants: the row kernel takes a weight and whole warps, at most ", kTwoVecThreads,
                  ", two vectors each covering the row");
      TORCH_CHECK((vectorizable<T, W, O, kVec16<T>>(a)), "norm_variants: 16-byte aligned rows only");
      return launch_rms_norm_rows<T, W, O, kVec16<T>>(a, 2, block, stream);
    }
  }
  if (cached == kLean) return launch_lean_variant<T, W, O, NormKind::kRms, RESIDUAL, false>(a, stream, per_thread, block);
  if (cached == kMultiRow) return launch_multi_row<T, W, O, RESIDUAL>(a, stream, per_thread, block);
  switch (cached) {
    case 0: return launch<T, W, O, NormKind::kRms, RESIDUAL, false>(a, stream);
    case 1: return launch_variant<T, W, O, 1, RESIDUAL>(a, stream, per_thread, block);
    case 2: return launch_variant<T, W, O, 2, RESIDUAL>(a, stream, per_thread, block);
    case 4: return launch_variant<T, W, O, 4, RESIDUAL>(a, stream, per_thread, block);
    default: TORCH_CHECK(false, "norm_variants: 0, 1, 2 or 4 vectors a thread, not ", cached);
  }
}

// rms_norm_out (norm.h) checks and lays out the arguments as the package's op does, then
// hands them here with the launch the call asked for.
struct VariantBackend {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static inline int cached = 0;
  static inline int per_thread = 0;
  static inline int block = 0;
  static void run(const NormArgs& a) {
    TORCH_CHECK(!a.weight_fp32 && !a.out_fp32, "norm_variants: a weight and output of the input's dtype");
    const c10::cuda::CUDAGuard guard(a.device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
    if (a.scale.ptr != nullptr) {  // AdaLN: bf16 and fp32 rows only (the harness's build time)
      TORCH_CHECK((a.dtype == at::kBFloat16 || a.dtype == at::kFloat) && a.normed,
                  "norm_variants: AdaLN rows in bf16 or fp32");
      const auto modulated = [&](auto type) {
        using T = decltype(type);
        const bool residual = a.residual != nullptr;
        if (a.kind == NormKind::kLayer) {
          return residual ? launch_modulated<T, NormKind::kLayer, true>(a, stream, cached, per_thread, block)
                          : launch_modulated<T, NormKind::kLayer, false>(a, stream, cached, per_thread, block);
        }
        return residual ? launch_modulated<T, NormKind::kRms, true>(a, stream, cached, per_thread, block)
                        : launch_modulated<T, NormKind::kRms, false>(a, stream, cached, per_thread, block);
      };
      return a.dtype == at::kFloat ? modulated(float{}) : modulated(c10::BFloat16{});
    }
    LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm_variants", [&] {
      using T = scalar_t;
      if (a.residual != nullptr) return launch_any<T, T, T, true>(a, stream, cached, per_thread, block);
      launch_any<T, T, T, false>(a, stream, cached, per_thread, block);
    });
  }
};

// fp8_detail::rms_norm_fp8 (fp8.h) checks the input, makes the fp32 weight (ones without
// one), allocates q and the scales and lays out the arguments as the package's op does,
// then hands them here.
struct VariantFp8Backend {
  static constexpr c10::DeviceType device = c10::kCUDA;
  // fp8.cu's check, which this library does not link
  static void check_capability(const char* op, c10::Device d) {
    const int index = d.index() >= 0 ? d.index() : c10::cuda::current_device();
    const int cc = 10 * device_attribute<cudaDevAttrComputeCapabilityMajor>(index) +
                   device_attribute<cudaDevAttrComputeCapabilityMinor>(index);
    TORCH_CHECK(cc >= 89, op, ": FP8 needs a GPU of compute capability 8.9 or newer");
  }
  static void run(const NormArgs& a) {
    TORCH_CHECK(a.out_fp8 && a.residual == nullptr && a.scale.ptr == nullptr && a.fp8_scales != nullptr,
                "norm_variants: rms_norm_fp8's dynamic rows only");
    TORCH_INTERNAL_ASSERT(a.weight_fp32 || a.dtype == at::kFloat, "norm_variants: the FP8 rows take an fp32 weight");
    const c10::cuda::CUDAGuard guard(a.device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
    LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm_variants", [&] {
      launch_any<scalar_t, float, Fp8E4m3, false>(a, stream, VariantBackend::cached, VariantBackend::per_thread,
                                                  VariantBackend::block);
    });
  }
};

void choose(int64_t cached, int64_t per_thread, int64_t block) {
  VariantBackend::cached = static_cast<int>(cached);
  VariantBackend::per_thread = static_cast<int>(per_thread);
  VariantBackend::block = static_cast<int>(block);
}

void run(const at::Tensor& x, const std::optional<at::Tensor>& weight, at::Tensor out, double eps,
         bool cast_before_weight, int64_t cached, int64_t per_thread, int64_t block) {
  choose(cached, per_thread, block);
  rms_norm_out<VariantBackend>(out, x, weight, eps, /*weight_offset=*/0.0, cast_before_weight);
}

void run_residual(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                  at::Tensor out, at::Tensor residual_out, double eps, bool cast_before_weight, int64_t cached,
                  int64_t per_thread, int64_t block) {
  choose(cached, per_thread, block);
  fused_add_rms_norm_out<VariantBackend>(out, residual_out, x, residual, weight, eps, /*weight_offset=*/0.0,
                                         cast_before_weight);
}

void run_adaln(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, at::Tensor out, double eps,
               const std::string& norm, int64_t cached, int64_t per_thread, int64_t block) {
  choose(cached, per_thread, block);
  adaln_out<VariantBackend>(out, x, scale, shift, eps, norm);
}

void run_gated_adaln(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& scale,
                     const at::Tensor& shift, at::Tensor residual_out, at::Tensor out, double eps,
                     const std::string& norm, int64_t cached, int64_t per_thread, int64_t block) {
  choose(cached, per_thread, block);
  gated_residual_out<VariantBackend>(residual_out, out, residual, x, gate, scale, shift, eps, norm);
}

// The package's rms_norm_fp8 (weight_offset 0), with the launch the call asks for.
std::tuple<at::Tensor, at::Tensor> run_fp8(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                                           bool cast_before_weight, int64_t cached, int64_t per_thread,
                                           int64_t block) {
  choose(cached, per_thread, block);
  return fp8_detail::rms_norm_fp8<VariantFp8Backend>(x, weight, eps, /*weight_offset=*/0.0, cast_before_weight,
                                                      /*static_scale=*/nullptr, "rms_norm_fp8");
}

}  // namespace norm_variants
}  // namespace ltx

TORCH_LIBRARY(norm_variants, m) {
  m.def("run(Tensor x, Tensor? weight, Tensor(a!) out, float eps, bool cast_before_weight, int cached, "
        "int per_thread, int block) -> ()");
  m.def("run_residual(Tensor x, Tensor residual, Tensor? weight, Tensor(a!) out, Tensor(b!) residual_out, "
        "float eps, bool cast_before_weight, int cached, int per_thread, int block) -> ()");
  m.def("run_adaln(Tensor x, Tensor scale, Tensor shift, Tensor(a!) out, float eps, str norm, int cached, "
        "int per_thread, int block) -> ()");
  m.def("run_gated_adaln(Tensor residual, Tensor x, Tensor gate, Tensor scale, Tensor shift, Tensor(a!) residual_out, "
        "Tensor(b!) out, float eps, str norm, int cached, int per_thread, int block) -> ()");
  m.def("run_fp8(Tensor x, Tensor? weight, float eps, bool cast_before_weight, int cached, int per_thread, "
        "int block) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(norm_variants, CUDA, m) {
  m.impl("run", &ltx::norm_variants::run);
  m.impl("run_residual", &ltx::norm_variants::run_residual);
  m.impl("run_adaln", &ltx::norm_variants::run_adaln);
  m.impl("run_gated_adaln", &ltx::norm_variants::run_gated_adaln);
  m.impl("run_fp8", &ltx::norm_variants::run_fp8);
}

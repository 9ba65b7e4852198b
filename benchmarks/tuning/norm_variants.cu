// Candidate launches of plain RMSNorm rows (no residual, no AdaLN; a weight of the input's
// dtype or none) beside the production one, built on norm_forward.cuh (the kernels and
// launch code norm_forward.cu runs), as a torch op library:
//   torch.ops.norm_variants.run(x, weight, out, eps, cast_before_weight, cached, block)
// cached = 0 is `launch` (what the package runs). Otherwise `norm_kernel` with `cached`
// 16-byte vectors a thread (1, 2 or 4), each row over the power of two of threads that
// covers it, and rows sharing blocks of `block` threads (0: a block a row). The kernels'
// register bounds are production's (bound_threads, bound_min_blocks): a variant tunes the
// launch, not the kernel. norm_variants.py builds and times them.
#include "norm_forward.cuh"

#include <torch/library.h>

namespace ltx {
namespace norm_variants {

using namespace norm_cuda;

template <typename T, int CACHED>
void launch_variant(const NormArgs& a, cudaStream_t stream, int block) {
  constexpr int V = kVec16<T>;
  TORCH_CHECK((vectorizable<T, T, T, V>(a)), "norm_variants: 16-byte aligned rows only");
  constexpr int kMaxThreads = bound_threads(CACHED, false, false);  // the kernel's __launch_bounds__
  const int64_t nvec = a.cols / V;
  const RowLaunch cfg = row_launch(nvec, CACHED, kMaxThreads, block);
  TORCH_CHECK(cfg.threads_per_row * CACHED >= nvec, "norm_variants: ", CACHED, " vectors a thread on at most ",
              kMaxThreads, " threads do not cover ", nvec, " vectors");
  TORCH_CHECK(cfg.block <= kMaxThreads, "norm_variants: blocks of at most ", kMaxThreads, " threads at ", CACHED,
              " vectors a thread");
  launch_norm_rows(norm_kernel<T, T, T, V, CACHED, NormKind::kRms, false, false>, a, cfg, stream);
}

// rms_norm_out (norm.h) checks and lays out the arguments as the package's op does, then
// hands them here with the launch the call asked for.
struct VariantBackend {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static inline int cached = 0;
  static inline int block = 0;
  static void run(const NormArgs& a) {
    TORCH_CHECK(!a.weight_fp32 && !a.out_fp32, "norm_variants: a weight and output of the input's dtype");
    const c10::cuda::CUDAGuard guard(a.device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
    LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm_variants", [&] {
      using T = scalar_t;
      switch (cached) {
        case 0: return launch<T, T, T, NormKind::kRms, false, false>(a, stream);
        case 1: return launch_variant<T, 1>(a, stream, block);
        case 2: return launch_variant<T, 2>(a, stream, block);
        case 4: return launch_variant<T, 4>(a, stream, block);
        default: TORCH_CHECK(false, "norm_variants: 0, 1, 2 or 4 vectors a thread, not ", cached);
      }
    });
  }
};

void run(const at::Tensor& x, const std::optional<at::Tensor>& weight, at::Tensor out, double eps,
         bool cast_before_weight, int64_t cached, int64_t block) {
  VariantBackend::cached = static_cast<int>(cached);
  VariantBackend::block = static_cast<int>(block);
  rms_norm_out<VariantBackend>(out, x, weight, eps, /*weight_offset=*/0.0, cast_before_weight);
}

}  // namespace norm_variants
}  // namespace ltx

TORCH_LIBRARY(norm_variants, m) {
  m.def("run(Tensor x, Tensor? weight, Tensor(a!) out, float eps, bool cast_before_weight, int cached, "
        "int block) -> ()");
}
TORCH_LIBRARY_IMPL(norm_variants, CUDA, m) { m.impl("run", &ltx::norm_variants::run); }

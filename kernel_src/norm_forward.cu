// The norm family's forward on CUDA: NormArgs (norm.h) to the kernel instantiation that
// computes it (norm_forward.cuh).
#include "norm_forward.cuh"

namespace ltx {
namespace {

// The FP8 output mode (O = Fp8E4m3): AdaLN after a gated residual or not, or RMSNorm with
// its weight as the fp32 out's (fp32 beside 16-bit input).
template <typename T>
void run_fp8(const NormArgs& a, cudaStream_t stream) {
  using norm_cuda::launch;
  const bool residual = a.residual != nullptr;
  if (a.scale.ptr != nullptr) {
    if (a.kind == NormKind::kLayer) {
      return residual ? launch<T, T, Fp8E4m3, NormKind::kLayer, true, true>(a, stream)
                      : launch<T, T, Fp8E4m3, NormKind::kLayer, false, true>(a, stream);
    }
    return residual ? launch<T, T, Fp8E4m3, NormKind::kRms, true, true>(a, stream)
                    : launch<T, T, Fp8E4m3, NormKind::kRms, false, true>(a, stream);
  }
  TORCH_INTERNAL_ASSERT(!residual, "norm: FP8 RMSNorm after a residual add is no op's");
  if constexpr (sizeof(T) == 2) {
    TORCH_INTERNAL_ASSERT(a.weight_fp32, "norm: FP8 RMSNorm of 16-bit rows takes an fp32 weight (the fp32 out's)");
    launch<T, float, Fp8E4m3, NormKind::kRms, false, false>(a, stream);
  } else {
    launch<T, T, Fp8E4m3, NormKind::kRms, false, false>(a, stream);
  }
}

}  // namespace

void run_norm_cuda(const NormArgs& a) {
  using norm_cuda::launch;
  const c10::cuda::CUDAGuard guard(a.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
  const bool residual = a.residual != nullptr;
  LTX_DISPATCH_FLOAT_TYPES(a.dtype, "norm", [&] {
    using T = scalar_t;
    if (!a.normed) {  // the gated residual alone: the residual add, no norm (KIND unused)
      return norm_cuda::launch_gated_residual<T>(a, stream);
    }
    if (a.out_fp8) return run_fp8<T>(a, stream);
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

// Op schemas and their CPU / CUDA implementations. Each op comes as an out-variant
// (`<op>_out`, output first, returns nothing) and a functional form that allocates
// its output here in C++, so a Python call costs one dispatch.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

namespace {

using RmsNormOut = void (*)(at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double);

template <RmsNormOut out_fn>
at::Tensor rms_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps) {
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  out_fn(out, input, weight, eps);
  return out;
}

}  // namespace

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("rms_norm(Tensor input, Tensor? weight, float eps) -> Tensor");
  ops.def("rms_norm_out(Tensor! out, Tensor input, Tensor? weight, float eps) -> ()");

  // CPU twins are registered in every variant: a CUDA build of torch serves CPU tensors too.
  ops.impl("rms_norm", c10::DeviceType::CPU, &rms_norm<ltx::rms_norm_out_cpu>);
  ops.impl("rms_norm_out", c10::DeviceType::CPU, &ltx::rms_norm_out_cpu);
#if defined(CUDA_KERNEL)
  ops.impl("rms_norm", c10::DeviceType::CUDA, &rms_norm<ltx::rms_norm_out_cuda>);
  ops.impl("rms_norm_out", c10::DeviceType::CUDA, &ltx::rms_norm_out_cuda);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)

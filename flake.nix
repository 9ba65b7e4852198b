{
  description = "ltx-kernels: fast CUDA kernels for the memory-bound layers of diffusion transformers and LLMs";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}

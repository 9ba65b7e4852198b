// Every op's entry points, as the binding registers them. The declarations live beside
// their kernels (kernel_src/<family>.h) so that kernels and binding share them.
#pragma once

#include "activation.h"
#include "fp8.h"
#include "norm.h"
#include "rope.h"

#include <torch/library.h>

// The Autograd-key kernels of the functional ops (torch_autograd.cpp).
void register_autograd_kernels(torch::Library& ops);

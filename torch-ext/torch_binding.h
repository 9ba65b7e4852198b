// Every op's entry points, as the binding registers them. The declarations live
// beside their kernels (kernel_src/<op>.h) so that kernels and binding share them.
#pragma once

#include "rms_norm.h"

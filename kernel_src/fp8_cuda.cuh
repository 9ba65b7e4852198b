// FP8 output on CUDA, shared by the quantize kernel (fp8.cu) and the norm kernels' FP8 mode
// (norm_forward.cuh): a row's amax over its threads, its scale and divisor, and e4m3 stores,
// the bits of fp8_math.h's math without its divisions.
// Conversion by cuda_fp8.h, saturating (every arch: below sm_89 it is emulated, and the ops
// refuse those GPUs anyway).
#pragma once

#include "cuda_common.cuh"
#include "fp8_math.h"

#include <cuda_fp8.h>

#include <type_traits>

namespace ltx {

// The norm kernels' FP8 output element (their O): an e4m3 byte, beside the row's scale.
struct Fp8E4m3 {
  uint8_t bits;
};
template <typename O>
constexpr bool kFp8Out = std::is_same_v<O, Fp8E4m3>;

// FP8 kernels run on sm_89 and newer (the ops refuse older GPUs). Ada (sm_89) runs the sm_80
// build (compute_90 PTX cannot serve it), so only the sm_75 build's bodies are a trap, with no
// build time or registers spent on code that cannot run.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kFp8Arch = false;
#else
constexpr bool kFp8Arch = true;
#endif


// fp8_amax_step over one row's threads, as row_sum adds them (cuda_common.cuh's
// row_reduce): every thread of the row gets the result.
struct Fp8AmaxStep {
  __device__ __forceinline__ float operator()(float running, float a) const { return fp8_amax_step(running, a); }
};
__device__ __forceinline__ float row_amax(float v, int threads_per_row, float* scratch) {
  return row_reduce(v, threads_per_row, scratch, Fp8AmaxStep{});
}

// How a row divides its y by its scale, and makes the scale from its amax, as the reference
// quantizer does (fp8_math.h: IEEE divisions), without a division instruction sequence: its
// slow-path subroutine call makes every FP8 kernel save registers around it (spills), and at
// about nine instructions an element it spends most of the instruction budget of three bytes
// an element (16-bit in, e4m3 out) at the copy roofline. Instead:
//   - scale = RN(amax / 448) as q0 = RN(amax * RN(1/448)) corrected by Markstein's step
//     RN(q0 + RN(amax - q0 * 448) * RN(1/448)), exact for every finite amax (checked over all
//     of them on the host with fmaf);
//   - 1 / scale in double from the approximate reciprocal and three Newton steps (to an ulp
//     of a double; 0, infinities and NaN exactly), rounded once more to a float for RN(1/scale);
//   - a row whose scale came from its own amax (|y / scale| <= 448) and is finite: y / scale
//     as q0 = RN(y * RN(1/scale)) and Markstein's step, three instructions an element (exact
//     above 2^-100, below which e4m3 rounds to a signed zero either way);
//   - a static scale (any y against any scale) or a non-finite one: RN(y * (1/scale)) in
//     double rounded to a float, which is RN(y / scale) because a quotient of floats is never
//     within 2^-49 of a float's rounding midpoint (in the normal range; below it, e4m3 zero).
// tests/fp8_division_check.c checks each against IEEE division on the host (exhaustively
// for the scale).
struct Fp8Divisor {
  float scale;
  float reciprocal;        // RN(1 / scale)
  double wide_reciprocal;  // 1 / scale to an ulp of a double
  bool markstein;
};

__device__ __forceinline__ double fp8_wide_reciprocal(float scale) {
  const double s = scale;
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(s));
  if (isfinite(scale) && scale != 0.f) {
#pragma unroll
    for (int k = 0; k < 3; ++k) r = __fma_rn(__fma_rn(-s, r, 1.0), r, r);
  }
  return r;
}

__device__ __forceinline__ float fp8_scale_from_amax(float amax) {
  const float a = amax < kFp8MinAmax ? kFp8MinAmax : amax;  // NaN stays NaN
  constexpr float kInverseMax = 1.f / kFp8E4m3Max;
  const float q0 = __fmul_rn(a, kInverseMax);
  const float scale = __fmaf_rn(__fmaf_rn(-q0, kFp8E4m3Max, a), kInverseMax, q0);
  return isfinite(a) ? scale : a;
}

__device__ __forceinline__ Fp8Divisor fp8_divisor(float scale, bool from_row_amax) {
  const double wide = fp8_wide_reciprocal(scale);
  return {scale, __double2float_rn(wide), wide, from_row_amax && isfinite(scale)};
}

// How a row's quotients y / scale are made: Markstein's step from RN(1 / scale) (the
// divisor's markstein), the product with the double reciprocal rounded to a float
// (otherwise), or either as the divisor says, tested an element.
enum class Fp8Rule { kMarkstein, kWide, kTested };

// y / scale by the row's divisor, unclamped (the saturating conversion clamps), by RULE. The
// step's remainder is taken as q0 * scale - y and subtracted: where it is zero (q0 exact,
// y = -0 among them) q0 + (-0) keeps q0's sign, which y - q0 * scale = +0 added would lose.
template <Fp8Rule RULE>
__device__ __forceinline__ float fp8_quotient(float y, const Fp8Divisor& d) {
  if (RULE == Fp8Rule::kMarkstein || (RULE == Fp8Rule::kTested && d.markstein)) {
    const float q0 = __fmul_rn(y, d.reciprocal);
    return __fmaf_rn(-__fmaf_rn(q0, d.scale, -y), d.reciprocal, q0);
  }
  return __double2float_rn(__dmul_rn(y, d.wide_reciprocal));
}

// Calls write(rule), a std::integral_constant of the rule for write to pass to store_fp8.
// SPLIT: the row's rule, one branch a row, where the test an element compiles to both rules'
// instructions, predicated, for every element written; write is compiled twice. Otherwise
// kTested, for kernels whose registers spill with two copies of their write.
template <bool SPLIT, typename Write>
__device__ __forceinline__ void with_quotient_rule(const Fp8Divisor& d, Write&& write) {
  if constexpr (SPLIT) {
    if (d.markstein) {
      write(std::integral_constant<Fp8Rule, Fp8Rule::kMarkstein>{});
    } else {
      write(std::integral_constant<Fp8Rule, Fp8Rule::kWide>{});
    }
  } else {
    write(std::integral_constant<Fp8Rule, Fp8Rule::kTested>{});
  }
}

// Stores VEC e4m3 bytes of f / scale at vector i of `row`, converted two at a time
// (saturating, as fp8_scaled's clamp) into 32-bit words in registers (an array of bytes went
// through local memory on sm_80, where the conversion is emulated), by the quotient rule
// RULE (with_quotient_rule's).
template <int VEC, Fp8Rule RULE>
__device__ __forceinline__ void store_fp8(uint8_t* row, int i, const float (&f)[VEC], const Fp8Divisor& d) {
  if constexpr (VEC == 1) {
    row[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(fp8_quotient<RULE>(f[0], d), __NV_SATFINITE, __NV_E4M3));
  } else {
    static_assert(VEC == 4 || VEC == 8, "fp8 stores: 1, 4 or 8 bytes");
    uint32_t words[VEC / 4];
#pragma unroll
    for (int w = 0; w < VEC / 4; ++w) {
      const auto pair = [&](int j) {
        const float2 q = make_float2(fp8_quotient<RULE>(f[j], d), fp8_quotient<RULE>(f[j + 1], d));
        return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3));
      };
      words[w] = pair(4 * w) | (pair(4 * w + 2) << 16);
    }
    if constexpr (VEC == 8) {
      reinterpret_cast<uint2*>(row)[i] = make_uint2(words[0], words[1]);
    } else {
      reinterpret_cast<uint32_t*>(row)[i] = words[0];
    }
  }
}
template <int VEC, Fp8Rule RULE>
__device__ __forceinline__ void store_fp8(Fp8E4m3* row, int i, const float (&f)[VEC], const Fp8Divisor& d) {
  store_fp8<VEC, RULE>(reinterpret_cast<uint8_t*>(row), i, f, d);
}

// The running amax of a row's values f: fp8_amax_step's result (NaN once any is NaN), on
// sm_80+ as one max.NaN an element instead of a compare, a NaN test and a select.
template <int VEC>
__device__ __forceinline__ float fp8_amax_of(float amax, const float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("max.NaN.f32 %0, %0, %1;" : "+f"(amax) : "f"(fabsf(f[j])));
#else
    amax = fp8_amax_step(amax, fabsf(f[j]));
#endif
  }
  return amax;
}

// A row's divisor: *static_scale, or a scale made from the row's running amax (each thread's
// share), reduced over the row's threads and stored at scales[row] by the thread that `writes`.
__device__ __forceinline__ Fp8Divisor row_fp8_divisor(float amax, int threads_per_row, float* scratch,
                                                      const float* static_scale, float* scales, int64_t row,
                                                      bool writes) {
  if (static_scale != nullptr) return fp8_divisor(*static_scale, false);
  const float scale = fp8_scale_from_amax(row_amax(amax, threads_per_row, scratch));
  if (writes) scales[row] = scale;
  return fp8_divisor(scale, true);
}

}  // namespace ltx

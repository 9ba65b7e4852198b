/* The FP8 kernels' division-free arithmetic (kernel_src/fp8_cuda.cuh) against IEEE division,
 * on the host with the same fp32 / fp64 operations (fmaf and fma round once, as the GPU's FFMA
 * and DFMA). Prints one line per check, "<name> <cases> <mismatches>"; exits 1 on a mismatch.
 *   scale:     RN(a / 448) by Markstein's step, every finite a >= 1e-12 (exhaustive);
 *   reciprocal: RN(1 / s) as the float of a double reciprocal from an approximation within
 *              2^-20 and three Newton steps, over the dynamic scales' range (sampled);
 *   dynamic:   RN(y / s) by Markstein's step from RN(1 / s), |y| <= the amax s was made from;
 *   static:    RN(y / s) as the float of y times that double reciprocal, any finite y and s.
 * Quotients below 2^-11 (which e4m3 rounds to zero) need only the same sign. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}
static float from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
static uint32_t bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}
static int same_e4m3_input(float q, float exact) {
  if (bits(q) == bits(exact)) return 1;
  return fabsf(q) < 0x1p-11f && fabsf(exact) < 0x1p-11f && signbit(q) == signbit(exact);
}

static float scale_from_amax(float a) {
  const float inverse_max = 1.f / 448.f;
  const float q0 = a * inverse_max;
  return fmaf(fmaf(-q0, 448.f, a), inverse_max, q0);
}
static double wide_reciprocal(float s) {
  const double d = s;
  /* an approximation within 2^-20, as rcp.approx.ftz.f64 */
  double r = (1.0 / d) * (1.0 + ((double)(next() % 2001) - 1000.0) * 0x1p-30);
  for (int k = 0; k < 3; ++k) r = fma(fma(-d, r, 1.0), r, r);
  return r;
}
static float markstein(float y, float s, float r) {
  const float q0 = y * r;
  return fmaf(-fmaf(q0, s, -y), r, q0);
}

static int report(const char* name, long cases, long bad) {
  printf("%s %ld %ld\n", name, cases, bad);
  return bad != 0;
}

int main(void) {
  int failed = 0;
  long cases = 0, bad = 0;
  for (uint32_t b = bits(1e-12f); b < 0x7f800000u; ++b, ++cases) {
    const float a = from_bits(b);
    bad += bits(scale_from_amax(a)) != bits(a / 448.f);
  }
  failed |= report("scale", cases, bad);

  cases = bad = 0;
  for (uint32_t b = bits(1e-12f / 448.f); b <= bits(3.4028235e38f / 448.f); b += 1 + next() % 256, ++cases) {
    const float s = from_bits(b);
    bad += bits((float)wide_reciprocal(s)) != bits(1.f / s);
  }
  failed |= report("reciprocal", cases, bad);

  cases = bad = 0;
  for (long it = 0; it < 400000; ++it) {
    float amax = fabsf(from_bits((uint32_t)next()));
    if (!isfinite(amax)) continue;
    if (amax < 1e-12f) amax = 1e-12f;
    const float s = scale_from_amax(amax), r = (float)wide_reciprocal(s);
    for (int k = 0; k < 64; ++k, ++cases) {
      float y;
      switch (next() % 4) {
        case 0: y = amax * ((float)(next() % 2000001) / 1e6f - 1.f); break;           /* spread */
        case 1: y = from_bits(bits(amax) - (uint32_t)(next() % (1u << 24))); break;  /* near amax */
        case 2: y = ldexpf((float)(next() % (1u << 24)), (int)(next() % 300) - 170); break;
        default: y = 0.f;
      }
      if (!(fabsf(y) <= amax)) y = amax;
      if (next() & 1) y = -y;
      bad += !same_e4m3_input(markstein(y, s, r), y / s);
    }
  }
  failed |= report("dynamic", cases, bad);

  cases = bad = 0;
  for (long it = 0; it < 20000000; ++it) {
    const float s = from_bits((uint32_t)next());
    float y = from_bits((uint32_t)next());
    if (it % 3 == 0) y = s * (float)(next() % 100000) / 1000.f;
    if (!isfinite(s) || !isfinite(y) || s == 0.f) continue;
    ++cases;
    bad += !same_e4m3_input((float)((double)y * wide_reciprocal(s)), y / s);
  }
  failed |= report("static", cases, bad);
  return failed;
}

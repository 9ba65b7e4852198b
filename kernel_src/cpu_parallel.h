// The CPU twins' row machinery: the targets a row pass is built for (LTX_ROW_PASS), and rows
// over torch's intra-op threads (parallel_rows).
//
// Rows over torch's intra-op threads. at::parallel_for cannot do it in
// this library: its OpenMP path is inline code behind _OPENMP, and the library is built
// without -fopenmp, so it would run every range on the calling thread. parallel_rows makes
// the call a `#pragma omp parallel` compiles to, into the OpenMP runtime torch loaded itself
// (libtorch_cpu needs libgomp.so.1), so the twins run on torch's threads, as many as
// torch.set_num_threads says. The runtime's symbols are weak: where torch has no OpenMP they
// are null, and the rows run on the calling thread.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

extern "C" {
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) __attribute__((weak));
int omp_get_thread_num() __attribute__((weak));
int omp_get_num_threads() __attribute__((weak));
}

// A row pass of a CPU twin is built for baseline x86-64 and for AVX2, and the loader picks
// the one the CPU runs (GCC's target_clones): the library still runs on any x86-64, and
// AVX2's wider vectors, without FMA, compute the same bits. What a row pass calls is inlined
// into it, and so built for its target too. Passes bound by their arithmetic (the exact
// GELU) also get an x86-64-v4 (AVX-512) clone, twice AVX2's elements a vector, with
// fp-contract=off keeping GCC from fusing its multiply-adds (C++ contracts by default): the
// same bits again.
#if defined(__x86_64__)
#define LTX_ROW_PASS __attribute__((target_clones("avx2", "default")))
#define LTX_ARITHMETIC_ROW_PASS \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), optimize("fp-contract=off")))
#else
#define LTX_ROW_PASS
#define LTX_ARITHMETIC_ROW_PASS
#endif

namespace ltx {

// f(first, last) over [begin, end) in one contiguous range per thread, split as
// at::parallel_for splits it: at most ceil((end - begin) / grain) threads, and none but the
// caller's for a range of one grain or less, or when the caller runs in a parallel region.
template <typename F>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (GOMP_parallel == nullptr || n <= grain || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  struct Range {
    const F& f;
    int64_t begin, end, grain;
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
    std::exception_ptr error;
  } range{f, begin, end, grain};
  GOMP_parallel(
      [](void* data) {
        Range& r = *static_cast<Range*>(data);
        const int64_t size = r.end - r.begin;
        const int64_t threads = std::min<int64_t>(omp_get_num_threads(), (size + r.grain - 1) / r.grain);
        const int64_t tid = omp_get_thread_num();
        const int64_t chunk = (size + threads - 1) / threads;
        const int64_t first = r.begin + tid * chunk;
        if (tid >= threads || first >= r.end) return;
        try {
          r.f(first, std::min(r.end, first + chunk));
        } catch (...) {  // an exception must not leave the parallel region
          if (!r.failed.test_and_set()) r.error = std::current_exception();
        }
      },
      &range, 0, 0);
  if (range.error) std::rethrow_exception(range.error);
}

}  // namespace ltx

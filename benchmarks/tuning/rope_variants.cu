// Candidate launches of RoPE beside the production one, built on rope_rotate.cuh (the
// kernels, helpers and launch rope.cu runs), as a torch op library:
//   torch.ops.rope_variants.run(q, k, cos, sin, q_out, k_out, variant, head_blocks)
// rotate-half: q and k are [B, H, S, D] (views), cos and sin [S, D] or [B, S, D] in q's
// dtype. Variant 0 is `launch` (what the package runs); 9 its kernel at a given
// head_blocks; the others run `variant_kernel`, a lean whole-groups kernel: aligned 8- or
// 16-byte units, head counts that are multiples of HEADS, every channel rotating, no
// pass-through.
//   torch.ops.rope_variants.run_interleaved(q, k, cos, sin, q_out, k_out, variant, unit_threads)
// interleaved: LTX-Video's [B, S, C] q and k, tables [B, S, C] (fp32 or q's dtype). Variant
// 0 is `launch`; 10 rope_pairs_kernel with a head's units over blocks of unit_threads
// threads; 11 rope_kernel at two heads a thread.
// Forward only; rope_variants.py builds and times them.
#include "rope_rotate.cuh"

#include <torch/library.h>

namespace ltx {
namespace rope_variants {

using namespace rope_cuda;

// HALF_TABLE reads only the tables' left half (Liger's assumption: the halves are equal),
// to price the bytes it saves; TOKENS tokens share a block.
template <typename T, int N, int HEADS, bool HALF_TABLE, int MAX_BLOCK, int MIN_BLOCKS, int TOKENS>
__global__ void __launch_bounds__(MAX_BLOCK, MIN_BLOCKS) variant_kernel(const RopeParams<T, T> p, int tokens) {
  const int rows_per_token = TOKENS == 1 ? blockDim.y : blockDim.y / TOKENS;
  const int slot = TOKENS == 1 ? 0 : threadIdx.y / rows_per_token;
  const int row = threadIdx.y - slot * rows_per_token;
  const uint32_t token = blockIdx.x * TOKENS + slot;
  if (TOKENS > 1 && token >= static_cast<uint32_t>(tokens)) return;
  const uint32_t b = p.seq.div(token);
  const uint32_t s = token - b * p.seq.divisor;
  const T* cos = p.cos + b * p.table_b + s * p.table_s;
  const T* sin = p.sin + b * p.table_b + s * p.table_s;
  const TokenRows<T> rows(p.q, p.k, b, s);
  const int heads = static_cast<int>(p.q.heads + p.k.heads);
  const int second = p.rotary_dim / 2;
  const int i = threadIdx.x * N;
  float c1[N], s1[N], c2[N], s2[N];
  const int first = (blockIdx.y * rows_per_token + row) * HEADS;
  for (int h0 = first; h0 < heads; h0 += gridDim.y * rows_per_token * HEADS) {
    const auto group = rows.group(h0);
    Vec<T, N> x1[HEADS], x2[HEADS];
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
      x1[j] = load_n<T, N, true>(group.in + j * group.in_h + i);
      x2[j] = load_n<T, N, true>(group.in + j * group.in_h + i + second);
    }
    if (h0 == first) {
      to_floats(load_n<T, N, true>(cos + i), c1);
      to_floats(load_n<T, N, true>(sin + i), s1);
      to_floats(load_n<T, N, true>(cos + (HALF_TABLE ? i : i + second)), c2);
      to_floats(load_n<T, N, true>(sin + (HALF_TABLE ? i : i + second)), s2);
    }
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
      float a[N], o[N], r1[N], r2[N];
      to_floats(x1[j], a);
      to_floats(x2[j], o);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        r1[e] = a[e] * c1[e] - o[e] * s1[e];
        r2[e] = o[e] * c2[e] + a[e] * s2[e];
      }
      T* out = group.out + j * group.out_h;
      store_n<T, N, true>(out + i, from_floats<T>(r1));
      store_n<T, N, true>(out + i + second, from_floats<T>(r2));
    }
  }
}

template <typename T, int N, int HEADS, bool HALF_TABLE, int MAX_BLOCK, int MIN_BLOCKS, int TOKENS = 1>
void launch_variant(const RopeArgs& a, cudaStream_t stream, int head_blocks) {
  const int tx = static_cast<int>(a.rotary_dim / 2 / N);
  const int64_t heads = a.q.heads + a.k.heads;
  const int rows = static_cast<int>((heads / HEADS + head_blocks - 1) / head_blocks);
  const int tokens = static_cast<int>(a.batch * a.seq);
  const bool takes = a.q.heads % HEADS == 0 && a.k.heads % HEADS == 0 && a.rotary_dim == a.head_dim &&
                     tx * rows * TOKENS <= MAX_BLOCK && vectorizable<T, T, N>(a);
  TORCH_CHECK(takes, "rope_variants: this variant does not take these shapes");
  const RopeParams<T, T> p = params_of<T, T>(a);  // forward only (rope_apply's inverse false)
  const dim3 grid((tokens + TOKENS - 1) / TOKENS, head_blocks);
  variant_kernel<T, N, HEADS, HALF_TABLE, MAX_BLOCK, MIN_BLOCKS, TOKENS>
      <<<grid, dim3(tx, rows * TOKENS), 0, stream>>>(p, tokens);
  check_launch();
}

// Variant numbers are what rope_variants.py names; units of H = 8 bytes, F = 16 bytes.
template <typename T>
void run_variant(const RopeArgs& a, cudaStream_t stream, int64_t variant, int head_blocks) {
  constexpr int H = kVec16<T> / 2;
  constexpr int F = kVec16<T>;
  switch (variant) {
    case 0: return launch<T, T, false>(a, stream);
    case 1: return launch_variant<T, H, 4, false, 192, 6>(a, stream, head_blocks);
    case 2: return launch_variant<T, H, 4, true, 192, 6>(a, stream, head_blocks);
    case 3: return launch_variant<T, H, 2, false, 320, 4>(a, stream, head_blocks);
    case 4: return launch_variant<T, H, 2, false, 320, 3>(a, stream, head_blocks);
    case 5: return launch_variant<T, H, 4, false, 320, 3, 2>(a, stream, head_blocks);
    case 6: return launch_variant<T, H, 1, false, 512, 2>(a, stream, head_blocks);
    case 7: return launch_variant<T, F, 1, false, 512, 2>(a, stream, head_blocks);
    case 8: return launch_variant<T, F, 2, false, 256, 3>(a, stream, head_blocks);
    case 9:  // production's kernel and units, a token's heads over head_blocks blocks
      TORCH_CHECK((vectorizable<T, T, H>(a)), "rope_variants: 8-byte aligned rows only");
      if (a.q.heads % 2 == 0 && a.k.heads % 2 == 0) return launch_with<T, T, false, H, 2, true>(a, stream, head_blocks);
      return launch_with<T, T, false, H, 2>(a, stream, head_blocks);
    default: TORCH_CHECK(false, "rope_variants: no variant ", variant);
  }
}

template <typename T, typename C>
void run_interleaved_variant(const RopeArgs& a, cudaStream_t stream, int64_t variant, int unit_threads) {
  constexpr int V = kVec16<T>;
  switch (variant) {
    case 0: return launch<T, C, true>(a, stream);
    case 10:
      TORCH_CHECK((unit_threads > 0 && unit_threads <= kUnitThreads && vectorizable<T, C, V>(a) &&
                   pairs_rope<V>(a, unit_threads)),
                  "rope_variants: the pairs kernel does not take these shapes");
      return launch_pairs<T, C, V>(a, stream, unit_threads);
    case 11:
      TORCH_CHECK((vectorizable<T, C, V>(a)), "rope_variants: 16-byte aligned rows only");
      return launch_with<T, C, true, V, 2>(a, stream);
    default: TORCH_CHECK(false, "rope_variants: no interleaved variant ", variant);
  }
}

// rope_apply (rope.h) checks and lays out the arguments as the package's op does, then
// hands them here with the variant the call asked for (`blocks`: head_blocks, or the
// interleaved variants' unit_threads).
struct VariantBackend {
  static constexpr c10::DeviceType device = c10::kCUDA;
  static inline int64_t variant = 0;
  static inline int blocks = 1;
  static void run(const RopeArgs& a) {
    TORCH_CHECK(a.interleaved || !a.table_fp32, "rope_variants: rotate-half takes tables in q's dtype");
    const c10::cuda::CUDAGuard guard(a.device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device.index());
    LTX_DISPATCH_FLOAT_TYPES(a.dtype, "rope_variants", [&] {
      using T = scalar_t;
      if (!a.interleaved) return run_variant<T>(a, stream, variant, blocks);
      if (a.table_fp32) return run_interleaved_variant<T, float>(a, stream, variant, blocks);
      run_interleaved_variant<T, T>(a, stream, variant, blocks);
    });
  }
};

void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, at::Tensor q_out,
         at::Tensor k_out, int64_t variant, int64_t head_blocks) {
  VariantBackend::variant = variant;
  VariantBackend::blocks = static_cast<int>(head_blocks);
  rope_apply<VariantBackend>(q_out, k_out, q, k, cos, sin, /*interleaved=*/false, /*sequence_dim=*/2,
                             /*inverse=*/false);
}

void run_interleaved(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor q_out, at::Tensor k_out, int64_t variant, int64_t unit_threads) {
  VariantBackend::variant = variant;
  VariantBackend::blocks = static_cast<int>(unit_threads);
  rope_apply<VariantBackend>(q_out, k_out, q, k, cos, sin, /*interleaved=*/true, /*sequence_dim=*/1,
                             /*inverse=*/false);
}

}  // namespace rope_variants
}  // namespace ltx

TORCH_LIBRARY(rope_variants, m) {
  m.def("run(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor(a!) q_out, Tensor(b!) k_out, int variant, "
        "int head_blocks) -> ()");
  m.def("run_interleaved(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor(a!) q_out, Tensor(b!) k_out, "
        "int variant, int unit_threads) -> ()");
}
TORCH_LIBRARY_IMPL(rope_variants, CUDA, m) {
  m.impl("run", &ltx::rope_variants::run);
  m.impl("run_interleaved", &ltx::rope_variants::run_interleaved);
}

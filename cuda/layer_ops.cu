// layer_ops.cu -- the small per-layer operations of the decoder (quantzoo/model/llm.py) fused into
// four operations (five kernels: silu_mul_q8_1 is silu_mul with a Q8_1 output too), so that a
// decode step is matmuls plus a handful of launches per layer instead of ~25 torch kernels
// (bench/notes-runner.md: those cost as much GPU time as the weights did).
//
// Each kernel computes what the torch / HF code computes, with the same fp16 roundings, in fp32
// in between (fp16 x fp16 products are exact in fp32, so "round the fp32 result once" is what
// torch's fp16 arithmetic does too):
//
//   add_rms_norm   h += delta (in place, fp16 add);   out = fp16(w * fp16(h * r)),
//                  r = rsqrt(mean(h^2) + eps) in fp32.  delta may be absent (first layer).
//                  Q > 0: out also in Q8_1 (q8_1.cuh; Q = 1 interleaved, 2 split layout), the
//                  bytes quantize_q8_1 would make of out -- the input of a GGUF matmul that
//                  then skips its own quantize launch (a decode step's ~1.4 us per matmul).
//   qk_rope_store  per token t and head of the fused qkv row [q heads | k heads | v heads]:
//                  q, k: optional per-head RMSNorm (Qwen3's q_norm / k_norm, the same two
//                  roundings), then rotate-half RoPE at position pos[t]:
//                      out_i = fp16( fp16(x_i cos_i) + fp16(x_{i+-hd/2} sin'_i) ),
//                  sin' = (-sin, sin) the signed table (llm.rope_tables), i.e. HF's
//                  x*cos + rotate_half(x)*sin. q goes to q_out (T, H, hd); k, and v unchanged,
//                  go straight into this layer's KV cache rows pos[t] (KV, S, hd) -- no
//                  separate index_copy, transpose or slicing kernels.
//   silu_mul       gu = [gate | up] (T, 2F) -> fp16( fp16(silu(gate)) * up ), silu in fp32
//                  (swiglu.cuh; the wgmma kernels' fused gate/up epilogue computes the same);
//                  silu_mul_q8_1 the same values, also in Q8_1 (as add_rms_norm's Q).
//   attn_decode    one query token (T = 1) against cache rows 0..pos: softmax(q k^T / sqrt(hd)) v
//                  in fp32, split over the cache ("flash-decoding"): grid (splits, KV heads),
//                  each CTA a run of positions for the G query heads that share a KV head
//                  (every K/V row is loaded once for G heads: grouped-query attention without
//                  repeating the cache), online softmax in base 2; the last CTA of each KV
//                  head merges the splits' (max, sum, unnormalised output) and writes fp16.
//                  A context of up to 128 positions (layer_ops::SINGLE_RUN) is one run per KV
//                  head that writes its output itself: no partials, no merge.
//                  The grid is fixed by the cache size S (and capped near two CTAs per SM:
//                  layer_ops.DecodeWork), CTAs past pos exit at once, and pos is read from device
//                  memory, so one CUDA graph serves every decode position. Each warp streams its
//                  rows through a cp.async ring in shared memory (RING stages). Long contexts
//                  made this kernel matter: at 16k tokens it had run at ~0.5 TB/s, 164 us a
//                  Qwen3-8B layer (its merge, fixed now, and one group of rows in flight a warp);
//                  32 us now (bench/NOTES.md, session 30).
//
// Layouts: row-major fp16, contiguous. head_dim hd = 32*E (E = 2: hd 64, E = 4: hd 128), one warp
// per head. In qk_rope_store lane l holds elements l + 32e, so element i and its RoPE partner
// i + hd/2 sit in the same lane (e and e + E/2) -- the rotation needs no shuffle; attn_decode's
// lanes hold E consecutive elements instead (one vector load per cache row).
//
// The bodies live in layer_ops.cuh as device functions, so that the persistent decode kernel
// (decode_persistent.cu) runs the very same arithmetic inside its phases; the kernels here only
// map a launch's blocks and threads onto them.
//
// (Tried and removed: extra blocks in these kernels that prefetched the next matmul's weight into
// L2 while DRAM idles. In isolation a GEMV started ~1 us sooner; the decode step got 0-10 %
// slower in every format: bench/NOTES.md, session 20.)
#include "layer_ops.cuh"

namespace layer_ops {
struct BlockSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
}  // namespace layer_ops

// grid (T), block ceil(D / (8 V)) threads rounded up to a warp (layer_ops::rms_norm_row).
template <bool ADD, int V, int Q>
__global__ void add_rms_norm(__half* __restrict__ h, const __half* __restrict__ delta,
                             const __half* __restrict__ w, __half* __restrict__ out,
                             unsigned char* __restrict__ q8, int D, float eps) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  __shared__ float red[32];
  const long long row = (long long)blockIdx.x * D;
  layer_ops::rms_norm_row<ADD, V, Q>(h + row, ADD ? delta + row : delta, w, out + row, q8,
                                     (long long)blockIdx.x * (D / 32), (long long)gridDim.x * (D / 32), D, eps,
                                     threadIdx.x, blockDim.x, red, layer_ops::BlockSync());
}

// grid (ceil(T * (H + 2 KV) / 4)), block 128: one warp per (token, head).
template <int E, bool NORM>
__global__ void qk_rope_store(const __half* __restrict__ qkv, const __half* __restrict__ norm_w,
                              const __half* __restrict__ cos_t, const __half* __restrict__ sin_t,
                              const long long* __restrict__ pos, __half* __restrict__ q_out,
                              __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                              int T, int H, int KV, int S, float eps) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  const int item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= T * (H + 2 * KV)) return;  // whole warps leave together
  layer_ops::rope_item<E, NORM>(item, threadIdx.x % 32, qkv, norm_w, cos_t, sin_t, pos, q_out, k_cache, v_cache,
                                H, KV, S, eps);
}

// grid-stride over T * F/2 pairs; F even.
__global__ void silu_mul(const __half* __restrict__ gu, __half* __restrict__ out, long long T, int F) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  const long long pairs = T * (F / 2);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs;
       i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / (F / 2), f2 = i % (F / 2);
    const float2 g = __half22float2(reinterpret_cast<const __half2*>(gu + t * 2 * F)[f2]);
    const float2 u = __half22float2(reinterpret_cast<const __half2*>(gu + t * 2 * F + F)[f2]);
    reinterpret_cast<__half2*>(out + t * F)[f2] = __floats2half2_rn(swiglu(g.x, u.x), swiglu(g.y, u.y));
  }
}

// silu_mul with Q8_1 output as well (F % 32 == 0): one warp per 32-value block, lane j computing
// value j with silu_mul's arithmetic; grid.x * (blockDim.x / 32) >= T * F / 32 blocks.
template <bool SPLIT>
__global__ void silu_mul_q8_1(const __half* __restrict__ gu, __half* __restrict__ out,
                              unsigned char* __restrict__ q8, long long T, int F) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  const long long blk = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const long long n_blocks = T * (F / 32);
  if (blk >= n_blocks) return;  // whole warps exit together
  const int lane = threadIdx.x % 32;
  const long long t = blk / (F / 32);
  const int f = int(blk % (F / 32)) * 32 + lane;
  const float g = __half2float(gu[t * 2 * F + f]), u = __half2float(gu[t * 2 * F + F + f]);
  const __half o = __float2half_rn(swiglu(g, u));
  out[t * F + f] = o;
  q8_1_store<SPLIT>(__half2float(o), q8, blk, n_blocks, lane);
}

// Decode attention: grid (n_split, KV), block 128: CTA (s, kv) is run s of KV head kv for all G query
// heads (layer_ops::attn_run), then the runs merge (attn_merge).
template <int E, int G, int RING>
__global__ void __launch_bounds__(128) attn_decode(const __half* __restrict__ q, const __half* __restrict__ k_cache,
                            const __half* __restrict__ v_cache, const long long* __restrict__ pos,
                            float* __restrict__ part_o, float* __restrict__ part_ml,
                            int* __restrict__ count, __half* __restrict__ out,
                            int S, int n_split, float scale_log2) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace layer_ops;
  // attn_run's and attn_merge's scratch, overlaid by attn_run's ring (RING stages of 8 rows a warp)
  constexpr int SM = 4 * G * (32 * E + 2), RING_FLOATS = 4 * RING * 8 * 32 * E / 2;
  __shared__ __align__(16) float sm[SM > RING_FLOATS ? SM : RING_FLOATS];
  __shared__ int ticket;
  constexpr int OUTS = (G * E + 3) / 4;   // attn_merge: outputs a thread takes, of G * 32 E over 128
  static_assert(OUTS * 128 >= G * 32 * E, "attn_merge needs OUTS * nthr >= G * HD");
  const AttnRuns ru(pos, n_split);
  if ((int)blockIdx.x >= ru.n) return;
  attn_run<E, G, false, BlockSync, RING>(ru, blockIdx.x, blockIdx.y, G, 0, threadIdx.x, q, k_cache, v_cache, part_o,
                                         part_ml, out, sm, S, n_split, scale_log2, BlockSync(),
                                         reinterpret_cast<__half*>(sm));
  if (ru.n > 1)
    attn_merge<E, OUTS>(ru, blockIdx.y, G, threadIdx.x, 128, part_o, part_ml, count, out, n_split, &ticket, sm,
                        BlockSync());
}

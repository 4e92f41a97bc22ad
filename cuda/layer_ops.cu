// layer_ops.cu -- the small per-layer operations of the decoder (quantzoo/model/llm.py) fused into
// four kernels, so that a decode step is matmuls plus a handful of launches per layer instead of
// ~25 torch kernels (bench/notes-runner.md: those cost as much GPU time as the weights did).
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
//                  The grid is fixed by the cache size S, CTAs past pos exit at once, and pos is
//                  read from device memory, so one CUDA graph serves every decode position.
//
// Layouts: row-major fp16, contiguous. head_dim hd = 32*E (E = 2: hd 64, E = 4: hd 128), one warp
// per head. In qk_rope_store lane l holds elements l + 32e, so element i and its RoPE partner
// i + hd/2 sit in the same lane (e and e + E/2) -- the rotation needs no shuffle; attn_decode's
// lanes hold E consecutive elements instead (one vector load per cache row).
//
// (Tried and removed: extra blocks in these kernels that prefetched the next matmul's weight into
// L2 while DRAM idles. In isolation a GEMV started ~1 us sooner; the decode step got 0-10 %
// slower in every format: bench/NOTES.md, session 20.)
#include <cuda_fp16.h>
#include "pdl.cuh"
#include "q8_1.cuh"
#include "swiglu.cuh"
#include "warp_sum.cuh"

namespace layer_ops {

__device__ __forceinline__ float block_sum(float v, float* red) {  // red: 32 floats of smem
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.0f;
  v = warp_sum(v);
  return v;
}

__device__ __forceinline__ float r16(float v) { return __half2float(__float2half_rn(v)); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }  // NVRTC: no INFINITY

}  // namespace layer_ops

// grid (T), block ceil(D / (8 V)) threads rounded up to a warp; D % 8 == 0. Thread i holds the
// 16-byte chunks i, i + blockDim, ... (V of them) of the row in registers: every load of the
// row is issued before the first use, and the second pass re-reads nothing (a loop that loaded,
// added and stored one chunk at a time paid one memory latency per chunk: 4.6 us per call).
// Q > 0 (D % 32 == 0): each output chunk is also quantized from registers by q8_1_store8, whose
// lane groups are the 4 threads holding one 32-value block (blockDim % 4 == 0; a first version
// that re-read the written row with one warp per block took 4.1 us a call at T = 1 instead of
// 1.9, a single CTA quantizing 128 blocks in 8 rounds). q8 holds the T * D / 32 blocks.
template <bool ADD, int V, int Q>
__global__ void add_rms_norm(__half* __restrict__ h, const __half* __restrict__ delta,
                             const __half* __restrict__ w, __half* __restrict__ out,
                             unsigned char* __restrict__ q8, int D, float eps) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace layer_ops;
  __shared__ float red[32];
  const long long row = (long long)blockIdx.x * D;
  const int chunks = D / 8;
  uint4* h8 = reinterpret_cast<uint4*>(h + row);
  const uint4* d8 = reinterpret_cast<const uint4*>(delta + (ADD ? row : 0));
  uint4 hv[V], dv[V], wv[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c < chunks) {
      hv[j] = h8[c];
      if (ADD) dv[j] = d8[c];
      wv[j] = reinterpret_cast<const uint4*>(w)[c];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c >= chunks) continue;
    __half2* x = reinterpret_cast<__half2*>(&hv[j]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 v = __half22float2(x[i]);
      if (ADD) {
        const float2 d = __half22float2(reinterpret_cast<const __half2*>(&dv[j])[i]);
        x[i] = __floats2half2_rn(v.x + d.x, v.y + d.y);
        v = __half22float2(x[i]);
      }
      ss += v.x * v.x + v.y * v.y;
    }
    if (ADD) h8[c] = hv[j];
  }
  const float r = rsqrtf(block_sum(ss, red) / float(D) + eps);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    const bool ok = c < chunks;
    if (!Q && !ok) continue;
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (ok) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 v = __half22float2(reinterpret_cast<const __half2*>(&hv[j])[i]);
        const float2 s = __half22float2(reinterpret_cast<const __half2*>(&wv[j])[i]);
        reinterpret_cast<__half2*>(&o)[i] = __floats2half2_rn(s.x * r16(v.x * r), s.y * r16(v.y * r));
      }
      reinterpret_cast<uint4*>(out + row)[c] = o;
    }
    if (Q)   // chunks 4b..4b+3 (Q8_1 block b of the row) sit in lanes 4q..4q+3 of one warp
      q8_1_store8<Q == 2>(o, ok, q8, (long long)blockIdx.x * (D / 32) + c / 4, (long long)gridDim.x * (D / 32), c & 3);
  }
}

// grid (ceil(T * (H + 2 KV) / 4)), block 128: one warp per (token, head).
template <int E, bool NORM>
__global__ void qk_rope_store(const __half* __restrict__ qkv, const __half* __restrict__ norm_w,
                              const __half* __restrict__ cos_t, const __half* __restrict__ sin_t,
                              const long long* __restrict__ pos, __half* __restrict__ q_out,
                              __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                              int T, int H, int KV, int S, float eps) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace layer_ops;
  constexpr int HD = 32 * E;
  const int heads = H + 2 * KV;
  const int item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= T * heads) return;  // whole warps leave together
  const int t = item / heads, head = item % heads, lane = threadIdx.x % 32;
  const __half* src = qkv + (long long)item * HD;  // row t, head `head` of (T, heads*HD)
  const long long p = pos[t];
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = __half2float(src[lane + 32 * e]);
  if (head >= H + KV) {  // v: copied into the cache as it is
    __half* dst = v_cache + ((long long)(head - H - KV) * S + p) * HD;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[lane + 32 * e] = src[lane + 32 * e];
    return;
  }
  if (NORM) {
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss += x[e] * x[e];
    const float r = rsqrtf(warp_sum(ss) / float(HD) + eps);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = r16(__half2float(norm_w[head * HD + lane + 32 * e]) * r16(x[e] * r));
  }
  __half* dst = head < H ? q_out + ((long long)t * H + head) * HD
                         : k_cache + ((long long)(head - H) * S + p) * HD;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = lane + 32 * e;
    const float c = __half2float(cos_t[p * HD + i]), s = __half2float(sin_t[p * HD + i]);
    dst[i] = __float2half_rn(r16(x[e] * c) + r16(x[(e + E / 2) % E] * s));
  }
}

// grid-stride over T * F/2 pairs; F even.
__global__ void silu_mul(const __half* __restrict__ gu, __half* __restrict__ out, long long T, int F) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace layer_ops;
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
  using namespace layer_ops;
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

// Decode attention. grid (n_split, KV), block 128 (4 warps). The cache rows 0..pos[0] are cut
// into n runs of `chunk` positions (chunk a multiple of 16, at least MIN_CHUNK, so that short
// contexts take one CTA per KV head and need no merge; n <= n_split), decided here from pos so
// that one captured graph serves every position; CTAs past n exit at once. Warp w of CTA s
// takes groups of 4 consecutive positions of its run; the next group's 8 row loads are issued
// before the current group is computed, and the 4 x G dot products are reduced independently so
// their shuffles pipeline. Lane l holds dims E*l .. E*l+E-1 (one 4- or 8-byte load per row).
// Scores are in base 2 (q pre-scaled by log2(e)/sqrt(hd)). With n > 1 each CTA leaves (max,
// sum, unnormalised output) per query head in part_ml / part_o (KV*G, n_split, ...), and the
// last CTA of a KV head to finish (a ticket from count[kv], which it resets) merges them.
constexpr int MIN_CHUNK = 64;

template <int E>
__device__ __forceinline__ void load_row(float* dst, const __half* src) {
  if constexpr (E == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    dst[0] = a.x; dst[1] = a.y; dst[2] = b.x; dst[3] = b.y;
  } else {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(src));
    dst[0] = a.x; dst[1] = a.y;
  }
}

template <int E, int G>
__global__ void __launch_bounds__(128) attn_decode(const __half* __restrict__ q, const __half* __restrict__ k_cache,
                            const __half* __restrict__ v_cache, const long long* __restrict__ pos,
                            float* __restrict__ part_o, float* __restrict__ part_ml,
                            int* __restrict__ count, __half* __restrict__ out,
                            int S, int n_split, float scale_log2) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using layer_ops::neg_inf;
  constexpr int HD = 32 * E, W = 4;
  const int split = blockIdx.x, kv = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int npos = (int)pos[0] + 1;
  int n = min(n_split, (npos + MIN_CHUNK - 1) / MIN_CHUNK);
  const int chunk = ((npos + n - 1) / n + 15) / 16 * 16;
  n = (npos + chunk - 1) / chunk;
  if (split >= n) return;
  const int p0 = split * chunk, p1 = min(p0 + chunk, npos);
  float qv[G][E], acc[G][E], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf();
    l[g] = 0.0f;
    load_row<E>(qv[g], q + (kv * G + g) * HD + E * lane);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qv[g][e] *= scale_log2;
      acc[g][e] = 0.0f;
    }
  }
  const __half* kb = k_cache + (long long)kv * S * HD + E * lane;
  const __half* vb = v_cache + (long long)kv * S * HD + E * lane;
  float kk[4][E], vv[4][E];
  auto fetch = [&](int pb) {   // rows past p1 are loaded (valid memory) and masked below
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long p = min(pb + j, p1 - 1);
      load_row<E>(kk[j], kb + p * HD);
      load_row<E>(vv[j], vb + p * HD);
    }
  };
  int pb = p0 + warp * 4;
  if (pb < p1) fetch(pb);
  for (; pb < p1; pb += W * 4) {   // pb itself is always a valid row
    float sc[4][G], nv[4][E];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) d += qv[g][e] * kk[j][e];
        sc[j][g] = d;
      }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < E; ++e) nv[j][e] = vv[j][e];
    if (pb + W * 4 < p1) fetch(pb + W * 4);   // next group in flight while this one finishes
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int g = 0; g < G; ++g) sc[j][g] += __shfl_xor_sync(0xffffffffu, sc[j][g], off);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = m[g];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (pb + j >= p1) sc[j][g] = neg_inf();
        mx = fmaxf(mx, sc[j][g]);
      }
      const float corr = exp2f(m[g] - mx);   // m = -inf on the first group: corr = 0
      float pw[4];
      l[g] *= corr;
#pragma unroll
      for (int j = 0; j < 4; ++j) { pw[j] = exp2f(sc[j][g] - mx); l[g] += pw[j]; }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float a = acc[g][e] * corr;
#pragma unroll
        for (int j = 0; j < 4; ++j) a += pw[j] * nv[j][e];
        acc[g][e] = a;
      }
      m[g] = mx;
    }
  }
  // merge the 4 warps through shared memory
  __shared__ float sm_m[W][G], sm_l[W][G], sm_o[W][G][HD];
  __shared__ int ticket;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_o[warp][g][E * lane + e] = acc[g][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
    const int g = idx / HD, d = idx % HD;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float o = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) {   // a warp that saw no position has m = -inf: weight 0
      const float f = exp2f(sm_m[w][g] - mx);
      o += sm_o[w][g][d] * f;
      sum += sm_l[w][g] * f;
    }
    if (n == 1) {   // the whole context was this CTA's: done
      out[(kv * G + g) * HD + d] = __float2half_rn(o / sum);
      continue;
    }
    const long long slot = (long long)(kv * G + g) * n_split + split;
    part_o[slot * HD + d] = o;
    if (d == 0) { part_ml[slot * 2] = mx; part_ml[slot * 2 + 1] = sum; }
  }
  if (n == 1) return;
  // the last of this KV head's n CTAs merges the runs
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(&count[kv], 1);
  __syncthreads();
  if (ticket != n - 1) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
    const int g = idx / HD, d = idx % HD;
    const long long base = (long long)(kv * G + g) * n_split;
    float mx = neg_inf();
    for (int sp = 0; sp < n; ++sp) mx = fmaxf(mx, __ldcg(part_ml + (base + sp) * 2));
    float o = 0.0f, sum = 0.0f;
    for (int sp = 0; sp < n; ++sp) {
      const float f = exp2f(__ldcg(part_ml + (base + sp) * 2) - mx);
      sum += __ldcg(part_ml + (base + sp) * 2 + 1) * f;
      o += __ldcg(part_o + (base + sp) * HD + d) * f;
    }
    out[(kv * G + g) * HD + d] = __float2half_rn(o / sum);
  }
  if (threadIdx.x == 0) count[kv] = 0;   // ready for the next call (or graph replay)
}

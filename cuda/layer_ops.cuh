// layer_ops.cuh -- the bodies of the decoder's small per-layer ops (the math is in layer_ops.cu's
// header), as device functions over an explicit thread index and barrier, so that two kinds of
// kernel run the very same arithmetic:
//   * layer_ops.cu: one launch per op, a CTA (or warp) per item, the barrier __syncthreads;
//   * decode_persistent.cu: one launch per decode step, each op a phase run by some of the
//     resident CTAs' consumer warps, the barrier a named barrier over those warps only.
// Data that a persistent kernel writes in one phase and reads in a later one (h, the qkv row,
// q) is read with ld.global.cg (L2): the non-coherent read-only path may keep a line from an
// earlier phase. It costs the one-op kernels nothing (their inputs come from L2 anyway).
#pragma once
#include <cuda_fp16.h>
#include "cp_async.cuh"
#include "pdl.cuh"
#include "q8_1.cuh"
#include "swiglu.cuh"
#include "warp_sum.cuh"

namespace layer_ops {

// The sum of v over threads 0 .. nthr - 1 (nthr % 32 == 0; threads past nthr pass 0 and take
// part in the barrier), in every one of them. red: 32 floats of shared memory.
template <class Sync>
__device__ __forceinline__ float block_sum(float v, float* red, int tid, int nthr, const Sync& sync) {
  const int lane = tid % 32, warp = tid / 32, nw = nthr / 32;
  v = warp_sum(v);
  if (lane == 0 && warp < nw) red[warp] = v;
  sync();
  v = lane < nw ? red[lane] : 0.0f;
  v = warp_sum(v);
  return v;
}

__device__ __forceinline__ float r16(float v) { return __half2float(__float2half_rn(v)); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }  // NVRTC: no INFINITY

// One row of add_rms_norm: threads tid < nthr (nthr = ceil(D / (8 V)) rounded up to a warp; the
// rest only meet the barrier). Thread i holds the 16-byte chunks i, i + nthr, ... (V of them) of
// the row in registers: every load of the row is issued before the first use, and the second
// pass re-reads nothing (a loop that loaded, added and stored one chunk at a time paid one
// memory latency per chunk: 4.6 us per call). out may be null (Q8_1 only). Q > 0 (D % 32 == 0):
// each output chunk is also quantized from registers by q8_1_store8, whose lane groups are the
// 4 threads holding one 32-value block (a first version that re-read the written row with one
// warp per block took 4.1 us a call at T = 1 instead of 1.9, a single CTA quantizing 128 blocks
// in 8 rounds); the row's blocks are blk0 .. of n_blocks at q8.
template <bool ADD, int V, int Q, class Sync>
__device__ __forceinline__ void rms_norm_row(__half* h, const __half* delta, const __half* __restrict__ w,
                                             __half* out, unsigned char* q8, long long blk0, long long n_blocks,
                                             int D, float eps, int tid, int nthr, float* red, const Sync& sync) {
  const int chunks = D / 8;
  uint4* h8 = reinterpret_cast<uint4*>(h);
  const uint4* d8 = reinterpret_cast<const uint4*>(delta);
  const bool mine = tid < nthr;
  uint4 hv[V], dv[V], wv[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = tid + j * nthr;
    if (mine && c < chunks) {
      hv[j] = __ldcg(h8 + c);
      if (ADD) dv[j] = __ldcg(d8 + c);
      wv[j] = __ldg(reinterpret_cast<const uint4*>(w) + c);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = tid + j * nthr;
    if (!mine || c >= chunks) continue;
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
  const float r = rsqrtf(block_sum(ss, red, tid, nthr, sync) / float(D) + eps);
  if (!mine) return;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = tid + j * nthr;
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
      if (out) reinterpret_cast<uint4*>(out)[c] = o;
    }
    if (Q)   // chunks 4b..4b+3 (Q8_1 block b of the row) sit in lanes 4q..4q+3 of one warp
      q8_1_store8<Q == 2>(o, ok, q8, blk0 + c / 4, n_blocks, c & 3);
  }
}

// One (token, head) item of qk_rope_store, run by one warp (lane = its lane): item = t * (H +
// 2 KV) + head of the fused qkv rows [q heads | k heads | v heads].
template <int E, bool NORM>
__device__ __forceinline__ void rope_item(int item, int lane, const __half* qkv, const __half* __restrict__ norm_w,
                                          const __half* __restrict__ cos_t, const __half* __restrict__ sin_t,
                                          const long long* __restrict__ pos, __half* q_out, __half* k_cache,
                                          __half* v_cache, int H, int KV, int S, float eps) {
  constexpr int HD = 32 * E;
  const int heads = H + 2 * KV;
  const int t = item / heads, head = item % heads;
  const __half* src = qkv + (long long)item * HD;  // row t, head `head` of (T, heads*HD)
  const long long p = pos[t];
  __half xh[E];
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    xh[e] = __ldcg(src + lane + 32 * e);
    x[e] = __half2float(xh[e]);
  }
  if (head >= H + KV) {  // v: copied into the cache as it is
    __half* dst = v_cache + ((long long)(head - H - KV) * S + p) * HD;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[lane + 32 * e] = xh[e];
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

// Decode attention (attn_run, attn_merge): 4 warps take run `split` of the cache rows 0..pos[0]
// for query heads of KV head kv. The rows are cut into n runs of `chunk` positions (a multiple
// of 16), decided from pos on the device (AttnRuns) so that one captured graph serves every
// position: a context of up to SINGLE_RUN positions is one run (one CTA per KV head, no merge),
// a longer one ceil(npos / MIN_CHUNK) runs, at most n_split. Warp w takes groups of 4
// consecutive positions of its run, with later groups' rows in flight while one is computed
// (attn_run's RING), and the 4 x G dot products are reduced independently so their shuffles
// pipeline. Lane l holds dims E*l .. E*l+E-1 (one 4- or 8-byte load per row). Scores are in
// base 2 (q pre-scaled by log2(e)/sqrt(hd)). With n > 1 each CTA leaves (max, sum,
// unnormalised output) per query head in part_ml / part_o (KV*G, n_split, ...), and the last
// run of a KV head to finish (a ticket from count[kv], which it resets) merges them.
constexpr int MIN_CHUNK = 64;
// Up to 128 positions one run of 8 groups a warp beats two or three shorter runs and their merge
// (fence, ticket, the partials read back): Qwen3-8B-shaped q4_0 decode graph, 128 steps from
// position 16, 443.7 -> 448.5 tok/s; from 100, 432.3 -> 434.1; no change from 160, 300, 1024.
// Single runs up to 192 / 256 positions lost from 160 (428.4 / 423.4 against 429.1), and runs
// of at least 128 positions lost at 1024 (404 against 414): bench/NOTES.md, session 32.
constexpr int SINGLE_RUN = 128;

template <int E, bool CG = false>
__device__ __forceinline__ void load_row(float* dst, const __half* src) {
  if constexpr (E == 4) {
    const uint2 u = CG ? __ldcg(reinterpret_cast<const uint2*>(src)) : *reinterpret_cast<const uint2*>(src);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    dst[0] = a.x; dst[1] = a.y; dst[2] = b.x; dst[3] = b.y;
  } else {
    const unsigned u = CG ? __ldcg(reinterpret_cast<const unsigned*>(src)) : *reinterpret_cast<const unsigned*>(src);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u));
    dst[0] = a.x; dst[1] = a.y;
  }
}

// The runs of the cache a decode attention is cut into: n runs of `chunk` rows over 0..pos.
struct AttnRuns {
  int npos, n, chunk;
  __device__ __forceinline__ AttnRuns(const long long* __restrict__ pos, int n_split) {
    npos = (int)pos[0] + 1;
    n = npos <= SINGLE_RUN ? 1 : min(n_split, (npos + MIN_CHUNK - 1) / MIN_CHUNK);
    chunk = ((npos + n - 1) / n + 15) / 16 * 16;
    n = (npos + chunk - 1) / chunk;
  }
};

// Run `split` of the cache for query heads g0 .. g0 + GN - 1 of KV head kv (G per KV head), by 4
// warps (tid 0..127; sync meets exactly them). Leaves this run's (max, sum, unnormalised output)
// per head in part_ml / part_o, or with a single run the head's output in out. Each head's
// arithmetic is the same whatever GN, so any grouping of the G heads gives the same bits.
// sm: shared scratch of W * GN * (HD + 2) floats. CG: read the cache through L2 (a persistent
// kernel writes row pos in an earlier phase).
// RING = 0: each warp keeps the next group of 4 rows in flight in registers. RING > 1: each warp
// streams its groups through a ring of RING stages in shared memory (ring: W * RING * 8 * HD
// halves) with cp.async.cg, RING - 1 groups in flight (cp.async.cg reads through L2 whatever CG
// says) -- at long contexts one group in flight left each warp waiting a full memory latency per
// 2 KB (a Qwen3-8B layer's 16k-token cache, 32 runs: 45.4 us in registers, 37.2 us with a 4-stage
// ring; bench/NOTES.md session 30). Both give the same bits: only where the rows wait differs.
// The ring may overlay sm: the warps meet before sm is written.
template <int E, int GN, bool CG, class Sync, int RING = 0>
__device__ __forceinline__ void attn_run(const AttnRuns& ru, int split, int kv, int G, int g0, int tid,
                                         const __half* q, const __half* k_cache, const __half* v_cache,
                                         float* part_o, float* part_ml, __half* out, float* sm,
                                         int S, int n_split, float scale_log2, const Sync& sync,
                                         __half* ring = nullptr) {
  constexpr int HD = 32 * E, W = 4;
  const int lane = tid % 32, warp = tid / 32;
  const int p0 = split * ru.chunk, p1 = min(p0 + ru.chunk, ru.npos);
  float qv[GN][E], acc[GN][E], m[GN], l[GN];
#pragma unroll
  for (int g = 0; g < GN; ++g) {
    m[g] = neg_inf();
    l[g] = 0.0f;
    load_row<E, true>(qv[g], q + (kv * G + g0 + g) * HD + E * lane);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qv[g][e] *= scale_log2;
      acc[g][e] = 0.0f;
    }
  }
  const __half* kb = k_cache + (long long)kv * S * HD;
  const __half* vb = v_cache + (long long)kv * S * HD;
  // A group: the 4 rows pb .. pb + 3 (rows past p1 are the valid row p1 - 1 again, masked in
  // update), this lane's E dims of each. scores: this lane's part of each row's q.k per head.
  auto scores = [&](const float (&kk)[4][E], float (&sc)[4][GN]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int g = 0; g < GN; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) d += qv[g][e] * kk[j][e];
        sc[j][g] = d;
      }
  };
  // update: the scores' warp sums and the online softmax over the group's V rows nv
  auto update = [&](int pb, float (&sc)[4][GN], const float (&nv)[4][E]) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int g = 0; g < GN; ++g) sc[j][g] += __shfl_xor_sync(0xffffffffu, sc[j][g], off);
#pragma unroll
    for (int g = 0; g < GN; ++g) {
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
  };
  if constexpr (RING == 0) {
    float kk[4][E], vv[4][E];
    auto fetch = [&](int pb) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long p = min(pb + j, p1 - 1);
        load_row<E, CG>(kk[j], kb + p * HD + E * lane);
        load_row<E, CG>(vv[j], vb + p * HD + E * lane);
      }
    };
    int pb = p0 + warp * 4;
    if (pb < p1) fetch(pb);
    for (; pb < p1; pb += W * 4) {   // pb itself is always a valid row
      float sc[4][GN], nv[4][E];
      scores(kk, sc);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < E; ++e) nv[j][e] = vv[j][e];
      if (pb + W * 4 < p1) fetch(pb + W * 4);   // next group in flight while this one finishes
      update(pb, sc, nv);
    }
  } else {
    // stage: K rows 0..3 then V rows 0..3 of a group, HD halves each; a lane copies 16-byte pieces
    constexpr int PIECES = 8 * HD * 2 / 16;   // per stage: 128 (E = 4) or 64 (E = 2)
    __half* wring = ring + (long long)warp * RING * 8 * HD;
    const unsigned base = smem_addr(wring);
    auto issue = [&](int pb, int slot) {   // always commits a group (empty past the run's end)
      if (pb < p1) {
#pragma unroll
        for (int i = lane; i < PIECES; i += 32) {
          const int r = i / (PIECES / 8), c = i % (PIECES / 8);   // stage row r (K 0..3, V 4..7), piece c
          const long long p = min(pb + (r & 3), p1 - 1);
          cp_async16_at(base + unsigned((slot * 8 * HD + r * HD + c * 8) * 2), (r < 4 ? kb : vb) + p * HD + c * 8,
                        true);
        }
      }
      cp_async_commit();
    };
    int pb = p0 + warp * 4;
#pragma unroll
    for (int i = 0; i < RING - 1; ++i) issue(pb + i * W * 4, i);
    for (int it = 0; pb < p1; pb += W * 4, ++it) {
      cp_async_wait<RING - 2>();
      __syncwarp();   // every lane's pieces of this stage landed; the slot refilled below was read
      issue(pb + (RING - 1) * W * 4, (it + RING - 1) % RING);
      const __half* st = wring + (it % RING) * 8 * HD + E * lane;
      float kk[4][E], nv[4][E], sc[4][GN];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        load_row<E>(kk[j], st + j * HD);
        load_row<E>(nv[j], st + (4 + j) * HD);
      }
      scores(kk, sc);
      update(pb, sc, nv);
    }
    cp_async_wait<0>();   // nothing left in flight into the ring
    sync();   // every warp is done with its ring before sm (which the ring may overlay) is written
  }
  // merge the 4 warps through shared memory: sm_m[W][GN], sm_l[W][GN], sm_o[W][GN][HD]
  float* sm_m = sm;
  float* sm_l = sm + W * GN;
  float* sm_o = sm + 2 * W * GN;
#pragma unroll
  for (int g = 0; g < GN; ++g) {
    if (lane == 0) { sm_m[warp * GN + g] = m[g]; sm_l[warp * GN + g] = l[g]; }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_o[(warp * GN + g) * HD + E * lane + e] = acc[g][e];
  }
  sync();
  for (int idx = tid; idx < GN * HD; idx += W * 32) {
    const int g = idx / HD, d = idx % HD;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, sm_m[w * GN + g]);
    float o = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) {   // a warp that saw no position has m = -inf: weight 0
      const float f = exp2f(sm_m[w * GN + g] - mx);
      o += sm_o[(w * GN + g) * HD + d] * f;
      sum += sm_l[w * GN + g] * f;
    }
    const int head = kv * G + g0 + g;
    if (ru.n == 1) {   // the whole context was this run's: done
      out[head * HD + d] = __float2half_rn(o / sum);
      continue;
    }
    const long long slot = (long long)head * n_split + split;
    part_o[slot * HD + d] = o;
    if (d == 0) { part_ml[slot * 2] = mx; part_ml[slot * 2 + 1] = sum; }
  }
  sync();   // sm may be reused for the next item
}

// After every head of KV head kv has its run `split` in part_o / part_ml (ru.n > 1): the last of
// the n runs to finish (a ticket from count[kv], which it resets) merges them into out. All
// threads 0 .. nthr - 1 that wrote parts call it (sync meets them); ticket: shared int; sm:
// shared scratch of G * (n + 1) floats; OUTS >= G * HD / nthr: the outputs a thread takes.
// The merge first turns each head's n (max, sum) pairs into the runs' weights 2^(m_run - max)
// and their weighted sum, one warp a head (its lanes take runs lane, lane + 32, ... and add with
// warp_sum: the same bits whatever nthr), into sm; then every output is one pass over the runs'
// partial outputs whose loads do not wait on each other. (The first version had every thread
// re-read each run's (max, sum) twice from L2 per output, in dependent loops: with 256 runs, a
// 16k-token context, that merge was about half of a Qwen3-8B layer's 164 us of attention.)
template <int E, int OUTS, class Sync>
__device__ __forceinline__ void attn_merge(const AttnRuns& ru, int kv, int G, int tid, int nthr,
                                           const float* part_o, const float* part_ml, int* count, __half* out,
                                           int n_split, int* ticket, float* sm, const Sync& sync) {
  constexpr int HD = 32 * E;
  __threadfence();
  sync();
  if (tid == 0) *ticket = atomicAdd(&count[kv], 1);
  sync();
  const bool last = *ticket == ru.n - 1;
  sync();   // everyone has read the ticket before a next item may take one
  if (!last) return;
  __threadfence();
  const int n = ru.n, lane = tid % 32;
  float* fw = sm;            // fw[g * n + run]: the run's weight in head g
  float* sum = sm + G * n;   // sum[g]: the weighted sum of the runs' softmax denominators
  for (int g = tid / 32; g < G; g += nthr / 32) {
    const float* ml = part_ml + (long long)(kv * G + g) * n_split * 2;
    float mx = neg_inf();
    for (int sp = lane; sp < n; sp += 32) mx = fmaxf(mx, __ldcg(ml + sp * 2));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float l = 0.0f;
    for (int sp = lane; sp < n; sp += 32) {
      const float f = exp2f(__ldcg(ml + sp * 2) - mx);
      fw[g * n + sp] = f;
      l += __ldcg(ml + sp * 2 + 1) * f;
    }
    l = warp_sum(l);
    if (lane == 0) sum[g] = l;
  }
  sync();
  // a thread's outputs tid, tid + nthr, ... side by side, so that their loads of a run are in
  // flight together
  const float* po[OUTS];
  float o[OUTS];
#pragma unroll
  for (int i = 0; i < OUTS; ++i) {
    const int idx = min(tid + i * nthr, G * HD - 1);
    po[i] = part_o + (long long)(kv * G + idx / HD) * n_split * HD + idx % HD;
    o[i] = 0.0f;
  }
// (unroll 4: 14.6 us at 4k tokens, 16: 13.9. ptxas registers the same to the 8-register
// allocation, except at E = 4, G = 7, 8 -- 168 and a 4- / 8-byte spill at 16, 160 / 161 and no
// spill at 4 -- and E = 2, G = 2: 56 against 48)
#pragma unroll 16
  for (int sp = 0; sp < n; ++sp)
#pragma unroll
    for (int i = 0; i < OUTS; ++i)
      if (tid + i * nthr < G * HD) o[i] += __ldcg(po[i] + (long long)sp * HD) * fw[(tid + i * nthr) / HD * n + sp];
#pragma unroll
  for (int i = 0; i < OUTS; ++i) {
    const int idx = tid + i * nthr;
    if (idx < G * HD) out[kv * G * HD + idx] = __float2half_rn(o[i] / sum[idx / HD]);
  }
  if (tid == 0) count[kv] = 0;   // ready for the next call (or graph replay)
  sync();
}

}  // namespace layer_ops

// decode_persistent.cu -- a whole decode step's decoder layers (one token, GGUF weights) in one
// launch: every CTA stays resident, streams its share of every layer's weights through a ring in
// shared memory, and runs the layer's small ops between grid-wide barriers.
//
// What it computes is exactly the runner's decode step with fused layer ops (quantzoo/model/
// llm.py, _forward_fused at T = 1), the same values bit for bit: per layer,
//   x    = Q8_1(rms_norm(h) * attn_norm)                 layer_ops::rms_norm_row
//   qkv  = W_qkv x                                       the GEMV below (the one-token mmvq's)
//   q, k = rope(q/k-norm(q, k)); k, v -> cache row pos   layer_ops::rope_item
//   a    = attention(q, cache rows 0..pos)               layer_ops::attn_run, attn_merge
//   h   += W_o Q8_1(a)
//   x    = Q8_1(rms_norm(h) * mlp_norm)
//   t    = Q8_1(silu(W_gate x) * (W_up x))               swiglu.cuh, q8_1_store
//   h   += W_down t
// The GEMV adds in the order of the one-token kernel the per-op path runs for the format, so each
// output equals it: lane l of the warp that owns a row takes the row's blocks l, l + 32, ... in
// that order, sumi by DP4A, the format's per-block term (gguf_common.cuh); then gguf_mmvq16.cu's
// warp_sum of one accumulator (q4_0, q8_0), or with SCALAR gguf_mmvq.cu's order (q4_1, q5_0,
// q5_1: 128 threads, thread t summing blocks t, t + 128, ..., then its 4 warps' sums in turn),
// kept as 4 accumulators, one per column j of lane + 32 j.
//
// Why. A decode step of one kernel per op spends ~35 % of its time outside the weight stream
// (bench/NOTES.md, session 27: 8-10 launches a layer, each a chain of dependent latencies --
// wait for the previous grid, load, reduce, store -- while DRAM idles), and fusing single ops
// into their neighbours cost what it saved (sessions 14, 22, 26, 28). Here the weights never wait
// for a launch: one producer thread per CTA walks the CTA's static list of weight pieces for the
// whole step -- every layer, every phase -- with cp.async.bulk copies into a ring of NS stages,
// waiting only for a free stage, never for a grid barrier (weights do not depend on activations).
// While the consumer warps sit at a barrier, in the attention or in a norm, the ring fills with
// the next phase's rows.
//
// Status (H100, session 29; bench/NOTES.md): correct -- bit-equal to the per-op step -- but
// SLOWER: 3.02 ms a Qwen3-8B q4_0 step (its final version, CUDA events) against the per-op
// graph's 2.33 ms (in the current bench/model-h100.json 324 against 448 tok/s), so the runner
// uses it only when asked (Model(persistent=True), model.use_persistent(True)). A per-phase
// trace (the `trace` argument, PersistentDecode.phase_times) shows why: the ring holds ~8 us
// of DRAM time (q4_0: 19 stages of 9,232 B, 175 KB a CTA), but a layer's barriers, norms and
// attention keep the consumers ~28 us a layer off the weights even with DRAM idle, and the
// consumers' GEMV, issue-bound at one CTA per SM, runs at only ~1.4x the DRAM rate, so it cannot
// catch up.
//
// Layout of the work:
//   * CTA c of P (one per SM, all resident) owns rows [c N / P, (c + 1) N / P) of each weight of
//     N rows; gate and up go by whole 32-row units, so that the CTA holds the gate and up rows of
//     the same Q8_1 blocks of t and quantizes them itself.
//   * A row is cut into pieces of up to PIECE (128) blocks; a ring stage is SP consecutive pieces,
//     one bulk copy (16-byte aligned: a row of K % 256 == 0 values is a multiple of 16 bytes in
//     every format). Consumer warp w takes the CTA's local rows w, w + CW, ...; stage s (counted
//     over the whole step, the same count in the producer and every consumer) lives in slot
//     s % NS with phase parity (s / NS) & 1, and is free again once its SP pieces are released.
//   * Small ops: the norm's and the o-input's quantization run redundantly in every CTA (D or
//     H hd values from L2, 4096 for Qwen3-8B, into the CTA's own shared x); q/k-norm + RoPE by
//     one warp per head; the attention on (run, KV head) items, a KV head's query heads spread
//     over up to 4 groups of 4 warps (layer_ops::attn_run gives each head the same bits in any
//     grouping; its register path, RING = 0: the shared memory is the weight ring).
//   * Grid barrier: the consumer warps meet (named barrier 1), thread 0 publishes with a fence and
//     an atomic add on a counter the host zeroes before the launch, and spins on an acquire load.
//     The launch must have all its CTAs resident: grid = the SM count, one CTA per SM (its shared
//     memory sees to that), a cooperative launch (the driver refuses a grid that cannot all be
//     resident instead of letting it wait forever), after the previous kernel completes.
// Data written in one phase and read in another goes through L2 (ld.global.cg / __ldcg).
//
// sm_90 (cp.async.bulk, mbarrier try_wait); elsewhere the kernel body is empty.
#include "gguf_window.cuh"
#include "layer_ops.cuh"
#include "mbarrier.cuh"

namespace persist {

constexpr int CW = 16;                       // consumer warps
constexpr int THREADS = (CW + 1) * 32;       // + one producer warp
constexpr int PIECE = 128;                   // blocks per row piece
constexpr int SP = 4;                        // row pieces per ring stage (one bulk copy)
constexpr int LAYER_PTRS = 9;                // qkv, o, gate_up, down, attn_norm, mlp_norm, qk_norm, k, v

// Rows of one weight a CTA streams in one phase: rows [r0, r1) of the tensor at w (rows of nb
// blocks of the format).
struct Rows {
  const uint8_t* w;
  int r0, r1, nb;
  __device__ __forceinline__ int pieces() const { return (nb + PIECE - 1) / PIECE; }
  // Where piece q (row r0 + q / pp, piece q % pp) starts, in blocks from row r0's first block:
  // the phase's pieces lie back to back in memory, so a stage of consecutive pieces is one copy.
  __device__ __forceinline__ long long block_of(int q, int pp) const {
    return (long long)(q / pp) * nb + (long long)(q % pp) * PIECE;
  }
};

__device__ __forceinline__ int share(int n, int c, int p) { return int((long long)n * c / p); }

// The five weight phases of layer l for CTA c of p, in streaming order.
struct LayerRows {
  Rows ph[5];
  __device__ __forceinline__ LayerRows(const unsigned long long* lw, int c, int p, int D, int F, int NQKV, int HHD) {
    const uint8_t* qkv = reinterpret_cast<const uint8_t*>(lw[0]);
    const uint8_t* o = reinterpret_cast<const uint8_t*>(lw[1]);
    const uint8_t* gu = reinterpret_cast<const uint8_t*>(lw[2]);
    const uint8_t* dn = reinterpret_cast<const uint8_t*>(lw[3]);
    const int u0 = 32 * share(F / 32, c, p), u1 = 32 * share(F / 32, c + 1, p);
    ph[0] = {qkv, share(NQKV, c, p), share(NQKV, c + 1, p), D / 32};
    ph[1] = {o, share(D, c, p), share(D, c + 1, p), HHD / 32};
    ph[2] = {gu, u0, u1, D / 32};
    ph[3] = {gu, F + u0, F + u1, D / 32};
    ph[4] = {dn, share(D, c, p), share(D, c + 1, p), F / 32};
  }
};

// The CTA's ring stages in streaming order (layer, phase, first piece): where each one's bytes are.
template <class F>
struct Walk {
  const unsigned long long* lw;
  int c, p, D, FF, NQKV, HHD, L;
  int l = 0, ph = -1, q0 = 0, pp = 1, Q = 0;
  Rows r{};
  __device__ __forceinline__ Walk(const unsigned long long* lw_, int c_, int p_, int D_, int FF_, int NQKV_, int HHD_,
                                  int L_)
      : lw(lw_), c(c_), p(p_), D(D_), FF(FF_), NQKV(NQKV_), HHD(HHD_), L(L_) {}
  // The next stage's source and size; false past the last one.
  __device__ __forceinline__ bool next(const uint8_t*& src, unsigned& bytes) {
    while (q0 >= Q) {
      if (++ph == 5) {
        ph = 0;
        ++l;
      }
      if (l >= L) return false;
      r = LayerRows(lw + (long long)l * LAYER_PTRS, c, p, D, FF, NQKV, HHD).ph[ph];
      pp = r.pieces();
      Q = (r.r1 - r.r0) * pp;
      q0 = 0;
    }
    const long long b0 = r.block_of(q0, pp), b1 = r.block_of(min(q0 + SP, Q), pp);
    src = r.w + ((long long)r.r0 * r.nb + b0) * F::BYTES;
    bytes = unsigned((b1 - b0) * F::BYTES);
    q0 += SP;
    return true;
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned saddr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_wait;
// bytes (a multiple of 16) from global src (16-byte aligned) to shared dst, completing on bar.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  mbar_arrive_expect_tx(bar, bytes);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" :: "n"(CW * 32) : "memory"); }
struct ConsumerSync {
  __device__ __forceinline__ void operator()() const { consumers_sync(); }
};
struct GroupSync {   // the 4 warps of one attention group: named barrier id
  int id;
  __device__ __forceinline__ void operator()() const { asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory"); }
};
// Query heads per attention group: the smallest divisor of G that leaves at most 4 groups.
__host__ __device__ constexpr int attn_heads_per_group(int g) {
  for (int n = 1; n <= g; ++n)
    if (g % n == 0 && g / n <= 4) return n;
  return g;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// All consumer warps of all CTAs meet; what any of them wrote before is visible after. With a
// trace, thread 0 records when its CTA arrived (at[0]) and left (at[gridDim.x]).
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned& n, int tid, unsigned long long* at) {
  consumers_sync();
  if (at && tid == 0) at[0] = global_ns();
  n += gridDim.x;
  if (tid == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    } while (v < n);
    if (at) at[gridDim.x] = global_ns();
  }
  consumers_sync();
}
#endif

}  // namespace persist

// One decode step through L layers of hidden size D, intermediate size FF (F is the weight
// format). lw: L x LAYER_PTRS device pointers (quantzoo/kernels/persistent.py). h (D) fp16: the
// residual stream, updated in place (on return h + every layer's two deltas; the caller's final
// norm adds nothing more). qkv ((H + 2 KV) HD), q (H HD), attn (H HD), act_q8 (FF / 32 Q8_1
// blocks, split layout): scratch; part_o / part_ml / count: the attention's (layer_ops.DecodeWork,
// n_split runs). bar: one zeroed counter. NS ring stages of SP pieces; V / norm_threads:
// add_rms_norm's V and thread count for D (layer_ops.py), which the norm must reproduce to give
// its bits. trace: null, or the per-CTA barrier times (below). Template: E elements a lane per
// head (head_dim 32 E, as layer_ops.cu), G query heads per KV head, NORM Qwen3's q/k norm,
// SCALAR gguf_mmvq.cu's summation order (above).
template <class F, int E, int G, bool NORM, int V, bool SCALAR>
__global__ void __launch_bounds__(persist::THREADS, 1)
decode_persistent(const unsigned long long* __restrict__ lw, int L, __half* h, __half* qkv, __half* q, __half* attn,
                  uint8_t* act_q8, float* part_o, float* part_ml, int* count, const long long* __restrict__ pos,
                  const __half* __restrict__ cos_t, const __half* __restrict__ sin_t, unsigned* bar,
                  int D, int FF, int H, int KV, int S, int n_split, int norm_threads, int NS,
                  float eps, float scale_log2, unsigned long long* trace) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace persist;
  pdl::grid_wait();   // no early release: the next kernel may start only when every CTA is gone
  constexpr int HD = 32 * E;
  constexpr int SLOT = SP * PIECE * F::BYTES;
  const int NQKV = (H + 2 * KV) * HD, HHD = H * HD;
  const int XB = max(max(D, HHD), FF) / 32;          // Q8_1 blocks the shared x holds at most
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;                              // NS x SLOT (+ 16: a window may read past)
  uint8_t* xs = ring + NS * SLOT + 16;               // Q8_1 x, split: qs 32 B / block, then half2 (d, s)
  __half* gs = reinterpret_cast<__half*>(xs + XB * 36);   // this CTA's gate outputs (<= 32 ceil(F/32/P))
  const int UMAX = 32 * ((FF / 32 + gridDim.x - 1) / gridDim.x);
  __half* ts = gs + UMAX;                            // and its silu(gate) * up
  // NS full then NS empty mbarriers, 8-byte aligned
  const unsigned full0 = (saddr(ts + UMAX) + 7u) & ~7u, empty0 = full0 + 8 * NS;
  float* att_sm = reinterpret_cast<float*>(smem + (empty0 + 8 * NS - saddr(smem)));   // 4 G (HD + 2) floats
  __shared__ float red[32];
  __shared__ int ticket;
  __shared__ int issued_count;   // stages the producer has issued so far (atomics, release / acquire)
  const unsigned issued = saddr(&issued_count);
  constexpr int AGN = attn_heads_per_group(G);
  constexpr int MERGE_OUTS = (G * HD + CW * 32 - 1) / (CW * 32);   // attn_merge's outputs a thread
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int c = blockIdx.x, P = gridDim.x;
  if (tid == 0) {
    issued_count = 0;
    for (int s = 0; s < NS; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, SP * 32);   // every lane of a piece's warp releases it
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == CW) {   // the producer: every piece of every phase of every layer, in order
    if (lane == 0) {
      // (Tried: asking L2 for the stage NS ahead before waiting for a free slot, so that L2 would
      // hold more of the next phase while the consumers sit in a barrier: 3.15 -> 3.85 ms a step.)
      Walk<F> fill(lw, c, P, D, FF, NQKV, HHD, L);
      const uint8_t* src;
      unsigned bytes;
      for (int st = 0; fill.next(src, bytes); ++st) {
        const int slot = st % NS;
        if (st >= NS) mbar_wait(empty0 + 8 * slot, ((st / NS) - 1) & 1);
        bulk_copy(saddr(ring + slot * SLOT), src, bytes, full0 + 8 * slot);
        // the copy's arrive on full[slot] before the count (an atomic, not a plain store: what
        // compute-sanitizer's racecheck accepts as a flag; st.release was reported as a race)
        asm volatile("atom.release.cta.shared::cta.exch.b32 _, [%0], %1;\n" :: "r"(issued), "r"(st + 1) : "memory");
      }
    }
    return;
  }

  // ---- consumers: tid 0 .. CW * 32 - 1 ----
  const ConsumerSync csync;
  unsigned nbar = 0;
  int st = 0;

  // y[row] for the phase's rows, each by one warp; epi(row, y) stores it (lane 0).
  auto gemv = [&](const Rows& r, int nbx, auto&& epi) {
    const int pp = r.pieces(), rows = r.r1 - r.r0, Q = rows * pp;
    const __half2* xds = reinterpret_cast<const __half2*>(xs + 32 * nbx);
    for (int i = warp; i < rows; i += CW) {
      float acc[PIECE / 32] = {};   // SCALAR: one per lane column j (gguf_mmvq.cu's 4 warps)
      for (int pc = 0; pc < pp; ++pc) {
        const int q = i * pp + pc, q0 = q / SP * SP, s = st + q / SP, slot = s % NS;
        // A parity wait can only tell phase k from k - 1. A warp waits on its own pieces' stages
        // only, and can be more than NS stages ahead of the last one that landed (rows of many
        // pieces, a small ring), where full[slot] still shows stage s - NS's phase and the
        // wait would pass at once. Once the producer has issued stage s, stage s - NS has been
        // released, so it landed: wait for that first.
        for (int n = -1; n <= s;)
          asm volatile("atom.acquire.cta.shared::cta.or.b32 %0, [%1], 0;\n" : "=r"(n) : "r"(issued) : "memory");
        mbar_wait(full0 + 8 * slot, (s / NS) & 1);
        const uint8_t* piece = ring + slot * SLOT + (r.block_of(q, pp) - r.block_of(q0, pp)) * F::BYTES;
        const int nbp = min(PIECE, r.nb - pc * PIECE);
#pragma unroll
        for (int j = 0; j < PIECE / 32; ++j) {
          const int b = lane + 32 * j;
          if (b < nbp) {
            vec16::Window<F, false, true> win;
            win.load(piece, (long long)b * F::BYTES);
            float dw, mw;
            int qw[8];
            F::unpack_from([&](int k) { return win.get(k); }, dw, mw, qw);
            const int kb = pc * PIECE + b;
            uint4 a0, a1;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a0.x), "=r"(a0.y), "=r"(a0.z), "=r"(a0.w)
                         : "r"(saddr(xs + 32 * kb)) : "memory");
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a1.x), "=r"(a1.y), "=r"(a1.z), "=r"(a1.w)
                         : "r"(saddr(xs + 32 * kb + 16)) : "memory");
            const float2 ds = __half22float2(xds[kb]);
            const int a[8] = {int(a0.x), int(a0.y), int(a0.z), int(a0.w), int(a1.x), int(a1.y), int(a1.z), int(a1.w)};
            int sumi = 0;
#pragma unroll
            for (int t = 0; t < 8; ++t) sumi = __dp4a(qw[t], a[t], sumi);
            acc[SCALAR ? j : 0] += F::term(sumi, dw, mw, ds.x, ds.y);
          }
        }
        // the stage's SP pieces each release it once in every lane (each lane's own reads before
        // its own arrive: what compute-sanitizer's racecheck follows, where a __syncwarp and lane
        // 0's arrive for the warp showed as 245,760 hazards); the last piece of a short last
        // stage also releases the pieces it lacks
        mbar_arrive(empty0 + 8 * slot, q == Q - 1 ? SP - (Q - q0) + 1 : 1);
      }
      float y = 0.0f;
      if constexpr (SCALAR) {   // ((0 + p0) + p1) + p2) + p3, as gguf_mmvq.cu adds its warps
#pragma unroll
        for (int j = 0; j < PIECE / 32; ++j) y += warp_sum(acc[j]);
      } else {
        y = warp_sum(acc[0]);
      }
      if (lane == 0) epi(r.r0 + i, y);
    }
    st += (Q + SP - 1) / SP;
  };

  // Q8_1 of n fp16 values at src (written by another phase) into xs: q8_1_store8's groups of 4
  // threads per block, the bytes quantize_q8_1_split makes.
  auto quantize_into_xs = [&](const __half* src, int n) {
    const int chunks = n / 8;
    for (int c0 = 0; c0 < chunks; c0 += CW * 32) {   // whole warps per round (chunks % 4 == 0)
      const int ch = c0 + tid;
      const bool ok = ch < chunks;
      const uint4 v = ok ? __ldcg(reinterpret_cast<const uint4*>(src) + ch) : make_uint4(0u, 0u, 0u, 0u);
      q8_1_store8<true>(v, ok, xs, ch / 4, n / 32, ch & 3);
    }
  };

  // trace: per layer l and barrier k (0: before qkv, 1-5: after qkv, rope, attention, o,
  // gate/up), arrival and departure of CTA c at trace[((l * 6 + k) * 2 + {0, 1}) * P + c]; the
  // end of the last down_proj at trace[L * 12 * P + c]
  auto at = [&](int l, int k) { return trace ? trace + (long long)(l * 6 + k) * 2 * P + c : nullptr; };
  for (int l = 0; l < L; ++l) {
    const unsigned long long* p = lw + (long long)l * LAYER_PTRS;
    const LayerRows lr(p, c, P, D, FF, NQKV, HHD);
    const __half* attn_norm = reinterpret_cast<const __half*>(p[4]);
    const __half* mlp_norm = reinterpret_cast<const __half*>(p[5]);
    const __half* qk_norm = reinterpret_cast<const __half*>(p[6]);
    __half* kc = reinterpret_cast<__half*>(p[7]);
    __half* vc = reinterpret_cast<__half*>(p[8]);

    // qkv = W_qkv Q8_1(norm(h))
    if (l > 0) {
      grid_barrier(bar, nbar, tid, at(l, 0));
    } else if (trace && tid == 0) {
      trace[c] = trace[P + c] = global_ns();
    }
    layer_ops::rms_norm_row<false, V, 2>(h, nullptr, attn_norm, nullptr, xs, 0, D / 32, D, eps, tid,
                                         norm_threads, red, csync);
    csync();
    gemv(lr.ph[0], D / 32, [&](int row, float y) { qkv[row] = __float2half_rn(y); });
    grid_barrier(bar, nbar, tid, at(l, 1));

    // q/k norm + RoPE; k, v into the cache
    for (int item = c * CW + warp; item < H + 2 * KV; item += P * CW)
      layer_ops::rope_item<E, NORM>(item, lane, qkv, qk_norm, cos_t, sin_t, pos, q, kc, vc, H, KV, S, eps);
    grid_barrier(bar, nbar, tid, at(l, 2));

    // attention: (run, KV head) items; the item's G query heads spread over up to 4 groups of 4
    // consumer warps (AGN heads each), then the runs of a KV head merge
    {
      const layer_ops::AttnRuns ru(pos, n_split);
      const int grp = warp / 4;
      for (int it = c; it < ru.n * KV; it += P) {
        const int split = it % ru.n, kvh = it / ru.n;
        if (grp < G / AGN)
          layer_ops::attn_run<E, AGN, true>(ru, split, kvh, G, grp * AGN, tid % 128, q, kc, vc, part_o, part_ml,
                                            attn, att_sm + grp * 4 * AGN * (HD + 2), S, n_split, scale_log2,
                                            GroupSync{2 + grp});
        if (ru.n > 1)
          layer_ops::attn_merge<E, MERGE_OUTS>(ru, kvh, G, tid, CW * 32, part_o, part_ml, count, attn, n_split,
                                              &ticket, att_sm, csync);
      }
    }
    grid_barrier(bar, nbar, tid, at(l, 3));

    // h += W_o Q8_1(a)
    quantize_into_xs(attn, HHD);
    csync();
    gemv(lr.ph[1], HHD / 32, [&](int row, float y) {
      h[row] = __float2half_rn(__half2float(__ldcg(h + row)) + __half2float(__float2half_rn(y)));
    });
    grid_barrier(bar, nbar, tid, at(l, 4));

    // t = Q8_1(silu(W_gate x) * (W_up x)), x = Q8_1(norm(h)), this CTA's 32-row units
    layer_ops::rms_norm_row<false, V, 2>(h, nullptr, mlp_norm, nullptr, xs, 0, D / 32, D, eps, tid,
                                         norm_threads, red, csync);
    csync();
    const int u0 = lr.ph[2].r0;
    gemv(lr.ph[2], D / 32, [&](int row, float y) { gs[row - u0] = __float2half_rn(y); });
    gemv(lr.ph[3], D / 32, [&](int row, float y) {   // the same warp wrote gate row row - F
      const int j = row - FF - u0;
      ts[j] = __float2half_rn(swiglu(__half2float(gs[j]), __half2float(__float2half_rn(y))));
    });
    csync();
    for (int u = lr.ph[2].r0 / 32 + warp; u < lr.ph[2].r1 / 32; u += CW)
      q8_1_store<true>(__half2float(ts[u * 32 - u0 + lane]), act_q8, u, FF / 32, lane);
    grid_barrier(bar, nbar, tid, at(l, 5));

    // h += W_down t
    {
      const int n16 = FF / 32 * 36 / 16;   // act_q8 is 16-byte aligned and FF % 128 == 0
      for (int i = tid; i < n16; i += CW * 32)
        reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(act_q8) + i);
    }
    csync();
    gemv(lr.ph[4], FF / 32, [&](int row, float y) {
      h[row] = __float2half_rn(__half2float(__ldcg(h + row)) + __half2float(__float2half_rn(y)));
    });
  }
  if (trace) {
    consumers_sync();
    if (tid == 0) trace[(long long)L * 12 * P + c] = global_ns();
  }
#endif
}

// gguf_mmvq16.cu -- y (M, N) = x (M, K) @ W (N, K)^T for small M (1..8) with wide loads:
// the decode-time GEMV, same math as gguf_mmvq.cu, different memory access.
//
// Math (unchanged, gguf_common.cuh): per output y[m, n] and 32-block b,
//   sumi_b = sum_{j<32} q_w[n, b, j] * q_a[m, b, j]      int32, 8 x __dp4a
//   y[m, n] = sum_b term(sumi_b, d_w, m_w, d_a, s_a)      fp32, term = the format's block dot
// Each lane finishes whole blocks, so every term is formed from the full block's sumi and is
// bit-identical to the numpy emulation's term; only the fp32 order of the sum differs.
//
// Why this kernel exists. gguf_mmvq.cu reads an 18/22/34-byte block with 2-byte loads (the
// blocks are only 2-byte aligned) and a Q8_1 block with nine 4-byte loads. A warp's load
// instruction then covers 32 blocks spread over ~576 (weight) or 1152 (activation) bytes, i.e.
// 5 or 9 L1 cache lines ("wavefronts") for 64 or 128 useful bytes; at M = 1 that is ~170
// wavefronts per 1152 weight bytes, and the SM's load pipeline -- not DRAM -- set the speed
// (66-78 % of the H100's copy bandwidth). Here:
//  * Weights: lane l still owns block b = 32 i + l of its row, but reads the 16-byte-aligned
//    window that covers the block with 16-byte `ld.global.nc` loads (LW = 16; LW = 8 is the
//    8-byte variant): 2 loads for Q4_0/Q4_1/Q5_1, 2-3 for Q5_0, 3 for Q8_0, each spanning the
//    same ~5 lines as before but carrying 8x the bytes. The block sits at a run-time byte offset
//    o (even) inside that window; it is shifted into place in registers with selects on the word
//    index (o / 4, 2-3 levels) and one byte_perm per word for the half-word part (o & 2) -- no
//    dynamic register indexing (that would spill to local memory).
//  * Activations: the Q8_1 workspace is in a split layout (q8_1_quantize.cu,
//    quantize_q8_1_split): qs of block i at 32 i (two aligned 16-byte loads; a warp reads one
//    contiguous 1 KB run), (d, s) as a half2 array after all qs. Same bytes, same values as the
//    codec's 36-byte blocks, only placed differently: 3 loads per block instead of 9.
//  * One warp owns R whole rows (4 warps per CTA): no shared memory and no __syncthreads, the
//    fp32 sums are reduced with xor shuffles and lane (m R + r) stores y[m, n0 + r].
// Weight loads may use L1::no_allocate (NOALLOC): the weight is streamed once, the activation
// is what every warp of the SM re-reads, so the weight should not evict it from L1.
//
// Requirements (checked in quantzoo/kernels/gguf.py, which otherwise runs gguf_mmvq.cu): the
// weight's base address and its total size N * nb * bytes are multiples of LW, so every
// LW-aligned window that covers a block lies inside the tensor. Rows themselves need not be
// aligned (the window offset is computed per block). Rows past N (the last warp when R does
// not divide N) are computed on row N - 1 and not stored.
#include "gguf_common.cuh"

constexpr int MMVQ16_WARPS = 4;

namespace vec16 {

constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// One LW-byte load (LW = 16 or 8) of read-only data into words w[0 .. LW/4 - 1].
template <int LW, bool NOALLOC>
__device__ __forceinline__ void load_chunk(const uint8_t* p, uint32_t* w) {
    if constexpr (LW == 16) {
        if constexpr (NOALLOC)
            asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
        else
            asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
    } else {
        if constexpr (NOALLOC)
            asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
        else
            asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    }
}

// A weight block held as an LW-aligned byte window in registers, shifted to its start.
template <class F, int LW, bool NOALLOC>
struct Window {
    static constexpr int G = gcd(F::BYTES, LW);
    static constexpr int OMAX = LW - G;                        // largest offset of a block in its window
    static constexpr int NC = (OMAX + F::BYTES + LW - 1) / LW; // loads per block (worst case)
    static constexpr int NW = NC * LW / 4;                     // window words
    static constexpr int NS = (F::BYTES + 3) / 4 + 1;          // shifted words kept (block + 1)
    static constexpr int JMAX = OMAX / 4;                      // largest word offset o / 4

    uint32_t sel[NS];  // sel[i] = window word (o / 4) + i (0 past the window)
    int half;          // o & 2: the block starts mid-word

    __device__ __forceinline__ void load(const uint8_t* W, long long off) {
        const int o = int(off & (LW - 1));
        const uint8_t* base = W + (off - o);
        uint32_t w[NW];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (c * LW < F::BYTES || c * LW < o + F::BYTES) {  // the first test is compile-time
                load_chunk<LW, NOALLOC>(base + c * LW, &w[c * LW / 4]);
            } else {
#pragma unroll
                for (int i = 0; i < LW / 4; ++i) w[c * LW / 4 + i] = 0u;
            }
        }
        // sel[i] = w[j + i], j = o >> 2 in 0..JMAX: one select level per bit of j.
        const int j = o >> 2;
        uint32_t t[NW];
#pragma unroll
        for (int i = 0; i < NW; ++i) t[i] = w[i];
#pragma unroll
        for (int step = 1; step <= JMAX; step *= 2) {
            const bool take = (j & step) != 0;
#pragma unroll
            for (int i = 0; i < NW; ++i) t[i] = take ? (i + step < NW ? t[i + step] : 0u) : t[i];
        }
#pragma unroll
        for (int i = 0; i < NS; ++i) sel[i] = i < NW ? t[i] : 0u;
        half = o & 2;
    }

    // The 4 bytes at in-block offset k (even; constant after unrolling).
    __device__ __forceinline__ int get(int k) const {
        const uint32_t lo = sel[k >> 2], hi = sel[(k >> 2) + 1];
        const uint32_t mid = __byte_perm(lo, hi, 0x5432);  // bytes 2..5 of (lo, hi)
        return int((k & 2) ? (half ? hi : mid) : (half ? mid : lo));
    }
};

}  // namespace vec16

// W: GGUF block bytes (N rows of nb blocks). Aqs: Q8_1 qs, block (m, b) at 32 (m nb + b);
// Ads: half2 (d, s) of block (m, b) at index m nb + b. y: fp16 (M, N).
template <class F, int M, int R, int LW, bool NOALLOC>
__global__ void __launch_bounds__(MMVQ16_WARPS * 32)
mmvq16(const uint8_t* __restrict__ W, const uint8_t* __restrict__ Aqs, const __half2* __restrict__ Ads,
       __half* __restrict__ y, int N, int nb) {
    const int lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * MMVQ16_WARPS + threadIdx.x / 32) * R;
    if (n0 >= N) return;  // whole warps: the shuffles below stay full
    long long row_off[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_off[r] = (long long)min(n0 + r, N - 1) * nb * F::BYTES;

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

    for (int kb = lane; kb < nb; kb += 32) {
        float dw[R], mw[R];
        int q[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            vec16::Window<F, LW, NOALLOC> win;
            win.load(W, row_off[r] + (long long)kb * F::BYTES);
            F::unpack_from([&](int k) { return win.get(k); }, dw[r], mw[r], q[r]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const long long ab = (long long)m * nb + kb;
            const uint4 a0 = __ldg(reinterpret_cast<const uint4*>(Aqs + ab * 32));
            const uint4 a1 = __ldg(reinterpret_cast<const uint4*>(Aqs + ab * 32 + 16));
            const float2 ds = __half22float2(__ldg(Ads + ab));
            const int a[8] = {int(a0.x), int(a0.y), int(a0.z), int(a0.w), int(a1.x), int(a1.y), int(a1.z), int(a1.w)};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                int sumi = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) sumi = __dp4a(q[r][i], a[i], sumi);
                acc[m][r] += F::term(sumi, dw[r], mw[r], ds.x, ds.y);
            }
        }
    }

    float mine = 0.0f;  // lane m R + r keeps y[m, n0 + r]
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == m * R + r) mine = v;
        }
    if (lane < M * R) {
        const int m = lane / R, n = n0 + lane % R;
        if (n < N) y[(long long)m * N + n] = __float2half_rn(mine);
    }
}

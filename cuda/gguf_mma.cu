// gguf_mma.cu -- y (M, N) = x (M, K) @ W (N, K)^T for mid-size M on int8 tensor cores.
//
// Math: the same per-block terms as every GGUF kernel here (gguf_common.cuh):
//   sumi[m, n, b] = sum_{j<32} q_w[n, b, j] * q_a[m, b, j]         exact int32
//   y[m, n]       = sum_b term(sumi[m, n, b], d_w, m_w, d_a, s_a)   fp32, fp16 out
// but sumi comes from `mma.sync.m16n8k32.row.col.s32.s8.s8.s32`: its K = 32 is exactly one GGUF
// block, so one MMA with a fresh accumulator gives a 16 (m) x 8 (n) tile of whole-block sumi,
// and the format's term (d_w, m_w per n; d_a, s_a per m) is applied to each fragment element in
// fp32 with the emulation's exact operation order. Every term is bit-identical to
// reference/gguf_dot.py's; only the fp32 order of the sum over blocks differs (split K too).
//
// Why the fragments line up with GGUF bytes: for m16n8k32 .s8, thread (g = lane / 4,
// t = lane % 4) holds B (32 x 8, "col": W rows) elements k = 4t..4t+3 and 16+4t..16+4t+3 of
// column n = g. A Q4 block's qs word t has elements 4t..4t+3 in its low nibbles and
// 16+4t..16+4t+3 in its high nibbles: b0 = v & 0x0F0F0F0F, b1 = (v >> 4) & 0x0F0F0F0F -- exactly
// the unpacked words q[t], q[t+4] (gguf_common.cuh). A (16 x 32, row) wants words t and t + 4
// of Q8_1 rows g and g + 8: a0 = row g word t, a1 = row g+8 word t, a2 = row g word t+4,
// a3 = row g+8 word t+4. C: c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1).
// Q4/Q5 values are unsigned (0..15 / 0..31) and still valid s8; their offset or minimum goes
// through s_a in the term, as in the DP4A kernels.
//
// Shape of the work. A CTA of 8 warps owns a 64 (n) x BM (m) output tile (BM = 16, 32, 64) and
// walks its share of K (split K over grid.z) in steps of BK = 4 blocks.
// Per step every thread fetches BK / 4 weight blocks (16-byte-aligned windows, gguf_window.cuh:
// 2-3 16-byte loads each; Q5_0's third a 4-byte one) and, for BM x BK <= 256 threads, one Q8_1
// block of the split activation layout (two 16-byte qs loads and the (d, s) word); the loads for
// step s + 1 are issued before the MMAs of step s and only decoded (nibbles, Q5 bits) into the
// other shared-memory buffer afterwards, so global latency hides under the tensor-core and fp32
// work: one __syncthreads per step. Warps are arranged BM/16 (m) x 8/(BM/16) (n); a warp's tile is
// 16 x 8 NT with NT = BM / 16 n-tiles.
// Shared rows are 8 words (32 bytes), swizzled: rows r with (r / 4) odd keep their two 16-byte
// halves swapped, so the 8 rows g of a fragment read (word t of each) hit banks
// 8 g + (t ^ 4 ((g / 4) & 1)) mod 32 -- all distinct -- without padding (rows padded to 12 words,
// keeping the 16-byte stores aligned, would take the BM = 64 tile from 40 KB to 56 KB, past the
// 48 KB a launch gets without the opt-in).
// With split K (grid.z > 1) each CTA writes fp32 partial sums to `part` [z][M][N] and
// mma_reduce adds them in z order and rounds to fp16 (deterministic); with grid.z = 1 the
// CTA rounds and stores y itself.
// Tails: weight rows past N are computed on row N - 1 and not stored; activation rows past M on
// row M - 1, not stored; blocks past this split's range are zeroed on both sides (term = 0).
// Requirements (quantzoo/kernels/gguf.py): weight base address and byte size multiples of 16
// (the window loads), as for the vector-load mmvq.
#include "gguf_window.cuh"

constexpr int MMA_BN = 64, MMA_THREADS = 256;

// Word position of word i (0..7) of shared row r after the swizzle.
__device__ __forceinline__ int swz(int r, int i) { return i ^ (((r >> 2) & 1) << 2); }

// c = A B + SUMI_MAGIC: the accumulator input is the magic constant, not 0, so each c[i] holds the
// float bits of 1.5 * 2^23 + sumi and one fp32 subtraction recovers sumi exactly
// (gguf_common.cuh) -- the I2F conversion it replaces runs at a quarter of the FADD rate.
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(SUMI_MAGIC));
}

// BK blocks per pipeline step. 4 for every tile: BK = 8 for BM <= 32 (twice the bytes in flight
// per step) was measured slower on the H100 (q4_0 M = 16: 50.1 vs 41.8 us; M = 32: 65.4 vs
// 54.1), so the template keeps the knob but not the setting.
template <int BM>
struct MmaCfg {
    static constexpr int BK = 4;
};

template <int BM, int BK>
struct MmaSmem {
    int w[2][BK][MMA_BN][8];     // unpacked weight words, swizzled rows
    int a[2][BK][BM][8];         // Q8_1 qs words, swizzled rows
    float2 wdm[2][BK][MMA_BN];   // (d_w, m_w) per weight row
    float2 ads[2][BK][BM];       // (d_a, s_a) per activation row
};

// W: GGUF blocks (N x nb). Aqs / Ads: Q8_1 split layout of M rows (qs of block (m, b) at
// 32 (m nb + b), half2 (d, s) at index m nb + b). kchunk: blocks per split (multiple of BK).
template <class F, int BM>
__global__ void __launch_bounds__(MMA_THREADS, 2)
mma_gemm(const uint8_t* __restrict__ W, const uint8_t* __restrict__ Aqs, const __half2* __restrict__ Ads,
         __half* __restrict__ y, float* __restrict__ part, int M, int N, int nb, int kchunk) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    constexpr int BK = MmaCfg<BM>::BK;
    constexpr int NT = BM / 16;                 // n-tiles per warp
    constexpr int WARPS_M = BM / 16;            // warps along m
    constexpr int WSLOTS = MMA_BN * BK / MMA_THREADS;  // weight blocks per thread per step
    extern __shared__ __align__(16) unsigned char mma_smem[];  // sizeof(MmaSmem<BM, BK>), dynamic
    MmaSmem<BM, BK>& sm = *reinterpret_cast<MmaSmem<BM, BK>*>(mma_smem);  // (opt-in above 48 KB)

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * MMA_BN, m0 = blockIdx.y * BM;
    const int kb0 = blockIdx.z * kchunk, kb1 = min(nb, kb0 + kchunk);
    const int wm0 = (warp % WARPS_M) * 16;      // warp's m offset in the tile
    const int wn0 = (warp / WARPS_M) * 8 * NT;  // warp's n offset in the tile

    // Loader slots: weight block (row tid / BK + i * 256 / BK, block tid % BK) for i < WSLOTS;
    // activation block (row tid / BK, block tid % BK) for tid < BM * BK.
    const int lc = tid % BK, lr = tid / BK;
    long long wrow[WSLOTS];
#pragma unroll
    for (int i = 0; i < WSLOTS; ++i) wrow[i] = (long long)min(n0 + lr + i * (MMA_THREADS / BK), N - 1) * nb;
    const bool has_a = tid < BM * BK;
    const long long arow = (long long)min(m0 + lr, M - 1) * nb;

    vec16::Window<F, false> win[WSLOTS];
    uint4 aq0, aq1;
    uint32_t adsw = 0;
    bool valid = false;

    auto fetch = [&](int k0) {  // issue the global loads of step k0 (no use of the results)
        const int kb = k0 + lc;
        valid = kb < kb1;
        const int kbc = valid ? kb : kb1 - 1;  // stay inside the tensor
#pragma unroll
        for (int i = 0; i < WSLOTS; ++i) win[i].load_raw(W, (wrow[i] + kbc) * F::BYTES);
        if (has_a) {
            const long long ab = arow + kbc;
            aq0 = __ldg(reinterpret_cast<const uint4*>(Aqs + ab * 32));
            aq1 = __ldg(reinterpret_cast<const uint4*>(Aqs + ab * 32 + 16));
            adsw = __ldg(reinterpret_cast<const unsigned int*>(Ads + ab));
        }
    };
    auto stash = [&](int buf) {  // decode what fetch loaded into shared buffer `buf`
#pragma unroll
        for (int i = 0; i < WSLOTS; ++i) {
            win[i].finish();
            int q[8];
            float d, m;
            const vec16::Window<F, false>& wi = win[i];
            F::unpack_from([&](int k) { return wi.get(k); }, d, m, q);
            if (!valid) {
#pragma unroll
                for (int j = 0; j < 8; ++j) q[j] = 0;
                d = 0.0f;
                m = 0.0f;
            }
            const int r = lr + i * (MMA_THREADS / BK);
            int4* dst = reinterpret_cast<int4*>(&sm.w[buf][lc][r][0]);
            const int h = (r >> 2) & 1;  // the swizzle: halves swapped when (row / 4) is odd
            dst[h] = make_int4(q[0], q[1], q[2], q[3]);
            dst[h ^ 1] = make_int4(q[4], q[5], q[6], q[7]);
            sm.wdm[buf][lc][r] = make_float2(d, m);
        }
        if (has_a) {
            int4* da = reinterpret_cast<int4*>(&sm.a[buf][lc][lr][0]);
            const int h = (lr >> 2) & 1;
            const uint4 z = make_uint4(0, 0, 0, 0);
            const uint4 v0 = valid ? aq0 : z, v1 = valid ? aq1 : z;
            da[h] = make_int4(int(v0.x), int(v0.y), int(v0.z), int(v0.w));
            da[h ^ 1] = make_int4(int(v1.x), int(v1.y), int(v1.z), int(v1.w));
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&adsw));
            sm.ads[buf][lc][lr] = valid ? f : make_float2(0.0f, 0.0f);
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

    fetch(kb0);  // kb0 < kb1: the host never makes an empty split
    stash(0);
    __syncthreads();
    int buf = 0;
    for (int k0 = kb0; k0 < kb1; k0 += BK) {
        const bool more = k0 + BK < kb1;
        if (more) fetch(k0 + BK);
#pragma unroll
        for (int c = 0; c < BK; ++c) {
            uint32_t a[4];
            const int ra = wm0 + g;
            a[0] = uint32_t(sm.a[buf][c][ra][swz(ra, t)]);
            a[1] = uint32_t(sm.a[buf][c][ra + 8][swz(ra + 8, t)]);
            a[2] = uint32_t(sm.a[buf][c][ra][swz(ra, t + 4)]);
            a[3] = uint32_t(sm.a[buf][c][ra + 8][swz(ra + 8, t + 4)]);
            const float2 as0 = sm.ads[buf][c][ra], as1 = sm.ads[buf][c][ra + 8];
            int s[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j) {  // all MMAs first: their latencies overlap
                const int rb = wn0 + 8 * j + g;
                mma_s8_16832(s[j], a, uint32_t(sm.w[buf][c][rb][swz(rb, t)]), uint32_t(sm.w[buf][c][rb][swz(rb, t + 4)]));
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                // (d, m) of weight rows 2t and 2t + 1 of this n-tile: one 16-byte shared load
                const float4 wq = *reinterpret_cast<const float4*>(&sm.wdm[buf][c][wn0 + 8 * j + 2 * t]);
                acc[j][0] += F::term_f(magic_to_float(s[j][0]), wq.x, wq.y, as0.x, as0.y);
                acc[j][1] += F::term_f(magic_to_float(s[j][1]), wq.z, wq.w, as0.x, as0.y);
                acc[j][2] += F::term_f(magic_to_float(s[j][2]), wq.x, wq.y, as1.x, as1.y);
                acc[j][3] += F::term_f(magic_to_float(s[j][3]), wq.z, wq.w, as1.x, as1.y);
            }
        }
        if (more) stash(buf ^ 1);
        __syncthreads();
        buf ^= 1;
    }

#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = m0 + wm0 + g + 8 * (i / 2), n = n0 + wn0 + 8 * j + 2 * t + (i % 2);
            if (m < M && n < N) {
                if (gridDim.z == 1)
                    y[(long long)m * N + n] = __float2half_rn(acc[j][i]);
                else
                    part[((long long)blockIdx.z * M + m) * N + n] = acc[j][i];
            }
        }
}

// y[i] = half(sum_z part[z][i]), z in order 0..S-1 (i over M x N).
__global__ void mma_reduce(const float* __restrict__ part, __half* __restrict__ y, long long total, int S) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float s = part[i];
    for (int z = 1; z < S; ++z) s += part[(long long)z * total + i];
    y[i] = __float2half_rn(s);
}

// gguf_window.cuh -- a GGUF weight block read with wide loads (shared by gguf_mmvq16.cu,
// gguf_mma.cu and decode_persistent.cu, which reads its windows from its shared-memory ring).
//
// Q4_0 / Q5_0 / Q8_0 blocks are 18 / 22 / 34 bytes, so a block is only 2-byte aligned and
// element-wise loads are 2 bytes wide. Here a block is read as the LW-byte-aligned window that
// covers it (LW = 16: two 16-byte loads for Q4_0 / Q4_1 / Q5_1, three for Q8_0; Q5_0 two, plus
// a third where the block crosses byte 32, which ptxas narrows to the one 4-byte word it uses),
// then shifted to its start in registers: the block's byte offset o in the window is a run-time
// value, so the shift is a few levels of selects on the word index o / 4 (one per bit) and one
// byte_perm per word for the half-word part o & 2 -- never a run-time index into a register
// array, which would put the array in local memory. get(k) then returns the 4 bytes at in-block
// offset k, which is what GGUFBlock::unpack_from consumes. The caller guarantees that every
// LW-aligned window covering a block lies inside the tensor (base address and byte size
// multiples of LW).
#pragma once
#include "gguf_common.cuh"

namespace vec16 {

constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

constexpr int LW = 16;   // window load width in bytes (8-byte loads were slower: bench/notes-gguf.md)

// One 16-byte load of read-only data into words w[0 .. 3]; SHARED: p points into shared memory
// (the persistent decode kernel's weight ring, decode_persistent.cu).
template <bool NOALLOC, bool SHARED = false>
__device__ __forceinline__ void load_chunk(const uint8_t* p, uint32_t* w) {
    if constexpr (SHARED) {
        const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a) : "memory");
    } else if constexpr (NOALLOC) {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
    } else {
        asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
    }
}

// A weight block held as an LW-aligned byte window in registers, shifted to its start.
template <class F, bool NOALLOC, bool SHARED = false>
struct Window {
    static constexpr int G = gcd(F::BYTES, LW);
    static constexpr int OMAX = LW - G;                        // largest offset of a block in its window
    static constexpr int NC = (OMAX + F::BYTES + LW - 1) / LW; // loads per block (worst case)
    static constexpr int NW = NC * LW / 4;                     // window words
    static constexpr int NS = (F::BYTES + 3) / 4 + 1;          // shifted words kept (block + 1)
    static constexpr int JMAX = OMAX / 4;                      // largest word offset o / 4

    uint32_t w[NW];    // the raw window (load_raw)
    uint32_t sel[NS];  // sel[i] = window word (o / 4) + i (0 past the window; finish)
    int o;             // the block's byte offset in the window
    int half;          // o & 2: the block starts mid-word

    __device__ __forceinline__ void load(const uint8_t* W, long long off) {
        load_raw(W, off);
        finish();
    }

    // Issue the window's loads only (a kernel can do other work before finish() uses them).
    __device__ __forceinline__ void load_raw(const uint8_t* W, long long off) {
        o = int(off & (LW - 1));
        const uint8_t* base = W + (off - o);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (c * LW < F::BYTES || c * LW < o + F::BYTES) {  // the first test is compile-time
                load_chunk<NOALLOC, SHARED>(base + c * LW, &w[c * LW / 4]);
            } else {
#pragma unroll
                for (int i = 0; i < LW / 4; ++i) w[c * LW / 4 + i] = 0u;
            }
        }
    }

    __device__ __forceinline__ void finish() {
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

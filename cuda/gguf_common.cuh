// gguf_common.cuh -- what every GGUF kernel shares: block layouts, unpacking, the per-block dot.
//
// A weight row is a run of 32-element blocks exactly as a .gguf file stores them (DESIGN.md §3):
//
//   Q4_0 18 B  half d;            u8 qs[16]     w = (q - 8) d      q in 0..15
//   Q4_1 20 B  half d, m;         u8 qs[16]     w = q d + m
//   Q5_0 22 B  half d; u8 qh[4];  u8 qs[16]     w = (q - 16) d     q in 0..31
//   Q5_1 24 B  half d, m; qh[4];  u8 qs[16]     w = q d + m
//   Q8_0 34 B  half d;            i8 qs[32]     w = q d
//   Q8_1 36 B  half2 (d, s);      i8 qs[32]     x = q d, s = sum(x)   (activations)
//
// unpack() turns one weight block into eight 32-bit words q[0..7], word i holding elements
// 4i..4i+3 as signed bytes -- the same order as the eight words of a Q8_1 block, so the block
// dot is  sumi = sum_i dp4a(q[i], a[i]).  Q4/Q5 values stay unsigned (0..15 / 0..31, still
// valid int8); their offset (8 / 16) or minimum m is applied once per block through s_a:
//
//   sum_j (q_j - 8) d_w * q_aj d_a = d_w (d_a sumi - 8 s_a)        (Q4_0; Q5_0 with 16)
//   sum_j (q_j d_w + m_w) q_aj d_a = (d_w d_a) sumi + m_w s_a      (Q4_1, Q5_1)
//
// because s_a = d_a sum_j q_aj (up to Q8_1's rounding, which is the point of storing s).
//
// Why the tricks:
// * Nibbles: a 4-byte word v of qs holds elements j..j+3 in its low nibbles and j+16..j+19 in
//   its high nibbles, so (v & 0x0F0F0F0F) and ((v >> 4) & 0x0F0F0F0F) are two ready DP4A
//   operands -- no per-element shifts.
// * Q5's fifth bits: four bits b0..b3 of qh (one per element of a word) are spread to bit 0 of
//   each byte by one multiply, h * 0x00204081 (copies of h shifted by 0, 7, 14, 21: bit j of
//   copy j lands on bit 8j, and no two copies' bits collide, so nothing carries), masked with
//   0x01010101 and shifted to bit 4. No branches, no loop over elements.
// * Alignment: Q4_0, Q5_0 and Q8_0 blocks are 18, 22, 34 bytes, so a block (and its qs) is only
//   2-byte aligned; words are read as two 16-bit loads there and as one 32-bit load for the
//   4-byte-aligned Q4_1 / Q5_1 / Q8_1.
// * The scale math uses __fmul_rn / __fadd_rn: they are never contracted into an FMA, so each
//   per-block term is bit-identical to the numpy emulation's float32 `block_dot`
//   (formats/gguf_blocks.py); only the order of the fp32 sum over blocks differs, and the
//   emulation's bound covers any order.
#pragma once
#include <cuda_fp16.h>
#include "pdl.cuh"
#include "warp_sum.cuh"
#ifdef __CUDACC_RTC__  // NVRTC (CuPy) ships no C library headers
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

namespace gguf {

__device__ __forceinline__ int load_word_b2(const uint8_t* p) {  // 2-byte aligned p
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return int(uint32_t(h[0]) | (uint32_t(h[1]) << 16));
}
__device__ __forceinline__ int load_word_b4(const uint8_t* p) {  // 4-byte aligned p
    return *reinterpret_cast<const int*>(p);
}
__device__ __forceinline__ float load_half(const uint8_t* p) {   // 2-byte aligned p
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Spread 4 bits (bits 0..3 of h) to bit 4 of each byte: the Q5 fifth bits of 4 elements.
__device__ __forceinline__ int q5_high_bits(uint32_t h) {
    return int((((h & 0xFu) * 0x00204081u) & 0x01010101u) << 4);
}

}  // namespace gguf

// Format traits. BYTES: block size; OFFSET: 8 / 16 for the symmetric 4/5-bit formats;
// HAS_MIN: block stores m; ALIGN4: blocks are 4-byte aligned (word loads may be 32-bit).
template <int BYTES_, int BITS_, int OFFSET_, bool HAS_MIN_>
struct GGUFBlock {
    static constexpr int BYTES = BYTES_, BITS = BITS_, OFFSET = OFFSET_;
    static constexpr bool HAS_MIN = HAS_MIN_, ALIGN4 = (BYTES_ % 4) == 0;

    __device__ __forceinline__ static int word(const uint8_t* p) {
        return ALIGN4 ? gguf::load_word_b4(p) : gguf::load_word_b2(p);
    }

    // One block -> d, m (0 when the format has none) and eight words of int8 values.
    __device__ __forceinline__ static void unpack(const uint8_t* b, float& d, float& m, int (&q)[8]) {
        d = gguf::load_half(b);
        m = HAS_MIN ? gguf::load_half(b + 2) : 0.0f;
        const uint8_t* p = b + (HAS_MIN ? 4 : 2);
        if constexpr (BITS == 8) {
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = word(p + 4 * i);
        } else {
            uint32_t qh = 0;
            if constexpr (BITS == 5) {
                qh = uint32_t(word(p));
                p += 4;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int v = word(p + 4 * i);
                q[i] = v & 0x0F0F0F0F;
                q[i + 4] = (v >> 4) & 0x0F0F0F0F;
                if constexpr (BITS == 5) {
                    q[i] |= gguf::q5_high_bits(qh >> (4 * i));
                    q[i + 4] |= gguf::q5_high_bits(qh >> (16 + 4 * i));
                }
            }
        }
    }

    // The same unpacking from any word source: get(k) returns the 4 bytes at in-block byte
    // offset k (k even, a compile-time constant once inlined). Used by the vector-load MMVQ,
    // which holds a block as a byte window in registers (gguf_mmvq16.cu).
    template <class Get>
    __device__ __forceinline__ static void unpack_from(const Get& get, float& d, float& m, int (&q)[8]) {
        const uint32_t h = uint32_t(get(0));
        d = __half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu)));
        m = HAS_MIN ? __half2float(__ushort_as_half((unsigned short)(h >> 16))) : 0.0f;
        constexpr int P = HAS_MIN ? 4 : 2;
        if constexpr (BITS == 8) {
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = get(P + 4 * i);
        } else {
            constexpr int PQ = P + (BITS == 5 ? 4 : 0);
            const uint32_t qh = BITS == 5 ? uint32_t(get(P)) : 0u;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int v = get(PQ + 4 * i);
                q[i] = v & 0x0F0F0F0F;
                q[i + 4] = (v >> 4) & 0x0F0F0F0F;
                if constexpr (BITS == 5) {
                    q[i] |= gguf::q5_high_bits(qh >> (4 * i));
                    q[i + 4] |= gguf::q5_high_bits(qh >> (16 + 4 * i));
                }
            }
        }
    }

    // The per-block term, exactly formats.gguf_blocks.<fmt>.block_dot in float32.
    __device__ __forceinline__ static float term(int sumi, float dw, float mw, float da, float sa) {
        return term_f(float(sumi), dw, mw, da, sa);  // exact: |sumi| <= 32 * 128 * 127 < 2^24 (Q8_0)
    }
    // The same with sumi already converted to float (exactly).
    __device__ __forceinline__ static float term_f(float fs, float dw, float mw, float da, float sa) {
        if constexpr (HAS_MIN) {
            return __fadd_rn(__fmul_rn(__fmul_rn(dw, da), fs), __fmul_rn(mw, sa));
        } else if constexpr (OFFSET != 0) {
            return __fmul_rn(dw, __fsub_rn(__fmul_rn(da, fs), __fmul_rn(float(OFFSET), sa)));
        } else {
            return __fmul_rn(__fmul_rn(dw, da), fs);
        }
    }

    // Dequantized element values in fp32, as gguf-py computes them (no FMA contraction).
    __device__ __forceinline__ static float value(int q, float d, float m) {
        return HAS_MIN ? __fadd_rn(__fmul_rn(d, float(q)), m) : __fmul_rn(d, float(q - OFFSET));
    }
};

struct BlockQ4_0 : GGUFBlock<18, 4, 8, false> {};
struct BlockQ4_1 : GGUFBlock<20, 4, 0, true> {};
struct BlockQ5_0 : GGUFBlock<22, 5, 16, false> {};
struct BlockQ5_1 : GGUFBlock<24, 5, 0, true> {};
struct BlockQ8_0 : GGUFBlock<34, 8, 0, false> {};

// int -> float without the (quarter-rate) I2F conversion: an integer accumulator started at
// SUMI_MAGIC (the bits of 1.5 * 2^23) holds the bits of the float 1.5 * 2^23 + sumi, exact for
// |sumi| < 2^22 (a block's |sumi| <= 32 * 128 * 127 < 2^19); subtracting 1.5 * 2^23 leaves sumi exactly.
constexpr int SUMI_MAGIC = 0x4B400000;
__device__ __forceinline__ float magic_to_float(int acc) { return __fsub_rn(__int_as_float(acc), 12582912.0f); }

// Q8_1 activation block: 36 bytes, 4-byte aligned.
constexpr int Q8_1_BYTES = 36;

__device__ __forceinline__ void load_q8_1(const uint8_t* b, float& d, float& s, int (&a)[8]) {
    const __half2 ds = *reinterpret_cast<const __half2*>(b);
    d = __low2float(ds);
    s = __high2float(ds);
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = gguf::load_word_b4(b + 4 + 4 * i);
}

// gguf_dequant.cu -- GGUF weight blocks -> fp16 rows, for the large-M path (dequant + cuBLAS).
//
// out[r, 32 b + j] = half(value(q_j, d, m)) for rows r = row0 .. row0 + rows - 1 of W, where
// value is gguf-py's fp32 arithmetic ((q - offset) * d, or q * d + m; gguf_common.cuh, no FMA
// contraction) rounded once to half -- so the result equals numpy's
// fmt.dequantize(qt).astype(float16) bit for bit.
//
// Four threads per block, each writing 8 consecutive halves (one 16-byte store), so a warp's
// stores cover 512 contiguous bytes -- full sectors. (One thread per block, four 16-byte stores
// 64 bytes apart, ran at about half the bandwidth: every store instruction then touched only
// half of each 32-byte sector it hit.) Each of the four threads unpacks the whole block with the
// same word tricks the dot kernels use and keeps its two words; the redundant header and qs
// reads hit L1. The writer, not the reader, dominates traffic (2 bytes out per 0.56..1.06 in).
// The caller converts a bounded slice of rows at a time into one reused buffer and hands each
// slice to cuBLAS, so the transient fp16 copy never grows with the matrix.
#include "gguf_common.cuh"

template <class F>
__global__ void __launch_bounds__(256)
dequant(const uint8_t* __restrict__ W, __half* __restrict__ out, long long row0, int rows, int nb) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * nb * 4) return;
    const long long blk = t / 4;  // block index within the slice (row-major over rows x nb)
    const int part = int(t % 4);  // elements 8 part .. 8 part + 7 = words 2 part, 2 part + 1
    const long long r = blk / nb;
    const int kb = int(blk % nb);
    float d, m;
    int q[8];
    F::unpack(W + ((row0 + r) * nb + kb) * F::BYTES, d, m, q);
    const int w0 = part == 0 ? q[0] : part == 1 ? q[2] : part == 2 ? q[4] : q[6];
    const int w1 = part == 0 ? q[1] : part == 1 ? q[3] : part == 2 ? q[5] : q[7];
    uint32_t packed[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int word = p < 2 ? w0 : w1;
        const int sh = 16 * (p % 2);
        const int e0 = int(int8_t(word >> sh)), e1 = int(int8_t(word >> (sh + 8)));
        const __half2 h = __floats2half2_rn(F::value(e0, d, m), F::value(e1, d, m));
        packed[p] = *reinterpret_cast<const uint32_t*>(&h);
    }
    reinterpret_cast<uint4*>(out)[t] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// gguf_dequant.cu -- GGUF weight blocks -> fp16 rows, for the large-M path (dequant + cuBLAS).
//
// out[r, 32 b + j] = half(value(q_j, d, m)) for rows r = row0 .. row0 + rows - 1 of W, where
// value is gguf-py's fp32 arithmetic ((q - offset) * d, or q * d + m; gguf_common.cuh, no FMA
// contraction) rounded once to half -- so the result equals numpy's
// fmt.dequantize(qt).astype(float16) bit for bit.
//
// One thread per block: it unpacks 32 values with the same word tricks the dot kernels use and
// writes its 64 contiguous output bytes as four 16-byte stores (K % 32 == 0 keeps every block's
// output 64-byte aligned). The writer, not the reader, dominates traffic (2 bytes out per
// 0.56..1.06 bytes in), so wide stores matter more than the 2-byte-aligned reads.
// The caller converts a bounded slice of rows at a time into one reused buffer and hands each
// slice to cuBLAS, so the transient fp16 copy never grows with the matrix.
#include "gguf_common.cuh"

template <class F>
__global__ void __launch_bounds__(256)
dequant(const uint8_t* __restrict__ W, __half* __restrict__ out, long long row0, int rows, int nb) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * nb) return;
    const long long r = t / nb;
    const int kb = int(t % nb);
    float d, m;
    int q[8];
    F::unpack(W + ((row0 + r) * nb + kb) * F::BYTES, d, m, q);
    uint4* dst = reinterpret_cast<uint4*>(out + (r * nb + kb) * 32);
#pragma unroll
    for (int v = 0; v < 4; ++v) {  // 8 elements (words 2v, 2v+1) per 16-byte store
        uint32_t packed[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int word = q[2 * v + p / 2];
            const int sh = 16 * (p % 2);
            const int e0 = int(int8_t(word >> sh)), e1 = int(int8_t(word >> (sh + 8)));
            const __half2 h = __floats2half2_rn(F::value(e0, d, m), F::value(e1, d, m));
            packed[p] = *reinterpret_cast<const uint32_t*>(&h);
        }
        dst[v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}

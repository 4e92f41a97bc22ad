// q8_1_quantize.cu -- activations x (M, K), fp16 or fp32, row-major -> Q8_1 blocks (36 B each).
//
// Per 32-element block (K % 32 == 0, the caller checks):
//   amax = max |x_j|            d = amax / 127 (fp32 division)
//   q_j  = roundf(x_j / d)      (a true fp32 division; roundf takes halves away from zero;
//                                 q = 0 for the whole block when amax == 0)
//   s    = sum_j x_j            (the original values, fp32)
//   block = half2(d, s) followed by the 32 int8 q_j; output rows are K/32 * 36 bytes.
//
// One warp per block: lane j owns element j, so the loads are one coalesced 64/128-byte read
// and each lane writes its own byte of qs. amax and s are xor-butterfly reductions
// (__shfl_xor_sync with offsets 16, 8, 4, 2, 1). fp32 addition is commutative, so after the
// butterfly every lane holds the same sum, and formats.gguf_blocks.butterfly_sum reproduces it
// bit for bit: the numpy Q8_1 codec and this kernel agree on qs, d *and* s exactly (no half-ulp
// allowance is needed). d and s are rounded to half (round to nearest even) only when stored.
// quantize_q8_1_split writes the same bytes in a split layout for the vector-load MMVQ
// (gguf_mmvq16.cu): the 32 qs bytes of block i at out + 32 i (so a block's qs are two aligned
// 16-byte loads, and a warp's 32 consecutive blocks one contiguous 1 KB run), then after all
// n_blocks of them, its half2 (d, s) at out + 32 n_blocks + 4 i. Same total size, same values.
// Division, not multiplication by 127/amax: that is what the codec (and llama.cpp's CUDA
// quantize_q8_1) specifies, and with the default -prec-div=true '/' is IEEE-exact.
#include "gguf_common.cuh"

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

// One warp per block: lane j quantizes element j; returns q_j, and d and s (every lane).
template <typename T>
__device__ __forceinline__ int quantize_lane(const T* __restrict__ x, long long blk, int lane, float& d, float& sum) {
    const float v = to_float(x[blk * 32 + lane]);
    float amax = fabsf(v);
    sum = v;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    d = amax / 127.0f;
    return amax == 0.0f ? 0 : int(roundf(v / d));
}

// grid.x * (blockDim.x / 32) >= number of blocks; blockDim.x a multiple of 32.
template <typename T>
__global__ void quantize_q8_1(const T* __restrict__ x, uint8_t* __restrict__ out, long long n_blocks) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    const long long blk = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (blk >= n_blocks) return;  // whole warps exit together: the shuffles below stay full
    float d, sum;
    const int q = quantize_lane(x, blk, lane, d, sum);
    uint8_t* b = out + blk * Q8_1_BYTES;
    b[4 + lane] = uint8_t(int8_t(q));
    if (lane == 0) *reinterpret_cast<__half2*>(b) = __halves2half2(__float2half_rn(d), __float2half_rn(sum));
}

// Split layout (see the header): qs of block i at out + 32 i, (d, s) at out + 32 n_blocks + 4 i.
template <typename T>
__global__ void quantize_q8_1_split(const T* __restrict__ x, uint8_t* __restrict__ out, long long n_blocks) {
    pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
    const long long blk = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (blk >= n_blocks) return;
    float d, sum;
    const int q = quantize_lane(x, blk, lane, d, sum);
    out[blk * 32 + lane] = uint8_t(int8_t(q));
    if (lane == 0)
        *reinterpret_cast<__half2*>(out + n_blocks * 32 + blk * 4) = __halves2half2(__float2half_rn(d), __float2half_rn(sum));
}

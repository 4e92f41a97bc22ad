// q8_1_quantize.cu -- activations x (M, K), fp16 or fp32, row-major -> Q8_1 blocks (36 B each),
// K % 32 == 0 (the caller checks); the arithmetic and both layouts are in q8_1.cuh.
//
// One warp per block: lane j owns element j, so the loads are one coalesced 64/128-byte read
// and each lane writes its own byte of qs. quantize_q8_1 writes the codec's interleaved blocks
// (output rows of K/32 * 36 bytes; gguf_mmvq.cu and gguf_mmq.cu read them); quantize_q8_1_split
// the split layout the vector-load MMVQ (gguf_mmvq16.cu) and the int8 MMA GEMM (gguf_mma.cu)
// read. Same values: the numpy Q8_1 codec and this kernel agree on qs, d *and*
// s exactly (no half-ulp allowance is needed).
#include "gguf_common.cuh"
#include "q8_1.cuh"

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

// grid.x * (blockDim.x / 32) >= number of blocks; blockDim.x a multiple of 32.
template <typename T, bool SPLIT>
__device__ __forceinline__ void quantize_blocks(const T* __restrict__ x, uint8_t* __restrict__ out, long long n_blocks) {
  const long long blk = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= n_blocks) return;  // whole warps exit together: the shuffles stay full
  q8_1_store<SPLIT>(to_float(x[blk * 32 + lane]), out, blk, n_blocks, lane);
}

template <typename T>
__global__ void quantize_q8_1(const T* __restrict__ x, uint8_t* __restrict__ out, long long n_blocks) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  quantize_blocks<T, false>(x, out, n_blocks);
}

template <typename T>
__global__ void quantize_q8_1_split(const T* __restrict__ x, uint8_t* __restrict__ out, long long n_blocks) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  quantize_blocks<T, true>(x, out, n_blocks);
}

// stream_read.cu -- a one-launch read of a buffer: no matmul, only the weight stream.
//
//   fold_out[16 b + w] = xor of the 32-bit words warp w of block b read;   out[:] = 0
//   (so the xor of fold_out[0 .. 16 gridDim.x) is the xor of every word of src)
//
// What it is for: a measured floor for an M = 1 matmul launched as one kernel. A GEMV of a weight
// of B bytes does all this kernel does (launch, read B bytes once, store its output) and its math
// besides, so this kernel's time for B bytes, timed the same way, is as fast as such a GEMV can
// be shown to go (`quantzoo bench kernels` times it beside every weight: read_us; `quantzoo bench
// model` decodes with every linear replaced by it). At small B that time is far from B / copy
// bandwidth -- launch, first-load latency and the last blocks' tail -- which is how far a "% of
// copy bandwidth" figure of a small weight can go at all.
//
// Why it is shaped so: a grid-stride walk in 16-byte loads (ld.global.nc.L1::no_allocate, the
// bytes are touched once), each thread issuing U independent loads a trip (in the SASS, nvcc
// 13.0, sm_90, 32 registers at U = 4 and 8: ptxas issues 4 loads before the first fold waits on
// its load, and at U = 8 each further load after a fold, so about 4 stay in flight), BPS blocks
// of 512 threads per SM (quantzoo/kernels/stream.py sweeps both and keeps the best per size).
// The xor fold, one plain store per warp, makes every load count (a read whose value is unused
// may be dropped by the compiler) and lets a test check that every word was read once.
// A GEMV's blocks each store their outputs at their end, and a block with a store outstanding
// retires later, so the floor pays that too: every warp ends with its fold store, and `out`
// (n_out16 16-byte words; the benches' timings pass none, the decode bound's linears their
// output) gets zeros spread over the blocks (word j from block j % gridDim.x). Prototypes (H200,
// 9.4 MB, PDL): stores from block 0 only 3.50 us, a store from every warp 3.85, a block barrier
// before one store per block 4.03 -- hence one store per warp and no barrier. (A first version
// xor-ed every warp's fold into one word by atomicXor, ~4,000 atomics on one address a launch:
// the H100's reads-only decode bound was 7 % lower with it.)
// It starts with pdl::grid_sync() like every kernel here, so it chains as a matmul would.
#include "pdl.cuh"
#include "stream_load.cuh"

namespace stream_detail {
__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
}  // namespace stream_detail

template <int U>   // blockDim.x == 512
__global__ void __launch_bounds__(512) stream_read(const uint4* __restrict__ src, long long n16,
                                                   uint4* __restrict__ out, long long n_out16,
                                                   unsigned* __restrict__ fold_out) {
  using namespace stream_detail;
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long i = first;
  unsigned acc = 0u;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  for (; i < n16; i += stride) acc ^= fold(load_stream(src + i));
  for (long long j = blockIdx.x + (long long)gridDim.x * threadIdx.x; j < n_out16; j += stride)
    out[j] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) fold_out[blockIdx.x * 16 + threadIdx.x / 32] = acc;
}

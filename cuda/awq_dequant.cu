// awq_dequant.cu -- AWQ W4A16 weight dequantisation: out[k, n] = fp16((q[k,n] - z[k/G,n]) * s[k/G,n]).
//
// Output is fp16 [K, 8*nw]: column words [c0, c0 + nw) of the [in, out] weight (the whole weight
// when c0 = 0, nw = N/8), ready for cuBLAS (torch.mm(x, out)). Used by the large-M path, which
// dequantises the whole weight into a reused buffer and hands it to cuBLAS (slabs of columns
// small enough to stay in L2 are an option, awq.SLAB_BYTES, off: measured slower,
// bench/notes-awq.md), and by ops.awq_dequantize.
//
// One thread per qweight word (8 weights) on each trip of a grid-stride loop (the host caps the
// grid at 16 blocks an SM, awq.dequantize_into): one 4-byte load of the word, one of the zero
// word, one 16-byte load of the 8 scales, the LOP3 conversion of awq_common.cuh, one 16-byte store.
// Thanks to the AWQ interleave the 4 half2 come out in natural column order (0,1)(2,3)(4,5)(6,7),
// so the store needs no shuffle. Bit-identical to the numpy reference (see awq_common.cuh).
// Consecutive threads take consecutive words of a row: loads and stores are coalesced.
#include "awq_common.cuh"

__global__ void __launch_bounds__(256)
awq_dequant_kernel(const unsigned* __restrict__ qweight, const unsigned* __restrict__ qzeros,
                   const half* __restrict__ scales, half* __restrict__ out, int K, int N, int G,
                   int c0, int nw) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  const int n8 = N / 8;
  const long long total = (long long)K * nw;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int k = (int)(i / nw), cc = (int)(i % nw), c = c0 + cc, g = k / G;
    const unsigned w = __ldg(qweight + (size_t)k * n8 + c);
    const awq::Zeros z = awq::make_zeros(__ldg(qzeros + (size_t)g * n8 + c));
    const uint4 sv = __ldg(reinterpret_cast<const uint4*>(scales + (size_t)g * N + 8 * c));
    const half2 s[4] = {awq::as_h2(sv.x), awq::as_h2(sv.y), awq::as_h2(sv.z), awq::as_h2(sv.w)};
    half2 o[4];
    awq::dequant8(w, z, s, o);
    *reinterpret_cast<uint4*>(out + ((size_t)k * nw + cc) * 8) =
        make_uint4(awq::as_u32(o[0]), awq::as_u32(o[1]), awq::as_u32(o[2]), awq::as_u32(o[3]));
  }
}

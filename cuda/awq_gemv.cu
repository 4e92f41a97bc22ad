// awq_gemv.cu -- AWQ W4A16 GEMV (one row of x: decode). Every lane streams its own weight words
// from global memory straight into registers, D k-steps ahead, and the tensor cores do its
// multiply-adds; inside an MMA no lane's products meet another lane's.
//
//   y[n] = fp16( sum_g  s[g, n] * sum_{k in g} (q[k, n] - z[g, n]) * x[k] )
//
// The same function as awq_small.cu: each product exact, fp32 sums per group, the zero taken out
// as z * sum_k x_k, the scale applied once per group; no weight is rounded to fp16
// (reference/awq_fp16.py::emulate_group_scaled and its fp32-order bound).
//
// Why it is shaped like this:
// * No shared-memory ring. awq_small.cu copies the weight into a per-warp shared ring so that a
//   lane can pick the four k rows its MMA fragment wants; the copies, the ring's waits and the
//   re-reads cost more per byte than the math (bench/NOTES.md, session 10). Here a lane (g, t)
//   (g = lane/4, t = lane%4) keeps NW column words (8 NW columns) and, in k-step s, loads rows
//   8s + 2t and 8s + 2t + 1 of them: two 8- or 16-byte loads, the 8 lanes of equal t covering
//   32 NW contiguous bytes of a row. The words go into an MMA as they are.
// * The MMA used diagonally. A fragment register holds two halves of one A row at k slots
//   (2t, 2t+1); a masked AWQ word gives two columns of ONE k row as a half2 (columns 0,1 under
//   0x000f000f, 2,3 under 0x00f000f0, 4..7 the same after >> 8). So the k slots of the MMA are
//   not k here: slot 2t carries the lane's even column of row r0 = 8s + 2t, slot 2t + 1 its odd
//   column of r0, slots 2t + 8 / 2t + 9 the same columns of r1 = r0 + 1. B (8 wide, one token)
//   sends slot 2t to output column 2t and slot 2t + 1 to output column 2t + 1:
//      B[2t][2t] = B[2t+8][2t] = x[r0], x[r1];   B[2t+1][2t+1] = B[2t+9][2t+1] = x[r0], x[r1]
//   and zero elsewhere. Then C[g][2t] (this lane's own accumulator) = w[r0][c0] x[r0] +
//   w[r1][c0] x[r1] for the lane's column c0, C[g][2t+1] the same for c1, C[g + 8][.] for the
//   0x00f000f0 columns: each lane's four accumulators are its own four columns. B is the lane's
//   x pair (x[r0], x[r1]) moved into place by one byte permute per B register (b0 takes x[r0],
//   b1 x[r1]), whose selector depends only on the lane (g == 2t: low halves, g == 2t + 1: high
//   halves, other lanes: zero).
// * No magic number, no subtraction (as awq_small.cu MODE 0): a masked nibble read as a half is
//   the subnormal q * 2^-24 (or q * 2^-20 under the high mask), which the tensor cores multiply
//   exactly. One SHF and four LOPs per word, one MMA per word (an MMA takes the same half of the
//   step's two row words, r0's and r1's). The zero point is fixed per
//   group, acc += s * (P - z' sum x), with sum x from one more MMA with an all-ones A (its C[g][2t]
//   is x[r0] + x[r1], the lane's own rows); z' comes from the zero word through the same masks.
// * Loads in flight without a deep ring: the steps run in rounds of D. At NW = 2 ptxas issues a
//   whole round's reloads at its start, so a lane has D to 2D steps of loads outstanding; at
//   NW = 4 (VEC) it issues the round's 8 weight reloads together just before the round's last
//   step (only x's at its start), so those have 1 to D steps. ptxas (nvcc 13, sm_90) gives 126
//   registers at NW = 2, D = 4: two 8-warp blocks per SM; 168 at NW = 4, D = 4 (4-warp blocks;
//   212 with VEC = false).
// * Every load is unconditional, and the rounds carry no predicate (see `issue` and the main
//   loop): a conditional load cost a full memory latency per step (below).
// * Grid: a block's WARPS warps share one tile of 8 NW column words and split the block's k
//   range; K is split across blocks (gridDim.y) to fill the SMs. The four lanes of a column
//   (different rows) meet by shuffles, the warps in shared memory (fixed order), the splits in an
//   fp32 workspace summed in split order by the tile's last block (awq_common.cuh):
//   deterministic, one launch, graph-replayable.
// * Tails: K is a multiple of the group size, so of the 8-row step. A lane whose columns run
//   past N reads the row's last words instead (clamped, never past the row) and its sums are not
//   stored. VEC = false (N/8 not a multiple of NW) loads single words.
//
// Measured on the H100 at M = 1, back to back under PDL (bench/NOTES.md, session 12): 4096->24576
// 25.1 us against awq_small's 29.2 (2.1 TB/s, 70 % of copy; the same walk with loads only, no
// math, takes 21.1); 4096->12288 and 4096->6144 tie; 12288->4096 (15.0 vs 14.4), 4096->4096 and
// 4096->1024 lose: with N/8 = 512 words there are only 32 column tiles, and the K splits that
// fill the SMs leave each warp a few dozen steps. Dispatch uses it for N >= 16384 (awq.GEMV_MIN_N),
// with (NW, WARPS, D) = (2, 8, 4) and gemv_plan's splits, except the runner's fused gate/up
// 4096->24576: (4, 4, 4) with 4 splits, the faster of the two inside the decode graph (session
// 27; awq.GEMV_TUNED). The first
// version, whose loads sat under `if (step < end)`, ran 2-4x slower: ptxas loaded into a
// temporary and copied it into the ring right after, so the copy waited for every load.
#include "awq_common.cuh"

namespace awq_gemv {

// The NW words of one row at p (VEC: one aligned 8- or 16-byte load; else NW single words, each
// clamped to the row's last word, `room` words from p).
template <int NW, bool VEC>
__device__ __forceinline__ void load_row(unsigned (&w)[NW], const unsigned* p, int room) {
  if constexpr (VEC && NW == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (VEC && NW == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < NW; ++j) w[j] = __ldg(p + min(j, room - 1));
  }
}

}  // namespace awq_gemv

// grid (ceil(N/8 / (8*NW)), splits); block 32*WARPS threads, each warp a slice of the block's k
// range; rows_per_split a multiple of 8.
template <int NW, int WARPS, int D, bool VEC>
__global__ void __launch_bounds__(32 * WARPS)
awq_gemv_kernel(const half* __restrict__ x, const unsigned* __restrict__ qweight,
                const unsigned* __restrict__ qzeros, const half* __restrict__ scales,
                half* __restrict__ y, float* __restrict__ ws, unsigned* __restrict__ counters,
                int K, int N, int G, int rows_per_split) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
  using namespace awq_gemv;
  static_assert(NW == 2 || NW == 4, "a lane keeps 2 or 4 column words");
  constexpr int TW = 8 * NW;  // column words per block tile
  __shared__ __align__(16) float red[WARPS][8 * TW];
  __shared__ int last_flag;
  const int n8 = N / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile_w0 = blockIdx.x * TW;
  const int cwl = VEC ? min(tile_w0 + NW * g, n8 - NW) : min(tile_w0 + NW * g, n8 - 1);
  const int room = n8 - cwl;
  const int splits = gridDim.y;
  const int2 range = awq::slice_steps<8>(K, rows_per_split, warp, WARPS);
  const int s0 = range.x, s1 = range.y;   // this warp's k-steps [s0, s1)
  const int steps_per_group = G / 8;

  // B fragment of lane (g, t): b0 = (B[2t][g], B[2t+1][g]), b1 = (B[2t+8][g], B[2t+9][g]) from
  // xw = (x[r0], x[r1]); byte-permute selectors (bytes 4..7 are the zero operand).
  const unsigned sel0 = g == 2 * t ? 0x4410u : g == 2 * t + 1 ? 0x1044u : 0x4444u;
  const unsigned sel1 = g == 2 * t ? 0x4432u : g == 2 * t + 1 ? 0x3244u : 0x4444u;

  // loop-carried sources (a value the loop updates is not rematerialised by ptxas every trip)
  const size_t step_words = (size_t)8 * n8;
  const unsigned* wp = qweight + (size_t)(8 * s0 + 2 * t) * n8 + cwl;   // row r0 of the next step
  const unsigned* xp = reinterpret_cast<const unsigned*>(x) + 4 * s0 + t;   // (x[r0], x[r1])
  unsigned wr[D][2][NW];
  unsigned xr[D];
  // Loads are issued unconditionally: past the warp's last step the sources stop advancing and
  // the last step is read again (unused). A load under a branch would land in a temporary that
  // the branch's join copies into the ring register, and that copy waits for the load: ptxas
  // did exactly that, and every step then paid a full memory latency.
  int to_issue = s1 - s0;   // steps whose loads are still to come, counting the one at wp
  auto issue = [&](unsigned (&w)[2][NW], unsigned& xw) {
    load_row<NW, VEC>(w[0], wp, room);
    load_row<NW, VEC>(w[1], wp + n8, room);
    xw = __ldg(xp);
    const bool more = --to_issue > 0;
    wp += more ? step_words : 0;
    xp += more ? 4 : 0;
  };

  float part[NW][2][4], acc[NW][2][4], sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NW; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[j][h][e] = acc[j][h][e] = 0.f;

  // scale and zero words of this lane's columns, for the group of step s
  uint4 sv[NW];
  unsigned zv[NW];
  auto load_group = [&](int s) {
    const int grp = (8 * s) / G;
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const int c = min(cwl + j, n8 - 1);
      sv[j] = __ldg(reinterpret_cast<const uint4*>(scales + (size_t)grp * N + 8 * c));
      zv[j] = __ldg(qzeros + (size_t)grp * n8 + c);
    }
  };
  // acc += s * (part - z' * sum x) per column word (awq::gemv_group_fixup), then clear the
  // group's partials
  auto flush_group = [&]() {
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const unsigned su[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
      unsigned zu[4];
      awq::gemv_zero_halves(zv[j], zu);
      awq::gemv_group_fixup(acc[j], part[j], sx[0], su, zu);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[j][h][e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sx[e] = 0.f;
  };

  const unsigned ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  if (s0 < s1) {
    load_group(s0);
#pragma unroll
    for (int d = 0; d < D; ++d) issue(wr[d], xr[d]);
    int left_in_group = steps_per_group - (s0 % steps_per_group);
    // one k-step from ring slot d (a compile-time index), whose loads are then reissued
    auto step = [&](const int s, unsigned (&wd)[2][NW], unsigned& xd) {
      unsigned w[2][NW];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) w[r][j] = wd[r][j];
      const unsigned xw = xd;
      issue(wd, xd);
      const unsigned b0 = __byte_perm(xw, 0u, sel0), b1 = __byte_perm(xw, 0u, sel1);
      awq::mma16816(sx, ones, b0, b1);
#pragma unroll
      for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned u0 = h ? w[0][j] >> 8 : w[0][j], u1 = h ? w[1][j] >> 8 : w[1][j];
          const unsigned a[4] = {u0 & awq::kLowMask, u0 & awq::kHighMask,
                                 u1 & awq::kLowMask, u1 & awq::kHighMask};
          awq::mma16816(part[j][h], a, b0, b1);
        }
      if (--left_in_group == 0 || s + 1 == s1) {   // the group (or the warp's range) ends
        flush_group();
        left_in_group = steps_per_group;
        if (s + 1 < s1) load_group(s + 1);
      }
    };
    // Whole rounds of D steps carry no predicate: a step under one made ptxas load into a
    // temporary and copy it into the ring after the load (a full latency per step). The last
    // < D steps are guarded.
    int s = s0;
    for (; s + D <= s1; s += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) step(s + d, wr[d], xr[d]);
    }
#pragma unroll
    for (int d = 0; d < D - 1; ++d)
      if (s + d < s1) step(s + d, wr[d], xr[d]);
  }

  // units off, then the four lanes t of a column (rows 2t, 2t+1 of every step) meet
  float v[NW][8];
#pragma unroll
  for (int j = 0; j < NW; ++j) awq::gemv_column_sums(acc[j], v[j]);
  if (t == 0) {
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int c = 0; c < 8; ++c) red[warp][8 * (NW * g + j) + c] = v[j][c];
  }
  __syncthreads();
  // the warps of the block in fixed order, one column word per thread
  for (int task = threadIdx.x; task < TW; task += 32 * WARPS) {
    const int cw = tile_w0 + task;
    if (cw >= n8) continue;
    float o[8];
    awq::gemv_sum_warps(o, red, 8 * task);
    if (splits == 1) awq::store8_half(y + 8 * cw, o);
    else awq::store8_float(ws + (size_t)blockIdx.y * N + 8 * cw, o);
  }
  if (splits == 1) return;
  if (!awq::last_block_of_tile(counters + blockIdx.x, splits, &last_flag)) return;
  for (int task = threadIdx.x; task < TW; task += 32 * WARPS) {
    const int cw = tile_w0 + task;
    if (cw >= n8) continue;
    float o[8];
    awq::sum8_partials(o, ws + 8 * cw, (size_t)N, splits);
    awq::store8_half(y + 8 * cw, o);
  }
}

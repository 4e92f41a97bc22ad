// gguf_wgmma.cu -- GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights x fp16 activations for Hopper
// (sm_90a): the weight blocks, dequantised in registers, are the register operand A of wgmma; x is
// operand B, read by the tensor cores from 128-byte-swizzled shared memory. The AWQ kernel
// awq_wgmma.cu is the model; this file differs in how weights reach the A fragments.
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[n, k] ),   w16 = half((q - offset) d)  or  half(q d + m)
//
// the same function as the dequant path (gguf_dequant.cu + cuBLAS): fp16 weights, fp32
// accumulation -- not the Q8_1 integer path of mmvq / mma. Q4_0 / Q5_0 / Q8_0's value is one
// product of an exact small integer and d, which fp16 math rounds once, exactly as the fp32
// product rounded to half: w16 is bit-equal to fmt.dequantize rounded to half. Q4_1 / Q5_1's
// q d + m is one fp16 FMA, the correctly rounded half of q d + m. The dequant path rounds twice
// (fp32 sum, then half), which is the same value whenever the fp32 sum is exact -- always when
// |q d| and |m| are within 2^9 of each other (15 + 11 significant bits fit in fp32's 24), as in
// any block quantised from real data (m ~ -8 d) -- and at most one ulp of that weight away
// otherwise (the tests' bound covers it).
//
// computed transposed, y^T = W x^T: wgmma's M (64 rows per instruction) runs over weight rows
// (output columns n), its N over tokens; one instruction is 64 rows x T tokens x 16 k.
//
// Block: NWG consumer warpgroups, each owning 64 JN weight rows (JN = 2 instructions per k-step
// up to T = 128, 1 at T = 256), x T tokens, and a producer warpgroup; K walked in D
// shared-memory stages of BK = 64 k (2 GGUF blocks), or 128 k (4 blocks) up to M = 32.
//
// Why the tricks:
// * Copies by TMA from one producer thread, as in awq_wgmma.cu (which says why: no per-thread
//   copy addresses or predicates, no block barrier in the K loop, setmaxnreg: wg::Regs). The
//   weight is seen as a byte matrix [N, nb BYTES] (rows 16-byte multiples: K % 256 == 0, checked
//   by the host). A row's blocks of stage s are RB = 36 / 40 / 44 / 48 / 68 bytes (Q4_0 /
//   Q4_1 / Q5_0 / Q5_1 / Q8_0; twice that at BK = 128) at byte s RB, mostly not a multiple of
//   16, and a TMA box must start on a 16-byte boundary (an unaligned innermost coordinate is an
//   illegal instruction, found here). So a stage's box is ROWS rows x SLOT = 48 / 48 / 64 / 48 /
//   80 bytes (80 / 80 / 96 / 96 / 144 at BK = 128) from the 16-byte window holding the stage,
//   and the readers add the stage's offset o = (s RB) % 16, the same in every row (a multiple
//   of gcd(RB, 16), so at most 16 - gcd(RB, 16)). Bytes of the window outside the stage are
//   never read; past the row's end TMA reads zeros, and rows past N read as zeros (d = 0: they
//   contribute 0, and are not stored). Before (sessions 8 to 15) every thread issued 3-5
//   16-byte cp.async a stage into such windows and the block met at one barrier a stage.
// * 128-k stages up to M = 32 (host: gguf.WGMMA_CFGS), plain launches with one consumer
//   warpgroup a block and 3-4 blocks an SM as in awq_wgmma.cu (shared memory holds 3 and 2 of
//   Q8_0's), GLU with its two warpgroups at one block an SM. At small M what a block waits for is its stage's TMA
//   copy, and the copy's time went with its ROWS box rows more than with its bytes: the same
//   bytes in boxes of half the rows, twice as wide, took q4_0 4096->12288 M = 16 from 24.9 to
//   20.7 us and q8_0 from 31.7 to 26.1, while dropping all dequant work saved only 5 %
//   (bench/NOTES.md, session 53). A 128-k stage's window is one box row of 80 bytes for Q4_0's
//   72 (two rows of 48 for 2 x 36 before). The consumers take such a stage as two 64-k wgmma
//   groups one after the other: the A fragments of the whole stage would not fit the registers
//   that 4 blocks an SM leave (ptxas then serialises the wgmmas).
// * Shared rows of 48, 80 or 144 bytes (12, 20 or 36 words) put the 8 rows g of a warp's reads 4
//   words apart mod 32 banks; a thread's 2-byte reads of one row span at most 3 words: no
//   conflicts. (Q5_0 / Q5_1's 96-byte rows at BK = 128 put rows g and g + 4 on the same banks:
//   2-way conflicts, left as they are; those formats gained least from the wider rows.)
//   Q5_0's 64-byte rows (BK = 64) would put rows g and g + 2 on the same banks (4-way conflicts); they come
//   in TMA's 64-byte swizzle instead, which moves each pair of rows to its own 16-byte chunk
//   position, and the readers XOR their in-row offsets with the same key.
// * A fragment (mma.sync's m16n8k16 A, per warp of the warpgroup): thread (g, t) holds rows g,
//   g + 8 and k pairs (2t, 2t+1), (2t+8, 2t+9) of a 16-k step. In a Q4_0 block, k < 16 is the
//   low nibble of qs byte k and k >= 16 the high nibble of byte k - 16, so the two bytes
//   2t, 2t+1 spread 16 bits apart by one byte permute give, through one LOP3 each, the k pair of
//   step 0 (low nibbles, 1024 + q) and of step 1 (high nibbles, 1024 + 16 q): exact q - 8 by
//   one hsub2 / hfma2, then one hmul2 by d (Q4_1: exact q, then one hfma2 by d plus m -- the
//   same count). Q5_0 / Q5_1: the same, with the two elements' fifth bits on mantissa bit 4
//   (bit 8 in the 16x form), carried by the word the nibbles are or-ed into -- the magic's
//   high bytes with the fifth bits already in place. Per row and block, qh shifted by the
//   lane's 2t puts each k pair's two bits at bits 8 i, 8 i + 1 (i = 2 hf + p); four LOP3 (and
//   four shifts) build fa / fb, one byte per pair of elements k / k + 1 plus the magic's 0x64
//   bytes; then one byte permute a k pair picks the lane word (was: a shift by the lane's bits,
//   two shifts and three LOP3 a pair -- the K loop at T = 256 274 -> 228 instructions a stage,
//   Q4_0's 138; q5_0 4096->4096 M = 1024 59.6 -> 55.8 us, session 54). Q8_0: signed bytes,
//   (b & 0xff) ^ 0x80 in the mantissa of 1024 (one LOP3: (v & 0x00ff00ff) ^ 0x64806480) is
//   1152 + b, exact b by hsub2.
// * 64 k of fragments (a 64-k stage, or half a 128-k one) are all dequantised, then issued as one
//   wgmma group that the warpgroup waits for (wg::stage_step says why), and the buffer is freed
//   after the stage's last group; another consumer warpgroup (or block) dequantises meanwhile.
// * Split K and whole waves as in awq_wgmma.cu: with no more tiles than resident blocks every
//   tile is split so that the grid fills one wave; with more, whole waves of tiles walk all of K
//   and only the last, partly empty wave's tiles are split. Their partials meet in an fp32
//   workspace that wgmma_reduce adds in split order (deterministic).
// * Tails: weight rows past N are zero-filled (d = 0: they contribute 0) and not stored. No x box
//   reaches past token M (wg::x_box_row says why): with M < T the box holds the M rows, and the
//   stale shared-memory rows after them feed only outputs that are not stored; with M >= T the
//   last token tile is shifted back to end at M.
// * GLU (matmul(glu=True), the decoder MLP's gate/up projection with W = [gate; up], N = 2F):
//   y [M, F] = swiglu(x gate^T, x up^T) (swiglu.cuh, silu_mul's roundings) in the epilogue. A
//   block's two weight boxes a stage are its FR = ROWS / 2 gate rows and the FR matching up rows,
//   so warpgroup 0 computes a gate tile and warpgroup 1 the up tile of the same outputs with the
//   unchanged K loop; the two tiles meet in shared memory (wg::glu_store). Split tiles leave
//   their gate and up partials (wg::SplitParts) and wgmma_reduce<V, true> applies the GLU. Against
//   the product + silu_mul launch (CUPTI, q4_0 4096->24576, bench/NOTES.md, session 21): M = 128
//   55.8 vs 54.2 + 5.3 us, M = 512 153.8 vs 152.4 + 18.0, M = 2048 635 vs 606 + 66.
//
// Measured on the H100 (bench/NOTES.md, sessions 8 and 16; rotated weights, us): with the
// producer warpgroup 0.7-1.0x the time of the session-15 kernel (every thread cp.async'ing, one
// barrier a stage): q4_0 4096->12288 M = 64 38.2 -> 33.1, M = 512 107.2 -> 97.3, M = 2048
// 332.9 -> 309.5 (0.90x cuBLAS fp16); q8_0 4096->24576 M = 2048 758 -> 671; q5_0 0.7-0.9x, its
// fifth bits' ALU in the K loop (0.8-0.9x since session 54's byte permutes). Dispatch uses it
// in every format from M = 9 to 2048 on weights of 4096 x 4096 and up (gguf.WGMMA_MIN_NK,
// WGMMA_MAX_M: the whole prefill runs at the card's power cap, where it wins to 2048; session
// 31) -- Q4_0 / Q4_1 / Q8_0 from M = 5-8 there, by GLU and K (gguf.WGMMA_SMALL_M, session 54:
// mmvq's time grows with M) --, and to M = 96 on weights from 4096 x 1024 once
// M N K > 2^27 (gguf.WGMMA_MID_*, session 51: 4096->1024 M = 64 12.4 vs mma 14.9 us); past 96
// dequant + cuBLAS stays faster on those.
//
// Compiled only for sm_90a; for any other target the kernel body is empty and the host
// (quantzoo/kernels/gguf.py) never launches it there.
#include "gguf_common.cuh"
#include "awq_common.cuh"   // smem_addr, as_h2, as_u32, lop3_and_or, kMagic
#include "wgmma_sm90.cuh"   // and swiglu.cuh

namespace ggw {

constexpr int HK = 64;  // k per wgmma group: 2 GGUF blocks, one 128-byte swizzle row of x

template <class F, int NWG, int T, int D, bool GLU = false, int BK = HK>
struct Cfg {
  static constexpr int CONSUMERS = 128 * NWG;
  static constexpr int THREADS = CONSUMERS + 128;      // + the producer warpgroup
  static constexpr int JN = T == 256 ? 1 : 2;          // wgmma instructions (64 rows) per k-step
  static constexpr int ROWS = 64 * JN * NWG;           // weight rows (output columns) per block
  static constexpr int HALVES = BK / HK;               // 64-k x tiles (and wgmma groups) a stage
  static constexpr int RB = BK / 32 * F::BYTES;        // bytes of a row per stage (BK = 64: 36, 40, 44, 48, 68)
  static constexpr int GCD16 = (RB & -RB) < 16 ? (RB & -RB) : 16;   // gcd(RB, 16): RB's lowest set bit, at most 16
  static constexpr int MAX_O = 16 - GCD16;             // the largest stage offset o in a window
  static constexpr int SLOT = (RB + MAX_O + 15) / 16 * 16;   // the TMA box's row: 48, 48, 64, 48, 80 bytes at BK = 64
  static constexpr int SWIZZLE = SLOT == 64 ? 64 : 0;   // the weight box's TMA swizzle (bytes; Q5_0)
  static constexpr int PH = F::HAS_MIN ? 4 : 2;        // in a block: qh (5-bit formats) after d [, m]
  static constexpr int PQ = PH + (F::BITS == 5 ? 4 : 0);   // and qs after that
  static constexpr int X_HALF = T * 128;               // a 64-k x tile: T tokens x 64 halves, swizzled
  static constexpr int X_BYTES = HALVES * X_HALF;
  static constexpr int STAGE = (X_BYTES + ROWS * SLOT + 1023) / 1024 * 1024;
  static constexpr int SMEM = D * STAGE + 1024;        // + slack to align the base to 1024
  static_assert(F::BITS == 8 ? !F::HAS_MIN && F::OFFSET == 0
                             : F::OFFSET == (F::HAS_MIN ? 0 : 1 << (F::BITS - 1)),
                "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0");
  static_assert(RB % 4 == 0, "a stage sits at a 4-byte offset o of its window (SLOT), its fields 2-byte aligned");
  static_assert(T % 8 == 0 && T >= 8 && T <= 256, "wgmma N (tokens) is a multiple of 8");
  static_assert(ROWS <= 256 && SLOT <= 256, "a TMA box is at most 256 rows of 256 bytes");
  static_assert(BK == HK || (BK == 2 * HK && SWIZZLE == 0), "64- or 128-k stages (the 64-byte swizzle spans 64 bytes)");
  static_assert(!GLU || NWG == 2, "GLU: warpgroup 0 takes the gate rows, warpgroup 1 the up rows");
  static_assert(!GLU || D * STAGE >= 2 * T * (ROWS / 2 + 8) * 2, "GLU: the stages hold the gate and up tiles (fp16)");
};

}  // namespace ggw

// grid (dp_tiles + (tiles - dp_tiles) * splits), tiles = tiles_m x ceil(N / ROWS): tile i =
// (token tile i % tiles_m, row tile i / tiles_m), token tiles varying fastest so that the blocks
// reading the same weights run together. Blocks below dp_tiles each do tile i over all of K; the
// rest do split j % splits of tile dp_tiles + j / splits (j = block - dp_tiles): stages
// [split sps, (split + 1) sps) of the nb / (BK / 32) (the host makes every split non-empty) -- the
// schedule of awq_wgmma.cu (wgmma_tiles.schedule). Block ggw::Cfg::THREADS (128 NWG + 128)
// threads. Tensor maps (host, kernels/gguf.py): x fp16 [M, K] box 64 x x_rows (x_rows =
// min(T, M): wg::x_box_row), 128-byte swizzle; W bytes [N, nb BYTES] box SLOT x ROWS (GLU: x
// ROWS / 2, a gate box and an up box a stage), swizzle ggw::Cfg::SWIZZLE (rows 16-byte
// multiples: nb % 8 == 0). With
// splits > 1 the split tiles' fp32 partials go to part (wg::SplitParts: [splits][M][the split
// columns]), which wgmma_reduce (the next launch) sums.
template <class F, int NWG, int T, int D, bool GLU = false, int BPS = 1, int BK = ggw::HK>
__global__ void __launch_bounds__(128 * NWG + 128, BPS)
gguf_wgmma(const __grid_constant__ wg::TmaDesc wmap, const __grid_constant__ wg::TmaDesc xmap,
           half* __restrict__ y, float* __restrict__ part, int M, int N, int nb, int tiles_m, int dp_tiles,
           int splits, int sps, int x_rows) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = ggw::Cfg<F, NWG, T, D, GLU, BK>;
  constexpr int JN = C::JN;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const unsigned base = (awq::smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - awq::smem_addr(smem_raw));

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const auto [whole, tile, split, n_split] = wg::BlockWork(dp_tiles, splits);
  // this tile's tokens are [m_tile, m_tile + T); its x box starts at token m0
  const int m0 = wg::x_box_row((tile % tiles_m) * T, M, x_rows);
  // GLU: the tile's FR gate rows start at n0, its up rows at N / 2 + n0
  constexpr int FR = GLU ? C::ROWS / 2 : C::ROWS;
  const int n0 = (tile / tiles_m) * FR;
  const int st0 = split * sps;
  const int nst = nb / (BK / 32);   // stages of K (the host takes K % 256 == 0)
  const int n_stages = whole ? nst : min(nst, st0 + sps) - st0;

  // full[b]: stage in buffer b has landed; empty[b]: every consumer warp is done with buffer b
  __shared__ unsigned long long bars[2 * D];
  const unsigned full0 = wg::init_stage_bars<D>(bars, C::CONSUMERS / 32), empty0 = full0 + 8 * D;

  if (tid >= C::CONSUMERS) {   // the producer warpgroup: one thread issues every copy
    wg::set_max_regs<false, wg::Regs<NWG, BPS>::PRODUCER>();
    if (tid == C::CONSUMERS) {
      wg::prefetch_map(&xmap); wg::prefetch_map(&wmap);
      for (int st = 0; st < n_stages; ++st) {
        const int b = st % D, s = st0 + st;
        if (st >= D) wg::mbar_wait(empty0 + 8 * b, (st / D - 1) & 1);
        const unsigned S0 = base + b * C::STAGE, bar = full0 + 8 * b;
        wg::mbar_arrive_expect_tx(bar, C::HALVES * x_rows * 128 + C::ROWS * C::SLOT);
#pragma unroll
        for (int hx = 0; hx < C::HALVES; ++hx) wg::tma_2d(S0 + hx * C::X_HALF, &xmap, BK * s + ggw::HK * hx, m0, bar);
        wg::tma_2d(S0 + C::X_BYTES, &wmap, (s * C::RB) & ~15, n0, bar);   // the 16-byte window
        if constexpr (GLU) wg::tma_2d(S0 + C::X_BYTES + FR * C::SLOT, &wmap, (s * C::RB) & ~15, N / 2 + n0, bar);
      }
    }
    return;   // nothing after setmaxnreg.dec is shared with the consumers (awq_wgmma.cu says why)
  }
  wg::set_max_regs<true, wg::Regs<NWG, BPS>::CONSUMER>();
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  // 64-byte weight rows come in TMA's 64-byte swizzle (16-byte chunk c of row r at chunk
  // c ^ (r / 2 % 4)); this thread's rows all have r / 2 % 4 = g / 2 % 4
  const int key = C::SWIZZLE == 64 ? ((g >> 1) & 3) << 4 : 0;
  // this thread's weight rows in the block: instruction j, r8 = 0 / 1 -> row rr(j) + 8 r8
  auto rr = [&](int j) { return 64 * JN * wg + 64 * j + 16 * wq + g; };
  float acc[JN][T / 2];   // written first by the k-step 0 wgmma (accumulate = 0)

  for (int st = 0; st < n_stages; ++st) {
    const int buf = st % D;
    wg::mbar_wait(full0 + 8 * buf, (st / D) & 1);
    const unsigned char* S0 = smem + buf * C::STAGE;
    const int o = ((st0 + st) * C::RB) & 15;   // the stage's offset in each row's window
    // a 128-k stage in two 64-k groups, one after the other (wg::stage_step waits): the A
    // fragments of a whole stage would not fit the registers at several blocks an SM
#pragma unroll 1
    for (int hx = 0; hx < C::HALVES; ++hx) {
      const unsigned long long desc = wg::desc_sw128(base + buf * C::STAGE + hx * C::X_HALF);
      unsigned a[ggw::HK / 16][JN][4];   // the group's A fragments, all dequantised before its wgmma
#pragma unroll
      for (int b = 0; b < 2; ++b) {   // the group's two GGUF blocks, 2 k-steps each
        // per row (j, r8): d (and m) broadcast, and the 16-bit words the k pairs come from -- 4 and
        // 5 bits: bytes 2t, 2t+1 and 2t+8, 2t+9 of qs (both k-steps of the block) plus, for 5 bits,
        // the 32 fifth bits qh (bit k: element k); Q8_0: bytes 16 h + 2t.. and 16 h + 2t + 8.. for
        // k-step half h.
        constexpr int NQ = F::BITS == 8 ? 4 : 2;
        unsigned qv[JN][2][NQ];
        unsigned qh[JN][2];
        half2 dd[JN][2], mm[JN][2];
#pragma unroll
        for (int j = 0; j < JN; ++j)
#pragma unroll
          for (int r8 = 0; r8 < 2; ++r8) {
            // the row's bytes; `at` places in-row byte offset f as TMA's swizzle put it
            const unsigned char* row = S0 + C::X_BYTES + (rr(j) + 8 * r8) * C::SLOT;
            const int ob = o + (2 * hx + b) * F::BYTES;   // the block's offset in the row
            auto at = [&](int f) { return row + (f ^ key); };
            // d (and m) in both lanes of a half2: byte_perm 0x1010 -> (d, d), 0x3232 -> (m, m);
            // a 16-bit d times 0x10001 copies it into the high half
            if constexpr (F::HAS_MIN) {   // 20 / 24-byte blocks, o in {0, 8}: ob % 4 == 0, d, m one word
              const unsigned dm = *reinterpret_cast<const unsigned*>(at(ob));
              dd[j][r8] = awq::as_h2(__byte_perm(dm, 0u, 0x1010));
              mm[j][r8] = awq::as_h2(__byte_perm(dm, 0u, 0x3232));
            } else {
              dd[j][r8] = awq::as_h2(unsigned(*reinterpret_cast<const unsigned short*>(at(ob))) * 0x10001u);
            }
#pragma unroll
            for (int q = 0; q < NQ; ++q)   // 2-byte loads: qs may sit at an even, not 4-byte, offset
              qv[j][r8][q] = *reinterpret_cast<const unsigned short*>(at(ob + C::PQ + 16 * (q >> 1) + 8 * (q & 1) + 2 * t));
            if constexpr (F::BITS == 5)   // shifted so that the pair (16 hf + 8 p + 2t, + 1) sits at 8 (2 hf + p)
              qh[j][r8] = (unsigned(*reinterpret_cast<const unsigned short*>(at(ob + C::PH)))
                           | (unsigned(*reinterpret_cast<const unsigned short*>(at(ob + C::PH + 2))) << 16)) >> (2 * t);
          }
        // 4 / 5 bits: (1024 + q) - (1024 + OFFSET), and (1024 + 16 q) / 16 - (64 + OFFSET), both
        // exact: the halves of 1024 + OFFSET and -(64 + OFFSET) (fp16's ulp is 1 at 1024 and 1/16
        // at 64, so adding OFFSET, or 16 OFFSET, to the bits of 0x6400 / 0xd400 adds OFFSET)
        constexpr unsigned LO = (0x6400u + F::OFFSET) * 0x10001u, HI = (0xd400u + 16 * F::OFFSET) * 0x10001u;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)   // which 16 of the block's 32 k
#pragma unroll
          for (int j = 0; j < JN; ++j)
#pragma unroll
            for (int r8 = 0; r8 < 2; ++r8) {
              // 5 bits: the magic's high bytes with the fifth bits of this half's two k pairs
              // already in place (mantissa bit 4 of each lane, bit 8 in the 16x form), the
              // pair of p in byte p of fa (element k) and fb (element k + 1); one byte permute
              // a pair then makes the word the nibbles are or-ed into (see the header)
              unsigned fa = 0, fb = 0;
              if constexpr (F::BITS == 5) {
                const unsigned h = qh[j][r8];
                if (hf == 0) {
                  fa = awq::lop3_and_or(h << 4, 0x00001010u, 0x64640000u);
                  fb = awq::lop3_and_or(h << 3, 0x00001010u, 0x64640000u);
                } else {
                  fa = awq::lop3_and_or(h >> 16, 0x00000101u, 0x00006464u);
                  fb = awq::lop3_and_or(h >> 17, 0x00000101u, 0x00006464u);
                }
              }
#pragma unroll
              for (int p = 0; p < 2; ++p) {   // p: k pair 2t.. or 2t + 8..
                half2 v;
                if constexpr (F::BITS == 8) {
                  const unsigned sp = __byte_perm(qv[j][r8][2 * hf + p], 0u, 0x4140);
                  unsigned u;
                  // (a & b) ^ c: LUT 0x6A = (0xF0 & 0xCC) ^ 0xAA
                  asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(u) : "r"(sp), "r"(0x00ff00ffu), "r"(0x64806480u));
                  v = __hsub2(awq::as_h2(u), awq::as_h2(0x64806480u));   // (1152 + b) - 1152 = b
                } else {
                  const unsigned sp = __byte_perm(qv[j][r8][p], 0u, 0x4140);   // [b0, 0, b1, 0]
                  // the bits around the nibbles: the magic 1024 in each lane, or for 5 bits
                  // 1024 + 16 fifth (1024 + 256 fifth in the 16x form): [fa.p, fa.2, fb.p, fb.2]
                  // for the low nibbles, [0, fa.p, 0, fb.p] for the high ones
                  unsigned mag = awq::kMagic;
                  if constexpr (F::BITS == 5)
                    mag = __byte_perm(fa, fb, hf == 0 ? 0x6420u + 0x101u * p : 0x4302u + 0x1010u * p);
                  if (hf == 0)
                    v = __hsub2(awq::as_h2(awq::lop3_and_or(sp, 0x000f000fu, mag)), awq::as_h2(LO));
                  else
                    v = __hfma2(awq::as_h2(awq::lop3_and_or(sp, 0x00f000f0u, mag)), awq::as_h2(0x2c002c00u),
                                awq::as_h2(HI));
                }
                // v = q - OFFSET exactly; then one rounding: (q - OFFSET) d, or q d + m
                half2 w;
                if constexpr (F::HAS_MIN) w = __hfma2(v, dd[j][r8], mm[j][r8]);
                else w = __hmul2_rn(v, dd[j][r8]);
                a[2 * b + hf][j][r8 + 2 * p] = awq::as_u32(w);
              }
            }
      }
      // the group's 4 k-steps as one wgmma group, done on return
      wg::stage_step<T, JN, ggw::HK / 16>(acc, a, desc, st > 0 || hx > 0);
    }
    if (lane == 0) wg::mbar_arrive(empty0 + 8 * buf);   // the buffer is free again
  }
  wg::drain<T, JN>(acc);

  // acc[j][4i + 2 r8 + e]: weight row n0 + rr(j) + 8 r8, token m0 + 8i + 2t + e. GLU: the
  // block's row lr = rr(j) + 8 r8 is gate row n0 + lr in warpgroup 0 and up row N / 2 + n0 + lr -
  // FR in warpgroup 1, for output column n0 + lr - FR wg of y [M, N / 2].
  const int m_tile = wg::first_stored_row(m0, M, x_rows, tiles_m, T);
  const int ny = GLU ? N / 2 : N;   // y's columns
  if constexpr (GLU) {
    // silu(gate) * up: the block's gate tile (warpgroup 0) and up tile (warpgroup 1), rounded to
    // fp16 as y would hold them, go to shared memory -- once both warpgroups' last wgmma has read
    // the stages -- and every consumer thread then takes a share of the outputs (wg::glu_store).
    // A split tile stores its partials below and needs neither barrier (n_split is the block's).
    if (n_split == 1) {
      wg::consumers_sync(C::CONSUMERS);
      half* tiles = reinterpret_cast<half*>(smem);
      half* tile = tiles + wg * T * (FR + 8);
#pragma unroll
      for (int j = 0; j < JN; ++j)
#pragma unroll
        for (int r8 = 0; r8 < 2; ++r8)
#pragma unroll
          for (int i = 0; i < T / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              tile[(8 * i + 2 * t + e) * (FR + 8) + rr(j) - FR * wg + 8 * r8] = __float2half_rn(acc[j][4 * i + 2 * r8 + e]);
      wg::consumers_sync(C::CONSUMERS);
      wg::glu_store<T, FR>(tiles, y, m0, m_tile, M, n0, ny, C::CONSUMERS);
      return;
    }
  }
  const wg::SplitParts parts(ny, FR, dp_tiles, tiles_m, GLU);
#pragma unroll
  for (int j = 0; j < JN; ++j)
#pragma unroll
    for (int r8 = 0; r8 < 2; ++r8) {
      const int lr = rr(j) + 8 * r8;
      const int n = n0 + lr - (GLU ? FR * wg : 0);   // y's column
      if (n >= ny) continue;
#pragma unroll
      for (int i = 0; i < T / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = m0 + 8 * i + 2 * t + e;
          if (m < m_tile || m >= M) continue;   // another tile's row, or past M
          const float v = acc[j][4 * i + 2 * r8 + e];
          if (n_split > 1) part[parts.at(split, M, m, n, GLU && wg)] = v;
          else y[(size_t)m * N + n] = __float2half_rn(v);
        }
    }
#endif
}

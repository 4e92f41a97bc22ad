// awq_wgmma.cu -- AWQ W4A16 matrix product for Hopper (sm_90a): the weight, dequantised in
// registers, is the register operand A of wgmma; x is operand B, read by the tensor cores
// straight from 128-byte-swizzled shared memory.
//
//   y[m, n] = fp16( sum_k x[m, k] * w16[k, n] ),   w16 = fp16((q - z) * s)   (awq_common.cuh)
//
// computed transposed, y^T = W^T x^T: wgmma's M (64 rows per instruction) runs over output
// columns n, its N over tokens m, so one instruction is 64 columns x T tokens x 16 k.
//
// Block: NWG warpgroups, each owning 128 output columns (16 column words; 64 columns at T = 256)
// x the block's T tokens; K walked in D shared-memory stages of 64 rows (one 128-byte swizzle
// row of x).
//
// Why the tricks:
// * wgmma, not mma.sync: wgmma issues a 64 x T x 16 product per instruction for a whole
//   warpgroup, asynchronously, so the dequant of the next k-step runs while the tensor cores work.
// * The weight as A from registers: the fp16 weight never exists, not even in shared memory.
//   A's fragment in warp w of a warpgroup is mma.sync's m16n8k16 A fragment: thread (g, t)
//   (g = lane/4, t = lane%4) holds rows g and g + 8, k pairs (2t, 2t+1) and (2t+8, 2t+9). A row
//   index is free to mean any output column, so the 4 rows a thread holds across the 2
//   instructions of a k-step (j = 0, 1; rows g and g + 8) stand for 4 columns of ONE packed word:
//   lanes g and g + 1 (even g) take the low and high half of the same word. A byte permute of the
//   words of rows k and k + 1 first puts both rows' nibbles of a column 16 bits apart, so each
//   LOP3 yields a k pair of one column; then exact q - z and one hmul2 (bit-identical fp16
//   weights). No repacked weight.
// * T = 16, 32, 64, 128 or 256 tokens per instruction, the narrowest that holds M up to 128, above
//   that 128 or 256, whichever wgmma_tiles.cost predicts faster from the idle SMs and padded
//   tokens each leaves (host: awq.wgmma_config, wgmma_tiles.config).
//   At M <= 16 the tensor work is small and a block's time is its walk over K, one stage after
//   another; T = 16 with 16 stages (128 KB of weight words in flight a block) takes 0.86-0.99x
//   the time of T = 32 with 6 stages there (bench/NOTES.md, session 18).
// * Several blocks an SM at small T (BPS). That walk is a serial chain per stage (wait, shared
//   loads, dequant, wgmma group, wait), and a consumer warp issues only about every other cycle
//   (ncu, 4096->12288 M = 16). So up to T = 128 dispatch runs ONE consumer warpgroup a block (64
//   or 128 columns) and 2-4 blocks an SM: 12-16 consumer warps an SM instead of 8, and twice the
//   tiles to spread over the SMs (M = 16 4096->12288 19.6 -> 16.9 us, 4096->24576 30.5 -> 25.5;
//   bench/NOTES.md, session 50). The launch bound then caps the entry registers at 65536 /
//   (BPS x threads) and setmaxnreg hands the consumers what the producer gives back (wg::Regs):
//   a consumer's highest register is R71 / R105 / R141 / R221 at T = 16 / 32 / 64 / 128, of the
//   96 / 128 / 224 / 224 that 4 / 3 / 2 / 2 blocks an SM leave it (ptxas, no spills).
//   No x box reaches past token M (wg::x_box_row). Up to T = 128 a warpgroup issues 2 instructions
//   per k-step (j), each thread dequantising half a word; at T = 256 the 64 x 256 fp32
//   accumulators allow only one (JN = 1): a warpgroup owns 64 columns and a thread 2 columns of a
//   word (lane g: columns 4h + 2 j0, +1 with h = g / 2 % 2, j0 = g % 2) -- half the dequant per MMA
//   again.
// * Which word a lane dequantises is chosen for y's stores: the lanes that share a token hold
//   whole words side by side (JN = 2: 4 words, 64 contiguous bytes of y's row; JN = 1: 2 words,
//   32 bytes), so a warp's store of 4 tokens writes 8 (JN = 2) or 4 (JN = 1) whole 32-byte
//   sectors. With 8 words a warp and each word's columns split over 2 or 4 warps, every store
//   wrote 16 sectors a quarter or half full (fragment_of; bench/NOTES.md, session 25).
// * A stage's 16 weight words, scales and zeros of a thread are read from shared memory at
//   once and all 4 k-steps dequantised, then issued as one wgmma group (wg::stage_step).
// * x tiles use the 128-byte swizzle (16-byte chunk ch of row r stored at chunk ch ^ (r % 8)),
//   the layout the wgmma descriptor reads without bank conflicts. One TMA copy per stage writes
//   it (the host encodes x's tensor map): no per-thread copy instructions. With every
//   thread issuing 16-byte cp.async chunks instead, the copies were a third of the kernel's time
//   at M = 2048 (bench/NOTES.md, session 13: 430 -> 358 us on 4096->12288).
// * Pipeline: warp-specialised, no block barrier in the K loop. A producer warpgroup (after the
//   consumer warpgroups) gives its registers to them (setmaxnreg: 40 vs 232 a thread) and one of
//   its threads issues each stage's four TMA copies -- x tile, weight words, scales, zeros; five
//   with GLU, whose weight words come as two boxes -- onto the buffer's "full" mbarrier, after
//   waiting on its "empty" mbarrier. Each consumer warp waits on "full", reads its fragments,
//   dequantises the stage, issues it as one wgmma group, waits for it (wg::stage_step says
//   why), and arrives on "empty". So copies run D stages ahead, the two consumer warpgroups
//   hide each other's dequantisation behind their wgmma, and no thread spends issue slots on
//   addresses and predicates of copies.
//   Against session 13's kernel (every thread cp.async'ing its weight chunk, then
//   cp.async.wait + fence + one __syncthreads a stage, a wgmma group per k-step):
//   4096->12288 M = 512 101-105 -> 97 us, M = 2048 395 -> 329-356 us (bench/notes-awq.md and
//   bench/NOTES.md, session 15).
//   The producer needs its own warpgroup: a single producer warp (9 warps) puts 3 warps on one
//   SM sub-partition and caps every thread at 168 registers, and the batched stage then spills.
// * The weight tile is what TMA writes: 64 rows of WORDS words, dense, with the 128-byte swizzle
//   (64-byte at 16 words a row): 16-byte chunk ch of row r at chunk ch ^ (r % 8) (ch ^ (r / 2 %
//   4)). A thread's fragment words (rows 2t + {0, 1, 8, 9}, one column word) then fall in distinct
//   banks across the warp (at 16 words a row once odd t load their rows in the other order: w_off
//   says why). TMA needs 16-byte global rows, so this path takes N % 32 == 0 (host:
//   WGMMA_N_MULTIPLE); dispatch sends other N to mma.sync.
// * Split K: one block walks its K range at a fixed per-stage latency, so a grid of few tiles
//   (small M, or N = 4096) is as slow as its longest K walk. The host splits K so that the grid
//   fills one wave of resident blocks. At 2 splits the first half of a tile to finish hands its
//   fp32 partial to the second, which adds it to its registers and stores y (wg::hand_over;
//   wg::work says why the halves are ordered as they are). Past 2, at T = 16 (host:
//   WGMMA_MEET_MAX_T) every part stores its partial and the last to finish sums them all in split
//   order and stores y (wg::meet: 2-6 % faster than a reduce launch at M <= 16, session 52); at
//   larger T the partials meet in a workspace and the next launch, wgmma_reduce in
//   wgmma_sm90.cuh, adds them in split order (the last blocks' serial sums of 3 to 16 T x 128
//   partials cost more than a launch over the GPU: M = 64 0.70-0.85x the time with it,
//   bench/NOTES.md, session 17; again 1.1-1.3x at T = 64 in session 52).
// * More tiles than resident blocks: the first dp_tiles tiles (whole waves) walk all of K, and
//   only the tiles of the last, partly empty wave are split, so that they fill it with shorter
//   blocks (4096->12288 M = 512: 192 tiles on 132 SMs; without this the second wave runs 60
//   full-length blocks and the time is two full waves).
// * GLU (matmul(glu=True): the decoder MLP's fused gate/up weight, columns [gate | up], N = 2F):
//   y [M, F] = swiglu(x gate, x up) (swiglu.cuh, silu_mul's roundings) in the epilogue. A
//   block's stage is a tile of its FW = WORDS / 2 gate column words (4 WORDS columns) and a tile
//   of the matching up column words (two TMA boxes of half rows), their scales and zeros one box
//   each (cuda_launch.tensor_map_halves), so warpgroup 0 computes the gate tile and warpgroup 1
//   the up tile with the unchanged K loop; the twins then meet in shared memory (the epilogue
//   says how).
//   Past 2 splits the gate and up partials go to the workspace (wg::SplitParts) and
//   wgmma_reduce<4, true> applies the GLU.
//   Against the product + silu_mul launches (us, 4096->24576, rotated weights, back to back,
//   bench/NOTES.md, session 24): M = 16 31.0-31.5 vs 32.6, M = 128 57-58.5 vs 58-59.5, M = 512
//   175-185 vs 190-194, M = 1024 353-355 vs 382-397. In the runner's 512-token prefill (kernel
//   time) it is 175 us against 158 + 18: no gain there yet.
//
// Measured on the H100 (bench/NOTES.md, sessions 7, 8, 13 and 25): from M = 1536 dequant +
// cuBLAS is faster per launch (at M = 2048 on the 12288 x 4096 weights the two tie within 5 %).
// With split K it is the fastest AWQ path from M = 8 to 1024 on weights of
// 4096 x 4096 and up (4096->12288 M = 128: 35 us against 93 for mma.sync and 40 for cuBLAS
// fp16; M = 512: 84-92 against 123 for dequant + cuBLAS and 73-75 for cuBLAS fp16; 4096->4096
// M = 512: 35 against 41 and 26). Dispatch uses it from M = 8 to 2048 on those weights (in a
// whole prefill, at the card's power cap, it wins to 2048: session 31), and for M = 17..256 from
// 1024 x 4096 (awq.WGMMA_MIN_NK, WGMMA_MID_*; 64-token tiles past M = 64, session 51: 4096->1024
// M = 128 10.1 vs 13.3 us for dequant + cuBLAS). Above M = 128 (and for GLU past M = 16)
// one block of 2 consumer warpgroups (232 registers a thread) + the producer warpgroup (40) per
// SM. (Tried and slower: a producer warpgroup issuing cp.async + mbarriers + setmaxnreg, ~300
// TFLOP/s, session 7; at M >= 512, T = 64 with two warpgroups at 2 blocks per SM, 10-30 %.)
// Where the rest goes (ncu, 4096->12288 M = 2048, session 19): the tensor pipe is busy 72 % of
// the elapsed cycles (cuBLAS fp16: 91 %); 22 % of the warps' stall samples are consumers waiting
// for their own group, most of the rest consumers issuing the dequant chain and dispatching the
// register-A wgmma. Three reshapings were correct and none faster: a group kept in flight while
// the next is dequantised (3-23 % slower); each warpgroup writing its fp16 tile to shared memory
// and issuing wgmma from two descriptors (within 3 % on 4096->12288, up to 14 % slower
// elsewhere); a third warpgroup dequantising for both (1.6x slower: 4 warps cannot keep up, and
// 512 threads leave 128 registers, under the 154 a 64 x 256 wgmma needs).
//
// Compiled only for sm_90a (wgmma); for any other target the kernel body is empty and the
// host (quantzoo/kernels/awq.py) never launches it there.
#include "awq_common.cuh"
#include "wgmma_sm90.cuh"

namespace awqw {

constexpr int BK = 64;  // k rows per stage

template <int NWG, int T, int D>
struct Cfg {
  static constexpr int CONSUMERS = 128 * NWG;
  static constexpr int THREADS = CONSUMERS + 128;         // + the producer warpgroup
  static constexpr int JN = T == 256 ? 1 : 2;              // wgmma instructions (64 columns) per k-step
  static constexpr int WORDS = 8 * JN * NWG;              // column words per block
  static constexpr int ROW = WORDS * 4;                   // bytes of a weight row: 128 or 64 (its swizzle)
  static constexpr int X_BYTES = T * 128;                 // T tokens x 64 halves, swizzled
  static constexpr int W_BYTES = BK * ROW;
  static constexpr int S_BYTES = 2 * WORDS * 16;          // up to 2 groups per stage (G = 32)
  static constexpr int Z_BYTES = 2 * WORDS * 4;
  static constexpr int STAGE = (X_BYTES + W_BYTES + S_BYTES + Z_BYTES + 1023) / 1024 * 1024;
  static constexpr int SMEM = D * STAGE + 1024;           // + slack to align the base to 1024
  static_assert(T % 8 == 0 && T >= 8 && T <= 256, "wgmma N (tokens) is a multiple of 8");
  static_assert(ROW == 64 || ROW == 128, "weight rows are one 64- or 128-byte swizzle span");
};

// Byte offset of word w of row r in a stage's weight tile, as TMA's swizzle placed it: the
// 16-byte chunk index XORed with address bits 7.. of the row (r % 8 at 128-byte rows, r / 2 % 4
// at 64-byte rows). GLU: the tile is two tiles of BK rows of ROW / 2 bytes (the 64- or 32-byte
// swizzle), the gate words', then the up words'.
template <int ROW, bool GLU = false>
__device__ __forceinline__ int w_offset(int r, int w) {
  constexpr int SPAN = GLU ? ROW / 2 : ROW, SW = SPAN / 4;   // a row's bytes, words
  return (w / SW) * BK * SPAN + r * SPAN + (((((w % SW) >> 2) ^ ((r * SPAN >> 7) & (SPAN / 16 - 1)))) << 4) + ((w & 3) << 2);
}

// A consumer thread's place in the fragments (tid < 128 NWG): t = lane % 4; its column word c
// within the block and its columns in it: JN = 2 -> the 4 columns 4h .. 4h + 3 (instruction j
// takes 4h + 2j, 4h + 2j + 1); JN = 1 -> 2 columns 4h + 2j0, +1. A warpgroup holds 16 (JN = 2)
// or 8 words, warp wq 4 or 2 of them, side by side; lane g's word is g / 2 (JN = 2) or g / 4 of
// its warp's, and the lanes of a word hold its columns in order, so that the lanes storing one
// token's outputs write whole sectors (the header says why).
struct Fragment { int t, c, h, j0; };
template <int V> struct IntC { static constexpr int value = V; };   // a compile-time int argument
template <int JN>
__device__ __forceinline__ Fragment fragment_of(int tid) {
  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wq = warp & 3, g = lane >> 2;
  if constexpr (JN == 2) return {lane & 3, 16 * wg + 4 * wq + (g >> 1), g & 1, 0};
  return {lane & 3, 8 * wg + 2 * wq + (g >> 2), (g >> 1) & 1, g & 1};
}
}  // namespace awqw

// grid (dp_tiles + (tiles - dp_tiles) * splits): tile i = (token tile i % tiles_m, column tile i /
// tiles_m), token tiles varying fastest, so the blocks that read the same weights run together and
// share L2. Tiles below dp_tiles walk all of K; split j of a later tile takes rows [j *
// rows_per_split, (j + 1) * rows_per_split) of K (a multiple of BK; the host makes every split
// non-empty). Which block takes which: wg::work. Block
// awqw::Cfg::THREADS (128 * NWG + 128) threads, dynamic shared memory awqw::Cfg<NWG, T, D>::SMEM.
// Tensor maps (host, kernels/awq.py): x fp16 [M, K] box 64 x x_rows (x_rows = min(T, M):
// wg::x_box_row), 128-byte swizzle; qweight u32 [K, N/8] box WORDS x 64, swizzle ROW; scales fp16
// [K/G, N] box 8 WORDS x gps; qzeros u32 [K/G, N/8] box WORDS x gps (gps = groups a stage spans: 2
// at G = 32, else 1). GLU: the qweight box is WORDS / 2 wide (swizzle ROW / 2), one for the gate
// columns, one for the up columns; scales and zeros are 3-D maps (column in the half, gate / up,
// group row) whose one box holds both halves (tensor_map_halves). K % 32 == 0 (K % G == 0,
// G >= 32), N % 32 == 0 (GLU: N % 64 == 0). Split tiles, with counters
// (one zeroed unsigned per tile, left zeroed): partials go to ws in fragment order, T x 8 WORDS
// floats a slot, one slot per split tile at splits == 2 (wg::hand_over), else one per split of
// each split tile (wg::meet); with counters null (any splits): each split's partial to ws for
// wgmma_reduce (wg::SplitParts: [splits][M][the split columns]).
template <int NWG, int T, int D, bool GLU = false, int BPS = 1>
__global__ void __launch_bounds__(128 * NWG + 128, BPS)
awq_wgmma_kernel(const __grid_constant__ wg::TmaDesc xmap, const __grid_constant__ wg::TmaDesc wmap,
                 const __grid_constant__ wg::TmaDesc smap, const __grid_constant__ wg::TmaDesc zmap,
                 half* __restrict__ y, float* __restrict__ ws, unsigned* __restrict__ counters,
                 int M, int K, int N, int G, int tiles_m, int dp_tiles, int splits, int rows_per_split, int x_rows) {
  pdl::grid_sync();  // cuda/pdl.cuh: before any memory access
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = awqw::Cfg<NWG, T, D>;
  constexpr int BK = awqw::BK;
  constexpr int FW = GLU ? C::WORDS / 2 : C::WORDS;   // a tile's column words (GLU: of gate, and of up)
  static_assert(!GLU || NWG == 2, "GLU: warpgroup 0 takes the gate columns, warpgroup 1 the up columns");
  static_assert(!GLU || D * C::STAGE >= 128 * C::JN * T, "GLU: the stages hold a warpgroup's fp16 accumulators");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const unsigned base = (awq::smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - awq::smem_addr(smem_raw));

  const int n8 = N / 8;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const auto [whole, tile, split, n_split] = wg::work(blockIdx.x, dp_tiles, splits, counters);
  // this tile's tokens are [m_tile, m_tile + T); its x box starts at token m0
  const int m0 = wg::x_box_row((tile % tiles_m) * T, M, x_rows);
  const int col0 = (tile / tiles_m) * FW;
  const int kb = whole ? 0 : split * rows_per_split;   // this block's rows [kb, ke)
  const int ke = whole ? K : min(K, kb + rows_per_split);
  const int n_stages = (ke - kb + BK - 1) / BK;
  const int gps = G < BK ? BK / G : 1;   // groups a stage spans

  // full[b]: stage in buffer b has landed; empty[b]: every consumer warp is done with buffer b
  __shared__ unsigned long long bars[2 * D];
  const unsigned full0 = wg::init_stage_bars<D>(bars, C::CONSUMERS / 32), empty0 = full0 + 8 * D;

  if (tid >= C::CONSUMERS) {   // the producer warpgroup: one thread issues every copy
    wg::set_max_regs<false, wg::Regs<NWG, BPS>::PRODUCER>();
    if (tid == C::CONSUMERS) {
      wg::prefetch_map(&xmap); wg::prefetch_map(&wmap); wg::prefetch_map(&smap); wg::prefetch_map(&zmap);
      const unsigned tx = x_rows * 128 + C::W_BYTES + gps * C::WORDS * (16 + 4);
      for (int st = 0; st < n_stages; ++st) {
        const int b = st % D, k0 = kb + st * BK;
        if (st >= D) wg::mbar_wait(empty0 + 8 * b, (st / D - 1) & 1);
        const unsigned S0 = base + b * C::STAGE, bar = full0 + 8 * b;
        wg::mbar_arrive_expect_tx(bar, tx);
        wg::tma_2d(S0, &xmap, k0, m0, bar);
        if constexpr (GLU) {   // a gate tile and an up tile of words; scales and zeros a row's gate
          // columns, then its up columns (3-D maps: column in the half, gate / up, row)
          wg::tma_2d(S0 + C::X_BYTES, &wmap, col0, k0, bar);
          wg::tma_2d(S0 + C::X_BYTES + C::W_BYTES / 2, &wmap, n8 / 2 + col0, k0, bar);
          wg::tma_3d(S0 + C::X_BYTES + C::W_BYTES, &smap, 8 * col0, 0, k0 / G, bar);
          wg::tma_3d(S0 + C::X_BYTES + C::W_BYTES + C::S_BYTES, &zmap, col0, 0, k0 / G, bar);
        } else {
          wg::tma_2d(S0 + C::X_BYTES, &wmap, col0, k0, bar);
          wg::tma_2d(S0 + C::X_BYTES + C::W_BYTES, &smap, 8 * col0, k0 / G, bar);
          wg::tma_2d(S0 + C::X_BYTES + C::W_BYTES + C::S_BYTES, &zmap, col0, k0 / G, bar);
        }
      }
    }
    // Done: no code after setmaxnreg.dec may be shared with the consumers, whose registers it
    // could not hold (the split-K handshake below meets at a named barrier of the consumers).
    return;
  }
  {   // the consumer warpgroups
    wg::set_max_regs<true, wg::Regs<NWG, BPS>::CONSUMER>();
    constexpr int JN = C::JN;
    const auto [t, c, h, j0] = awqw::fragment_of<JN>(tid);
    const unsigned j_mask = j0 ? awq::kHighMask : awq::kLowMask;                 // JN = 1 only
    const half2 j_mul = awq::as_h2(j0 ? 0x2c002c00u : 0x3c003c00u);              // 1/16 or 1
    // this thread's fragment words in a stage's weight tile: rows 16 kk + 2t + {0, 1, 8, 9} of
    // word c (the swizzle's XOR is the same for every kk), loaded in the order {1, 0, 9, 8} by
    // odd t (GLU at T = 256: by t = 2, 3). Why: in rows of 64 bytes (T = 256; GLU's tiles at
    // T <= 128) a load's rows 2t + i, all of one parity, cover only half the banks: a warp's loads
    // conflicted 2-way. Rows of both parities cover them all. In GLU's 32-byte rows (T = 256) the
    // rows must cover 4 residues mod 4, which the swap by t / 2 gives. (At 128-byte rows any order
    // is conflict-free.)
    const int odd = GLU && JN == 1 ? t >> 1 : t & 1;
    constexpr int RP = GLU ? C::ROW / 2 : C::ROW;   // the tile's row pitch (bytes)
    int w_off[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w_off[i] = awqw::w_offset<C::ROW, GLU>(2 * t + ((i & 1) ^ odd) + 8 * (i >> 1), c);

    float acc[JN][T / 2];   // written first by the k-step 0 wgmma (accumulate = 0)

    // the byte permute that pairs rows k and k + 1 (below): bytes h and h + 2 of each, of the
    // first and the second operand, or (odd t, rows swapped) of the second and the first
    unsigned sel = (odd ? 0x2064u : 0x6420u) + 0x1111u * h;
    for (int st = 0; st < n_stages; ++st) {
      // Opaque to ptxas: the offsets are carried from stage to stage in registers, never
      // recomputed from tid, which ptxas otherwise chose for some versions of this kernel
      // (+30 instructions a stage, 4096->12288 M = 128 39 -> 43 us; bench/NOTES.md, session 23).
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(w_off[i]));
      asm volatile("" : "+r"(sel));
      const int b = st % D;
      wg::mbar_wait(full0 + 8 * b, (st / D) & 1);
      const unsigned char* S0 = smem + b * C::STAGE;
      const unsigned long long desc = wg::desc_sw128(base + b * C::STAGE);
      const unsigned char* Wt = S0 + C::X_BYTES;
      const half* S = reinterpret_cast<const half*>(S0 + C::X_BYTES + C::W_BYTES);
      const unsigned* Z = reinterpret_cast<const unsigned*>(S0 + C::X_BYTES + C::W_BYTES + C::S_BYTES);
      // the stage's 16 weight words of this thread and both groups' scales and zeros
      unsigned wv[BK / 16][4];
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) wv[kk][i] = *reinterpret_cast<const unsigned*>(Wt + 16 * kk * RP + w_off[i]);
      const int g2 = G == 32;   // a stage spans 2 groups only when G == 32
      const uint4 sv0 = *reinterpret_cast<const uint4*>(S + 8 * c);
      const uint4 sv1 = *reinterpret_cast<const uint4*>(S + 8 * (g2 * C::WORDS + c));
      const unsigned zw0 = Z[c], zw1 = Z[g2 * C::WORDS + c];
      // per column 4h + i of this thread, both lanes: its scale, and its zero term -- 1024 + z for
      // the low-mask columns 4h, 4h + 1, -(64 + z) for the high-mask ones 4h + 2, 4h + 3
      half2 sc[4], zc[4];
      unsigned a[BK / 16][JN][4];   // the stage's A fragments, all dequantised before its wgmma
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        if (kk == 0 || kk == 2) {   // the second group's terms (the same as the first unless G == 32)
          const uint4 sv = kk == 0 ? sv0 : sv1;
          const half2 s01 = awq::as_h2(h ? sv.z : sv.x), s23 = awq::as_h2(h ? sv.w : sv.y);
          const awq::Zeros z = awq::make_zeros(kk == 0 ? zw0 : zw1);
          const half2 zlo = h ? z.lo[1] : z.lo[0], zhi = h ? z.hi[1] : z.hi[0];
          if constexpr (JN == 2) {
            sc[0] = __low2half2(s01); sc[1] = __high2half2(s01); sc[2] = __low2half2(s23); sc[3] = __high2half2(s23);
            zc[0] = __low2half2(zlo); zc[1] = __high2half2(zlo); zc[2] = __low2half2(zhi); zc[3] = __high2half2(zhi);
          } else {   // columns 4h + 2j0, +1 only; the zero term is added (below): -(1024 + z) or -(64 + z)
            const half2 sp = j0 ? s23 : s01, zp = j0 ? zhi : __hneg2(zlo);
            sc[0] = __low2half2(sp); sc[1] = __high2half2(sp); zc[0] = __low2half2(zp); zc[1] = __high2half2(zp);
          }
        }
        // k pairs first: byte h and byte h + 2 of rows k and k + 1 -> [k.bh, k.bh2, k1.bh, k1.bh2],
        // so each mask below picks one column's nibble in rows k (low lane) and k + 1 (high lane):
        // word byte b holds slots 2b, 2b + 1, so bytes h / h + 2 hold columns 4h / 4h + 1 in their
        // low nibbles and 4h + 2 / 4h + 3 in their high ones; p takes byte h, p >> 8 byte h + 2.
        const unsigned p0 = __byte_perm(wv[kk][0], wv[kk][1], sel);   // rows 2t, 2t + 1 (in either order)
        const unsigned p8 = __byte_perm(wv[kk][2], wv[kk][3], sel);   // rows 2t + 8, 2t + 9
        const unsigned q0 = p0 >> 8, q8 = p8 >> 8;
        const half2 one16 = awq::as_h2(0x2c002c00u);
        auto lo = [&](unsigned p, int i) {   // (q - z) * s of a low-mask column, exact then one rounding
          return awq::as_u32(__hmul2_rn(__hsub2(awq::as_h2(awq::lop3_and_or(p, awq::kLowMask, awq::kMagic)), zc[i]), sc[i]));
        };
        auto hi = [&](unsigned p, int i) {
          return awq::as_u32(__hmul2_rn(__hfma2(awq::as_h2(awq::lop3_and_or(p, awq::kHighMask, awq::kMagic)), one16, zc[i]), sc[i]));
        };
        // instruction j: row g = column 4h + 2j, row g + 8 = column 4h + 2j + 1; registers 0, 1 at
        // k 2t.., 2, 3 at k 2t + 8..
        if constexpr (JN == 2) {
          const unsigned a0[4] = {lo(p0, 0), lo(q0, 1), lo(p8, 0), lo(q8, 1)};
          const unsigned a1[4] = {hi(p0, 2), hi(q0, 3), hi(p8, 2), hi(q8, 3)};
#pragma unroll
          for (int e = 0; e < 4; ++e) { a[kk][0][e] = a0[e]; a[kk][JN - 1][e] = a1[e]; }
        } else {   // one instruction, this thread's columns 4h + 2j0 (row g) and 4h + 2j0 + 1 (row g + 8)
          auto f = [&](unsigned p, int i) {   // low mask: (1024 + q) * 1 - (1024 + z); high: as hi()
            return awq::as_u32(__hmul2_rn(__hfma2(awq::as_h2(awq::lop3_and_or(p, j_mask, awq::kMagic)), j_mul, zc[i]), sc[i]));
          };
          a[kk][0][0] = f(p0, 0); a[kk][0][1] = f(q0, 1); a[kk][0][2] = f(p8, 0); a[kk][0][3] = f(q8, 1);
        }
      }
      // the stage's 4 k-steps as one wgmma group, done on return: the buffer is free again
      wg::stage_step<T, JN, BK / 16>(acc, a, desc, st > 0);
      if (lane == 0) wg::mbar_arrive(empty0 + 8 * b);
    }
    wg::drain<T, JN>(acc);

    const auto [e_whole, e_tile, e_split, e_n_split] = wg::work(wg::block_index(), dp_tiles, splits, counters);
    const int e_tid = wg::thread_index();
    const auto [e_t, e_c, e_h, e_j0] = awqw::fragment_of<JN>(e_tid);
    const bool meet = counters != nullptr;   // split tiles' parts summed here, else by wgmma_reduce
    if (meet && e_n_split > 1 &&
        !(e_n_split == 2 ? wg::hand_over<T, JN, C::CONSUMERS>(acc, ws, counters, e_tile, dp_tiles, e_tid)
                         : wg::meet<T, JN, C::CONSUMERS>(acc, ws, counters, e_tile, dp_tiles, e_split, e_n_split, e_tid)))
      return;   // not the last part of the tile: its partial is out for the last (wg::hand_over, wg::meet)
    const bool to_y = e_n_split == 1 || meet;   // else a split's partial for wgmma_reduce
    const int e_m0 = wg::x_box_row((e_tile % tiles_m) * T, M, x_rows);
    const int e_col0 = (e_tile / tiles_m) * FW;

    // acc[j][4i + 2r + e]: column 8c + 4h + 2j + r (JN = 1: 8c + 4h + 2j0 + r), token m0 + 8i + 2t + e
    // of the block's columns. GLU: word c < FW is gate word e_col0 + c, c >= FW up word e_col0 + c - FW
    // (weight word n8 / 2 + e_col0 + c - FW), for y's columns 8 (e_col0 + c % FW) + .. of y [M, N / 2].
    const int m_tile = wg::first_stored_row(e_m0, M, x_rows, tiles_m, T);
    const int up = GLU && e_c >= FW;              // GLU: this thread holds up values
    const int yw = e_col0 + e_c - FW * up;        // y's column word
    const int ny8 = GLU ? n8 / 2 : n8;            // y's column words
    if constexpr (GLU) {
      if (to_y) {
        // silu(gate) * up. A thread of the up warpgroup holds, register for register, the up
        // values of the outputs whose gate values its twin in the gate warpgroup (tid - 128)
        // holds. The twins split those outputs: the gate thread takes accumulators [0, NH), the
        // up thread [NH, NV), and each hands the other its own values of the other's half,
        // rounded to fp16 as y would hold them, through shared memory in fragment order (each
        // warp's 16-byte stores 512 contiguous bytes: no bank conflicts) -- once both
        // warpgroups' last wgmma has read the stages. Each then stores its outputs from
        // registers. The SwiGLU's fp32 division and exp (swiglu.cuh, bit-equal to silu_mul) are
        // ~20 instructions an output that no other block hides (one block an SM): split over
        // both warpgroups they cost half. (Staged as fp16 tiles [T][8 FW] and stored by every
        // thread, as the GGUF kernel does (wg::glu_store), the launch was 10-20 us slower than the
        // product alone at M = 512 on 4096->24576; bench/NOTES.md, session 24.)
        constexpr int NV = JN * T / 2, NH = NV / 2;   // a thread's accumulators, half of them
        uint4* xch = reinterpret_cast<uint4*>(smem) + (e_tid & 127);   // [2][NH / 8][128] chunks of 8 halves
        auto at = [&](int f) -> float& { return acc[f / (T / 2)][f % (T / 2)]; };
        // this thread's first token and first column of y (JN = 2: +2 for instruction j = 1)
        const int row0 = e_m0 + 2 * e_t, col0y = 8 * yw + 4 * e_h + (JN == 1 ? 2 * e_j0 : 0);
        // Two phases, each called by both warpgroups, with the barrier between them outside:
        // every consumer thread then meets at the same bar.sync instruction (bar.sync is
        // barrier.sync.aligned: all threads of the block must execute the same one; a barrier
        // inside each warpgroup's own instantiation was two instructions, which
        // compute-sanitizer --tool synccheck reports as divergent; bench/NOTES.md, session 45).
        auto give = [&](auto mine) {   // mine: IntC<0> (gate) or IntC<NH> (up)
          constexpr int F0 = decltype(mine)::value, G0 = NH - F0;   // my outputs, the half I give
#pragma unroll
          for (int v = 0; v < NH / 8; ++v) {
            unsigned q[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) q[p] = awq::as_u32(__floats2half2_rn(at(G0 + 8 * v + 2 * p), at(G0 + 8 * v + 2 * p + 1)));
            xch[128 * (v + (F0 ? 0 : NH / 8))] = make_uint4(q[0], q[1], q[2], q[3]);
          }
        };
        auto store = [&](auto mine) {
          constexpr int F0 = decltype(mine)::value;
          unsigned other[NH / 2];   // the twin's fp16 values of my outputs, in pairs
#pragma unroll
          for (int v = 0; v < NH / 8; ++v) {
            const uint4 q = xch[128 * (v + (F0 ? NH / 8 : 0))];
            other[4 * v] = q.x; other[4 * v + 1] = q.y; other[4 * v + 2] = q.z; other[4 * v + 3] = q.w;
          }
          auto out = [&](int f) {   // y's value at accumulator f of mine
            const half2 o2 = awq::as_h2(other[(f - F0) / 2]);
            const float ov = __half2float(f & 1 ? __high2half(o2) : __low2half(o2));
            const float mv = __half2float(__float2half_rn(at(f)));
            return F0 ? swiglu(ov, mv) : swiglu(mv, ov);
          };
          if (yw >= ny8) return;
          // JN = 2: mine are instruction j = F0 / NH's (columns 4h + 2j, +1), every token; JN = 1:
          // tokens 8i + .. with i in [F0 / 4, F0 / 4 + T / 16)
          constexpr int I0 = JN == 1 ? F0 / 4 : 0, NI = JN == 1 ? T / 16 : T / 8, FJ = JN == 1 ? 0 : F0;
#pragma unroll
          for (int i = I0; i < I0 + NI; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int m = row0 + 8 * i + e;
              if (m < m_tile || m >= M) continue;   // another tile's row, or past M
              *reinterpret_cast<half2*>(y + (size_t)m * (N / 2) + col0y + (JN == 2 && F0 ? 2 : 0)) =
                  __floats2half2_rn(out(FJ + 4 * i + e), out(FJ + 4 * i + 2 + e));
            }
        };
        wg::consumers_sync(C::CONSUMERS);   // both warpgroups past their last wgmma: the stages are free
        if (up) give(awqw::IntC<NH>{});
        else give(awqw::IntC<0>{});
        wg::consumers_sync(C::CONSUMERS);   // every half handed over
        if (up) store(awqw::IntC<NH>{});
        else store(awqw::IntC<0>{});
        return;
      }
    }
    const wg::SplitParts parts(8 * ny8, 8 * FW, dp_tiles, tiles_m, GLU);
    if (yw < ny8) {
#pragma unroll
      for (int i = 0; i < T / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = e_m0 + 8 * i + 2 * e_t + e;
          if (m >= m_tile && m < M) {   // not another tile's row, nor past M
            const float v0 = acc[0][4 * i + e], v1 = acc[0][4 * i + 2 + e];
            if constexpr (JN == 1) {   // columns 8c + 4h + 2j0 + r
              const size_t o = (size_t)m * N + 8 * yw + 4 * e_h + 2 * e_j0;   // in y (to_y: not GLU)
              if (to_y) *reinterpret_cast<half2*>(y + o) = __floats2half2_rn(v0, v1);
              else *reinterpret_cast<float2*>(ws + parts.at(e_split, M, m, 8 * yw + 4 * e_h + 2 * e_j0, up)) =
                  make_float2(v0, v1);
              continue;
            }
            const float v2 = acc[JN - 1][4 * i + e], v3 = acc[JN - 1][4 * i + 2 + e];
            if (to_y) {
              const half2 p0 = __floats2half2_rn(v0, v1), p1 = __floats2half2_rn(v2, v3);
              *reinterpret_cast<uint2*>(y + (size_t)m * N + 8 * yw + 4 * e_h) = make_uint2(awq::as_u32(p0), awq::as_u32(p1));
            } else {
              *reinterpret_cast<float4*>(ws + parts.at(e_split, M, m, 8 * yw + 4 * e_h, up)) = make_float4(v0, v1, v2, v3);
            }
          }
        }
    }
  }   // consumers
#endif
}

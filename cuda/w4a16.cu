// W4A16 GEMM on Tensor Cores: C[M,N] = A[M,K] · dequant(B)[K,N].
//
// The weights come in 64-column n-tiles of 16-row steps: for each step a
// lane holds one 16-byte chunk of B — exactly its mma.m16n8k16 B fragments
// for the tile's eight n8 sub-tiles, 32 int4 values — which every kernel
// dequantizes in registers with the fp16 magic-number trick: OR-ing a
// nibble into the mantissa of 1024.0 (0x6400) gives the fp16 value
// 1024 + q, so (1024 + q) − (1024 + z) = q − z exactly, then × scale. K
// may be split across CTAs: their fp32 sums meet by atomics in a
// workspace, and the last CTA to finish a tile (a per-tile counter)
// converts it to fp16 and re-zeroes the workspace and counter
// (finish_splits), so one launch does the whole product. A GEMM with no
// outputs (a decode step's q/k/v, o and down, at most kSumsMaxM rows)
// skips that last step: the GEMV kernels' SUMS instantiations leave the
// sums in the workspace, and the next kernel (RoPE, the norm) finishes
// and zeroes them.
//
// Fused path (v18; M = 33–128 on large layers): a CTA of NW warps owns NW
// adjacent n-tiles for a row block of up to 64 rows and streams the
// codes and the activations through shared-memory stages filled by
// cp.async, the activations read once for the CTA's tiles; each warp
// multiplies its tile by ldmatrix's A fragments.
//
// GEMV paths (the decode of a few sequences): at such M a shared-memory
// pipeline's machinery (stages, barriers, ldmatrix) is paid per 512
// bytes of B, so it runs out of instruction issue long before bandwidth
// (NOTES.md, v5, v6). The GEMV kernels load a lane's 16-byte chunk
// straight into registers instead (two batches of U chunks in flight) and
// dequantize it as the fused kernel does. w4a16_gemv (M = 1, and 2 for 8-bit codes)
// multiplies them by its rows' activations with fp16 FMAs (HFMA2), two
// chunks into one half2 partial before it is added to fp32 accumulators;
// the four lanes that share columns are reduced with shuffles.
// w4a16_gemv_mma (v11, M = 9–64; 2–64 for 8-bit codes) hands the same
// fragments (q − z)·s, the same fp16 bits, to mma.m16n8k16 with the tokens
// as its 16 rows, so the cost per byte does not grow with M.
// w4a16_gemv_swap (v15; 4-bit codes at M = 2–8, and at M = 1 on large
// layers) swaps the mma's operands: the weights are its 16 rows, the tokens
// its 8 columns, and the codes go in unscaled (exact q − z), the scales
// applied once per group in fp32 — not the same bits as the others, within
// the tests' 1e-3. All reduce the CTA's warps in shared memory and the K
// splits through the fused kernel's workspace and last-CTA rule.
//
// Large M (compute-bound): B is dequantized once to fp16 and multiplied by
// cuBLAS; the extra K·N·2 bytes are small next to the arithmetic there.
// Group sizes that are not powers of two take this path at every M (slow
// at small M: the whole layer is dequantized per call).
#include <cublas_v2.h>
#include <cuda.h>  // CUtensorMap (v21's activations; the encoder comes from the runtime's entry point)
#include <cuda_fp16.h>
#include <type_traits>
#include <utility>
#include "common.cuh"
#include "moe.cuh"
#include "stream.cuh"

namespace {

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// put_words puts chunk v (16 bytes of a lane's codes) in words 4c … 4c+3
// of w, as the dequantizers take a step's codes.
__device__ __forceinline__ void put_words(uint32_t* w, int c, uint4 v) {
  w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
}

// hsub and hmul are __hsub2 and __hmul2 on half2 bit patterns.
__device__ __forceinline__ uint32_t hsub(uint32_t a, uint32_t b) {
  half2 v = __hsub2(*reinterpret_cast<half2*>(&a), *reinterpret_cast<half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t hmul(uint32_t a, uint32_t b) {
  half2 v = __hmul2(*reinterpret_cast<half2*>(&a), *reinterpret_cast<half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));  // (a & b) | c
  return d;
}

constexpr int kWarps = 4;  // warps per CTA of the GEMV kernels (splitting its K slice) and of the fused kernel's default

// The fused kernel's shared-memory stage (STAGES of them, dynamic): the
// codes of the CTA's NW n-tiles for U 16-row steps — a tile's steps lie
// one after another in B, 512·CH bytes each, so a stage copies NW
// contiguous runs — and the activations of those steps, 16·MB rows, as
// U·MB tiles of 16×16 in 16-byte slots: row r's half h (8 columns) in
// slot act_slot(r, h).
template <int MB, int U, int CH, int NW>
struct TileStage {
  uint4 b[NW][U][CH][32];
  uint4 a[U][MB][32];
};

template <int MB, int U, int STAGES, int CH, int NW>
constexpr size_t fused_smem_bytes() {
  return STAGES * sizeof(TileStage<MB, U, CH, NW>);
}

// act_slot: row r, half h of a 16×16 activation tile. ldmatrix reads
// eight rows' 16 bytes at a time; 2r + h would put rows r and r + 4 in
// the same four banks (32 bytes a row, 128 bytes apart), so h is flipped
// on rows 4–7 and 12–15 and the eight rows cover all 32 banks.
__device__ __forceinline__ int act_slot(int r, int h) { return 2 * r + (h ^ ((r >> 2) & 1)); }

// Group scales/zeros in the form the dequant needs: half2 scale, and the
// half2 offsets 1024 + z (even nibbles) and 64 + z (odd nibbles), for the
// 2P sub-tiles a lane dequantizes: all eight of a 64-column tile
// (GroupRegs, every kernel but v21) or one pair (PairRegs: v21, whose
// warps each take 16 of a tile's columns).
template <int P>
struct SubtileRegs {
  uint32_t s[2 * P], zlo[2 * P], zhi[2 * P];
};
using GroupRegs = SubtileRegs<4>;
using PairRegs = SubtileRegs<1>;
// ZerosOf<BITS>: a lane's zeros of a group as stored, one word for 2- to
// 4-bit codes (a nibble a sub-tile), two for 8-bit (a byte a sub-tile).
template <int BITS>
using ZerosOf = typename std::conditional<BITS == 8, uint2, uint32_t>::type;

// pair_scales: sub-tiles 2i and 2i + 1's scales (s[0], s[1]) from their
// word sw (fp16, sub-tile 2i in the low half), one byte permute a scale.
__device__ __forceinline__ void pair_scales(uint32_t* s, uint32_t sw) {
  s[0] = __byte_perm(sw, 0, 0x1010);
  s[1] = __byte_perm(sw, 0, 0x3232);
}
// pair_zeros: sub-tiles 2i and 2i + 1's offsets (zlo, zhi [0] and [1])
// from the group's zeros zv. For 2- to 4-bit codes a zero is a nibble
// (sub-tile j in nibble j of zv): the even sub-tiles' zeros, a byte each,
// are e's bytes, the odd ones o's, and a byte permute against 0x64 or
// 0x54 makes each pair of offsets (1024 + z as fp16 is 0x64 over z, 64 +
// z is 0x54 over z·16).
__device__ __forceinline__ void pair_zeros(uint32_t* zlo, uint32_t* zhi, uint32_t zv, int i) {
  const uint32_t e = zv & 0x0f0f0f0fu, o = (zv >> 4) & 0x0f0f0f0fu;
  const uint32_t sel = 0x4040u | (i << 8) | i;  // bytes (z, 0x.., z, 0x..) from byte i
  zlo[0] = __byte_perm(e, 0x64646464u, sel);
  zlo[1] = __byte_perm(o, 0x64646464u, sel);
  zhi[0] = __byte_perm(e << 4, 0x54545454u, sel);
  zhi[1] = __byte_perm(o << 4, 0x54545454u, sel);
}
// pair_zeros for 8-bit codes: zeros a byte each (sub-tile j in byte j of
// zv), the offsets 1024 + z in zlo (zhi unused).
__device__ __forceinline__ void pair_zeros(uint32_t* zlo, uint32_t* zhi, uint2 zv, int i) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int j = 2 * i + k;
    zlo[k] = __byte_perm(j < 4 ? zv.x : zv.y, 0x64646464u, 0x4040u | ((j & 3) << 8) | (j & 3));
    zhi[k] = 0;
  }
}

// convert_group: a group's scales sv (sub-tile j in half j) and zeros zv
// for all eight sub-tiles.
template <typename ZV>
__device__ __forceinline__ void convert_group(GroupRegs& r, uint4 sv, ZV zv) {
  const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) pair_scales(r.s + 2 * i, sw[i]);
#pragma unroll
  for (int i = 0; i < 4; ++i) pair_zeros(r.zlo + 2 * i, r.zhi + 2 * i, zv, i);
}
// convert_group for one pair i: its scales' word sw and the group's zeros.
template <typename ZV>
__device__ __forceinline__ void convert_group(PairRegs& r, uint32_t sw, ZV zv, int i) {
  pair_scales(r.s, sw);
  pair_zeros(r.zlo, r.zhi, zv, i);
}

// codes_word turns word i of a lane's chunk into the exact fp16 codes
// q − z of its two n8 sub-tiles ja = 2i, jb = 2i + 1 (not yet scaled):
// b[0], b[1] are sub-tile ja's mma B fragments (rows 2·tig, 2·tig+1 and
// 2·tig+8, 2·tig+9 of column gid), b[2], b[3] sub-tile jb's. The magic
// numbers first make fp16 pairs (1024 + n0, 1024 + n4), (64 + n1, 64 +
// n5), (1024 + n2, …), (64 + n3, …) of nibbles n0 … n7 (the odd nibbles
// sit at bit 4, where 64's mantissa counts sixteenths); subtracting the
// group's offsets 1024 + z and 64 + z leaves q − z.
template <int P>
__device__ __forceinline__ void codes_word(uint32_t (&b)[4], uint32_t q, int i, const SubtileRegs<P>& gr) {
  const uint32_t q8 = q >> 8;
  const uint32_t p0 = lop3_and_or(q, 0x000f000fu, 0x64006400u);
  const uint32_t p1 = lop3_and_or(q, 0x00f000f0u, 0x54005400u);
  const uint32_t p2 = lop3_and_or(q8, 0x000f000fu, 0x64006400u);
  const uint32_t p3 = lop3_and_or(q8, 0x00f000f0u, 0x54005400u);
  const int ja = 2 * i, jb = 2 * i + 1;
  b[0] = hsub(p0, gr.zlo[ja]);
  b[1] = hsub(p1, gr.zhi[ja]);
  b[2] = hsub(p2, gr.zlo[jb]);
  b[3] = hsub(p3, gr.zhi[jb]);
}

// codes_pair: pair i's codes from the lane's words w (word i at 4 bits,
// words 2i and 2i + 1 at 8), with gr's entries 2i and 2i + 1. (PairRegs
// holds one pair: i = 0, w the pair's own words.)
template <int BITS, int P>
__device__ __forceinline__ void codes_pair(uint32_t (&b)[4], const uint32_t* w, int i, const SubtileRegs<P>& gr) {
  if constexpr (BITS == 4) {
    codes_word(b, w[i], i, gr);
  } else {
    const int ja = 2 * i, jb = 2 * i + 1;
    b[0] = hsub(__byte_perm(w[ja], 0x64646464u, 0x4140), gr.zlo[ja]);
    b[1] = hsub(__byte_perm(w[ja], 0x64646464u, 0x4342), gr.zlo[ja]);
    b[2] = hsub(__byte_perm(w[jb], 0x64646464u, 0x4140), gr.zlo[jb]);
    b[3] = hsub(__byte_perm(w[jb], 0x64646464u, 0x4342), gr.zlo[jb]);
  }
}

// dequant_pair is codes_pair scaled: the fp16 weights (q − z)·s.
template <int BITS, int P>
__device__ __forceinline__ void dequant_pair(uint32_t (&b)[4], const uint32_t* w, int i, const SubtileRegs<P>& gr) {
  codes_pair<BITS>(b, w, i, gr);
  b[0] = hmul(b[0], gr.s[2 * i]);
  b[1] = hmul(b[1], gr.s[2 * i]);
  b[2] = hmul(b[2], gr.s[2 * i + 1]);
  b[3] = hmul(b[3], gr.s[2 * i + 1]);
}

// mma_step: dequantize one lane's words w of a step (4 for 4-bit codes,
// 8 for 8-bit) and run the mma for MB m-tiles of A fragments af.
template <int MB, int BITS = 4>
__device__ __forceinline__ void mma_step(float (&acc)[MB][8][4], const uint32_t* w, const uint32_t (&af)[MB][4],
                                         const GroupRegs& gr) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t b[4];
    dequant_pair<BITS>(b, w, i, gr);
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      mma16816(acc[m][2 * i], af[m], b[0], b[1]);
      mma16816(acc[m][2 * i + 1], af[m], b[2], b[3]);
    }
  }
}

// compute_step: mma_step on one lane's B chunks of a step (BITS/4 of
// them, 32 uint4 apart from bq).
template <int MB, int BITS = 4>
__device__ __forceinline__ void compute_step(float (&acc)[MB][8][4], const uint4* bq, const uint32_t (&af)[MB][4],
                                             const GroupRegs& gr) {
  constexpr int CH = BITS / 4;
  uint32_t w[4 * CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) put_words(w, c, bq[c * 32]);
  mma_step<MB, BITS>(acc, w, af, gr);
}

// step_group: the group of 16-row step k, groups of 2^gshift steps
// (gshift < 0: a single group, 0).
__device__ __forceinline__ int step_group(int k, int gshift) { return gshift < 0 ? 0 : k >> gshift; }

// GroupStream keeps a warp's current group's scales and zeros in
// registers (GroupRegs) and the next group's raw values loaded ahead, as
// the warp walks its K range in order. gshift: a group spans 2^gshift
// 16-row steps (−1: a single group). BITS: the codes' width, 4 (a lane's
// zeros in one word) or 8 (two). SHARED: S and Z are copies in shared
// memory (a fused down's gate/up, FusedStage), read without __ldg.
template <int BITS = 4, bool SHARED = false>
struct GroupStream {
  using ZV = ZerosOf<BITS>;
  const uint4* S;
  const ZV* Z;
  size_t off, stride;  // this lane's entry of group 0; entries per group
  int gshift, G, cur;
  uint4 sv_next;
  ZV zv_next;

  __device__ __forceinline__ GroupStream() {}
  __device__ __forceinline__ GroupStream(const uint4* S_, const uint32_t* Z_, int nt, int NT, int gid, int KT, int gshift_)
      : S(S_), Z(reinterpret_cast<const ZV*>(Z_)), off((size_t)nt * 8 + gid), stride((size_t)NT * 8), gshift(gshift_),
        G(gshift_ < 0 ? 1 : KT >> gshift_), cur(0), sv_next(), zv_next() {}

  template <class T>
  static __device__ __forceinline__ T ld(const T* p) {
    if constexpr (SHARED)
      return *p;
    else
      return __ldg(p);
  }
  __device__ __forceinline__ void prefetch() {
    if (cur + 1 < G) {
      sv_next = ld(S + (cur + 1) * stride + off);
      zv_next = ld(Z + (cur + 1) * stride + off);
    }
  }
  // start loads the group of step k0 into gr.
  __device__ __forceinline__ void start(GroupRegs& gr, int k0) {
    cur = step_group(k0, gshift);
    convert_group(gr, ld(S + cur * stride + off), ld(Z + cur * stride + off));
    prefetch();
  }
  // crosses: whether step k lies past gr's group.
  __device__ __forceinline__ bool crosses(int k) const { return gshift >= 0 && (k >> gshift) != cur; }
  // advance moves gr to step k's group, the next one (crosses(k) held).
  __device__ __forceinline__ void advance(GroupRegs& gr, int k) {
    cur = k >> gshift;
    convert_group(gr, sv_next, zv_next);
    prefetch();
  }
  // at moves gr to step k's group (k increases by one step at a time).
  __device__ __forceinline__ void at(GroupRegs& gr, int k) {
    if (crosses(k)) advance(gr, k);
  }
  // seek moves gr to step k's group for any k past the last one: the
  // group loaded ahead if k is in it, else k's own, loaded now (v19's
  // warps that take every R-th step, with groups shorter than R steps).
  __device__ __forceinline__ void seek(GroupRegs& gr, int k) {
    if (!crosses(k)) return;
    if ((k >> gshift) == cur + 1)
      advance(gr, k);
    else
      start(gr, k);
  }
};

// warp_range is warp's share [k0, k1) of split's share of the KT steps.
__device__ __forceinline__ void warp_range(int KT, int splits, int split, int warp, int& k0, int& k1) {
  const int per_split = (KT + splits - 1) / splits;
  const int s0 = split * per_split, s1 = min(KT, s0 + per_split);
  const int per_warp = (s1 - s0 + kWarps - 1) / kWarps;
  k0 = s0 + warp * per_warp;
  k1 = min(s1, k0 + per_warp);
}

// GemvThread is where a thread of a GEMV kernel (w4a16_gemv, _mma,
// _swap: a CTA of kWarps warps, n-tile blockIdx.x, K slice blockIdx.y of
// `splits`) stands: its n-tile, warp, lane (gid and tig in mma's terms),
// the layer's 16-row steps and 64-column tiles, and its warp's steps
// [k0, k1).
struct GemvThread {
  int nt, warp, lane, gid, tig, KT, NT, k0, k1;
  __device__ __forceinline__ GemvThread(int N, int K, int splits)
      : nt(blockIdx.x), warp(threadIdx.x >> 5), lane(threadIdx.x & 31), gid(lane >> 2), tig(lane & 3), KT(K >> 4),
        NT(N >> 6) {
    warp_range(KT, splits, blockIdx.y, warp, k0, k1);
  }
};

// Outs is where a GEMM's output columns go: up to three row-major fp16
// tensors side by side (a joined layer's q, k and v), each a multiple of
// 64 columns wide, so an n-tile lies in one of them.
struct Outs {
  half* c[3];
  int end[3];  // each tensor's last column + 1 in the joined N
  int n;
  // ≥ 0: gated (a gate/up layer interleaved in 32-column halves,
  // pack.InterleaveGPU): c[0] [M][N/2] gets act(gate)·up (act_of's act),
  // tile nt's columns c and c + 32 making output column 32·nt + c.
  int act;
};

// out_at is the address of output (r, col).
__device__ __forceinline__ half* out_at(const Outs& o, int r, int col) {
  int s = 0, start = 0;
  while (s + 1 < o.n && col >= o.end[s]) start = o.end[s++];
  return o.c[s] + (size_t)r * (o.end[s] - start) + (col - start);
}

// emit stores output (r, col) (a single split) or adds it into the
// workspace [M][N] (K splits, or SUMS: the sums left there for the caller,
// w4a16_gemm with no outputs).
template <bool SUMS = false>
__device__ __forceinline__ void emit(const Outs& o, float* ws, int r, int col, int N, float v, int splits) {
  if (!SUMS && splits == 1)
    *out_at(o, r, col) = __float2half_rn(v);
  else
    atomicAdd(&ws[(size_t)r * N + col], v);
}

// store_gated writes act(gate)·up for row r, column c < 32 of n-tile nt
// of a gated GEMM (Outs::act ≥ 0) from that tile's columns c (gate) and
// c + 32 (up): output column 32·nt + c of the N/2.
__device__ __forceinline__ half* gated_at(const Outs& o, int r, int N, int nt, int c) {
  return &o.c[0][(size_t)r * (N / 2) + nt * 32 + c];
}
__device__ __forceinline__ void store_gated(const Outs& o, int r, int N, int nt, int c, float gate, float up) {
  *gated_at(o, r, N, nt, c) = gated_pair(gate, up, o.act);
}

// store_four writes four adjacent outputs of row r from fp32 sums g:
// columns c … c+3 of n-tile t, or when gated (o.act ≥ 0, c < 32)
// act(gate)·up of the gate's g and the up's u (columns c + 32 …), output
// columns 32·t + c …; u unused otherwise. (gated is the caller's
// o.act ≥ 0: computed here, it changed the SASS of every kernel that
// splits K, in finish_splits.)
__device__ __forceinline__ void store_four(const Outs& o, bool gated, int r, int N, int t, int c, float4 g, float4 u) {
  half2 h[2];
  if (gated) {
    h[0] = __halves2half2(gated_pair(g.x, u.x, o.act), gated_pair(g.y, u.y, o.act));
    h[1] = __halves2half2(gated_pair(g.z, u.z, o.act), gated_pair(g.w, u.w, o.act));
    *reinterpret_cast<uint2*>(gated_at(o, r, N, t, c)) = *reinterpret_cast<uint2*>(h);
  } else {
    h[0] = __floats2half2_rn(g.x, g.y);
    h[1] = __floats2half2_rn(g.z, g.w);
    *reinterpret_cast<uint2*>(out_at(o, r, t * 64 + c)) = *reinterpret_cast<uint2*>(h);
  }
}

// copy_codes issues THREADS threads' cp.async copies of a stage's codes:
// n-tiles nt0 … nt0+NTILES−1 for the U steps from kb, tile t's steps one
// run of U·CH·32 chunks after t − 1's in dst (as they lie in B), none
// past N's edge (NT tiles) or the slice's end k1 (the fused kernels' stages).
template <int NTILES, int U, int CH, int THREADS>
__device__ __forceinline__ void copy_codes(uint4* dst, const uint4* __restrict__ B, int nt0, int NT, int KT, int kb,
                                           int k1) {
  constexpr int kCodes = NTILES * U * CH * 32;
  static_assert(kCodes % THREADS == 0, "a stage's codes split evenly over the threads");
#pragma unroll
  for (int t = 0; t < kCodes / THREADS; ++t) {
    const int i = threadIdx.x + t * THREADS;
    const int w = i / (U * CH * 32), j = i % (U * CH * 32);
    if (nt0 + w < NT && kb + j / (CH * 32) < k1) cp_async16(dst + i, B + ((size_t)(nt0 + w) * KT + kb) * CH * 32 + j);
  }
}

// emit_tile writes rows row0 … row0+rows−1 (those below M) of n-tile nt,
// whose sums total(r − row0, col) gives (the CTA's, after its warps
// met): each through emit, or in the gated mode with one split, a pair
// of columns a thread into act(gate)·up.
// It runs in CTAs of kWarps warps (the GEMV kernels'): a constant stride,
// so the compiler can unroll the loops over a tile's rows, which the
// kernels' epilogues took before emit_tile (finish_splits likewise, with
// its CTA's thread count a template parameter). SUMS: every sum into the
// workspace, one split or several (no outputs, never gated).
template <bool SUMS = false, typename Total>
__device__ __forceinline__ void emit_tile(const Outs& o, float* ws, int row0, int rows, int M, int N, int nt, int splits,
                                          Total total) {
  if (!SUMS && o.act >= 0 && splits == 1) {
    for (int i = threadIdx.x; i < rows * 32; i += kWarps * 32) {
      const int r = row0 + i / 32, c = i & 31;
      if (r < M) store_gated(o, r, N, nt, c, total(i / 32, c), total(i / 32, c + 32));
    }
    return;
  }
  for (int i = threadIdx.x; i < rows * 64; i += kWarps * 32) {
    const int r = row0 + i / 64;
    if (r < M) emit<SUMS>(o, ws, r, nt * 64 + (i & 63), N, total(i / 64, i & 63), splits);
  }
}

// cta_sync is the barrier of THREADS threads: __syncthreads() (BAR 0, the
// whole CTA) or named barrier BAR for threads 0 … THREADS − 1 (v21's
// consumers, whose producer warpgroup has left).
template <int BAR, int THREADS>
__device__ __forceinline__ void cta_sync() {
  if constexpr (BAR == 0)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" ::"n"(BAR), "n"(THREADS) : "memory");
}

// finish_splits: the last of a tile's `splits` CTAs to finish (counted in
// *counter) converts rows row0 … row0+rows−1 of the tile from the
// workspace to fp16 (in the gated mode, pairs into act(gate)·up) and
// re-zeroes the workspace and the counter. ntiles: the CTA's sums cover
// n-tiles nt … nt+ntiles−1 (the fused kernel's NW, fewer at N's edge),
// all under the one counter. THREADS: the CTA's. SUMS (a GEMM with no
// outputs): nothing to do, the sums stay in the workspace, where the
// caller's next kernel reads and zeroes them.
template <int THREADS = kWarps * 32, int BAR = 0, bool SUMS = false>
__device__ __forceinline__ void finish_splits(const Outs& o, float* ws, int* counter, int row0, int rows, int M, int N,
                                              int nt, int splits, int& s_last, int ntiles = 1) {
  if (SUMS || splits == 1) return;  // SUMS: the sums stay in the workspace for the caller
  __threadfence();
  cta_sync<BAR, THREADS>();
  if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == splits - 1;
  cta_sync<BAR, THREADS>();
  if (!s_last) return;
  __threadfence();
  // Four columns a thread, rows·2^lg of them a tile (lg 3 gated: the
  // gate's 32 columns; 4 plain), kDrain fours loaded before any is stored:
  // the loads are independent, so a thread waits out L2's latency once a
  // round, not once an element (the fused kernel's CTA drains four tiles of
  // 64 rows, 32 fours a thread).
  constexpr int kDrain = 8, kStride = THREADS;
  const bool gated = o.act >= 0;
  const int lg = gated ? 3 : 4, per_tile = rows << lg;
  for (int t = nt; t < nt + ntiles; ++t)
    for (int base = threadIdx.x; base < per_tile; base += kDrain * kStride) {
      float4 g[kDrain], u[kDrain];
#pragma unroll
      for (int d = 0; d < kDrain; ++d) {
        const int i = base + d * kStride, r = row0 + (i >> lg);
        if (i < per_tile && r < M) {
          const float* p = &ws[(size_t)r * N + t * 64 + (i & ((1 << lg) - 1)) * 4];
          g[d] = __ldcg(reinterpret_cast<const float4*>(p));
          if (gated) u[d] = __ldcg(reinterpret_cast<const float4*>(p + 32));
        }
      }
#pragma unroll
      for (int d = 0; d < kDrain; ++d) {
        const int i = base + d * kStride, r = row0 + (i >> lg), c = (i & ((1 << lg) - 1)) * 4;
        if (i >= per_tile || r >= M) continue;
        float* p = &ws[(size_t)r * N + t * 64 + c];
        store_four(o, gated, r, N, t, c, g[d], u[d]);
        if (gated) *reinterpret_cast<float4*>(p + 32) = make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(p) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  if (threadIdx.x == 0) *counter = 0;
}

// w4a16_fused (v18): a CTA of NW warps owns NW adjacent n-tiles (warp w:
// tile NW·blockIdx.y + w) for the 16·MB rows of row block
// blockIdx.x, over one K slice (blockIdx.z of `splits`). All its threads
// stream the slice through STAGES shared-memory stages of U steps with
// cp.async, so the activations are read once for the CTA's NW tiles and
// the bytes in flight are the ring's, not the registers'. Each warp takes
// its tile's codes as B fragments from the stage (a lane's 16 bytes, as
// the GEMV kernels load them), dequantizes them in registers and runs
// MB·8 mma.m16n8k16 a step against the rows' A fragments (ldmatrix).
// Row blocks that share codes are neighbours in the grid (blockIdx.x
// varies fastest), so they run together and all but one read the codes
// from L2. MINB asks the compiler to fit MINB CTAs per SM. gshift: a group
// spans 2^gshift steps (−1: a single group). BITS: the codes' width, 4 or 8
// (two chunks a lane a step).
template <int MB, int U, int STAGES, int MINB, int BITS, int NW>
__global__ void __launch_bounds__(NW * 32, MINB) w4a16_fused(const half* __restrict__ A, const uint4* __restrict__ B,
                                                           const uint4* __restrict__ S, const uint32_t* __restrict__ Z,
                                                           const Outs C, float* __restrict__ ws,
                                                           int* __restrict__ counters, int M, int N, int K, int gshift,
                                                           int splits) {
  constexpr int CH = BITS / 4, kThreads = NW * 32;
  using Stage = TileStage<MB, U, CH, NW>;
  constexpr int kActs = U * MB * 32;  // 16-byte copies of activations a stage
  static_assert(kActs % kThreads == 0, "a stage's copies split evenly over the threads");
  extern __shared__ __align__(16) unsigned char smem[];
  Stage* stages = reinterpret_cast<Stage*>(smem);
  __shared__ int s_last;
  const int row0 = blockIdx.x * 16 * MB, nt0 = blockIdx.y * NW;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int KT = K >> 4, NT = N >> 6, nt = nt0 + warp;
  const bool tile_ok = nt < NT;  // the CTA at N's edge has fewer tiles than warps
  const int per_split = (KT + splits - 1) / splits;
  const int k0 = blockIdx.z * per_split, k1 = min(KT, k0 + per_split);
  const int batches = k1 > k0 ? (k1 - k0 + U - 1) / U : 0;

  // issue copies batch b's codes and activations into stage b % STAGES
  // (nothing past the slice or N's edge; rows past M as zeros) and
  // commits them as one group — an empty one past the last batch, so that
  // the waits below count the same.
  auto issue = [&](int b) {
    if (b < batches) {
      Stage& st = stages[b % STAGES];
      const int kb = k0 + b * U;
      copy_codes<NW, U, CH, kThreads>(&st.b[0][0][0][0], B, nt0, NT, KT, kb, k1);
#pragma unroll
      for (int t = 0; t < kActs / kThreads; ++t) {
        // consecutive threads along a row: a row's U steps are 32·U contiguous bytes
        const int i = threadIdx.x + t * kThreads;
        const int h = i & 1, u = (i >> 1) % U, r = (i / (2 * U)) % 16, m = i / (32 * U);
        const int row = row0 + m * 16 + r;
        if (kb + u < k1)
          cp_async16_zfill(&st.a[u][m][act_slot(r, h)], A + (size_t)(row < M ? row : 0) * K + (kb + u) * 16 + h * 8,
                           row < M);
      }
    }
    cp_async_commit();
  };

  float acc[MB][8][4];
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.f;

  // Scales and zeros: the current group's in registers, the next one's
  // loaded ahead — weights, so asked for before the PDL gate
  // (weights_then_gate in common.cuh); everything else after it.
  GroupStream<BITS> groups(S, Z, tile_ok ? nt : 0, NT, gid, KT, gshift);
  GroupRegs gr;
  if (k1 > k0) groups.start(gr, k0);
  pdl_gate();
#pragma unroll
  for (int b = 0; b < STAGES - 1; ++b) issue(b);
  const int lm = act_slot(lane & 15, lane >> 4);  // ldmatrix: this lane's row lane%16, half lane/16

  for (int b = 0; b < batches; ++b) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // batch b landed (every thread's copies), and every warp is done with batch b − 1's stage
    issue(b + STAGES - 1);  // into that stage
    if (tile_ok) {
      const Stage& st = stages[b % STAGES];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + b * U + u;
        if (k < k1) {
          groups.at(gr, k);
          uint32_t af[MB][4];
#pragma unroll
          for (int m = 0; m < MB; ++m) ldmatrix_x4(af[m], &st.a[u][m][lm]);
          compute_step<MB, BITS>(acc, &st.b[warp][u][0][lane], af, gr);
        }
      }
    }
  }
  cp_async_wait<0>();

  // A lane holds rows gid and gid + 8 of each m-tile, columns j·8 + 2·tig
  // and + 1 of sub-tile j; gated, sub-tile j's gate pairs with j + 4's up
  // in the same lane.
  if (tile_ok) {
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = row0 + m * 16 + gid + 8 * hr;
        if (r >= M) continue;
        if (C.act >= 0 && splits == 1) {
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              store_gated(C, r, N, nt, j * 8 + 2 * tig + e, acc[m][j][2 * hr + e], acc[m][j + 4][2 * hr + e]);
          continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = nt * 64 + j * 8 + 2 * tig;
          if (splits == 1) {
            *reinterpret_cast<half2*>(out_at(C, r, col)) = __floats2half2_rn(acc[m][j][2 * hr], acc[m][j][2 * hr + 1]);
          } else {
            float* p = &ws[(size_t)r * N + col];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float2*>(p), make_float2(acc[m][j][2 * hr], acc[m][j][2 * hr + 1]));
#else
            atomicAdd(p, acc[m][j][2 * hr]);
            atomicAdd(p + 1, acc[m][j][2 * hr + 1]);
#endif
          }
        }
      }
  }
  finish_splits<kThreads>(C, ws, &counters[blockIdx.x * NT + nt0], row0, 16 * MB, M, N, nt0, splits, s_last,
                          min(NW, NT - nt0));
}

// v19: the fused kernel on Hopper's warpgroup MMA (wgmma, sm_90a), with
// the dequantized weights staged in shared memory. v18's warps issue
// mma.sync, 32 of them a step at 64 rows beside the step's 52
// dequantization instructions, and with two warps a scheduler (232
// registers) they wait on each other's fixed latencies: ncu's stalls at 64
// rows on gate+up were mostly "wait", not memory (cuda/NOTES.md, "The
// sixteenth session"). Here the Tensor Cores run on their own: the
// operands are swapped (C^T = W^T · A^T) so the tile's 64 output columns
// are wgmma's M side and the CTA's NTOK tokens its N side, and both
// operands come from shared memory:
// - the codes of the CTA's T n-tiles and the tokens' activations stream
//   through STAGES cp.async stages, as v18's do, the activations laid out
//   K-major for wgmma, a token's step in 32 bytes, 32-byte swizzled
//   (wgmma_desc, sw32); each warp copies the codes it dequantizes, so its
//   own wait, before the stage's barrier, is the one they need;
// - each warp dequantizes one n-tile's steps (warp w: tile w mod T, the
//   steps u ≡ w / T mod R of a stage, R = warps / T) exactly as every
//   kernel does, (q − z)·s in fp16, and stores the lane's mma B fragments
//   with stmatrix: they are rows 8j … 8j+7 (sub-tile j) of the 64 × 16
//   weight tile in the same layout, so a tile-step is 2 KB of fp16 that
//   wgmma reads by descriptor;
// - one barrier a stage, then each warpgroup issues wgmma.m64nNTOKk16 for
//   its WN = T / NWG tiles and the stage's U steps as one group, and goes
//   on to dequantize the next stage while they run (wait_group 1: a
//   stage's wgmmas are retired one stage later). Three dequantized
//   buffers and the stages refilled two stages behind keep every write
//   after the reads of the wgmmas it replaces, with the one barrier.
// Accumulators: WN·NTOK/2 fp32 a thread. The epilogue goes through shared
// memory (the tile of NTOK tokens × 64·T columns in fp32), so that stores,
// gated pairs and split-K atomics are four adjacent columns a thread.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LLMQ_HAVE_WGMMA 1
#else
#define LLMQ_HAVE_WGMMA 0
#endif

// WgTile: v19's shared-memory plan for NTOK tokens, NWG warpgroups, T
// n-tiles, U steps a stage, STAGES stages and BITS-bit codes.
template <int NTOK, int NWG, int T, int U, int STAGES, int BITS>
struct WgTile {
  static constexpr int kWarpsCta = 4 * NWG, kThreads = 128 * NWG, WN = T / NWG, R = kWarpsCta / T, CH = BITS / 4;
  static constexpr int kCodes = T * U * CH * 32;  // 16-byte copies of codes a stage: tile t's U steps, then t + 1's
  static constexpr int kActs = U * NTOK * 2;      // 16-byte copies of activations a stage
  static constexpr int kStage = 16 * (kCodes + kActs);
  static constexpr int kDeq = U * T * 2048;  // one dequantized buffer: [U][T] tile-steps of 64 × 16 fp16
  static constexpr int kEpiStride = T * 64 + 4;  // floats a token's row of the epilogue's tile (+4: no bank conflicts)
  static constexpr size_t kMain = (size_t)STAGES * kStage + 3 * (size_t)kDeq;
  static constexpr size_t kEpi = (size_t)NTOK * kEpiStride * 4;
  // (+16: s_last, after the rest, so that no static shared memory moves
  // the swizzled buffers off their 256-byte alignment)
  static constexpr size_t kSmem = (kMain > kEpi ? kMain : kEpi) + 16;
  static_assert(NTOK % 16 == 0 && T % NWG == 0 && kWarpsCta % T == 0 && U % R == 0, "v19's shape");
  static_assert(kActs % kThreads == 0, "a stage's activation copies split evenly over the threads");
  static_assert(STAGES >= 3 && WN >= 1, "the stages are refilled two behind");
};

template <int N>
struct WgmmaSS;
#if LLMQ_HAVE_WGMMA
// wgmma_desc is the shared-memory matrix descriptor of a K-major operand
// of 16 K (one step) in the 32-byte swizzle: a row's 32 bytes hold its 16
// K, the two 16-byte halves exchanged on rows 4–7 of every 8 (sw32), 256
// bytes between groups of 8 rows (SBO; LBO unused: K is one swizzle atom
// wide). The first build's unswizzled core matrices (eight rows of a
// column 128 bytes apart, in the same banks) were 11–13% slower at 128
// tokens (gemm-h100-sweep-v19a.txt against -v19b.txt).
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  return (uint64_t)((a >> 4) & 0x3fffu) | (uint64_t(1) << 16) | (uint64_t(256 >> 4) << 32) | (uint64_t(3) << 62);
}
// sw32 is the byte offset of row r's 16-byte half h in a 32-byte-swizzled
// K-major tile (wgmma_desc): the layout ldmatrix-style eight-row accesses
// read in one pass of the banks, as v18's act_slot.
__device__ __forceinline__ int sw32(int r, int h) { return r * 32 + 16 * (h ^ ((r >> 2) & 1)); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// fence_proxy_async makes this thread's shared-memory writes (stores, and
// cp.async copies once waited for) visible to the async proxy, through
// which wgmma reads its operands.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// pin: the accumulators are read only after this point (the compiler
// cannot see that wgmma_wait is what makes them final).
template <int ND>
__device__ __forceinline__ void pin(float (&d)[ND]) {
#pragma unroll
  for (int i = 0; i < ND; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// stmatrix_x4 stores four 8×8 fp16 matrices, register i of every lane
// to matrix i (row lane/4, columns 2·(lane%4) and + 1, as mma's fragments
// hold them), at the rows lanes 8i … 8i+7 address.
__device__ __forceinline__ void stmatrix_x4(void* smem, const uint32_t (&r)[4]) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}
// The accumulators of a wgmma of N columns (N/2 fp32 a thread): their
// places in the instruction's text, %0 … %(N/2 − 1) (the operands after
// them number from N/2), and their constraints.
#define LLMQ_ACC_REGS16 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define LLMQ_ACC_REGS32 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31"
#define LLMQ_ACC_REGS64 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49," \
  "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define LLMQ_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define LLMQ_ACC16(d, i) LLMQ_ACC4(d, i), LLMQ_ACC4(d, i + 4), LLMQ_ACC4(d, i + 8), LLMQ_ACC4(d, i + 12)
#define LLMQ_ACC_OPS16(d) LLMQ_ACC16(d, 0)
#define LLMQ_ACC_OPS32(d) LLMQ_ACC16(d, 0), LLMQ_ACC16(d, 16)
#define LLMQ_ACC_OPS64(d) LLMQ_ACC16(d, 0), LLMQ_ACC16(d, 16), LLMQ_ACC16(d, 32), LLMQ_ACC16(d, 48)
// WgmmaSS<N>::mma is wgmma.mma_async m64nNk16, fp32 += fp16 × fp16, both
// operands K-major in shared memory by descriptor, accumulating into d.
template <>
struct WgmmaSS<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" LLMQ_ACC_REGS16 "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : LLMQ_ACC_OPS16(d)
                 : "l"(da), "l"(db), "r"(1));
  }
};
template <>
struct WgmmaSS<64> {
  static __device__ __forceinline__ void mma(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" LLMQ_ACC_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : LLMQ_ACC_OPS32(d)
                 : "l"(da), "l"(db), "r"(1));
  }
};
template <>
struct WgmmaSS<128> {
  static __device__ __forceinline__ void mma(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" LLMQ_ACC_REGS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : LLMQ_ACC_OPS64(d)
                 : "l"(da), "l"(db), "r"(1));
  }
};
// WgmmaRS<N>::mma is the same with the A operand (the 64 weight columns ×
// 16 K) in registers, as mma.m16n8k16's A fragments (warp w of the
// warpgroup: rows 16w … 16w + 15), B by descriptor (v21).
template <int N>
struct WgmmaRS;
// (N columns, ND = N/2 accumulators; PA: the predicate's operand, OPS:
// the A registers' and B's descriptor's.)
#define LLMQ_WGMMA_RS(N, ND, PA, OPS)                                                                            \
  template <>                                                                                                    \
  struct WgmmaRS<N> {                                                                                            \
    static __device__ __forceinline__ void mma(float (&d)[ND], const uint32_t (&a)[4], uint64_t db) {            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PA ", 0;\n"                                              \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" LLMQ_ACC_REGS##ND "}, " OPS          \
                   ", p, 1, 1, 0;\n}\n"                                                                          \
                   : LLMQ_ACC_OPS##ND(d)                                                                         \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));                               \
    }                                                                                                            \
  };
LLMQ_WGMMA_RS(64, 32, "%37", "{%32,%33,%34,%35}, %36")
LLMQ_WGMMA_RS(128, 64, "%69", "{%64,%65,%66,%67}, %68")
#endif

// wg_acc_to_tile writes a wgmma warp's accumulators (v19, v21) to the
// epilogue's tile of NTOK tokens × the CTA's columns in fp32 (rows STRIDE
// floats apart): acc[j][4i + 2h + e] is column 16·(warp mod 4) + gid + 8h
// of the warpgroup's tile j (the CTA's wg·WN + j), token 8i + 2·tig + e.
template <int NTOK, int WN, int STRIDE>
__device__ __forceinline__ void wg_acc_to_tile(float* tile, const float (&acc)[WN][NTOK / 2], int warp, int lane) {
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int j = 0; j < WN; ++j) {
    const int col = ((warp >> 2) * WN + j) * 64 + 16 * (warp & 3) + gid;
#pragma unroll
    for (int i = 0; i < NTOK / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) tile[(8 * i + 2 * tig + e) * STRIDE + col + 8 * h] = acc[j][4 * i + 2 * h + e];
  }
}

// wg_epilogue stores the tile (v19, v21): four adjacent columns a thread
// of THREADS, as outputs (gated pairs through the activation) or, with K
// splits, added into the workspace, which finish_splits' last CTA turns
// into outputs (meeting at barrier BAR: cta_sync).
template <int NTOK, int T, int THREADS, int STRIDE, int BAR = 0>
__device__ __forceinline__ void wg_epilogue(const float* tile, const Outs& C, float* ws, int* counters, int row0,
                                            int nt0, int M, int N, int splits, int& s_last) {
  const int NT = N >> 6;
  constexpr int kF4 = T * 16;  // four-column groups a token's row
  for (int i = threadIdx.x; i < NTOK * kF4; i += THREADS) {
    const int tok = i / kF4, c = (i % kF4) * 4, t = c >> 6, cc = c & 63;
    const int r = row0 + tok, nt = nt0 + t;
    if (r >= M || nt >= NT) continue;
    const float4* p = reinterpret_cast<const float4*>(tile + tok * STRIDE + c);
    if (splits > 1)
      atomicAdd(reinterpret_cast<float4*>(&ws[(size_t)r * N + nt * 64 + cc]), p[0]);
    else if (C.act < 0)
      store_four(C, false, r, N, nt, cc, p[0], p[0]);
    else if (cc < 32)  // gated: the gate's columns cc < 32 pair with the up's cc + 32
      store_four(C, true, r, N, nt, cc, p[0], p[8]);
  }
  finish_splits<THREADS, BAR>(C, ws, &counters[blockIdx.x * NT + nt0], row0, NTOK, M, N, nt0, splits, s_last,
                              min(T, NT - nt0));
}

// w4a16_wgmma (v19): a CTA of NWG warpgroups owns T adjacent n-tiles
// (64·T columns) for the NTOK rows of row block blockIdx.x, over one K
// slice (blockIdx.z of `splits`); the grid, the workspace and the counters
// are v18's. gshift and BITS as v18's.
template <int NTOK, int NWG, int T, int U, int STAGES, int BITS>
__global__ void __launch_bounds__(128 * NWG, 1) w4a16_wgmma(const half* __restrict__ A, const uint4* __restrict__ B,
                                                          const uint4* __restrict__ S, const uint32_t* __restrict__ Z,
                                                          const Outs C, float* __restrict__ ws,
                                                          int* __restrict__ counters, int M, int N, int K, int gshift,
                                                          int splits) {
#if LLMQ_HAVE_WGMMA
  using L = WgTile<NTOK, NWG, T, U, STAGES, BITS>;
  constexpr int CH = L::CH, kThreads = L::kThreads, WN = L::WN, R = L::R;
  extern __shared__ __align__(1024) unsigned char wg_smem[];  // (the swizzle needs 256-byte alignment)
  unsigned char* const smem = wg_smem;
  int& s_last = *reinterpret_cast<int*>(smem + L::kSmem - 16);
  const int row0 = blockIdx.x * NTOK, nt0 = blockIdx.y * T;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const int KT = K >> 4, NT = N >> 6;
  const int per_split = (KT + splits - 1) / splits;
  const int k0 = blockIdx.z * per_split, k1 = min(KT, k0 + per_split);
  const int batches = k1 > k0 ? (k1 - k0 + U - 1) / U : 0;
  // The warp's share of the dequantization: tile tw's steps pw, pw + R, …
  const int tw = warp % T, pw = warp / T;
  const bool tile_ok = nt0 + tw < NT;
  unsigned char* const deq = smem + (size_t)STAGES * L::kStage;
  auto stage_at = [&](int b) { return smem + (size_t)(b % STAGES) * L::kStage; };

  // issue copies batch b's codes and activations into stage b % STAGES
  // and commits them as one group (an empty one past the last batch, so
  // that the waits count the same). Activations past M or the slice are
  // zeros, so the wgmmas run unguarded.
  auto issue = [&](int b) {
    if (b < batches) {
      unsigned char* st = stage_at(b);
      const int kb = k0 + b * U;
      // Codes: each warp copies the chunks it will dequantize itself (tile
      // tw, steps pw, pw + R, …), so that its own cp_async_wait makes them
      // visible to it before the stage's barrier. (Copied by the CTA's
      // threads in turn, as v18's copy_codes does, a warp read chunks whose
      // copies another thread had not yet waited for: the two variants that
      // were wrong on the device — cuda/NOTES.md, "The seventeenth session".)
      if (tile_ok) {
        uint4* cst = reinterpret_cast<uint4*>(st);
        const uint4* src = B + ((size_t)(nt0 + tw) * KT + kb) * CH * 32 + lane;
#pragma unroll
        for (int uu = 0; uu < U / R; ++uu) {
          const int u = uu * R + pw;
          if (kb + u < k1)
#pragma unroll
            for (int c = 0; c < CH; ++c) cp_async16(cst + ((tw * U + u) * CH + c) * 32 + lane, src + (u * CH + c) * 32);
        }
      }
      unsigned char* acts = st + 16 * L::kCodes;
#pragma unroll
      for (int t = 0; t < L::kActs / kThreads; ++t) {
        // consecutive threads along a token: its U steps are 32·U contiguous bytes
        const int i = threadIdx.x + t * kThreads;
        const int n = i / (2 * U), u = (i >> 1) % U, kh = i & 1;
        const int row = row0 + n;
        const bool ok = row < M && kb + u < k1;
        cp_async16_zfill(acts + u * (NTOK * 32) + sw32(n, kh),
                         A + (size_t)(row < M ? row : 0) * K + (ok ? (kb + u) * 16 + kh * 8 : 0), ok);
      }
    }
    cp_async_commit();
  };

  float acc[WN][NTOK / 2];
#pragma unroll
  for (int j = 0; j < WN; ++j)
#pragma unroll
    for (int i = 0; i < NTOK / 2; ++i) acc[j][i] = 0.f;

  GroupStream<BITS> groups(S, Z, tile_ok ? nt0 + tw : 0, NT, lane >> 2, KT, gshift);
  GroupRegs gr;
  if (k0 + pw < k1) groups.start(gr, k0 + pw);
  pdl_gate();
#pragma unroll
  for (int b = 0; b < STAGES - 2; ++b) issue(b);
  // stmatrix: lane addresses row lane%8 of matrix lane/8, which for word
  // i's four registers is tile row 8·(2i + lane/16) + lane%8 (sub-tile 2i
  // or 2i + 1, column lane%8) and K half (lane/8)%2.
  const int st_off = sw32((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);

  for (int b = 0; b < batches; ++b) {
    cp_async_wait<STAGES - 3>();  // batch b's copies (this thread's) are in: the codes this warp dequantizes
    const unsigned char* st = stage_at(b);
    unsigned char* dq = deq + (size_t)(b % 3) * L::kDeq;
#pragma unroll
    for (int uu = 0; uu < U / R; ++uu) {
      const int u = uu * R + pw, k = k0 + b * U + u;
      uint32_t bq[4][4];
      if (k < k1 && tile_ok) {  // (uniform across the warp)
        groups.seek(gr, k);
        uint32_t w[4 * CH];
        const uint4* cq = reinterpret_cast<const uint4*>(st) + (tw * U + u) * CH * 32 + lane;
#pragma unroll
        for (int c = 0; c < CH; ++c) put_words(w, c, cq[c * 32]);
#pragma unroll
        for (int i = 0; i < 4; ++i) dequant_pair<BITS>(bq[i], w, i, gr);
      } else {  // past the slice or N's edge: zeros, never a stale buffer's bits
#pragma unroll
        for (int i = 0; i < 4; ++i) bq[i][0] = bq[i][1] = bq[i][2] = bq[i][3] = 0;
      }
      unsigned char* dst = dq + (u * T + tw) * 2048 + st_off;
#pragma unroll
      for (int i = 0; i < 4; ++i) stmatrix_x4(dst + i * 512, bq[i]);
    }
    fence_proxy_async();
    __syncthreads();  // batch b is dequantized and in, for every warp; batch b − 2's wgmmas are retired (all warpgroups)
    issue(b + STAGES - 2);  // into batch b − 2's stage
    const unsigned char* acts = st + 16 * L::kCodes;
    wgmma_fence();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t db = wgmma_desc(acts + u * (NTOK * 32));
#pragma unroll
      for (int j = 0; j < WN; ++j) WgmmaSS<NTOK>::mma(acc[j], wgmma_desc(dq + (u * T + wg * WN + j) * 2048), db);
    }
    wgmma_commit();
    wgmma_wait<1>();  // batch b − 1's wgmmas are done
  }
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < WN; ++j) pin(acc[j]);
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: the epilogue's tile takes their place

  float* tile = reinterpret_cast<float*>(smem);
  wg_acc_to_tile<NTOK, WN, L::kEpiStride>(tile, acc, warp, lane);
  __syncthreads();
  wg_epilogue<NTOK, T, kThreads, L::kEpiStride>(tile, C, ws, counters, row0, nt0, M, N, splits, s_last);
#else
  __trap();  // built without sm_90a: the plan refuses v19 off Hopper before a launch gets here
#endif
}

// v21 (w4a16_wgmma_rs; the plan's on Hopper at M = 33–256): v19 without its proxy
// fence. v19's fence.proxy.async, which makes the dequantized weights
// (stmatrix) and the activations (cp.async) visible to wgmma, compiles to
// a MEMBAR that waits for every copy and load its thread has in flight,
// the next stages' too (cuda/NOTES.md, "The seventeenth session"). Here
// neither operand is written through the generic proxy:
// - the weights go to wgmma in registers (its A operand, as Machete's and
//   CUTLASS's mixed-input kernels do): warp w of a warpgroup dequantizes
//   rows 16w … 16w + 15 of each of the warpgroup's WN tiles, which are
//   sub-tiles 2w and 2w + 1 of the GPU layout — one dequant_pair of the
//   lane's chunk, whose B fragments are the lane's A fragment in another
//   order (PairRegs: that pair's scales and zeros alone). A warp reads
//   its word of each chunk a step ahead;
// - a producer warpgroup (the CTA's last; one thread of it) fills the
//   STAGES stages through the copy engine: each tile's codes for a
//   stage's U steps as one bulk copy, the activations as U boxes of a
//   tensor map (16 K × NTOK rows) that land in wgmma's 32-byte swizzle,
//   rows past M and steps past the slice as zeros, and the scales and
//   zeros of each group the steps touch (the CTA's tiles' entries are
//   contiguous: two bulk copies a group). The consumers so load nothing
//   from global memory: before, each warp loaded its next group's scales
//   ahead into registers, and a convert waited on the load another tile
//   had just issued (a warp's loads share a few scoreboards): ncu's
//   stall samples, cuda/NOTES.md, "The nineteenth session". A stage's `full`
//   mbarrier completes when its bytes have landed, its `empty` one when
//   every consumer thread has retired the stage's wgmmas. (A whole
//   warpgroup, since ptxas gives every thread of a wgmma kernel the
//   registers of a CTA rounded up to warpgroups: 168 at 384 threads. The
//   producer hands registers to the consumers (setmaxnreg); ptxas 12.4
//   still allocated within 168, but without it the consumers spilled.)
// - a consumer dequantizes one tile-step's A fragments at a time into one
//   of two register buffers, issues its wgmma as a group of one and waits
//   for the group before (wait_group 1), so that a wgmma runs while the
//   next tile-step is dequantized. (A group a step, its WN tiles' A
//   fragments in two buffers, took more than the 168 registers: ptxas
//   serialized every wgmma, C7512.)
// The epilogue is v19's, among the consumers (named barrier 1).
template <int NTOK, int NWG, int T, int U, int STAGES, int BITS>
struct WgRsTile {
  static constexpr int kConsumers = 128 * NWG, kThreads = kConsumers + 128, WN = T / NWG, CH = BITS / 4;
  // registers a thread (setmaxnreg): at launch (the register file over the
  // CTA, in multiples of 8, at most 255: 168 at 384 threads), then the
  // producer's, and the consumers' from the rest (multiples of 8, at most 256)
  static constexpr int kEntryRegs = (65536 / kThreads < 255 ? 65536 / kThreads : 255) / 8 * 8;
  static constexpr int kProducerRegs = 40;
  static constexpr int kRest = (kThreads * kEntryRegs - 128 * kProducerRegs) / kConsumers / 8 * 8;
  static constexpr int kConsumerRegs = kRest < 256 ? kRest : 256;
  static constexpr int kCodeBytes = T * U * CH * 512;  // a stage's codes: tile t's U steps, then t + 1's
  static constexpr int kActBytes = U * NTOK * 32;      // its activations: step u's NTOK rows of 32 bytes (sw32)
  // its groups' scales, then zeros: the i-th group the stage's steps
  // touch (at most U of them) for tile t at (i·T + t)·kScaleTile, as
  // stored (a tile's eight lanes' entries, gid by gid)
  static constexpr int kZeroTile = 8 * (int)sizeof(ZerosOf<BITS>), kScaleTile = 8 * 16;
  static constexpr int kScaleBytes = U * T * kScaleTile, kZeroBytes = U * T * kZeroTile;
  // (rounded up to 1 KiB: every stage's boxes as aligned as the first's; the swizzle needs 256 bytes)
  static constexpr int kStage = (kCodeBytes + kActBytes + kScaleBytes + kZeroBytes + 1023) / 1024 * 1024;
  static constexpr int kEpiStride = T * 64 + 4;  // floats a token's row of the epilogue's tile
  static constexpr size_t kMain = (size_t)STAGES * kStage, kEpi = (size_t)NTOK * kEpiStride * 4;
  static constexpr size_t kBar = kMain > kEpi ? kMain : kEpi;  // full[STAGES], empty[STAGES], then s_last
  static constexpr size_t kSmem = kBar + 16 * STAGES + 16;
  static_assert((NTOK == 64 || NTOK == 128) && T % NWG == 0 && WN >= 1 && U % 2 == 0 && STAGES >= 2, "v21's shape");
  static_assert(kSmem <= 232448, "v21's stages fit an SM's shared memory");
  // stage: where batch b's stage starts
  static __device__ __forceinline__ unsigned char* stage(unsigned char* smem, int b) {
    return smem + (size_t)(b % STAGES) * kStage;
  }
  static_assert(128 * kProducerRegs + kConsumers * kConsumerRegs <= kThreads * kEntryRegs,
                "v21's consumers take no more registers than its producer gives up");
};

#if LLMQ_HAVE_WGMMA
// rs_warp_arrive: whether v21's consumers free a stage with one arrival a
// warp (at 64 tokens) rather than one a thread (128). In one H100 A/B
// (gemm-h100-ab-v21-warp-arrive.txt) a warp's arrival was 1–2% faster on
// every large layer at 48 and 64 rows, and 2–4% slower at 128 and 256.
// The warp's lanes read the stage before its __syncwarp, and lane 0's
// arrival (a release) follows it, so the producer's wait orders the
// refill after every lane's reads — an elected arrival, as CUTLASS's
// pipelines release stages. compute-sanitizer's racecheck does not follow
// that chain and reports each read as a hazard
// (cuda-racecheck-wgmma-d335a87-h100.log: only the 64-token kernels);
// build with -DLLMQ_RS_THREAD_ARRIVE for a racecheck run, which gives
// every kernel one arrival a thread.
__device__ constexpr bool rs_warp_arrive(int ntok) {
#ifdef LLMQ_RS_THREAD_ARRIVE
  return false;
#else
  return ntok == 64;
#endif
}

// tma_load_2d copies the box of map at (x, y) (innermost first) to dst,
// completing on bar; parts of the box outside the tensor land as zeros.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
      smem_addr(dst)),
    "l"(map), "r"(x), "r"(y), "r"(smem_addr(bar))
    : "memory");
}
// set_max_regs: the warpgroup's registers a thread go from FROM (what the
// launch gave it) to N (setmaxnreg; every thread of the warpgroup runs it).
template <int FROM, int N>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (N > FROM)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else if constexpr (N < FROM)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// rs_consume is v21's consumer warpgroups' part (w4a16_wgmma_rs): warp w
// takes rows 16·(w mod 4) … 16·(w mod 4) + 15 of its warpgroup's tiles
// wg·WN + j, stage by stage as the producer fills them, then the epilogue.
template <int NTOK, int NWG, int T, int U, int STAGES, int BITS>
__device__ __forceinline__ void rs_consume(unsigned char* smem, uint64_t* full, uint64_t* empty, int& s_last,
                                           const Outs& C, float* __restrict__ ws, int* __restrict__ counters, int row0,
                                           int nt0, int M, int N, int k0, int k1, int batches, int gshift,
                                           int splits) {
  using L = WgRsTile<NTOK, NWG, T, U, STAGES, BITS>;
  constexpr int CH = L::CH, WN = L::WN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  set_max_regs<L::kEntryRegs, L::kConsumerRegs>();
  const int pair = warp & 3, gid = lane >> 2;
  PairRegs gr[WN];
  pdl_gate();
  float acc[WN][NTOK / 2];
#pragma unroll
  for (int j = 0; j < WN; ++j)
#pragma unroll
    for (int i = 0; i < NTOK / 2; ++i) acc[j][i] = 0.f;
  uint32_t a[2][4];  // tile-step i's A fragments in a[i % 2] (the one before may be in flight)
  for (int b = 0; b < batches; ++b) {
    mbar_wait(&full[b % STAGES], (b / STAGES) & 1);  // batch b has landed
    const unsigned char* st = L::stage(smem, b);
    const int kb = k0 + b * U, g0 = step_group(kb, gshift);
    // converts: whether step kb + u takes a group's scales and zeros — the
    // split's first step and each group's first; the registers keep them
    // across batches otherwise (a step past the slice takes none: its
    // group's entries may not be in the stage)
    auto converts = [&](int u) {
      const int k = kb + u;
      return k < k1 && ((b == 0 && u == 0) || (gshift >= 0 && (k & ((1 << gshift) - 1)) == 0));
    };
    // StepIn: what a step takes from the stage for the warp's tiles — the
    // pair's words (word `pair` of the lane's chunk at 4 bits, words
    // 2·pair and + 1, in chunk pair / 2, at 8) and, where it converts, its
    // group's scales and zeros as stored — read a step ahead, so that the
    // reads' latency hides behind the step before
    struct StepIn {
      uint32_t w[WN][CH], sw[WN];
      ZerosOf<BITS> zv[WN];
    };
    auto read_step = [&](StepIn& in, int u) {
      const int gi = gshift < 0 ? 0 : ((kb + u) >> gshift) - g0;
      const unsigned char* sc = st + L::kCodeBytes + L::kActBytes;
      const bool group = converts(u);
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        const uint32_t* chunk = reinterpret_cast<const uint32_t*>(st) +
                                ((((wg * WN + j) * U + u) * CH + (CH - 1) * (pair >> 1)) * 32 + lane) * 4;
        if constexpr (CH == 1) {
          in.w[j][0] = chunk[pair];
        } else {
          const uint2 v = reinterpret_cast<const uint2*>(chunk)[pair & 1];
          in.w[j][0] = v.x;
          in.w[j][1] = v.y;
        }
        if (group) {
          const int t = gi * T + wg * WN + j;
          in.sw[j] = reinterpret_cast<const uint32_t*>(sc + t * L::kScaleTile + gid * 16)[pair];
          in.zv[j] = reinterpret_cast<const ZerosOf<BITS>*>(sc + L::kScaleBytes + t * L::kZeroTile)[gid];
        }
      }
    };
    StepIn next;
    read_step(next, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u;
      const uint64_t db = wgmma_desc(st + L::kCodeBytes + u * (NTOK * 32));
      const StepIn in = next;
      if (u + 1 < U) read_step(next, u + 1);
      if (converts(u))
#pragma unroll
        for (int j = 0; j < WN; ++j) convert_group(gr[j], in.sw[j], in.zv[j], pair);
      // The steps past the slice (in its last batch) multiply zero weights:
      // their codes are whatever the stage held before (finite weights with
      // any scale, as codes_word makes them), their activations a box past
      // K (zeros), and zero scales keep an overflowing scale's ∞ · 0 out.
      if (k == k1)
#pragma unroll
        for (int j = 0; j < WN; ++j) gr[j].s[0] = gr[j].s[1] = 0u;
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        uint32_t(&af)[4] = a[(u * WN + j) & 1];
        // A's fragment: rows gid and gid + 8 (sub-tiles 2·pair and + 1) at
        // K 2·tig, then at 2·tig + 8. A tile past N's edge computes rows of
        // garbage (its stage's bytes were never copied) that the epilogue
        // does not store, and no other row sums them.
        uint32_t bq[4];
        dequant_pair<BITS>(bq, in.w[j], 0, gr[j]);
        af[0] = bq[0];
        af[1] = bq[2];
        af[2] = bq[1];
        af[3] = bq[3];
        wgmma_fence();
        WgmmaRS<NTOK>::mma(acc[j], af, db);
        wgmma_commit();
        wgmma_wait<1>();  // the tile-step before is retired: its A buffer is free
        if (u == 0 && j == 0 && b > 0) {  // and with it batch b − 1's stage
          if constexpr (rs_warp_arrive(NTOK)) {   // once every lane of the warp is past
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[(b - 1) % STAGES]);
          } else {
            mbar_arrive(&empty[(b - 1) % STAGES]);
          }
        }
      }
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < WN; ++j) pin(acc[j]);
  cta_sync<1, L::kConsumers>();  // every consumer's wgmmas are retired: the epilogue's tile takes the stages' place
  float* tile = reinterpret_cast<float*>(smem);
  wg_acc_to_tile<NTOK, WN, L::kEpiStride>(tile, acc, warp, lane);
  cta_sync<1, L::kConsumers>();
  wg_epilogue<NTOK, T, L::kConsumers, L::kEpiStride, 1>(tile, C, ws, counters, row0, nt0, M, N, splits, s_last);
}
#endif

template <int NTOK, int NWG, int T, int U, int STAGES, int BITS>
__global__ void __launch_bounds__(128 * NWG + 128, 1)
  w4a16_wgmma_rs(const half* __restrict__ A, const uint4* __restrict__ B, const uint4* __restrict__ S,
                 const uint32_t* __restrict__ Z, const Outs C, float* __restrict__ ws, int* __restrict__ counters,
                 int M, int N, int K, int gshift, int splits, const __grid_constant__ CUtensorMap tmA) {
#if LLMQ_HAVE_WGMMA
  using L = WgRsTile<NTOK, NWG, T, U, STAGES, BITS>;
  constexpr int CH = L::CH;
  extern __shared__ __align__(1024) unsigned char rs_smem[];  // (the swizzle needs 256-byte alignment)
  unsigned char* const smem = rs_smem;
  auto& full = *reinterpret_cast<uint64_t(*)[STAGES]>(smem + L::kBar);
  auto& empty = *reinterpret_cast<uint64_t(*)[STAGES]>(smem + L::kBar + 8 * STAGES);
  int& s_last = *reinterpret_cast<int*>(smem + L::kBar + 16 * STAGES);
  const int row0 = blockIdx.x * NTOK, nt0 = blockIdx.y * T;
  const int wg = threadIdx.x >> 7;
  const int KT = K >> 4, NT = N >> 6;
  const int per_split = (KT + splits - 1) / splits;
  const int k0 = blockIdx.z * per_split, k1 = min(KT, k0 + per_split);
  const int batches = k1 > k0 ? (k1 - k0 + U - 1) / U : 0;
  ring_init(full, empty, rs_warp_arrive(NTOK) ? L::kConsumers / 32 : L::kConsumers);

  if (wg == NWG) {  // the producer warpgroup: its first thread issues every copy, then it leaves
    set_max_regs<L::kEntryRegs, L::kProducerRegs>();
    pdl_gate();
    if (threadIdx.x == L::kConsumers) {
      const int tiles = min(T, NT - nt0);
      for (int b = 0; b < batches; ++b) {
        const int s = b % STAGES;
        if (b >= STAGES) mbar_wait(&empty[s], (b / STAGES - 1) & 1);  // batch b − STAGES is retired
        unsigned char* st = L::stage(smem, b);
        const int kb = k0 + b * U, steps = min(U, k1 - kb);
        // the groups the batch's steps touch: g0 … g1 (one, g = 0, for a single group)
        const int g0 = step_group(kb, gshift), g1 = step_group(kb + steps - 1, gshift);
        mbar_expect_tx(&full[s], (uint32_t)(L::kActBytes + tiles * steps * CH * 512 +
                                            (g1 - g0 + 1) * tiles * (L::kScaleTile + L::kZeroTile)));
        for (int u = 0; u < U; ++u)  // a step past the slice: a box past K, all zeros
          tma_load_2d(st + L::kCodeBytes + u * (NTOK * 32), &tmA, u < steps ? (kb + u) * 16 : K, row0, &full[s]);
        for (int t = 0; t < tiles; ++t)
          bulk_copy(st + t * U * CH * 512, B + ((size_t)(nt0 + t) * KT + kb) * CH * 32, steps * CH * 512, &full[s]);
        unsigned char* sc = st + L::kCodeBytes + L::kActBytes;
        for (int g = g0; g <= g1; ++g) {  // each group's scales and zeros of the CTA's tiles, contiguous as stored
          const size_t e = ((size_t)g * NT + nt0) * 8;  // entry (g, nt0, gid 0)
          bulk_copy(sc + (g - g0) * T * L::kScaleTile, S + e, tiles * L::kScaleTile, &full[s]);
          bulk_copy(sc + L::kScaleBytes + (g - g0) * T * L::kZeroTile,
                    reinterpret_cast<const unsigned char*>(Z) + e * sizeof(ZerosOf<BITS>), tiles * L::kZeroTile,
                    &full[s]);
        }
      }
    }
  } else {
    rs_consume<NTOK, NWG, T, U, STAGES, BITS>(smem, full, empty, s_last, C, ws, counters, row0, nt0, M, N, k0, k1,
                                              batches, gshift, splits);
  }
#else
  __trap();  // built without sm_90a: the plan refuses v21 off Hopper before a launch gets here
#endif
}

__device__ __forceinline__ half2 as_h2(uint32_t v) { return *reinterpret_cast<half2*>(&v); }

// prefetch_batch: with PF > 0, lane 0 asks L2 for the warp's batch of U
// steps PF batches on from step kb (v11 pf, v15 variants 3–6); the codes
// of step k start at bp − lane + 32·CH·k, 512 bytes a chunk.
template <int U, int CH, int PF>
__device__ __forceinline__ void prefetch_batch(const uint4* bp, int kb, int k1, int lane) {
  if constexpr (PF > 0) {
    const int kp = kb + PF * U;
    if (lane == 0 && kp < k1) prefetch_l2(bp - lane + (size_t)kp * CH * 32, (uint32_t)(min(U, k1 - kp) * CH * 512));
  }
}

// codes_batch loads U steps of a lane's codes from step kb (CH chunks a
// step, step k's at bp + 32·(CH·k + c)), after prefetch_batch; a step
// past k1 − 1 repeats step k1 − 1, which the caller never multiplies.
template <int U, int CH, int PF>
__device__ __forceinline__ void codes_batch(uint4 (&q)[U][CH], const uint4* bp, int kb, int k1, int lane) {
  prefetch_batch<U, CH, PF>(bp, kb, k1, lane);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = min(kb + u, k1 - 1);
#pragma unroll
    for (int c = 0; c < CH; ++c) q[u][c] = ld_stream(bp + ((size_t)k * CH + c) * 32);
  }
}

// code_at is the lane's 16 bytes of codes at bp + i, streamed from
// memory; or, from a StagedCodes, the copy of them in shared memory.
__device__ __forceinline__ uint4 code_at(const uint4* bp, size_t i) { return ld_stream(bp + i); }
// StagedCodes: a lane's codes of steps k0 … copied to shared memory
// (FusedStage), what bp + i holds at p[i − off] (off = 32·k0).
struct StagedCodes {
  const uint4* p;
  size_t off;
};
__device__ __forceinline__ uint4 code_at(const StagedCodes& s, size_t i) { return s.p[i - s.off]; }

// gemv_steps is the GEMV kernels' main loop: one warp's steps [k0, k1)
// of one n-tile for MT rows, lane's activations of row m at ap[m] (its
// row's first word + tig), its chunks at bp (step k's at bp + 32k; or a
// StagedCodes), U steps a batch with the next batch's codes and
// activations loaded while this one is multiplied. It sets acc to the
// lane's sums: 8 columns × MT rows. GATE: the kernel left pdl_gate() to
// it, which it calls after asking for the first batch's codes and before
// the activations (weights_then_gate; codes in memory only).
template <int MT, int U, int BITS = 4, bool GATE = false, class Codes = const uint4*, bool SG = false>
__device__ __forceinline__ void gemv_steps(float (&acc)[MT][8], const uint32_t* (&ap)[MT], Codes bp,
                                           GroupStream<BITS, SG>& groups, int k0, int k1) {
  static_assert(U % 2 == 0, "steps are multiplied in pairs");
  constexpr int CH = BITS / 4;  // chunks a step: step k's are at bp + 32·(CH·k + c)
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[m][j] = 0.f;
  // Step k's activations for this lane, as half2 words: rows 16k + 2·tig
  // (+1) at word 8k + tig, rows 16k + 2·tig + 8 (+9) four words on.
  uint4 qn[U][CH];
  uint32_t xn[U][MT][2];
  // load asks for batch kb's activations and, with codes, its codes
  // (zeros past k1 − 1).
  auto load = [&](int kb, bool codes) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u;
#pragma unroll
      for (int c = 0; c < CH; ++c)
        if (codes) qn[u][c] = make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int m = 0; m < MT; ++m) xn[u][m][0] = xn[u][m][1] = 0;
      if (k < k1) {
#pragma unroll
        for (int c = 0; c < CH; ++c)
          if (codes) qn[u][c] = code_at(bp, ((size_t)k * CH + c) * 32);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          xn[u][m][0] = __ldg(ap[m] + (size_t)k * 8);
          xn[u][m][1] = __ldg(ap[m] + (size_t)k * 8 + 4);
        }
      }
    }
  };

  GroupRegs gr;
  if constexpr (GATE) {  // the kernel's pdl_gate here: the weights before, the activations after (weights_then_gate)
    if (k1 > k0) {
      codes_batch<U, CH, 0>(qn, bp, k0, k1, 0);  // steps past k1 − 1 are loaded, never multiplied
      groups.start(gr, k0);
    }
    pdl_gate();
    if (k1 > k0) load(k0, false);
  } else if (k1 > k0) {
    groups.start(gr, k0);
    load(k0, true);
  }
  for (int kb = k0; kb < k1; kb += U) {
    uint4 q[U][CH];
    uint32_t x[U][MT][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int c = 0; c < CH; ++c) q[u][c] = qn[u][c];
#pragma unroll
      for (int m = 0; m < MT; ++m) x[u][m][0] = xn[u][m][0], x[u][m][1] = xn[u][m][1];
    }
    if (kb + U < k1) load(kb + U, true);
#pragma unroll
    for (int u = 0; u < U; u += 2) {
      // Two steps' products into half2 partials (each half sums two rows),
      // then into fp32.
      half2 h[MT][8];
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j) h[m][j] = __float2half2_rn(0.f);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int k = kb + u + v;
        if (k < k1) {
          groups.at(gr, k);
          uint32_t w[4 * CH];
#pragma unroll
          for (int c = 0; c < CH; ++c) put_words(w, c, q[u + v][c]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            uint32_t b[4];
            dequant_pair<BITS>(b, w, i, gr);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              const half2 x01 = as_h2(x[u + v][m][0]), x89 = as_h2(x[u + v][m][1]);
              h[m][2 * i] = __hfma2(as_h2(b[0]), x01, h[m][2 * i]);
              h[m][2 * i] = __hfma2(as_h2(b[1]), x89, h[m][2 * i]);
              h[m][2 * i + 1] = __hfma2(as_h2(b[2]), x01, h[m][2 * i + 1]);
              h[m][2 * i + 1] = __hfma2(as_h2(b[3]), x89, h[m][2 * i + 1]);
            }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 f = __half22float2(h[m][j]);
          acc[m][j] += f.x + f.y;
        }
    }
  }
}

// gemv_reduce: lanes 4·gid … 4·gid+3 hold the same eight columns (gid +
// 8j) for different rows of K: it sums them into red[warp], and returns
// once every warp's sums are there (red_total adds the warps').
template <int MT>
__device__ __forceinline__ void gemv_reduce(float (&acc)[MT][8], float (&red)[kWarps][MT][64], int warp, int gid, int tig) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = acc[m][j];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (tig == 0) red[warp][m][j * 8 + gid] = v;
    }
  __syncthreads();
}

// red_total is the CTA's sum for row m, column col of its tile: the warps'
// partial sums that gemv_reduce left in red.
template <int MT>
__device__ __forceinline__ float red_total(const float (&red)[kWarps][MT][64], int m, int col) {
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v += red[w][m][col];
  return v;
}

// w4a16_gemv: a CTA of kWarps warps owns one 64-column n-tile and one K
// slice (blockIdx.y of `splits`); its warps split the slice. MT tokens
// (M ≤ MT; rows past M repeat row M−1 and are not written), U 16-row
// steps a batch (gemv_steps); MINB asks the compiler to fit MINB CTAs per
// SM.
template <int MT, int U, int MINB, int BITS, bool SUMS = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) w4a16_gemv(const half* __restrict__ A, const uint4* __restrict__ B,
                                                          const uint4* __restrict__ S, const uint32_t* __restrict__ Z,
                                                          const Outs C, float* __restrict__ ws,
                                                          int* __restrict__ counters, int M, int N, int K, int gshift,
                                                          int splits) {
  // pdl_gate() is gemv_steps' (GATE): the first codes are asked for before it.
  __shared__ float red[kWarps][MT][64];
  __shared__ int s_last;
  const GemvThread t(N, K, splits);
  const int nt = t.nt, warp = t.warp, lane = t.lane, gid = t.gid, tig = t.tig, KT = t.KT, NT = t.NT, k0 = t.k0, k1 = t.k1;
  const uint32_t* ap[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) ap[m] = reinterpret_cast<const uint32_t*>(A + (size_t)min(m, M - 1) * K) + tig;
  GroupStream<BITS> groups(S, Z, nt, NT, gid, KT, gshift);
  float acc[MT][8];
  gemv_steps<MT, U, BITS, true>(acc, ap, B + (size_t)nt * KT * 32 * (BITS / 4) + lane, groups, k0, k1);
  gemv_reduce<MT>(acc, red, warp, gid, tig);
  emit_tile<SUMS>(C, ws, 0, MT, M, N, nt, splits, [&](int m, int col) { return red_total<MT>(red, m, col); });
  finish_splits<kWarps * 32, 0, SUMS>(C, ws, &counters[nt], 0, MT, M, N, nt, splits, s_last);
}

// w4a16_gemv_mma (v11): the GEMV kernel's streaming — a lane's chunks
// loaded straight into registers, U steps a batch with the next batch in
// flight, the group's scales and zeros in registers — with the products
// on the Tensor Cores instead of HFMA2: per step and lane, 8·MB
// mma.m16n8k16 whose B fragments are the dequantized chunk (mma_step, the
// fused kernel's) and whose A rows are the tokens: m-tile mb's rows
// 16·mb + gid and 16·mb + gid + 8 in a lane (rows past M repeat row M − 1;
// with MT = 8 the second row is zero). The sums stay in fp32, and the cost
// per byte of codes does not grow with M up to an m-tile: the rows the
// CUDA-core GEMV pays for one by one come free. MT: 8, 16, 32 or 64 rows
// (MB = 1, 1, 2, 4 m-tiles). CTA and K split as w4a16_gemv. PF > 0: lane 0
// asks L2 for the warp's codes PF batches ahead (as v15's variants 3–6).
template <int MT, int U, int BITS, int PF = 0, bool SUMS = false>
__global__ void __launch_bounds__(kWarps * 32) w4a16_gemv_mma(const half* __restrict__ A, const uint4* __restrict__ B,
                                                            const uint4* __restrict__ S, const uint32_t* __restrict__ Z,
                                                            const Outs C, float* __restrict__ ws,
                                                            int* __restrict__ counters, int M, int N, int K, int gshift,
                                                            int splits) {
  static_assert(MT == 8 || MT == 16 || MT == 32 || MT == 64, "rows: half an m-tile or 1, 2, 4 m-tiles");
  constexpr int MB = MT <= 16 ? 1 : MT / 16;  // m-tiles
  constexpr int RT = MT <= 16 ? MT : 16;      // rows an m-tile holds
  constexpr int CH = BITS / 4;                // chunks a step: step k's are at bp + 32·(CH·k + c)
  // pdl_gate() waits below, after the first codes are asked for (weights_then_gate)
  __shared__ float red[kWarps][RT][64];
  __shared__ int s_last;
  const GemvThread t(N, K, splits);
  const int nt = t.nt, warp = t.warp, lane = t.lane, gid = t.gid, tig = t.tig, KT = t.KT, NT = t.NT, k0 = t.k0, k1 = t.k1;
  // Step k's A fragment of m-tile mb: a0/a2 = row 16·mb + gid's words
  // 8k + tig and 8k + tig + 4, a1/a3 the same of row 16·mb + gid + 8.
  const uint32_t* ar[MB][2];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      ar[mb][h] = reinterpret_cast<const uint32_t*>(A + (size_t)min(16 * mb + 8 * h + gid, M - 1) * K) + tig;
  const uint4* bp = B + (size_t)nt * KT * 32 * CH + lane;
  GroupStream<BITS> groups(S, Z, nt, NT, gid, KT, gshift);
  float acc[MB][8][4];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[mb][j][0] = acc[mb][j][1] = acc[mb][j][2] = acc[mb][j][3] = 0.f;
  uint4 qn[U][CH];
  uint32_t xn[U][MB][4];
  // load asks for batch kb's activations and, with codes, its codes
  // (zeros past k1 − 1); the first batch's codes come before pdl_gate.
  auto load = [&](int kb, bool codes) {
    if (codes) prefetch_batch<U, CH, PF>(bp, kb, k1, lane);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u;
#pragma unroll
      for (int c = 0; c < CH; ++c)
        if (codes) qn[u][c] = make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) xn[u][mb][0] = xn[u][mb][1] = xn[u][mb][2] = xn[u][mb][3] = 0;
      if (k < k1) {
#pragma unroll
        for (int c = 0; c < CH; ++c)
          if (codes) qn[u][c] = ld_stream(bp + ((size_t)k * CH + c) * 32);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
          xn[u][mb][0] = __ldg(ar[mb][0] + (size_t)k * 8);
          xn[u][mb][2] = __ldg(ar[mb][0] + (size_t)k * 8 + 4);
          if constexpr (MT > 8) {
            xn[u][mb][1] = __ldg(ar[mb][1] + (size_t)k * 8);
            xn[u][mb][3] = __ldg(ar[mb][1] + (size_t)k * 8 + 4);
          }
        }
      }
    }
  };
  GroupRegs gr;
  if (k1 > k0) {
    codes_batch<U, CH, PF>(qn, bp, k0, k1, lane);  // steps past k1 − 1 are loaded, never multiplied
    groups.start(gr, k0);
  }
  pdl_gate();  // before the activations, workspace and outputs: see weights_then_gate
  if (k1 > k0) load(k0, false);
  for (int kb = k0; kb < k1; kb += U) {
    uint4 q[U][CH];
    uint32_t af[U][MB][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int c = 0; c < CH; ++c) q[u][c] = qn[u][c];
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int i = 0; i < 4; ++i) af[u][mb][i] = xn[u][mb][i];
    }
    if (kb + U < k1) load(kb + U, true);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u;
      if (k < k1) {
        groups.at(gr, k);
        uint32_t w[4 * CH];
#pragma unroll
        for (int c = 0; c < CH; ++c) put_words(w, c, q[u][c]);
        mma_step<MB, BITS>(acc, w, af[u], gr);
      }
    }
  }
  // The warps' sums, an m-tile at a time: row gid's columns 8j + 2·tig
  // (+1) in acc[mb][j][0..1], row gid + 8's in [2..3].
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) {
    if (16 * mb >= M) break;  // uniform across the CTA
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = j * 8 + 2 * tig;
      *reinterpret_cast<float2*>(&red[warp][gid][col]) = make_float2(acc[mb][j][0], acc[mb][j][1]);
      if constexpr (RT == 16)
        *reinterpret_cast<float2*>(&red[warp][gid + 8][col]) = make_float2(acc[mb][j][2], acc[mb][j][3]);
    }
    __syncthreads();
    emit_tile<SUMS>(C, ws, 16 * mb, RT, M, N, nt, splits, [&](int r, int col) { return red_total<RT>(red, r, col); });
    __syncthreads();
  }
  finish_splits<kWarps * 32, 0, SUMS>(C, ws, &counters[nt], 0, MT, M, N, nt, splits, s_last);
}

// SwapSums is a v15 lane's sums (w4a16_gemv_swap): tot[i][nb] for m16
// tile i (columns 16i + gid and 16i + gid + 8) × tokens 8·nb + 2·tig, +1,
// as mma leaves D; part, the current group's, unscaled (unused when
// SCALED, whose codes are scaled first).
template <int NB, int BITS, bool SCALED>
struct SwapSums {
  static constexpr int NP = SCALED ? 1 : NB;
  float tot[4][NB][4], part[4][NP][4];
  __device__ __forceinline__ SwapSums() {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) tot[i][nb][0] = tot[i][nb][1] = tot[i][nb][2] = tot[i][nb][3] = 0.f;
#pragma unroll
      for (int nb = 0; nb < NP; ++nb) part[i][nb][0] = part[i][nb][1] = part[i][nb][2] = part[i][nb][3] = 0.f;
    }
  }
  // flush adds the group's sums, scaled by its columns' scales, into tot.
  __device__ __forceinline__ void flush(const GroupRegs& gr) {
    if constexpr (!SCALED) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float s0 = __low2float(as_h2(gr.s[2 * i]));
        const float s1 = __low2float(as_h2(gr.s[2 * i + 1]));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          tot[i][nb][0] += s0 * part[i][nb][0], tot[i][nb][1] += s0 * part[i][nb][1];
          tot[i][nb][2] += s1 * part[i][nb][2], tot[i][nb][3] += s1 * part[i][nb][3];
          part[i][nb][0] = part[i][nb][1] = part[i][nb][2] = part[i][nb][3] = 0.f;
        }
      }
    }
  }
  // step multiplies a step's codes (w: its 4·BITS/4 words) into the sums
  // against the tokens' B fragments x.
  __device__ __forceinline__ void step(const uint32_t* w, const uint32_t (&x)[NB][2], const GroupRegs& gr) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t b[4];
      if constexpr (SCALED)
        dequant_pair<BITS>(b, w, i, gr);
      else
        codes_pair<BITS>(b, w, i, gr);
      const uint32_t a[4] = {b[0], b[2], b[1], b[3]};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        if constexpr (SCALED)
          mma16816(tot[i][nb], a, x[nb][0], x[nb][1]);
        else
          mma16816(part[i][nb], a, x[nb][0], x[nb][1]);
      }
    }
  }
  // store puts the warp's sums in red[warp]: a lane's D rows are columns
  // 16i + gid (+8), its D columns tokens 8·nb + 2·tig (+1).
  template <int MT>
  __device__ __forceinline__ void store(float (&red)[kWarps][MT][64], int warp, int gid, int tig) const {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const int r = 8 * nb + 2 * tig, col = 16 * i + gid;
        red[warp][r][col] = tot[i][nb][0];
        red[warp][r + 1][col] = tot[i][nb][1];
        red[warp][r][col + 8] = tot[i][nb][2];
        red[warp][r + 1][col + 8] = tot[i][nb][3];
      }
  }
};

// swap_acts loads U steps' B fragments of the tokens from step kb (a step
// past k1 − 1 repeats step k1 − 1, never multiplied): token tile nb's are
// token 8·nb + gid's words 8k + tig (rows 16k + 2·tig, +1) and 8k + tig +
// 4 (rows + 8), from xr[nb] (the token's row + tig).
template <int U, int NB>
__device__ __forceinline__ void swap_acts(uint32_t (&x)[U][NB][2], const uint32_t* const (&xr)[NB], int kb, int k1) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = min(kb + u, k1 - 1);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      x[u][nb][0] = __ldg(xr[nb] + (size_t)k * 8);
      x[u][nb][1] = __ldg(xr[nb] + (size_t)k * 8 + 4);
    }
  }
}

// w4a16_gemv_swap (v15): the GEMV's streaming with the operands of
// mma.m16n8k16 swapped — the weights are its 16-row A operand and the
// tokens its 8 columns (C^T = W^T·A^T). Word i of a lane's chunk, as
// codes_pair leaves it, is exactly an A fragment: rows 0–7 of the m16
// tile are sub-tile 2i's columns, rows 8–15 sub-tile 2i+1's (a0 = b[0],
// a1 = b[2], a2 = b[1], a3 = b[3]); the B fragment of token tile nb is
// two words of activations of token 8·nb + gid (the rows past M repeat
// row M − 1 and are not written). Per 16-row step a warp runs 4·NB mma
// (v11 runs 8·MB with half its rows idle up to M = 8), and where the
// group's sums stay apart (SCALED false) the codes go in unscaled —
// exact integers q − z, whose products the Tensor Core sums in fp32 — and
// the lane multiplies its two columns' scales in once per group: per code
// pair a mask and a subtraction, no multiply. MT: 8, 16 or 32 tokens.
// CTA and K split as w4a16_gemv.
template <int MT, int U, int BITS, bool SCALED, int MINB, int PF, bool SUMS = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) w4a16_gemv_swap(const half* __restrict__ A, const uint4* __restrict__ B,
                                                             const uint4* __restrict__ S, const uint32_t* __restrict__ Z,
                                                             const Outs C, float* __restrict__ ws,
                                                             int* __restrict__ counters, int M, int N, int K, int gshift,
                                                             int splits) {
  static_assert(MT == 8 || MT == 16 || MT == 32, "tokens: 1, 2 or 4 n8 tiles");
  constexpr int NB = MT / 8;     // n8 token tiles
  constexpr int CH = BITS / 4;   // chunks a step: step k's are at bp + 32·(CH·k + c)
  // pdl_gate() waits below, after the first codes are asked for (weights_then_gate)
  __shared__ float red[kWarps][MT][64];
  __shared__ int s_last;
  const GemvThread t(N, K, splits);
  const int nt = t.nt, warp = t.warp, lane = t.lane, gid = t.gid, tig = t.tig, KT = t.KT, NT = t.NT, k0 = t.k0, k1 = t.k1;
  const uint32_t* xr[NB];  // token 8·nb + gid's row + tig (swap_acts)
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) xr[nb] = reinterpret_cast<const uint32_t*>(A + (size_t)min(8 * nb + gid, M - 1) * K) + tig;
  const uint4* bp = B + (size_t)nt * KT * 32 * CH + lane;
  GroupStream<BITS> groups(S, Z, nt, NT, gid, KT, gshift);
  GroupRegs gr;
  SwapSums<NB, BITS, SCALED> sums;
  // Two register batches of U steps, loaded and multiplied in turn (no
  // copies); a load past k1 repeats step k1 − 1 (never multiplied).
  uint4 qa[U][CH], qb[U][CH];
  uint32_t xa[U][NB][2], xb[U][NB][2];
  auto load_codes = [&](uint4 (&q)[U][CH], int kb) { codes_batch<U, CH, PF>(q, bp, kb, k1, lane); };
  auto load_acts = [&](uint32_t (&x)[U][NB][2], int kb) { swap_acts<U, NB>(x, xr, kb, k1); };
  auto step = [&](const uint4 (&qv)[CH], const uint32_t (&x)[NB][2], int k) {
    if (groups.crosses(k)) {
      sums.flush(gr);
      groups.advance(gr, k);
    }
    uint32_t w[4 * CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) put_words(w, c, qv[c]);
    sums.step(w, x, gr);
  };
  auto batch = [&](const uint4 (&q)[U][CH], const uint32_t (&x)[U][NB][2], int kb, bool full) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (full || kb + u < k1) step(q[u], x[u], kb + u);
  };
  auto load = [&](uint4 (&q)[U][CH], uint32_t (&x)[U][NB][2], int kb) {
    load_codes(q, kb);
    load_acts(x, kb);
  };
  if (k1 > k0) {
    load_codes(qa, k0);
    groups.start(gr, k0);
  }
  pdl_gate();  // before the activations, workspace and outputs: see weights_then_gate
  if (k1 > k0) {
    load_acts(xa, k0);
    int kb = k0;
    for (; kb + 2 * U <= k1; kb += 2 * U) {
      load(qb, xb, kb + U);
      batch(qa, xa, kb, true);
      if (kb + 2 * U < k1) load(qa, xa, kb + 2 * U);
      batch(qb, xb, kb + U, true);
    }
    if (kb < k1) {  // fewer than 2U steps left, the first U of them in qa
      if (kb + U < k1) load(qb, xb, kb + U);
      batch(qa, xa, kb, false);
      if (kb + U < k1) batch(qb, xb, kb + U, false);
    }
    sums.flush(gr);
  }
  sums.store(red, warp, gid, tig);
  __syncthreads();
  emit_tile<SUMS>(C, ws, 0, MT, M, N, nt, splits, [&](int r, int col) { return red_total<MT>(red, r, col); });
  finish_splits<kWarps * 32, 0, SUMS>(C, ws, &counters[nt], 0, MT, M, N, nt, splits, s_last);
}

// w4a16_gemv_grouped: the GEMV kernel over a mixture's experts, whose
// weights lie one after another in B, S and Z (each N×K in the layout
// above). CTA (nt, c, z) runs chunk c of the expert plan (moe_plan): up to
// MT slots of one expert, listed in order[start …], over K slice z of
// `splits`; slot s reads A row s / a_div and adds its partial sums into
// out row s (fp32 [S][N], atomics: the slices' sums meet there). Chunks
// with no slots exit.
//
// Gated (gt.act ≥ 0: the experts' gate and up interleaved in 32-column
// halves, pack.InterleaveGPU; one K split): the CTA pairs its own sums
// into act(gate)·up, gt.g [S][N/2] fp16 (gated_pair, as the dense GEMM's
// epilogue), so that no activation launch stands between gate/up and
// down; out is not touched.
//
// ROUTED (a decode step: MT = 1, T ≤ kMaxRoutedRows, T·k ≤ kMaxRoutedSlots): no plan
// is read; each CTA routes the rows itself from the router's logits
// (route_row, warp t taking row t), ranks the slots by (expert, slot) —
// the plan of chunks of one slot, chunk c holding the slot of rank c — and
// takes chunk blockIdx.y. CTA (0, 0, 0) writes the routing (ids, weights:
// the combine's) and that plan (order, chunks [S][3]: the down GEMV's), so
// that moe_route_plan's launch and its round trip through memory go.
//
// ROUTED with a next layer (API 27, LLMQ_MOE_PREFETCH 1 or 2): the routing
// also says which of the next grouped GEMV's experts (down's) the step
// reads, so the CTAs of each routed expert ask L2 for that expert's codes,
// scales and zeros of the next layer — a 1/(gridDim.x·gridDim.z) share
// each, one bulk request per array — either right after routing (1: the
// requests stream beside this GEMV's own loads) or after the CTA's loop
// (2: in the GEMV's tail), so that the down launch, which waits on this
// one, finds its bytes in L2. An expert routed twice asks once (its first
// rank). Only a hint: results are the same.
struct MoEPrefetch {
  const char* B;               // the next layer's codes, scales and zeros, expert after expert
  const char* S;
  const char* Z;
  uint32_t b_bytes, s_bytes, z_bytes;  // an expert's bytes of each
  int mode;                    // 0 none; 1 after routing; 2 after the loop
};

// ROUTED and gated with its down fused (API 28, LLMQ_MOE_FUSED_DOWN=1):
// CTA (nt, c) holds act(gate)·up for 32 rows of its slot's expert's
// intermediate — rows 32·nt … 32·nt + 31, down's 16-row steps 2·nt and
// 2·nt + 1 — so it multiplies them by those rows of the expert's down
// (every one of down's N columns) and adds the products into out row
// slot, where the gate/up tiles of the slot meet (fp32 atomics, as the
// split down GEMV's slices meet). The down launch, and the wait on the
// gate/up launch before it, go. The products are summed in half2 over
// each pair of steps, as the down GEMV's warps sum theirs when each takes
// an even run of steps from an even one (qwen3-30b-a3b's down: 12 a warp);
// then only the order of the fp32 additions differs. Where a warp takes
// one step, or odd runs, the fp16 roundings differ too (past what fp32
// reordering moves: TestMoEGemvRoutedMatchesCPU checks those cases
// against float64 only).
struct MoEDown {
  const uint4* B;      // down's experts, expert after expert (UploadExperts); nullptr: not fused
  const uint4* S;
  const uint32_t* Z;
  float* out;          // [T·k][N] fp32, zero before (the next norm reads and zeroes it)
  int N, K, gshift;    // down's N × K (K: the gate/up's N/2); gshift ≥ 1 or −1 (a group holds both steps)
};

struct MoERouting {
  const float* logits;  // [T][E] fp32
  int T, E, k, norm;
  int32_t* ids;         // [T·k]
  float* weights;       // [T·k]
  int32_t* order;       // [T·k]
  int32_t* chunks;      // [T·k][3]
  MoEPrefetch next;
  MoEDown down;
};

// red_add4 adds v into p[0 … 3] (16-byte aligned) with one vector
// reduction where the GPU has it (Hopper), else four.
__device__ __forceinline__ void red_add4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(p, v.x), atomicAdd(p + 1, v.y), atomicAdd(p + 2, v.z), atomicAdd(p + 3, v.w);
#endif
}

// A fused down's operands for its first kDownStaged n-tiles (down's N ≤
// 2,048, qwen3-30b-a3b's: all of them) wait in shared memory, copied
// there (stage_down, cp.async) once the CTA knows its expert, so that
// they arrive while the gate/up's own loads do: down_slice then finds
// them there instead of starting a round trip to memory of its own after
// the gate/up's sums. N-tiles past kDownStaged it reads from memory.
constexpr int kDownStaged = 32;
struct DownStage {
  uint4 q[kDownStaged][2][32];  // n-tile t's codes of the two steps, lane by lane (down_slice's q)
  uint4 s[kDownStaged][8];      // n-tile t's group entry of the steps, gid by gid: scales (sv)
  uint32_t z[kDownStaged][8];   // and zeros (zv)
};
// down_stage: the CTA's one DownStage, in the kernels that call it only
// (a function's __shared__ variable is the block's, however often called).
__device__ __forceinline__ DownStage& down_stage() {
  __shared__ __align__(16) DownStage st;
  return st;
}

// down_operands: where n-tile t of a fused down (MoEDown) of expert e
// finds its codes (both steps: b + t·KT·32, 64 uint4s) and its group
// entries (g + 8t, 8 of scales and of zeros) in down's arrays.
struct DownOperands {
  const uint4* b;
  size_t g;
  int KT;
};
__device__ __forceinline__ DownOperands down_operands(const MoEDown& d, int e, int nt) {
  const int NT = d.N >> 6, KT = d.K >> 4, k = 2 * nt;
  const size_t per_b = (size_t)NT * KT * 32, per_group = (size_t)(d.gshift < 0 ? 1 : KT >> d.gshift) * NT * 8;
  return {d.B + e * per_b + (size_t)k * 32, e * per_group + (size_t)step_group(k, d.gshift) * NT * 8, KT};
}

// stage_entries starts the copies of `blocks` blocks of group entries —
// block j the 8 scales (uint4s) and 8 zeros (words) at S + base + j·stride
// and Z + base + j·stride — to s + 8j and z + 8j, the CTA's threads
// sharing them 16 bytes at a time (cp.async; the zeros' base and stride
// multiples of 4 words).
__device__ __forceinline__ void stage_entries(uint4* s, uint32_t* z, const uint4* S, const uint32_t* Z, size_t base,
                                              size_t stride, int blocks) {
  for (int i = threadIdx.x; i < blocks * 8; i += blockDim.x) cp_async16(s + i, S + base + (i >> 3) * stride + (i & 7));
  for (int i = threadIdx.x; i < blocks * 2; i += blockDim.x)
    cp_async16(z + 4 * i, Z + base + (i >> 1) * stride + 4 * (i & 1));
}

// stage_down starts the copies of CTA (nt, ·)'s down operands for n-tiles
// t < kDownStaged into st, the CTA's threads sharing them 16 bytes at a
// time, as one cp.async group (cp_async_wait<0> before down_slice).
__device__ __forceinline__ void stage_down(const MoEDown& d, int e, int nt, DownStage& st) {
  const DownOperands o = down_operands(d, e, nt);
  const int tiles = min(d.N >> 6, kDownStaged);
  for (int i = threadIdx.x; i < tiles * 64; i += blockDim.x)
    cp_async16(&st.q[i >> 6][(i >> 5) & 1][i & 31], o.b + (size_t)(i >> 6) * o.KT * 32 + (i & 63));
  stage_entries(&st.s[0][0], &st.z[0][0], d.S, d.Z, o.g, 8, tiles);  // n-tile t's entries: o.g + 8t
  cp_async_commit();
}

// FusedStage: where a fused down's CTA keeps its own gate/up operands in
// dynamic shared memory (uint4 offsets): warp w's codes of its steps
// [k0, k1), lane by lane (step k's 32 uint4s at 32·(w·per_warp + k −
// k0)); then the tile's scales, 8 a group; then its zeros, 8 words a
// group. With stage_down's DownStage, the CTA's weights are asked for at
// once as soon as the routing names its expert (its activations, and
// down's n-tiles past kDownStaged, are read as before), where a CTA
// streaming them keeps two batches of steps in flight a warp.
struct FusedStage {
  int per_warp, G;  // steps a warp (warp_range's, one split); the tile's groups
  __host__ __device__ int scales_at() const { return kWarps * per_warp * 32; }
  __host__ __device__ int zeros_at() const { return scales_at() + G * 8; }
  __host__ __device__ size_t bytes() const { return (size_t)(zeros_at() + G * 2) * 16; }
};
__host__ __device__ inline FusedStage fused_stage(int K, int gshift) {
  const int KT = K >> 4;
  return {(KT + kWarps - 1) / kWarps, gshift < 0 ? 1 : KT >> gshift};
}
// fused_stage_bytes: the dynamic shared memory a fused down's launch
// gives each CTA for its FusedStage (qwen3-30b-a3b's gate/up, K 2,048 in
// groups of 128: 66.5 KB), 0 where that is past kFusedStageMax (K past
// 2,176 in groups of 128, or groups under 64 rows at 2,048), where the
// CTA streams its gate/up's codes as the unfused pass does. 72 KB beside
// the 40 KB of static (DownStage) leaves two CTAs an SM of Hopper's 228 KB.
constexpr size_t kFusedStageMax = 72 * 1024;
__host__ __device__ inline size_t fused_stage_bytes(int K, int gshift) {
  const size_t b = fused_stage(K, gshift).bytes();
  return b <= kFusedStageMax ? b : 0;
}
// fused_smem: the kernel's dynamic shared memory (FusedStage), of
// dynamic_smem_bytes() bytes, as the launch gave it.
__device__ __forceinline__ uint4* fused_smem() {
  extern __shared__ __align__(16) uint4 fused_dynamic[];
  return fused_dynamic;
}
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t b;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(b));
  return b;
}

// down_slice is a fused down's share (MoEDown) of CTA (nt, ·) of expert
// e: the 32 fp16 rows h (act(gate)·up, in shared memory) times down's
// steps 2·nt and 2·nt + 1, every n-tile of down, added into out row
// `slot`. Warp w takes n-tiles w, w + kWarps, …, kBatch of them at a
// time, their codes and group entries taken from st (stage_down) or,
// past kDownStaged, asked of memory before any is multiplied; per n-tile
// the arithmetic is gemv_steps' for one pair of steps, then gemv_reduce's
// lane sums, staged in `stage` so that 16 lanes add the tile's 64 columns
// four at a time.
__device__ __forceinline__ void down_slice(const MoEDown& d, int e, int slot, int nt, const half* hs,
                                           const DownStage& st, float (&stage)[kWarps][64], int warp, int lane) {
  constexpr int kBatch = 4;
  const int gid = lane >> 2, tig = lane & 3;
  const int NT = d.N >> 6;
  const DownOperands o = down_operands(d, e, nt);
  const int KT = o.KT;
  const uint4* bp = o.b + lane;  // n-tile t's two steps: bp + t·KT·32 (+ 32)
  const size_t gi = o.g + gid;   // n-tile t's entry: gi + 8t
  // The lane's activations of each step, as gemv_steps takes them: rows
  // 2·tig, 2·tig + 1 (word tig) and 2·tig + 8, 2·tig + 9 (word tig + 4).
  const uint32_t* hw = reinterpret_cast<const uint32_t*>(hs);
  const uint32_t x[2][2] = {{hw[tig], hw[tig + 4]}, {hw[8 + tig], hw[12 + tig]}};
  float* out = d.out + (size_t)slot * d.N;
  for (int t0 = warp; t0 < NT; t0 += kWarps * kBatch) {
    uint4 q[kBatch][2], sv[kBatch];
    uint32_t zv[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int t = t0 + kWarps * b;
      if (t < NT && t < kDownStaged) {  // (the same for the whole warp)
        q[b][0] = st.q[t][0][lane], q[b][1] = st.q[t][1][lane];
        sv[b] = st.s[t][gid], zv[b] = st.z[t][gid];
      } else if (t < NT) {
        q[b][0] = ld_stream(bp + (size_t)t * KT * 32);
        q[b][1] = ld_stream(bp + (size_t)t * KT * 32 + 32);
        sv[b] = __ldg(d.S + gi + 8 * t);
        zv[b] = __ldg(d.Z + gi + 8 * t);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int t = t0 + kWarps * b;
      if (t >= NT) break;  // the same for the whole warp
      GroupRegs gr;
      convert_group(gr, sv[b], zv[b]);
      half2 h[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = __float2half2_rn(0.f);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t w[4];
        put_words(w, 0, q[b][s]);
        const half2 x01 = as_h2(x[s][0]), x89 = as_h2(x[s][1]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t c[4];
          dequant_pair<4>(c, w, i, gr);
          h[2 * i] = __hfma2(as_h2(c[0]), x01, h[2 * i]);
          h[2 * i] = __hfma2(as_h2(c[1]), x89, h[2 * i]);
          h[2 * i + 1] = __hfma2(as_h2(c[2]), x01, h[2 * i + 1]);
          h[2 * i + 1] = __hfma2(as_h2(c[3]), x89, h[2 * i + 1]);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 f = __half22float2(h[j]);
        float v = f.x + f.y;
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (tig == 0) stage[warp][j * 8 + gid] = v;
      }
      __syncwarp();
      if (lane < 16) red_add4(out + t * 64 + 4 * lane, *reinterpret_cast<const float4*>(&stage[warp][4 * lane]));
      __syncwarp();
    }
  }
}

// prefetch_share asks L2 for share `part` of `parts` of an expert's
// `bytes` (16-byte multiples) from p.
__device__ __forceinline__ void prefetch_share(const char* p, uint32_t bytes, int part, int parts) {
  const uint32_t piece = ((bytes + parts - 1) / parts + 15) & ~15u, off = part * piece;
  if (off < bytes) prefetch_l2(p + off, min(piece, bytes - off));
}

// prefetch_next: the CTA's share of expert e's next-layer arrays (one
// request a warp: codes, scales, zeros), unless an earlier rank holds e.
__device__ __forceinline__ void prefetch_next(const MoEPrefetch& nx, int e, bool first_rank) {
  if (!first_rank || (threadIdx.x & 31) != 0 || threadIdx.x >= 96) return;
  const int part = blockIdx.x + gridDim.x * blockIdx.z, parts = gridDim.x * gridDim.z, w = threadIdx.x >> 5;
  if (w == 0) prefetch_share(nx.B + (size_t)e * nx.b_bytes, nx.b_bytes, part, parts);
  if (w == 1) prefetch_share(nx.S + (size_t)e * nx.s_bytes, nx.s_bytes, part, parts);
  if (w == 2) prefetch_share(nx.Z + (size_t)e * nx.z_bytes, nx.z_bytes, part, parts);
}

struct MoEGated {
  half* g;  // [S][N/2] fp16: act(gate)·up
  int act;  // act_of's; < 0: not gated (out gets the sums)
};

template <int MT, int U, bool ROUTED = false, bool DOWN = false>
__global__ void __launch_bounds__(kWarps * 32) w4a16_gemv_grouped(const half* __restrict__ A, int a_div,
                                                               const int32_t* __restrict__ order,
                                                               const int32_t* __restrict__ chunks,
                                                               const uint4* __restrict__ B, const uint4* __restrict__ S,
                                                               const uint32_t* __restrict__ Z, float* __restrict__ out,
                                                               int N, int K, int gshift, int splits, MoERouting rt,
                                                               MoEGated gt) {
  pdl_gate();  // before any global access: see common.cuh
  __shared__ float red[kWarps][MT][64];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int e, n, start = 0, routed_slot = 0;
  bool first_rank = true;  // ROUTED: no lower rank has this chunk's expert
  if constexpr (ROUTED) {
    static_assert(MT == 1, "a routed pass has chunks of one slot");
    static_assert(kWarps >= kMaxRoutedRows, "a warp routes a row");
    __shared__ int32_t ids[kMaxRoutedSlots], slot_at[kMaxRoutedSlots];  // slot_at[r]: the slot of rank r
    __shared__ float wts[kMaxRoutedSlots];
    const int slots = rt.T * rt.k;
    if (warp < rt.T)
      route_row(rt.logits + (size_t)warp * rt.E, ids + warp * rt.k, wts + warp * rt.k, rt.E, rt.k, rt.norm, lane);
    __syncthreads();
    if (threadIdx.x < slots) {  // slot s's place in the plan: the slots before it by (expert, slot)
      const int s = threadIdx.x, es = ids[s];
      int r = 0;
      for (int j = 0; j < slots; ++j) r += ids[j] < es || (ids[j] == es && j < s);
      slot_at[r] = s;
    }
    __syncthreads();
    if ((blockIdx.x | blockIdx.y | blockIdx.z) == 0 && threadIdx.x < slots) {
      const int i = threadIdx.x;
      rt.ids[i] = ids[i], rt.weights[i] = wts[i], rt.order[i] = slot_at[i];
      rt.chunks[3 * i] = ids[slot_at[i]], rt.chunks[3 * i + 1] = i, rt.chunks[3 * i + 2] = 1;
    }
    routed_slot = slot_at[blockIdx.y], e = ids[routed_slot], n = 1;
    first_rank = blockIdx.y == 0 || ids[slot_at[blockIdx.y - 1]] != e;
    if (rt.next.mode == 1) prefetch_next(rt.next, e, first_rank);
  } else {
    const int* ch = chunks + 3 * blockIdx.y;
    e = ch[0], start = ch[1], n = ch[2];
    if (n == 0) return;  // the whole CTA: past the plan's chunks
  }
  // The chunk's m-th slot: A row slot / a_div, out row slot.
  auto slot = [&](int m) { return ROUTED ? routed_slot : order[start + m]; };
  const int nt = blockIdx.x;
  const int gid = lane >> 2, tig = lane & 3;
  const int KT = K >> 4, NT = N >> 6, G = gshift < 0 ? 1 : KT >> gshift;
  const size_t per_b = (size_t)NT * KT * 32, per_group = (size_t)G * NT * 8;  // an expert's uint4s of B; of S (= Z's words)
  int k0, k1;
  warp_range(KT, splits, blockIdx.z, warp, k0, k1);
  const uint32_t* ap[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) ap[m] = reinterpret_cast<const uint32_t*>(A + (size_t)(slot(min(m, n - 1)) / a_div) * K) + tig;
  GroupStream<4> groups(S + e * per_group, Z + e * per_group, nt, NT, gid, KT, gshift);
  float acc[MT][8];
  const uint4* bp = B + e * per_b + (size_t)nt * KT * 32 + lane;  // step k's codes: bp + 32k
  if constexpr (DOWN) {
    // A fused down's CTA asks for its weights at once (FusedStage, then
    // DownStage: a cp.async group each), then runs the gate/up from shared
    // memory once its group is in; where its gate/up does not fit, it
    // streams those as below.
    const FusedStage fs = fused_stage(K, gshift);
    const size_t want = fused_stage_bytes(K, gshift);
    const bool staged = gt.act >= 0 && want > 0 && dynamic_smem_bytes() >= want;  // (grouped_launch's choice)
    uint4* st = fused_smem();
    if (staged) {
      for (int k = k0; k < k1; ++k) cp_async16(st + (size_t)(warp * fs.per_warp + k - k0) * 32 + lane, bp + (size_t)k * 32);
      // The tile's entries of group g: e·per_group + nt·8 + g·NT·8 …
      stage_entries(st + fs.scales_at(), reinterpret_cast<uint32_t*>(st + fs.zeros_at()), S, Z,
                    e * per_group + (size_t)nt * 8, (size_t)NT * 8, fs.G);
      cp_async_commit();
    }
    if (gt.act >= 0) stage_down(rt.down, e, nt, down_stage());  // (a group of its own, after)
    if (staged) {
      cp_async_wait<1>();  // this thread's gate/up copies (the down's may still be on the way); the
      __syncthreads();     // barrier, the scales and zeros the warps share
      GroupStream<4, true> sg(st + fs.scales_at(), reinterpret_cast<const uint32_t*>(st + fs.zeros_at()), 0, 1, gid, KT,
                              gshift);
      gemv_steps<MT, U>(acc, ap, StagedCodes{st + (size_t)warp * fs.per_warp * 32 + lane, (size_t)k0 * 32}, sg, k0, k1);
    } else {
      gemv_steps<MT, U>(acc, ap, bp, groups, k0, k1);
    }
  } else {
    gemv_steps<MT, U>(acc, ap, bp, groups, k0, k1);
  }
  gemv_reduce<MT>(acc, red, warp, gid, tig);
  if constexpr (ROUTED)
    if (rt.next.mode == 2) prefetch_next(rt.next, e, first_rank);
  if (gt.act >= 0) {  // act(gate)·up of the tile's 32 pairs (columns c and c + 32) for each slot
    __shared__ __align__(16) half hs[32];  // DOWN: the tile's act(gate)·up, down_slice's rows
    for (int i = threadIdx.x; i < MT * 32; i += kWarps * 32) {
      const int m = i >> 5, c = i & 31;
      if (m < n) {
        const half v = gated_pair(red_total<MT>(red, m, c), red_total<MT>(red, m, c + 32), gt.act);
        gt.g[(size_t)slot(m) * (N / 2) + nt * 32 + c] = v;
        if constexpr (DOWN) hs[c] = v;
      }
    }
    if constexpr (DOWN) {  // MoEDown: this tile's rows of down, from its own act(gate)·up
      static_assert(ROUTED && MT == 1, "a fused down follows a routed pass");
      __shared__ __align__(16) float stage[kWarps][64];
      cp_async_wait<0>();  // this thread's copies of the operands; the barrier, everyone's (and hs)
      __syncthreads();
      down_slice(rt.down, e, routed_slot, nt, hs, down_stage(), stage, warp, lane);
    }
    return;
  }
  for (int i = threadIdx.x; i < MT * 64; i += kWarps * 32) {
    const int m = i >> 6, col = i & 63;
    if (m < n) atomicAdd(&out[(size_t)slot(m) * N + nt * 64 + col], red_total<MT>(red, m, col));
  }
}

// dequant_kernel writes W[K][N] fp16 from the tiled layout, one warp per
// 16×64 tile, with the kernels' dequantization (dequant_pair): lanes
// dequantize their fragments into a shared tile, then store it as 16 rows
// of 128 contiguous bytes.
template <int BITS>
__global__ void __launch_bounds__(256) dequant_kernel(const uint4* __restrict__ B, const uint4* __restrict__ S,
                                                      const uint32_t* __restrict__ Z, half* __restrict__ W, int N,
                                                      int K, int group) {
  __shared__ __align__(16) half tile[8][16][64];
  const int KT = K >> 4, NT = N >> 6;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t chunk = (size_t)blockIdx.x * 8 + warp;
  if (chunk >= (size_t)NT * KT) return;
  const int kt = chunk % KT, nt = chunk / KT;
  const int gid = lane >> 2, tig = lane & 3;
  const size_t g = (size_t)((kt << 4) / group) * NT + nt;
  GroupRegs gr;
  constexpr int CH = BITS / 4;  // chunks a tile
  if constexpr (BITS == 8)
    convert_group(gr, __ldg(S + g * 8 + gid), __ldg(reinterpret_cast<const uint2*>(Z) + g * 8 + gid));
  else
    convert_group(gr, __ldg(S + g * 8 + gid), __ldg(Z + g * 8 + gid));
  uint32_t w[4 * CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) put_words(w, c, __ldg(B + (chunk * CH + c) * 32 + lane));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t b[4];  // the fused kernels' fragments: rows k, k+8 of sub-tile 2i, then of 2i+1
    dequant_pair<BITS>(b, w, i, gr);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int j = 2 * i + (s >> 1);              // n8 sub-tile
      const int kk = 2 * tig + ((s & 1) ? 8 : 0);  // first row of the pair
      const uint32_t d = b[s];
      tile[warp][kk][j * 8 + gid] = __ushort_as_half((unsigned short)(d & 0xffffu));
      tile[warp][kk + 1][j * 8 + gid] = __ushort_as_half((unsigned short)(d >> 16));
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int piece = lane + 32 * i, row = piece >> 3, c8 = (piece & 7) * 8;
    *reinterpret_cast<uint4*>(&W[(size_t)(kt * 16 + row) * N + nt * 64 + c8]) =
        *reinterpret_cast<const uint4*>(&tile[warp][row][c8]);
  }
}

// gated_pairs_kernel: a gated layer's output (C, Outs::act) from t [M][N],
// its interleaved product (dequantize + cuBLAS), a thread an output.
__global__ void gated_pairs_kernel(const half* __restrict__ t, const Outs C, int M, int N) {
  pdl_gate();  // before any global access: see common.cuh
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)M * (N / 2)) return;
  const int r = (int)(i / (N / 2)), o = (int)(i % (N / 2)), nt = o / 32, c = o % 32;
  const half* row = t + (size_t)r * N + nt * 64;
  store_gated(C, r, N, nt, c, __half2float(row[c]), __half2float(row[c + 32]));
}

__global__ void gather_cols(const half* __restrict__ A, const int32_t* __restrict__ perm, half* __restrict__ out, int M,
                            int K) {
  pdl_gate();  // before any global access: see common.cuh
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)M * K) return;
  const size_t m = i / K;
  out[i] = A[m * K + perm[i % K]];
}

int check_shape(llmq_ctx* c, int M, int N, int K, int group) {
  if (M < 1 || N < 64 || N % 64 || K < 16 || K % 16 || group < 16 || group % 16 || K % group) {
    llmq::set_error(c, "unsupported W4A16 shape M=%d N=%d K=%d group=%d (need N %% 64 == 0, group %% 16 == 0, K %% group == 0)",
                    M, N, K, group);
    return 1;
  }
  return 0;
}

// check_bits: the kernels read codes in nibbles (2 to 4 bits, bits 4) or
// bytes (bits 8).
int check_bits(llmq_ctx* c, int bits) {
  if (bits != 4 && bits != 8) {
    llmq::set_error(c, "W4A16 codes of %d bits: the layout holds 4 (2- to 4-bit codes) or 8", bits);
    return 1;
  }
  return 0;
}

// Plan is what one call runs: the GEMV kernel's or the fused kernel's
// instantiation and its K splits, or dequantize + cuBLAS.
struct Plan {
  int bits;     // the codes' width: 4 (2- to 4-bit codes, in nibbles) or 8
  int path;     // 1 fused kernel, 2 dequantize + cuBLAS, 3 GEMV kernel, 4 GEMV on the Tensor Cores (v11),
                // 5 the same with the operands swapped (v15)
  int variant;  // the instantiation: kVariants[variant] (fused), kGemv[variant] (GEMV), kMma[variant] (v11),
                // kSwap[variant] (v15)
  int splits;
};

// The fused kernel's instantiations, by M: m-tiles of 16 rows (MB, a
// row block), 16-row steps a stage (U) and stages (STAGES); MINB 1 for all.
// M past 16·MB runs several row blocks. The GEMV kernel's: tokens (MT)
// and steps a batch (U). plan and w4a16_gemm switch on the index with
// these same template arguments.
struct Variant {
  int mb, u, stages, nw;  // nw: n-tiles a CTA (v18: warps a CTA, each its n-tile)
  int wg = 0;             // > 0: v19 (w4a16_wgmma, Hopper), warpgroups a CTA; the rows 16·mb are its NTOK
  int rs = 0;             // 1 (with wg): v21 (w4a16_wgmma_rs), the weights in registers, a producer warp's copies
};
// At 64 rows two steps a stage beat four on the three large layers
// (gemm-h100-sweep-v18b.txt, variant 3 then). Variants 3–7 are for sweeps
// (LLMQ_W4_FUSED_VARIANT); 5–7 hold more stages in flight (cuda/NOTES.md,
// "The fifteenth session": at 64 rows a batch waited about 3.7 µs for its
// bytes with three stages ahead); 8 and 9 are CTAs of eight warps over
// eight n-tiles, which read the activations half as often a byte of codes.
// Variants 10–16 are v19 (wgmma, sweep-only so far): 64 tokens over four
// tiles in one warpgroup; 128 over four in two warpgroups (two warps a
// tile, alternate steps); 128 over two tiles in one warpgroup (two warps a
// tile); 64 with four steps a stage; 64 with six stages; 64 over eight
// tiles in two warpgroups; 64 over four tiles in four warpgroups (a tile
// each, 32 accumulators a thread: four warps a tile and twice the warps an
// SM to hide the dequantization's latencies); 17 and 18 are the two that
// were wrong on the device while a warp read codes other threads copied
// (32 tokens over four tiles, and 64 over four in two warpgroups:
// cuda/NOTES.md, "The sixteenth session" and "The seventeenth session");
// 19 is 11 with four steps a stage (half the stages, so half the proxy
// fence's waits for the copies in flight; 22 in face48a's sweep).
// Variants 20–26 are v21: 128 tokens over four tiles in two
// warpgroups, four steps a stage in four or six stages, eight in three
// (22, the plan's at 65–256 rows); 64 tokens over four tiles in six
// stages (23, the plan's at 33–64 before 25); 128 tokens, two steps a stage in
// eight. (64 tokens over eight tiles, four a warpgroup, spilled.) 25 is
// 23 with eight steps a stage in four stages (half the barrier rounds a
// step), the plan's at 33–64; 26 is 64 tokens with sixteen steps a stage
// in two (sweep-only; three, or 22 in four stages, would not fit shared
// memory with 8-bit codes). (64 tokens over four
// tiles in four consumer warpgroups, a tile each, lost: 70.25 against
// 62.80 µs on gate+up at 64 rows, gemm-h100-sweep-v21h.txt against
// -ab-v21h.txt; at 128 tokens ptxas serialized its wgmmas.)
constexpr Variant kVariants[] = {{1, 4, 4, 4},    {2, 4, 4, 4},    {4, 2, 4, 4},    {4, 4, 4, 4},
                                 {2, 2, 4, 4},    {4, 2, 8, 4},    {4, 4, 6, 4},    {2, 4, 8, 4},
                                 {4, 2, 8, 8},    {4, 4, 4, 8},    {4, 2, 4, 4, 1}, {8, 2, 4, 4, 2},
                                 {8, 2, 4, 2, 1}, {4, 4, 4, 4, 1}, {4, 2, 6, 4, 1}, {4, 2, 4, 8, 2},
                                 {4, 4, 4, 4, 4}, {2, 2, 4, 4, 1}, {4, 2, 4, 4, 2}, {8, 4, 4, 4, 2},
                                 {8, 4, 4, 4, 2, 1}, {8, 4, 6, 4, 2, 1}, {8, 8, 3, 4, 2, 1}, {4, 4, 6, 4, 2, 1},
                                 {8, 2, 8, 4, 2, 1}, {4, 8, 4, 4, 2, 1}, {4, 16, 2, 4, 2, 1}};
constexpr int kFusedVariants = sizeof(kVariants) / sizeof(kVariants[0]);
// wgmma_version: a wgmma variant's kernel, v19 or v21 (for messages).
constexpr int wgmma_version(const Variant& v) { return v.rs ? 21 : 19; }
// v21's variants in the plan (llmq_ctx::wgmma_max_m): 128 tokens over
// four tiles in two warpgroups, eight steps a stage, for M = 65 …
// wgmma_max_m, and 64 tokens, eight steps a stage in four, for M = 33–64.
// On one H100 (cuda/NOTES.md, "The nineteenth session") variant 22 took
// 26%, 18% and 24% less time than v19's variant 19 (the plan before) at
// 128 rows on 8B gate+up, down and 70B down, 28%, 22% and 29% less at 256
// (gemm-h100-sweep-v21c.txt). At 64 rows variant 25 took 23%, 13% and 23%
// less than variant 23 (four steps a stage in six, the plan before) in
// one run (gemm-h100-sweep-v21i.txt: 49.00, 34.80 and 90.89 µs against
// 63.33, 39.81 and 118.65).
constexpr int kWgmmaVariant = 22, kWgmmaVariant64 = 25;
struct GemvVariant {
  int mt, u, minb;
};
// They serve M = 1 and 2; M = 2 takes 2 steps a batch, the sweep's winner
// on four of five shapes (NOTES.md, "v7"). v11 (below) took M = 3–4 from
// it, and M = 2 at 4 bits; v10's activations in shared memory lost.
constexpr GemvVariant kGemv[] = {{1, 4, 1}, {2, 2, 1}};
constexpr int kGemvVariants = sizeof(kGemv) / sizeof(kGemv[0]);
constexpr int kGemvMaxM = 2;
// v11's instantiations (w4a16_gemv_mma): the A rows (MT) and steps a
// batch (U), for M ≤ 8, 16, 32 and 64; fewer steps as the rows' fragments
// and accumulators take the registers (128, 150, 164 and 226 of them at 4
// bits: evals/results/ptxas-registers-h200.txt).
// Variant 4 (32 rows) is for sweeps (LLMQ_W4_MMA_VARIANT), variant 5 the
// plan's for 4-bit M = 33–64: pf > 0 asks L2 for a warp's codes pf
// batches ahead (at 32 and 64 rows a batch is 2 and 1 steps, too few to
// cover a load's latency from memory).
struct MmaVariant {
  int mt, u, pf;
};
constexpr MmaVariant kMma[] = {{8, 4, 0}, {16, 4, 0}, {32, 2, 0}, {64, 1, 0}, {32, 2, 4}, {64, 1, 8}};
constexpr int kMmaVariants = sizeof(kMma) / sizeof(kMma[0]);
constexpr int kMmaMaxM = 64;
// v15's (w4a16_gemv_swap): the tokens (MT), steps a batch (U), whether
// the codes are scaled before the mma (SCALED: no per-group sums, whose
// registers 32 tokens cannot spare), and the CTAs an SM the registers are
// bounded for (MINB). At 8 tokens the sweep's winner (NOTES.md, v15) is
// 4 steps a batch in 128 registers, 4 CTAs an SM. Variants 3–6 ask L2
// for a warp's codes PF batches ahead; sweeps only (LLMQ_W4_SWAP_VARIANT).
// 16 tokens bounded to 3 or 4 CTAs an SM (168, 157 and 128 registers
// against variant 1's 192) lost 2–34% on gate+up, 8B down and 70B down
// at 12 and 16 rows (cuda/NOTES.md, "The twenty-second session").
// Three other designs were tried in the eleventh and twelfth sessions and
// removed after losing to variant 0 on the large layers (cuda/NOTES.md,
// "The twelfth session"; gemm-h200-sweep-swap-v17.txt, -swap-u2.txt):
// NEGZ, which fed the codes with their magic offsets and added the zeros
// as a second mma; v17, which brought the codes through a shared-memory
// ring fed by bulk copies; and 2 steps a batch at 4 or 5 CTAs an SM.
struct SwapVariant {
  int mt, u;
  bool scaled;
  int minb;
  int pf;  // batches ahead a warp's codes are asked of L2 (0: none)
};
constexpr SwapVariant kSwap[] = {{8, 4, false, 4, 0}, {16, 4, false, 1, 0}, {32, 2, true, 1, 0},
                                 {8, 4, false, 4, 2}, {8, 4, false, 4, 4}, {16, 4, false, 1, 2},
                                 {32, 2, true, 1, 4}};
constexpr int kSwapVariants = sizeof(kSwap) / sizeof(kSwap[0]);
constexpr int kSwapMaxM = 32;
// A GEMM with no outputs (w4a16_gemm's n_outs 0: its fp32 sums left in the
// workspace for the next kernel to finish, llmq.h) runs on the GEMV
// kernels' instantiations of at most kSumsMaxM rows, which the plan picks
// for M ≤ kSumsMaxM (a decode step's, whose sums the next kernel
// finishes: cuda/model.go, Model.leavesSums), or through dequantize + cuBLAS.
// Theirs is a second instantiation (the kernels' SUMS), so that the other
// kernels' code stays as it was: the same condition at run time in every
// epilogue cost up to 12% where it was never taken (o at 64 rows; q/k/v
// and o at 8 rows 6% and 9%; one H100 A/B, cuda/NOTES.md, "The
// twenty-third session").
constexpr int kSumsMaxM = 8;
static_assert(kMma[0].mt == kSumsMaxM && kSwap[0].mt == kSumsMaxM, "the plan's M ≤ 8 variants have their sums");
constexpr bool sums_serves(int path, int variant) {
  return path == 2 || (path == 3 && kGemv[variant].mt <= kSumsMaxM) || (path == 4 && kMma[variant].mt <= kSumsMaxM) ||
         (path == 5 && kSwap[variant].mt <= kSumsMaxM);
}
// At M = 1 the plan takes v15 on layers of this many weights or more
// (8B gate+up, 70B down) and the CUDA-core GEMV on smaller ones, as the
// seventh session measured. The twelfth session's H200 runs had v15,
// forced at M = 1, 2–7% faster on the smaller ones (two runs); the
// thirteenth's same-run A/B on an H100 did not (gemm-h100-ab-kswap0.txt,
// decode-ab-h100-kswap0.txt). An H200 A/B decides (cuda/NOTES.md).
constexpr size_t kSwapMinWeights = size_t(1) << 26;
// The plan takes the fused kernel (v18; on Hopper v21) at M = kFusedMinM + 1 to
// fused_max_m on layers of this many weights or more: in one H100 run
// (gemm-h100-sweep-v18b.txt against gemm-h100-paths-v18b.txt) it beat v11
// at M = 64 and dequantize + cuBLAS at M = 128 on 8B gate+up (2^26.8
// weights), down (2^25.8) and 70B down (2^27.8), and lost on o (2^24) or
// drew on q/k/v (2^24.6) at M = 64; at M = 32 v11 and v15 were level or
// ahead (but for one sweep-only variant on gate+up), and at M = 256
// dequantize + cuBLAS won on every shape. At M = 128 it was 6% ahead on
// q/k/v too, which this threshold leaves to dequantize + cuBLAS.
constexpr size_t kFusedMinWeights = size_t(1) << 25;
// v21 (Hopper) takes smaller layers too, down to 8B's q/k/v (4096 × 6144,
// 3 · 2^23 weights): in one H100 run (gemm-h100-sweep-v21g.txt against
// -v21g-auto.txt, 9b78bbf) it ran q/k/v in 24.98 and 35.22 µs at M = 64
// and 128 against v11's 32.21 and dequantize + cuBLAS's 45.81, and lost at
// 256 (51.05 against 50.25); with 7cfdff1's consumer it took 47.47 there
// against 50.16 (gemm-h100-ab-v21h.txt). On o (2^24) it lost at 64 (23.83
// against v11's 20.42), 128 (33.63 against 28.63; variant 23 forced drew,
// 28.22) and 256 (37.37 against 32.09).
constexpr size_t kWgmmaMinWeights = size_t(3) << 23;
constexpr int kFusedMinM = 32;
// resident_slot: where a kernel instantiation's resident CTAs per SM are
// kept (llmq_ctx::resident): the fused kernel's kFusedVariants, then the
// GEMV's, then v11's, then v15's, each 4-bit then 8-bit.
constexpr int resident_slot(int path, int variant, int bits) {
  constexpr int F = 2 * kFusedVariants;
  return path == 1   ? kFusedVariants * (bits == 8) + variant
         : path == 3 ? F + kGemvVariants * (bits == 8) + variant
         : path == 4 ? F + 2 * kGemvVariants + kMmaVariants * (bits == 8) + variant
                     : F + 2 * kGemvVariants + 2 * kMmaVariants + kSwapVariants * (bits == 8) + variant;
}
static_assert(resident_slot(5, kSwapVariants - 1, 8) < (int)(sizeof(llmq_ctx::resident) / sizeof(int)),
              "a resident slot per variant");

// gemv_variant does one thing with GEMV instantiation V for BITS-bit
// codes: query its resident CTAs (run false) or launch it.
template <int V, int BITS>
int gemv_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                 const Outs& C, void* workspace, int M, int N, int K, int gshift);

// with_variant calls f(V, BITS), the two as std::integral_constant, for a
// variant index v in [0, N) and a code width known only at run time (8,
// or 4 for 2- to 4-bit codes): the one switch from the plan's numbers to a
// kernel instantiation, as with_gemv and with_mma use it.
template <typename F, int... Vs>
int with_variant_in(std::integer_sequence<int, Vs...>, int v, int bits, F& f) {
  int rc = 1;
  ((v == Vs && (rc = bits == 8 ? f(std::integral_constant<int, Vs>{}, std::integral_constant<int, 8>{})
                               : f(std::integral_constant<int, Vs>{}, std::integral_constant<int, 4>{}),
                true)),
   ...);
  return rc;
}
template <int N, typename F>
int with_variant(llmq_ctx* c, const char* kernel, int v, int bits, F f) {
  if (v < 0 || v >= N) {
    llmq::set_error(c, "no %s variant %d for %d-bit codes", kernel, v, bits);
    return 1;
  }
  return with_variant_in(std::make_integer_sequence<int, N>{}, v, bits, f);
}

// fused_variant does one thing with the fused kernel's instantiation V
// for BITS-bit codes: query its resident CTAs (run false) or launch it.
template <int V, int BITS>
int fused_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                  const Outs& C, void* workspace, int M, int N, int K, int gshift);

// with_fused calls fused_variant<v, bits> for a variant index and a code
// width known only at run time.
int with_fused(int v, int bits, llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S,
               const void* Z, const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  return with_variant<kFusedVariants>(c, "fused", v, bits, [&](auto vi, auto bi) {
    return fused_variant<decltype(vi)::value, decltype(bi)::value>(c, run, splits, A, B, S, Z, C, workspace, M, N, K,
                                                                    gshift);
  });
}

// with_gemv calls gemv_variant<v, bits> for a variant index and a code
// width known only at run time.
int with_gemv(int v, int bits, llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S,
              const void* Z, const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  return with_variant<kGemvVariants>(c, "GEMV", v, bits, [&](auto vi, auto bi) {
    return gemv_variant<decltype(vi)::value, decltype(bi)::value>(c, run, splits, A, B, S, Z, C, workspace, M, N, K,
                                                                   gshift);
  });
}

// mma_variant does one thing with v11's instantiation V for BITS-bit
// codes: query its resident CTAs (run false) or launch it.
template <int V, int BITS>
int mma_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                const Outs& C, void* workspace, int M, int N, int K, int gshift);

// with_mma calls mma_variant<v, bits> for a variant index and a code
// width known only at run time.
int with_mma(int v, int bits, llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S,
             const void* Z, const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  return with_variant<kMmaVariants>(c, "Tensor Core GEMV", v, bits, [&](auto vi, auto bi) {
    return mma_variant<decltype(vi)::value, decltype(bi)::value>(c, run, splits, A, B, S, Z, C, workspace, M, N, K,
                                                                  gshift);
  });
}

// swap_variant does one thing with v15's instantiation V for BITS-bit
// codes: query its resident CTAs (run false) or launch it.
template <int V, int BITS>
int swap_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                 const Outs& C, void* workspace, int M, int N, int K, int gshift);

// with_swap calls swap_variant<v, bits> for a variant index and a code
// width known only at run time.
int with_swap(int v, int bits, llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S,
              const void* Z, const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  return with_variant<kSwapVariants>(c, "swapped Tensor Core GEMV", v, bits, [&](auto vi, auto bi) {
    return swap_variant<decltype(vi)::value, decltype(bi)::value>(c, run, splits, A, B, S, Z, C, workspace, M, N, K,
                                                                   gshift);
  });
}

// resident_of queries (once per context, in c->resident[slot]) how many
// CTAs of a kernel instantiation fit on an SM.
template <typename Kernel>
int resident_of(llmq_ctx* c, int slot, Kernel kernel, size_t smem, int threads = kWarps * 32) {
  int& resident = c->resident[slot];
  if (!resident) {
    if (allow_smem(c, kernel, smem)) return 1;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, smem));
  }
  return 0;
}

// query_resident fills the resident slot of a path's instantiation.
int query_resident(llmq_ctx* c, int path, int variant, int bits) {
  if (path == 5)
    return with_swap(variant, bits, c, false, 0, nullptr, nullptr, nullptr, nullptr, Outs{}, nullptr, 0, 0, 0, 0);
  if (path == 4)
    return with_mma(variant, bits, c, false, 0, nullptr, nullptr, nullptr, nullptr, Outs{}, nullptr, 0, 0, 0, 0);
  if (path == 3)
    return with_gemv(variant, bits, c, false, 0, nullptr, nullptr, nullptr, nullptr, Outs{}, nullptr, 0, 0, 0, 0);
  return with_fused(variant, bits, c, false, 0, nullptr, nullptr, nullptr, nullptr, Outs{}, nullptr, 0, 0, 0, 0);
}

// plan picks the path and, for the kernels, the instantiation and its K
// splits: one full wave, as many splits as fill the resident CTA slots,
// each warp keeping at least two batches (GEMV) or a CTA two rings (fused) of
// steps; fewer splits as M grows (the cross-CTA reduction costs
// M·N·splits atomics).
// forced_splits is the planned K splits, or LLMQ_W4_SPLITS' (c->w4_splits)
// where set, at most one a warp's step.
int forced_splits(llmq_ctx* c, int planned, int KT) {
  return c->w4_splits > 0 ? min(c->w4_splits, max(1, KT / kWarps)) : planned;
}

// swap_wide_layer sets wide: whether a wave of v15's instantiation for M
// tokens (9–32) is narrower than the layer's n-tiles, which makes the
// plan's K splits for it one. The one same-run measurement (NOTES.md,
// v15: v15 forced beside the plan) has v15 ahead of v11 only there: 8B
// gate+up at M = 16 36.75 against 39.73 µs, at 32 57.01 against 73.14,
// where every layer it had to split was level or slower.
int swap_wide_layer(llmq_ctx* c, int M, int N, bool& wide) {
  const int v = M <= 16 ? 1 : 2;
  if (query_resident(c, 5, v, 4)) return 1;
  wide = c->sms * max(c->resident[resident_slot(5, v, 4)], 1) < 2 * (N / 64);
  return 0;
}

// v21 where it is measured ahead: Hopper, groups of two steps or more
// (measured in groups of 128; in groups of one step a stage of eight
// would take sixteen bulk copies of scales and zeros), more than 32 rows
// (to 32, v15 and v11 lead) up to wgmma_max_m — and from 17 rows on a
// layer v15 runs without a K split (wide: 8B gate+up, where variant 25
// took 48.01, 47.83 and 48.33 µs at 17, 24 and 32 rows against v15's
// 49.63, 52.40 and 56.51 in one H200 run, gemm-h200-sweep-v21k.txt
// against -v21k-auto.txt, and 48.12, 47.16 and 47.03 against 49.92,
// 52.66 and 56.46 in one H100 run, gemm-h100-sweep-m17.txt; on the other
// layers v11 led at 32 rows).
bool wgmma_serves(const llmq_ctx* c, int M, int group, bool wide) {
  return c->cc_major == 9 && M > (wide ? 16 : 32) && M <= c->wgmma_max_m && group >= 32;
}

int plan(llmq_ctx* c, Plan& p, int M, int N, int K, int group, int bits, bool have_scratch) {
  p = Plan{};
  p.bits = bits;
  const bool pow2 = group >= K || !(group & (group - 1));
  // The measured choice (NOTES.md, v11 and v15): on Hopper v21 wherever
  // wgmma_serves (4-bit codes, 33–wgmma_max_m rows, from 17 on a wide
  // layer) on layers of kWgmmaMinWeights or more; otherwise for 4-bit
  // codes v15 at M = 2–8, at M = 1 on large layers, and at M =
  // 9–swap_max_m (32) on layers wide enough that a wave of its CTAs needs
  // no K split (8B gate+up); the CUDA-core GEMV at M = 1 (and M = 2 for
  // 8-bit codes), v11 from there to mma_max_m (64), except that the fused
  // kernel (v18) takes M = 33–fused_max_m (128) on layers of
  // kFusedMinWeights or more (4-bit codes); then dequantize + cuBLAS (the
  // fused kernel without a scratch).
  const int gemv_max = c->gemv_max_m >= 0 ? min(c->gemv_max_m, kGemvMaxM) : bits == 8 ? 2 : 1;
  const bool swap_ok = M <= min(c->swap_max_m, kSwapMaxM) && pow2 && bits == 4;
  bool swap_wide = false;  // M = 9–32 on a wide layer (swap_wide_layer)
  if (!c->w4_path && swap_ok && M > 8 && swap_wide_layer(c, M, N, swap_wide)) return 1;
  const bool v21 = bits == 4 && pow2 && wgmma_serves(c, M, group, swap_wide);
  if (c->w4_path)
    p.path = c->w4_path;
  else if (v21 && (size_t)N * K >= kWgmmaMinWeights)
    p.path = 1;
  else if (swap_ok && (M <= 8 ? M > 1 || (size_t)N * K >= kSwapMinWeights : swap_wide))
    p.path = 5;
  else if (M <= gemv_max && pow2)
    p.path = 3;
  else if (bits == 4 && pow2 && !v21 && M > kFusedMinM && M <= c->fused_max_m && (size_t)N * K >= kFusedMinWeights)
    p.path = 1;
  else if (M <= min(c->mma_max_m, kMmaMaxM) && pow2)
    p.path = 4;
  else if (bits == 8)
    p.path = 2;
  else
    p.path = have_scratch ? 2 : 1;
  if (p.path == 2) return 0;
  if (!pow2) {
    llmq::set_error(c,
                    "the fused and GEMV W4A16 kernels need a power-of-two group size or one group per column "
                    "(group=%d); other groups run through dequantize + cuBLAS, which needs the K·N fp16 scratch",
                    group);
    return 1;
  }
  if (p.path == 3 && M > kGemvMaxM) {
    llmq::set_error(c, "the GEMV W4A16 kernel runs M ≤ %d, not M=%d", kGemvMaxM, M);
    return 1;
  }
  if (p.path == 4 && M > kMmaMaxM) {
    llmq::set_error(c, "the Tensor Core GEMV W4A16 kernel runs M ≤ %d, not M=%d", kMmaMaxM, M);
    return 1;
  }
  if (p.path == 5 && M > kSwapMaxM) {
    llmq::set_error(c, "the swapped Tensor Core GEMV W4A16 kernel runs M ≤ %d, not M=%d", kSwapMaxM, M);
    return 1;
  }
  const int NT = N / 64, KT = K / 16;
  if (p.path >= 3) {  // the GEMV kernels: one full wave, two batches a warp at least
    // 4-bit M = 33–64 runs v11's 64 rows with the L2 prefetch 8 steps
    // ahead (variant 5): 5–7% faster than without on 8B q/k/v and
    // gate+up and 70B down, level on o and down (gemm-h200-sweep-mma-stack.txt).
    p.variant = p.path == 3 ? M - 1 : M <= 8 ? 0 : M <= 16 ? 1 : M <= 32 ? 2 : bits == 4 ? 5 : 3;
    // LLMQ_W4_SWAP_VARIANT and LLMQ_W4_MMA_VARIANT: v15 or v11 runs that
    // instantiation wherever M fits it (the plan's elsewhere), so that a
    // sweep can span several M and the GEMM tests can run under one.
    if (p.path == 5 && c->swap_forced_variant >= 0) {
      if (c->swap_forced_variant >= kSwapVariants) {
        llmq::set_error(c, "LLMQ_W4_SWAP_VARIANT=%d: v15 has variants 0–%d", c->swap_forced_variant, kSwapVariants - 1);
        return 1;
      }
      if (M <= kSwap[c->swap_forced_variant].mt) p.variant = c->swap_forced_variant;
    }
    if (p.path == 4 && c->mma_forced_variant >= 0) {
      if (c->mma_forced_variant >= kMmaVariants) {
        llmq::set_error(c, "LLMQ_W4_MMA_VARIANT=%d: v11 has variants 0–%d", c->mma_forced_variant, kMmaVariants - 1);
        return 1;
      }
      if (M <= kMma[c->mma_forced_variant].mt) p.variant = c->mma_forced_variant;
    }
    const int u = p.path == 3 ? kGemv[p.variant].u : p.path == 4 ? kMma[p.variant].u : kSwap[p.variant].u;
    if (query_resident(c, p.path, p.variant, bits)) return 1;
    int splits = max(1, (c->sms * max(c->resident[resident_slot(p.path, p.variant, bits)], 1)) / NT);
    splits = min(splits, max(1, KT / (2 * kWarps * u)));
    if (M > 16) splits = min(splits, max(1, 64 / ((M + 15) / 16)));
    p.splits = forced_splits(c, splits, KT);
    return 0;
  }
  // The fused kernel: a CTA per row block and NW n-tiles, K split
  // until a wave fills the resident slots, each split keeping at least
  // two rings' worth of batches.
  p.variant = M <= 16 ? 0 : M <= 32 ? 1 : 2;
  if (v21) p.variant = M <= 64 ? kWgmmaVariant64 : kWgmmaVariant;
  if (c->fused_forced_variant >= 0) {  // LLMQ_W4_FUSED_VARIANT: any M fits (row blocks)
    if (c->fused_forced_variant >= kFusedVariants) {
      llmq::set_error(c, "LLMQ_W4_FUSED_VARIANT=%d: the fused kernel has variants 0–%d", c->fused_forced_variant,
                      kFusedVariants - 1);
      return 1;
    }
    p.variant = c->fused_forced_variant;
  }
  if (kVariants[p.variant].wg > 0 && c->cc_major != 9) {
    llmq::set_error(c, "fused variant %d (v%d) runs on Hopper's wgmma (compute capability 9.0), not on %d.x",
                    p.variant, wgmma_version(kVariants[p.variant]), c->cc_major);
    return 1;
  }
  const Variant v = kVariants[p.variant];
  if (query_resident(c, 1, p.variant, bits)) return 1;
  const int ctas = ((M + 16 * v.mb - 1) / (16 * v.mb)) * ((NT + v.nw - 1) / v.nw);
  int splits = max(1, (c->sms * max(c->resident[resident_slot(1, p.variant, bits)], 1)) / ctas);
  splits = min(splits, max(1, KT / (2 * v.stages * v.u)));
  if (M > 16) splits = min(splits, max(1, 64 / ((M + 15) / 16)));
  p.splits = forced_splits(c, splits, KT);
  return 0;
}

// group_shift: a group spans 2^gshift 16-row steps; −1 for one group.
int group_shift(int group, int K) {
  int gshift = -1;
  if (group < K) {
    gshift = 0;
    while ((16 << gshift) < group) ++gshift;
  }
  return gshift;
}

// fused_launch queries a fused kernel's resident CTAs (run false) or
// launches it: v18, v19 and v21 take the same grid and arguments (v21 one
// more, the activations' tensor map, in extra).
template <typename Kernel, typename... Extra>
int fused_launch(llmq_ctx* c, bool run, int slot, Kernel kernel, const Variant& v, size_t smem, int threads, int splits,
                 const half* A, const void* B, const void* S, const void* Z, const Outs& C, void* workspace, int M,
                 int N, int K, int gshift, Extra... extra) {
  if (!run) return resident_of(c, slot, kernel, smem, threads);
  float* ws = (float*)workspace;
  const dim3 grid((M + 16 * v.mb - 1) / (16 * v.mb), (N / 64 + v.nw - 1) / v.nw, splits);
  CK(launch(c, (kernel), grid, threads, smem, A, (const uint4*)B, (const uint4*)S, (const uint32_t*)Z, C, ws,
            (int*)(ws + (size_t)M * N), M, N, K, gshift, splits, extra...));
  return 0;
}

// act_map fills m with the copy engine's description of the activations
// A (M rows of K fp16) in boxes of 16 K × rows, 32-byte swizzled as wgmma
// reads them (v21). The encoder is the driver's cuTensorMapEncodeTiled,
// found once through the runtime and kept in the context.
typedef CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                         const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                         CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
int act_map(llmq_ctx* c, CUtensorMap* m, const half* A, int M, int K, int rows) {
  if (!c->tmap_encode) {
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &c->tmap_encode, 12000,
                                                           cudaEnableDefault, &q);
#else  // (the local checks' older toolkit)
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &c->tmap_encode, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !c->tmap_encode) {
      c->tmap_encode = nullptr;
      llmq::set_error(c, "v21: the driver has no cuTensorMapEncodeTiled (%s)", cudaGetErrorString(e));
      return 1;
    }
  }
  if (reinterpret_cast<uintptr_t>(A) % 16 != 0) {
    llmq::set_error(c, "v21: the activations must start 16-byte aligned for the copy engine");
    return 1;
  }
  // The encoder is a driver call: it needs the device's context current
  // on this thread, which a runtime call makes so only on threads that
  // made one before (Go calls in from any of its threads: error 201,
  // CUDA_ERROR_INVALID_CONTEXT, in an H100 sweep, gemm-h100-sweep-v21a.txt).
  if (const cudaError_t e = cudaSetDevice(c->device); e != cudaSuccess) {
    llmq::set_error(c, "v21: cudaSetDevice(%d): %s", c->device, cudaGetErrorString(e));
    return 1;
  }
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M}, strides[1] = {(cuuint64_t)K * sizeof(half)};
  const cuuint32_t box[2] = {16, (cuuint32_t)rows}, steps[2] = {1, 1};
  const CUresult r = reinterpret_cast<TensorMapEncodeTiled>(c->tmap_encode)(
    m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<half*>(A), dims, strides, box, steps,
    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_32B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    llmq::set_error(c, "v21: cuTensorMapEncodeTiled failed (error %d) for %d × %d activations", (int)r, M, K);
    return 1;
  }
  return 0;
}

template <int V, int BITS>
int fused_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                  const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  constexpr Variant v = kVariants[V];
  const int slot = resident_slot(1, V, BITS);
  if constexpr (v.rs) {
    using L = WgRsTile<16 * v.mb, v.wg, v.nw, v.u, v.stages, BITS>;
    CUtensorMap tm{};  // (a resident query launches nothing and needs none)
    if (run && act_map(c, &tm, A, M, K, 16 * v.mb)) return 1;
    return fused_launch(c, run, slot, w4a16_wgmma_rs<16 * v.mb, v.wg, v.nw, v.u, v.stages, BITS>, v, L::kSmem,
                        L::kThreads, splits, A, B, S, Z, C, workspace, M, N, K, gshift, tm);
  } else if constexpr (v.wg > 0) {
    using L = WgTile<16 * v.mb, v.wg, v.nw, v.u, v.stages, BITS>;
    return fused_launch(c, run, slot, w4a16_wgmma<16 * v.mb, v.wg, v.nw, v.u, v.stages, BITS>, v, L::kSmem,
                        L::kThreads, splits, A, B, S, Z, C, workspace, M, N, K, gshift);
  } else {
    return fused_launch(c, run, slot, w4a16_fused<v.mb, v.u, v.stages, 1, BITS, v.nw>, v,
                        fused_smem_bytes<v.mb, v.u, v.stages, BITS / 4, v.nw>(), v.nw * 32, splits, A, B, S, Z, C,
                        workspace, M, N, K, gshift);
  }
}

// gemv_kernel queries a GEMV kernel's resident CTAs into slot (run false)
// or launches it over N/64 tiles × splits: the one launch of both GEMV
// kernels, which take the same arguments.
template <typename Kernel>
int gemv_kernel(llmq_ctx* c, bool run, int slot, Kernel kernel, int splits, const half* A, const void* B, const void* S,
                const void* Z, const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  if (!run) return resident_of(c, slot, kernel, 0);
  float* ws = (float*)workspace;
  CK(launch(c, (kernel), dim3(N / 64, splits), kWarps * 32, 0, A, (const uint4*)B, (const uint4*)S, (const uint32_t*)Z,
            C, ws, (int*)(ws + (size_t)M * N), M, N, K, gshift, splits));
  return 0;
}

// with_sums calls launch(std::bool_constant<SUMS>) for the instantiation
// a GEMV variant of MT rows runs: a GEMM with no outputs (C.n 0: the sums
// left in the workspace, w4a16_gemm's n_outs 0) the kernel's SUMS one,
// which exists for the variants of at most kSumsMaxM rows (sums_serves,
// checked before); a resident query and every other GEMM the plain one,
// whose resident CTAs give the plan's K splits for both.
template <int MT, typename F>
int with_sums(bool run, const Outs& C, F launch) {
  if constexpr (MT <= kSumsMaxM)
    if (run && !C.n) return launch(std::true_type{});
  return launch(std::false_type{});
}

template <int V, int BITS>
int gemv_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                 const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  constexpr GemvVariant v = kGemv[V];
  return with_sums<v.mt>(run, C, [&](auto sums) {
    return gemv_kernel(c, run, resident_slot(3, V, BITS), w4a16_gemv<v.mt, v.u, v.minb, BITS, decltype(sums)::value>,
                       splits, A, B, S, Z, C, workspace, M, N, K, gshift);
  });
}

template <int V, int BITS>
int mma_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  constexpr MmaVariant v = kMma[V];
  return with_sums<v.mt>(run, C, [&](auto sums) {
    return gemv_kernel(c, run, resident_slot(4, V, BITS), w4a16_gemv_mma<v.mt, v.u, BITS, v.pf, decltype(sums)::value>,
                       splits, A, B, S, Z, C, workspace, M, N, K, gshift);
  });
}

template <int V, int BITS>
int swap_variant(llmq_ctx* c, bool run, int splits, const half* A, const void* B, const void* S, const void* Z,
                 const Outs& C, void* workspace, int M, int N, int K, int gshift) {
  constexpr SwapVariant v = kSwap[V];
  return with_sums<v.mt>(run, C, [&](auto sums) {
    return gemv_kernel(c, run, resident_slot(5, V, BITS),
                       w4a16_gemv_swap<v.mt, v.u, BITS, v.scaled, v.minb, v.pf, decltype(sums)::value>, splits, A, B, S, Z, C,
                       workspace, M, N, K, gshift);
  });
}

}  // namespace

namespace llmq {

size_t w4a16_workspace_bytes(int M, int N) {
  return (size_t)M * N * sizeof(float) + (size_t)((M + 15) / 16) * (N / 64) * sizeof(int);
}

int w4a16_set_path(llmq_ctx* c, int path) {
  if (path < 0 || path > 5) {
    set_error(c, "W4A16 path %d: 0 automatic, 1 fused, 2 dequantize + cuBLAS, 3 GEMV, 4 v11, 5 v15", path);
    return 1;
  }
  c->w4_path = path;
  return 0;
}

int w4_dequant(llmq_ctx* c, const void* B, const void* S, const void* Z, void* W, int N, int K, int group, int bits) {
  if (check_shape(c, 1, N, K, group) || check_bits(c, bits)) return 1;
  const size_t chunks = (size_t)(N / 64) * (K / 16);
  if (bits == 8)
    dequant_kernel<8><<<(unsigned)((chunks + 7) / 8), 256, 0, c->stream>>>(
        (const uint4*)B, (const uint4*)S, (const uint32_t*)Z, (half*)W, N, K, group);
  else
    dequant_kernel<4><<<(unsigned)((chunks + 7) / 8), 256, 0, c->stream>>>(
        (const uint4*)B, (const uint4*)S, (const uint32_t*)Z, (half*)W, N, K, group);
  CK_LAUNCH("dequant_kernel");
  return 0;
}

// gemm_f16_cols: C[M,n] = A[M,K]·W[:, cols] for the n columns of a
// row-major W[K][ldw] starting at W; with sums, C is fp32 and the product
// is added to it (a GEMM with no outputs: its sums into the workspace).
int gemm_f16_cols(llmq_ctx* c, const void* A, const half* W, int ldw, void* C, int M, int n, int K, bool sums = false) {
  const float alpha = 1.f, beta = sums ? 1.f : 0.f;
  // Row-major C = A·W is column-major Cᵀ = Wᵀ·Aᵀ.
  cublasStatus_t s = cublasGemmEx(c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, n, M, K, &alpha, W, CUDA_R_16F, ldw, A, CUDA_R_16F,
                                  K, &beta, C, sums ? CUDA_R_32F : CUDA_R_16F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    set_error(c, "cublasGemmEx failed: status %d (M=%d N=%d K=%d%s)", (int)s, M, n, K, sums ? ", sums" : "");
    return 1;
  }
  return 0;
}

int gemm_f16(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K) {
  return gemm_f16_cols(c, A, (const half*)W, N, C, M, N, K);
}

// check_out_align: the epilogues store two and four columns at once
// (half2, and four halves as 8 bytes in finish_splits), so every output
// must start on 8 bytes.
int check_out_align(llmq_ctx* c, const char* fn, const Outs& C) {
  for (int i = 0; i < C.n; ++i)
    if ((uintptr_t)C.c[i] & 7) {
      set_error(c, "%s: output %d at %p is not 8-byte aligned (the epilogues store 4 columns at once)", fn, i,
                (void*)C.c[i]);
      return 1;
    }
  return 0;
}

// make_outs checks and gathers a GEMM's outputs (w4a16_gemm's outs,
// out_cols, n_outs) for N columns.
int make_outs(llmq_ctx* c, const char* fn, void* const* outs, const int* out_cols, int n_outs, int act, int N, Outs& C) {
  C = Outs{};
  C.n = n_outs;
  C.act = act;
  if (n_outs == 0 && act < 0) return 0;  // the sums into the workspace, left there (llmq.h)
  if (act >= 0) {  // gated: one output, half the columns
    if (act > 1 || n_outs != 1 || out_cols[0] != N / 2 || N % 64) {
      set_error(c,
                "%s: a gated GEMM (act %d: 0 SiLU, 1 GELU-tanh) writes one output of N/2 = %d columns from N = %d, a "
                "multiple of 64 (have %d outputs, the first %d wide)",
                fn, act, N / 2, N, n_outs, out_cols[0]);
      return 1;
    }
    C.c[0] = (half*)outs[0];
    C.end[0] = N;
    return check_out_align(c, fn, C);
  }
  int end = 0;
  for (int i = 0; i < n_outs && n_outs <= 3; ++i) {
    if (out_cols[i] <= 0 || (n_outs > 1 && out_cols[i] % 64)) break;
    C.c[i] = (half*)outs[i];
    C.end[i] = end += out_cols[i];
  }
  if (n_outs < 1 || n_outs > 3 || end != N || C.end[n_outs - 1] != N) {
    set_error(c, "%s: %d outputs whose widths must be multiples of 64 adding up to N=%d", fn, n_outs, N);
    return 1;
  }
  return check_out_align(c, fn, C);
}

int w4a16_gemm(llmq_ctx* c, const void* A, const void* B, const void* scales, const void* zeros, const int32_t* perm,
               void* a_perm, void* const* outs, const int* out_cols, int n_outs, int act, void* workspace, void* scratch,
               int M, int N, int K, int group, int bits) {
  if (check_shape(c, M, N, K, group) || check_bits(c, bits)) return 1;
  Outs C;
  if (make_outs(c, "w4a16_gemm", outs, out_cols, n_outs, act, N, C)) return 1;
  if ((uintptr_t)workspace & 15) {  // finish_splits reads and zeroes it 16 bytes at a time
    set_error(c, "w4a16_gemm: the workspace at %p is not 16-byte aligned", workspace);
    return 1;
  }
  const half* a = (const half*)A;
  if (perm) {
    if (!a_perm) {
      set_error(c, "act-order weights need an a_perm scratch of M·K fp16");
      return 1;
    }
    const size_t n = (size_t)M * K;
    CK(launch(c, (gather_cols), (unsigned)((n + 255) / 256), 256, 0, a, perm, (half*)a_perm, M, K));
    a = (const half*)a_perm;
  }
  Plan p;
  if (plan(c, p, M, N, K, group, bits, scratch != nullptr)) return 1;
  if (!n_outs && !sums_serves(p.path, p.variant)) {
    set_error(c,
              "w4a16_gemm with no outputs (the sums left in the workspace) runs the GEMV kernels at M ≤ %d or "
              "dequantize + cuBLAS; the plan took path %d, variant %d for M=%d (a forced path or variant?)",
              kSumsMaxM, p.path, p.variant, M);
    return 1;
  }
  if (p.path == 2) {
    if (!scratch) {
      set_error(c, "the dequantize+cuBLAS path needs a K·N fp16 scratch");
      return 1;
    }
    if (w4_dequant(c, B, scales, zeros, scratch, N, K, group, bits)) return 1;
    if (C.act >= 0) {  // the interleaved [M][N] product into the workspace (re-zeroed after), then its pairs
      half* t = (half*)workspace;
      if (gemm_f16_cols(c, a, (const half*)scratch, N, t, M, N, K)) return 1;
      const size_t n = (size_t)M * (N / 2);
      CK(launch(c, (gated_pairs_kernel), (unsigned)((n + 255) / 256), 256, 0, (const half*)t, C, M, N));
      CK(cudaMemsetAsync(t, 0, (size_t)M * N * sizeof(half), c->stream));
      return 0;
    }
    if (n_outs == 0) return gemm_f16_cols(c, a, (const half*)scratch, N, workspace, M, N, K, true);
    for (int i = 0, start = 0; i < n_outs; start = C.end[i++])
      if (gemm_f16_cols(c, a, (const half*)scratch + start, N, C.c[i], M, C.end[i] - start, K)) return 1;
    return 0;
  }
  if (p.path == 3)
    return with_gemv(p.variant, bits, c, true, p.splits, a, B, scales, zeros, C, workspace, M, N, K,
                     group_shift(group, K));
  if (p.path == 4)
    return with_mma(p.variant, bits, c, true, p.splits, a, B, scales, zeros, C, workspace, M, N, K,
                    group_shift(group, K));
  if (p.path == 5)
    return with_swap(p.variant, bits, c, true, p.splits, a, B, scales, zeros, C, workspace, M, N, K,
                     group_shift(group, K));
  return with_fused(p.variant, bits, c, true, p.splits, a, B, scales, zeros, C, workspace, M, N, K,
                    group_shift(group, K));
}

// moe_splits: the grouped GEMV's K splits — enough CTAs for about four an
// SM over the chunks the slots fill, each warp keeping at least two
// batches of U steps (U: 4 for one slot a chunk, 2 for four, the
// instantiations below).
static int moe_splits(const llmq_ctx* c, int slots, int mt, int N, int K) {
  const int NT = N / 64, KT = K / 16, used = (slots + mt - 1) / mt, U = mt == 1 ? 4 : 2;
  if (c->moe_splits > 0) return min(c->moe_splits, max(1, KT / kWarps));  // LLMQ_MOE_SPLITS, for sweeps
  return max(1, min((c->sms * 4) / (NT * used), KT / (2 * kWarps * U)));
}

// check_grouped checks what the grouped kernel runs: its shape and group.
static int check_grouped(llmq_ctx* c, const char* fn, int N, int K, int group) {
  if (check_shape(c, 1, N, K, group)) return 1;
  if (group < K && (group & (group - 1))) {
    set_error(c, "%s: the grouped W4A16 kernel needs a power-of-two group size or one group per column (group=%d)", fn,
              group);
    return 1;
  }
  return 0;
}

// check_gated checks a grouped GEMV's gated output (MoEGated): act 0
// (SiLU) or 1 (GELU-tanh) with g, or act −1.
int check_gated(llmq_ctx* c, const char* fn, const void* g, int act) {
  if (act < -1 || act > 1 || (act >= 0 && !g)) {
    set_error(c, "%s: act %d%s (want −1, or 0 SiLU / 1 GELU-tanh with g)", fn, act, act >= 0 && !g ? " and no g" : "");
    return 1;
  }
  return 0;
}

// fuses_act: whether grouped_launch writes a gated pass's act(gate)·up
// in the GEMV's own launch (one K split).
static bool fuses_act(const llmq_ctx* c, int chunks, int slots, int mt, int N, int K, int act) {
  return act >= 0 && c->moe_fused_act && (moe_splits(c, slots, mt, N, K) == 1 || (N / 64) * chunks >= c->sms);
}

// grouped_launch runs w4a16_gemv_grouped<MT, U, ROUTED, DOWN> over
// `chunks` chunks: gated (act ≥ 0, unless LLMQ_MOE_FUSED_ACT=0) with one K split
// where its tiles of chunks fill the SMs or one split is the plan anyway
// — a second split's sums would have to meet in memory before the pairs,
// and that tail cost more than the split gained at qwen3-30b-a3b's batch
// 1, 192 tiles on 132 SMs (NOTES.md, "The fourteenth session") — else
// moe_splits', the sums into out, and moe_act after when gated.
template <int MT, int U, bool ROUTED, bool DOWN = false>
static int grouped_launch(llmq_ctx* c, int chunks, int slots, const void* A, int a_div, const int32_t* order,
                          const int32_t* chunk_list, const void* B, const void* scales, const void* zeros, float* out,
                          int N, int K, int group, void* g, int act, const MoERouting& rt) {
  const bool fused = fuses_act(c, chunks, slots, MT, N, K, act);
  const int splits = fused ? 1 : moe_splits(c, slots, MT, N, K);
  const MoEGated gt{(half*)g, fused ? act : -1};
  // A fused down's CTAs keep their gate/up operands in shared memory where
  // those fit (FusedStage; not with LLMQ_MOE_FUSED_STAGE=0: the kernel
  // stages only into the dynamic shared memory the launch gives it).
  const size_t smem = DOWN && fused && c->moe_fused_stage ? fused_stage_bytes(K, group_shift(group, K)) : 0;
  if (allow_smem(c, w4a16_gemv_grouped<MT, U, ROUTED, DOWN>, smem)) return 1;
  CK(launch(c, (w4a16_gemv_grouped<MT, U, ROUTED, DOWN>), dim3(N / 64, chunks, splits), kWarps * 32, smem, (const half*)A,
            a_div, order, chunk_list, (const uint4*)B, (const uint4*)scales, (const uint32_t*)zeros, out, N, K,
            group_shift(group, K), splits, rt, gt));
  CK_LAUNCH("w4a16_gemv_grouped");
  if (act >= 0 && !fused) return moe_act(c, out, g, slots, N / 2, act, 1);
  return 0;
}

int moe_gemv_w4(llmq_ctx* c, const void* A, int a_div, const int32_t* order, const int32_t* chunks, int max_chunks, int mt,
                int slots, const void* B, const void* scales, const void* zeros, float* out, int N, int K, int group,
                void* g, int act) {
  if (check_grouped(c, "moe_gemv", N, K, group)) return 1;
  const MoERouting none{};
  if (mt == 1)
    return grouped_launch<1, 4, false>(c, max_chunks, slots, A, a_div, order, chunks, B, scales, zeros, out, N, K, group, g,
                                       act, none);
  if (mt == 4)
    return grouped_launch<4, 2, false>(c, max_chunks, slots, A, a_div, order, chunks, B, scales, zeros, out, N, K, group, g,
                                       act, none);
  set_error(c, "moe_gemv: %d slots a chunk (the kernel runs 1 or 4)", mt);
  return 1;
}

int moe_gemv_routed(llmq_ctx* c, const void* A, const float* logits, int T, int E, int k, int norm, int32_t* ids,
                    float* weights, int32_t* order, int32_t* chunks, const void* B, const void* scales, const void* zeros,
                    float* out, int N, int K, int group, void* g, int act, const void* nB, const void* nS,
                    const void* nZ, int nN, int nK, int ngroup, float* nout) {
  if (T < 1 || T > kMaxRoutedRows || k < 1 || k > E || k > kMaxTopK || E > kMaxExperts || T * k > kMaxRoutedSlots) {
    set_error(c, "moe_gemv_routed: %d rows of %d experts, top %d (want 1–%d rows, top ≤ experts ≤ %d, top ≤ %d, "
                 "rows·top ≤ %d)", T, E, k, kMaxRoutedRows, kMaxExperts, kMaxTopK, kMaxRoutedSlots);
    return 1;
  }
  if (check_grouped(c, "moe_gemv_routed", N, K, group) || check_gated(c, "moe_gemv_routed", g, act)) return 1;
  if (!nB != !nS || !nB != !nZ || (nout && !nB)) {
    set_error(c, "moe_gemv_routed: the next layer's codes, scales and zeros: all three or none (and all three with its output)");
    return 1;
  }
  if (nB && check_grouped(c, "moe_gemv_routed's next layer", nN, nK, ngroup)) return 1;
  const int S = T * k;
  if (nout && (act < 0 || nK != N / 2)) {  // the next layer reads g, act(gate)·up
    set_error(c, "moe_gemv_routed: a next layer of %d inputs run with its output: want gated experts (act %d) of %d "
                 "outputs, their act(gate)·up's %d", nK, act, N, N / 2);
    return 1;
  }
  // API 28: the next layer (down) over the plan, into nout (the whole MLP):
  // in this launch where its CTAs hold whole groups of it (MoEDown), else
  // by its own launch after.
  auto next_layer = [&]() {
    return nout ? moe_gemv_w4(c, g, 1, order, chunks, S, 1, S, nB, nS, nZ, nout, nN, nK, ngroup, nullptr, -1) : 0;
  };
  if (!c->moe_routed) {  // LLMQ_MOE_ROUTED=0: the same results in two launches (the A/B's baseline)
    if (moe_route_plan(c, logits, ids, weights, T, E, k, norm, 1, order, chunks, S) ||
        moe_gemv_w4(c, A, k, order, chunks, S, 1, S, B, scales, zeros, out, N, K, group, g, act))
      return 1;
    return next_layer();
  }
  // Fused where this launch writes g itself (fuses_act: one K split), each
  // CTA's pair of steps lies in one group of the next layer, nout can take
  // 16-byte reductions and both layers' zeros 16-byte copies (stage_down,
  // FusedStage).
  const bool fuse_down = nout && c->moe_fused_down && fuses_act(c, S, S, 1, N, K, act) &&
                         (ngroup >= 32 || ngroup == nK) &&
                         (((uintptr_t)nout | (uintptr_t)nZ | (uintptr_t)zeros) & 15) == 0;
  MoEPrefetch next{};  // c->moe_prefetch is 0–2: ctx_create refuses others
  if (nB && c->moe_prefetch && !fuse_down) {
    const uint32_t G = nK / ngroup;  // an expert's groups: G·N/64 tiles of 8 uint4 scales and 8 words of zeros
    next = MoEPrefetch{(const char*)nB, (const char*)nS, (const char*)nZ, (uint32_t)nN * nK / 2, G * nN * 2, G * nN / 2,
                       c->moe_prefetch};
  }
  MoEDown down{};
  if (fuse_down)
    down = MoEDown{(const uint4*)nB, (const uint4*)nS, (const uint32_t*)nZ, nout, nN, nK, group_shift(ngroup, nK)};
  const MoERouting rt{logits, T, E, k, norm, ids, weights, order, chunks, next, down};
  if (fuse_down)
    return grouped_launch<1, 4, true, true>(c, S, S, A, k, nullptr, nullptr, B, scales, zeros, out, N, K, group, g, act, rt);
  if (grouped_launch<1, 4, true>(c, S, S, A, k, nullptr, nullptr, B, scales, zeros, out, N, K, group, g, act, rt)) return 1;
  return next_layer();
}

int w4a16_plan(llmq_ctx* c, int M, int N, int K, int group, int bits, char* out, int n) {
  if (check_shape(c, M, N, K, group) || check_bits(c, bits)) return 1;
  Plan p;
  if (plan(c, p, M, N, K, group, bits, true)) return 1;
  // A variant's L2 prefetch distance in batches, as " pf4" (none: empty).
  char pf[16] = "";
  if (int d = p.path == 5 ? kSwap[p.variant].pf : p.path == 4 ? kMma[p.variant].pf : 0) snprintf(pf, sizeof pf, " pf%d", d);
  if (p.path == 2)
    snprintf(out, n, "dequant%s+cublas", bits == 8 ? " w8" : "");
  else if (p.path == 5)
    snprintf(out, n, "gemv-swap v15%s mt%d u%d%s%s b%d splits%d", bits == 8 ? " w8" : "", kSwap[p.variant].mt,
             kSwap[p.variant].u, kSwap[p.variant].scaled ? " scaled" : "", pf, kSwap[p.variant].minb, p.splits);
  else if (p.path == 4)
    snprintf(out, n, "gemv-mma v11%s mt%d u%d%s splits%d", bits == 8 ? " w8" : "", kMma[p.variant].mt,
             kMma[p.variant].u, pf, p.splits);
  else if (p.path == 3)
    snprintf(out, n, "gemv%s mt%d u%d b%d splits%d", bits == 8 ? " w8" : "", kGemv[p.variant].mt, kGemv[p.variant].u,
             kGemv[p.variant].minb, p.splits);
  else {
    const Variant v = kVariants[p.variant];
    char nw[16] = "";  // warps a CTA where not kWarps
    if (v.nw != kWarps) snprintf(nw, sizeof nw, " nw%d", v.nw);
    if (v.wg > 0)
      snprintf(out, n, "fused v%d wgmma%s%s n%d t%d wg%d u%d s%d splits%d", wgmma_version(v), v.rs ? "-rs" : "",
               bits == 8 ? " w8" : "", 16 * v.mb, v.nw, v.wg, v.u, v.stages, p.splits);
    else
      snprintf(out, n, "fused v18%s mb%d u%d s%d%s splits%d", bits == 8 ? " w8" : "", v.mb, v.u, v.stages, nw,
               p.splits);
  }
  return 0;
}

}  // namespace llmq

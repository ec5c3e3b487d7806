// WNA16 GEMM on Tensor Cores: C[M,N] = A[M,K] · dequant(B)[K,N], with B in
// 4-bit (2-, 3- and 4-bit checkpoints) or 8-bit codes, A and C fp16.
//
// Small M (decoding: M ≤ 32), the "swapped" kernel. The weights are the
// bytes that matter, so the kernel is built to stream them at the memory's
// rate with as few instructions per byte as possible:
//  - Operand swap: a 16-column tile of the weights is the 16×16 A operand
//    of mma.m16n8k16 and up to 8 tokens are its n = 8 operand, so the
//    Tensor Core's 16 rows are weights, not padding (the first kernel put
//    the tokens on the 16-row side: at M = 1, 15 of 16 rows were empty and
//    the mma count per byte of B was twice this one's).
//  - A CTA of 8 warps owns 8 column tiles (128 columns) and walks a range
//    of K in 64-row chunks, all warps on the same chunk: each chunk's
//    activations are copied once for the CTA (at M = 16 a warp of its own
//    would read twice as many bytes of A as of weights). Codes, scales,
//    zeros and activations stream with cp.async through a ring of DEPTH
//    chunks in shared memory, so the bytes in flight cost no registers.
//  - The rows of a chunk are permuted (pack.GPURow) so that a lane's
//    activations for the chunk are two contiguous 16-byte runs of A's row.
//  - Dequantization by the magic-number trick: a nibble OR-ed into the
//    mantissa of 1024.0 (0x6400) is the fp16 value 1024 + q, an odd nibble
//    OR-ed into 64.0 (0x5400, ulp 1/16) is 64 + q, a byte into 1024.0 is
//    1024 + q; one subtraction of (base + zero) gives q − z exactly.
//  - Scales are applied once per group, after the mma: the Tensor Core
//    accumulates Σ (q − z)·x of a group in fp32 (exact products), and each
//    lane multiplies its partial sums by its two columns' scales at the
//    group's end. Per 8 codes a lane spends 2 shifts/masks and 2 fp16
//    subtractions, nothing else.
// When the column tiles alone cannot fill the GPU, K is also split across
// CTAs (gridDim.y); the CTAs of one column range form a thread block
// cluster and add their sums through distributed shared memory, so C is
// written once, with no workspace and no atomics (Hopper; elsewhere K is
// not split).
//
// Large M (compute-bound), groups of 16, or other group sizes: B is
// dequantized once to fp16 and multiplied by cuBLAS.
#include <cooperative_groups.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <stdio.h>
#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

// Warps per CTA, one 16-column tile each; equal to pack.GPUTileGroup, the
// tiles the layout interleaves chunk by chunk.
constexpr int kWarps = 8;
constexpr int kMaxSmallM = 32;

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));  // (a & b) | c
  return d;
}

__device__ __forceinline__ uint32_t hsub2u(uint32_t a, uint32_t b) {
  half2 r = __hsub2(*reinterpret_cast<half2*>(&a), *reinterpret_cast<half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t hmul2u(uint32_t a, uint32_t b) {
  half2 r = __hmul2(*reinterpret_cast<half2*>(&a), *reinterpret_cast<half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// tile_chunk is pack.GPUTileChunk: chunk c of column tile ct sits at this
// index (in units of one tile's chunk) — tiles in groups of kWarps (a
// CTA's columns), each group chunk by chunk, so a CTA's chunk is one
// contiguous block.
__device__ __forceinline__ size_t tile_chunk(int ct, int c, int CT, int KC) {
  const int grp = ct / kWarps, i = ct % kWarps, width = min(kWarps, CT - grp * kWarps);
  return (size_t)grp * kWarps * KC + (size_t)c * width + i;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Zero points of a lane's two columns c and c+8 as the half2 values
// subtracted from the magic-number codes: 4-bit, lo = 1024 + z_c (even
// nibbles, registers a0/a2) and hi = 64 + z_{c+8} (odd nibbles, a1/a3);
// 8-bit, 1024 + z for both.
struct Zeros {
  uint32_t lo, hi;
};

template <int BITS>
__device__ __forceinline__ Zeros zeros_of(uint32_t z) {
  uint32_t lo, hi;
  if constexpr (BITS == 4) {
    lo = 0x6400u | (z & 0xfu);
    hi = 0x5400u | (z & 0xf0u);
  } else {
    lo = 0x6400u | (z & 0xffu);
    hi = 0x6400u | ((z >> 8) & 0xffu);
  }
  return {lo | (lo << 16), hi | (hi << 16)};
}

// fragment: the mma A registers (q − z, fp16) of step s of a lane's chunk.
template <int BITS>
__device__ __forceinline__ void fragment(uint32_t (&a)[4], const uint4 (&w)[BITS / 4], int s, Zeros z) {
  if constexpr (BITS == 4) {
    const uint32_t q = word_of(w[0], s), q8 = q >> 8;
    a[0] = hsub2u(lop3_and_or(q, 0x000f000fu, 0x64006400u), z.lo);
    a[1] = hsub2u(lop3_and_or(q, 0x00f000f0u, 0x54005400u), z.hi);
    a[2] = hsub2u(lop3_and_or(q8, 0x000f000fu, 0x64006400u), z.lo);
    a[3] = hsub2u(lop3_and_or(q8, 0x00f000f0u, 0x54005400u), z.hi);
  } else {
    const uint32_t w0 = word_of(w[(2 * s) >> 2], (2 * s) & 3), w1 = word_of(w[(2 * s + 1) >> 2], (2 * s + 1) & 3);
    a[0] = hsub2u(lop3_and_or(w0, 0x00ff00ffu, 0x64006400u), z.lo);
    a[1] = hsub2u(lop3_and_or(w0 >> 8, 0x00ff00ffu, 0x64006400u), z.hi);
    a[2] = hsub2u(lop3_and_or(w1, 0x00ff00ffu, 0x64006400u), z.lo);
    a[3] = hsub2u(lop3_and_or(w1 >> 8, 0x00ff00ffu, 0x64006400u), z.hi);
  }
}

// Stage is one 64-row chunk in the CTA's shared-memory ring: each warp's
// codes for its column tile (lane-contiguous 16-byte words), each warp's
// scale and zero words for the chunk's two halves (copied by the lanes
// with t = 0, one per column pair g), and the chunk's activations, 16
// bytes (8 columns of A) per (half, row, t) so that the lanes of a warp
// read 8 consecutive 16-byte units at a time (no bank conflicts).
template <int BITS, int NT>
struct Stage {
  uint4 w[kWarps][BITS / 4][32];
  uint32_t sz[kWarps][8][4];  // s (half 0), z word (half 0), s (half 1), z word (half 1)
  uint4 a[2][NT * 8][4];
};

template <int BITS, int NT, int DEPTH>
constexpr size_t ring_bytes() {
  return (size_t)DEPTH * sizeof(Stage<BITS, NT>);
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(a), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem));
}

// wna16_small: a CTA of kWarps warps owns kWarps column tiles (16 columns
// each, one per warp) and the blockIdx.y-th of `splits` slices of K's
// chunks; all its warps walk the same chunks, so each chunk of A is
// copied once for the CTA. Chunks stream through a DEPTH-stage cp.async
// ring (one barrier per chunk). NT token tiles of 8 cover M ≤ 8·NT. A
// group spans 2^gshift rows (gshift ≥ 30: one group). With splits > 1 the
// CTAs of a column range form a thread block cluster and add their sums
// through distributed shared memory (Hopper); C is written once.
template <int BITS, int NT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32, 2) wna16_small(const half* __restrict__ A, const uint4* __restrict__ B,
                                                              const uint32_t* __restrict__ S,
                                                              const uint8_t* __restrict__ Z, half* __restrict__ C,
                                                              int M, int N, int K, int gshift, int splits) {
  constexpr int WV = BITS / 4;  // 16-byte words per lane per chunk
  constexpr int TM = NT * 8;    // token rows of the tile
  extern __shared__ __align__(16) unsigned char smem[];
  Stage<BITS, NT>* ring = reinterpret_cast<Stage<BITS, NT>*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int CT = N >> 4, KC = (K + 63) >> 6;
  const int ct = blockIdx.x * kWarps + warp;
  const bool active = ct < CT;
  const int rows = min(M, TM);
  const int per_split = (KC + splits - 1) / splits;
  const int cs0 = blockIdx.y * per_split;
  const int n = max(0, min(KC, cs0 + per_split) - cs0);
  const int gmask = (1 << gshift) - 1;

  // This warp's tile: chunk c at Bp + c·width·32·WV (see tile_chunk).
  const int width = min(kWarps, CT - (int)blockIdx.x * kWarps);
  const uint4* Bp = B + ((size_t)blockIdx.x * kWarps * KC + warp) * 32 * WV + lane;
  const size_t zrow = (size_t)CT * 8;  // entries per group in S and Z
  const size_t e0 = (size_t)(active ? ct : 0) * 8 + g;
  // A lane's zero entry is WV bytes at e·WV; it is copied as the aligned
  // word holding it and shifted down by zsh.
  const int zsh = 8 * ((g * WV) & 3);
  auto zword = [&](int grp) { return reinterpret_cast<const uint32_t*>(Z + (((e0 + grp * zrow) * WV) & ~(size_t)3)); };
  auto issue = [&](int st, int c) {
    Stage<BITS, NT>& S_ = ring[st];
    if (active) {
#pragma unroll
      for (int i = 0; i < WV; ++i) cp_async16(&S_.w[warp][i][lane], Bp + ((size_t)c * width * WV + i) * 32);
      if (t == 0) {
        const int g0 = (c << 6) >> gshift, g1 = ((c << 6) + 32) >> gshift;
        cp_async4(&S_.sz[warp][g][0], S + e0 + g0 * zrow);
        cp_async4(&S_.sz[warp][g][1], zword(g0));
        if (g1 != g0) {
          cp_async4(&S_.sz[warp][g][2], S + e0 + g1 * zrow);
          cp_async4(&S_.sz[warp][g][3], zword(g1));
        }
      }
    }
    for (int e = threadIdx.x; e < rows * 8; e += kWarps * 32) {
      const int row = e >> 3, h = (e >> 2) & 1, tt = e & 3;
      const int k = (c << 6) + 32 * h + 8 * tt;
      cp_async16_zfill(&S_.a[h][row][tt], A + (size_t)row * K + (k < K ? k : 0), k < K);
    }
  };

  float acc[NT][4], part[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = part[nt][e] = 0.f;

  // One cp.async group per chunk (empty past the range): waiting for all
  // but the newest DEPTH − 2 means chunk i is in, and the barrier makes
  // every thread's copies visible and frees the stage chunk i + DEPTH − 1
  // goes to (chunk i − 1's, computed before the barrier).
#pragma unroll
  for (int j = 0; j < DEPTH - 1; ++j) {
    if (j < n) issue(j, cs0 + j);
    cp_async_commit();
  }
  int rd = 0, wr = DEPTH - 1;
  for (int i = 0; i < n; ++i) {
    cp_async_wait<DEPTH - 2>();
    __syncthreads();
    if (i + DEPTH - 1 < n) issue(wr, cs0 + i + DEPTH - 1);
    cp_async_commit();
    wr = wr == DEPTH - 1 ? 0 : wr + 1;
    const Stage<BITS, NT>& st = ring[rd];
    rd = rd == DEPTH - 1 ? 0 : rd + 1;
    if (!active) continue;
    const int c = cs0 + i;
    uint4 w[WV];
#pragma unroll
    for (int v = 0; v < WV; ++v) w[v] = st.w[warp][v][lane];
    uint4 a_cur[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        a_cur[nt][h] = nt * 8 + g < rows ? st.a[h][nt * 8 + g][t] : make_uint4(0, 0, 0, 0);
    const uint4 sz = *reinterpret_cast<const uint4*>(st.sz[warp][g]);
    const bool two = (((c << 6) >> gshift) != (((c << 6) + 32) >> gshift));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t s_h = h && two ? sz.z : sz.x, z_h = h && two ? sz.w : sz.y;
      const Zeros z = zeros_of<BITS>(z_h >> zsh);
#pragma unroll
      for (int s = 2 * h; s < 2 * h + 2; ++s) {
        uint32_t a[4];
        fragment<BITS>(a, w, s, z);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 v = a_cur[nt][h];
          mma16816(part[nt], a, (s & 1) ? v.z : v.x, (s & 1) ? v.w : v.y);
        }
      }
      // A group ends here, or the range does: scale and add.
      if ((((c << 6) + 32 * (h + 1)) & gmask) == 0 || (h == 1 && i == n - 1)) {
        const float2 sc = __half22float2(*reinterpret_cast<const half2*>(&s_h));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          acc[nt][0] += sc.x * part[nt][0];
          acc[nt][1] += sc.x * part[nt][1];
          acc[nt][2] += sc.y * part[nt][2];
          acc[nt][3] += sc.y * part[nt][3];
#pragma unroll
          for (int e = 0; e < 4; ++e) part[nt][e] = 0.f;
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is reused for the sums below

  // Lane (g, t) holds columns g and g+8 of its warp's tile for tokens 2t
  // and 2t+1 of each token tile: into red[column][token] (padded rows).
  float* red = reinterpret_cast<float*>(smem);
  constexpr int RP = TM + 1;
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c0 = warp * 16 + g, r0 = nt * 8 + 2 * t;
      red[c0 * RP + r0] = acc[nt][0];
      red[c0 * RP + r0 + 1] = acc[nt][1];
      red[(c0 + 8) * RP + r0] = acc[nt][2];
      red[(c0 + 8) * RP + r0 + 1] = acc[nt][3];
    }
  }
  const int col0 = blockIdx.x * kWarps * 16, cols = min(kWarps * 16, N - col0);
  if (splits == 1) {
    __syncthreads();
    for (int e = threadIdx.x; e < rows * cols; e += kWarps * 32) {
      const int r = e / cols, col = e - r * cols;
      C[(size_t)r * N + col0 + col] = __float2half_rn(red[col * RP + r]);
    }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The cluster's CTAs (one per K slice) each add up a share of the
  // tile from every CTA's shared memory.
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();
  const int rank = (int)cl.block_rank();
  for (int e = threadIdx.x + rank * kWarps * 32; e < rows * cols; e += kWarps * 32 * splits) {
    const int r = e / cols, col = e - r * cols;
    float v = 0.f;
    for (int q = 0; q < splits; ++q) v += cl.map_shared_rank(red, q)[col * RP + r];
    C[(size_t)r * N + col0 + col] = __float2half_rn(v);
  }
  cl.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

// dequant_kernel writes W[K][N] fp16 from the layout: a CTA's 4 warps take
// 4 column tiles of one chunk, dequantize with the same fp16 arithmetic as
// pack.GPUWeights.Dequantize ((q − z)·s rounded once) into a shared 64×64
// tile, and store it as rows of 128 contiguous bytes.
template <int BITS>
__global__ void __launch_bounds__(128) dequant_kernel(const uint4* __restrict__ B, const uint32_t* __restrict__ S,
                                                      const uint8_t* __restrict__ Z, half* __restrict__ W, int N,
                                                      int K, int group) {
  constexpr int WV = BITS / 4;
  __shared__ __align__(16) half tile[64][64];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int CT = N >> 4, KC = (K + 63) >> 6;
  const int ct = blockIdx.x * 4 + warp, c = blockIdx.y;
  if (ct < CT) {
    uint4 w[WV];
#pragma unroll
    for (int i = 0; i < WV; ++i) w[i] = __ldg(B + (tile_chunk(ct, c, CT, KC) * WV + i) * 32 + lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // A lane's 8 rows of a half lie in one group (groups are multiples of 16).
      const int grp = group >= K ? 0 : ((c << 6) + 32 * h + 8 * t) / group;
      const size_t e = ((size_t)grp * CT + ct) * 8 + g;
      const uint32_t sp = S[e];
      const uint32_t zv = WV == 1 ? Z[e] : reinterpret_cast<const unsigned short*>(Z)[e];
      const Zeros z = zeros_of<BITS>(zv);
      const uint32_t s_lo = (sp & 0xffffu) | (sp << 16), s_hi = (sp >> 16) | (sp & 0xffff0000u);
#pragma unroll
      for (int s = 2 * h; s < 2 * h + 2; ++s) {
        uint32_t a[4];
        fragment<BITS>(a, w, s, z);
        const int k0 = 32 * h + 8 * t + 4 * (s & 1);  // pack.GPURow(s, t, 0)
        const uint32_t v[4] = {hmul2u(a[0], s_lo), hmul2u(a[1], s_hi), hmul2u(a[2], s_lo), hmul2u(a[3], s_hi)};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int col = warp * 16 + g + 8 * (r & 1), k = k0 + 2 * (r >> 1);
          tile[k][col] = __ushort_as_half((unsigned short)(v[r] & 0xffffu));
          tile[k + 1][col] = __ushort_as_half((unsigned short)(v[r] >> 16));
        }
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int piece = threadIdx.x + 128 * i, row = piece >> 3, c8 = (piece & 7) * 8;
    const int k = (c << 6) + row, col = blockIdx.x * 64 + c8;
    if (k < K && col < N) *reinterpret_cast<uint4*>(&W[(size_t)k * N + col]) = *reinterpret_cast<const uint4*>(&tile[row][c8]);
  }
}

__global__ void gather_cols(const half* __restrict__ A, const int32_t* __restrict__ perm, half* __restrict__ out, int M,
                            int K) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)M * K) return;
  const size_t m = i / K;
  out[i] = A[m * K + perm[i % K]];
}

int check_shape(llmq_ctx* c, int M, int N, int K, int group, int bits) {
  if (M < 1 || N < 16 || N % 16 || K < 16 || K % 16 || (bits != 4 && bits != 8) ||
      (group < K && (group < 16 || group % 16 || K % group))) {
    llmq::set_error(c,
                    "unsupported WNA16 shape M=%d N=%d K=%d group=%d bits=%d (need N %% 16 == 0, K %% 16 == 0, bits 4 "
                    "or 8, a group that is a multiple of 16 dividing K)",
                    M, N, K, group, bits);
    return 1;
  }
  return 0;
}

// Plan is what one call runs: the swapped kernel's instantiation and its
// K splits, or dequantize + cuBLAS.
struct Plan {
  int path;  // 1 swapped kernel, 2 dequantize + cuBLAS
  int nt, depth, splits, gshift;
};

// small_ok: the swapped kernel handles groups that are powers of two of at
// least 32 rows (a group of 32 is a half chunk) or one group per column.
bool small_ok(int M, int K, int group) {
  return M <= kMaxSmallM && (group >= K || (group >= 32 && (group & (group - 1)) == 0));
}

// Instantiations: (bits, token tiles) → ring depth, for ≈ 48 KB of ring a
// CTA (two CTAs an SM keep ≈ 2·(depth − 1) chunks of codes in flight).
template <int BITS, int NT>
struct Tune {
  static constexpr int depth = BITS == 4 ? (NT == 1 ? 8 : NT == 2 ? 7 : 5) : (NT == 4 ? 4 : 5);
};

template <int BITS, int NT>
int resident_of(llmq_ctx* c, int variant) {
  constexpr int D = Tune<BITS, NT>::depth;
  constexpr size_t smem = ring_bytes<BITS, NT, D>();
  int& r = c->resident[variant];
  if (!r) {
    CK(cudaFuncSetAttribute(wna16_small<BITS, NT, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, wna16_small<BITS, NT, D>, kWarps * 32, smem));
  }
  return 0;
}

// plan_small picks the token tiles, ring depth and K splits: enough CTAs
// to fill the resident slots once, each CTA walking at least one ring's
// worth of chunks; splits form a cluster, at most 8 (the portable cluster
// size), and only on Hopper.
int plan_small(llmq_ctx* c, Plan& p, int M, int N, int K, int group, int bits) {
  p.path = 1;
  p.nt = M <= 8 ? 1 : M <= 16 ? 2 : 4;
  const int variant = (bits == 8 ? 3 : 0) + (p.nt == 1 ? 0 : p.nt == 2 ? 1 : 2);
  int rc = 0;
  switch (variant) {
    case 0: rc = resident_of<4, 1>(c, variant), p.depth = Tune<4, 1>::depth; break;
    case 1: rc = resident_of<4, 2>(c, variant), p.depth = Tune<4, 2>::depth; break;
    case 2: rc = resident_of<4, 4>(c, variant), p.depth = Tune<4, 4>::depth; break;
    case 3: rc = resident_of<8, 1>(c, variant), p.depth = Tune<8, 1>::depth; break;
    case 4: rc = resident_of<8, 2>(c, variant), p.depth = Tune<8, 2>::depth; break;
    default: rc = resident_of<8, 4>(c, variant), p.depth = Tune<8, 4>::depth; break;
  }
  if (rc) return rc;
  const int ctas = (N / 16 + kWarps - 1) / kWarps, KC = (K + 63) / 64;
  int splits = max(1, c->sms * max(c->resident[variant], 1) / ctas);
  splits = min(min(splits, 8), max(1, KC / p.depth));
  if (c->w4_splits > 0) splits = min(min(c->w4_splits, 8), KC);
  if (c->cc_major < 9) splits = 1;
  p.splits = splits;
  p.gshift = 30;  // one group
  if (group < K) {
    p.gshift = 0;
    while ((1 << p.gshift) < group) ++p.gshift;
  }
  return 0;
}

int plan(llmq_ctx* c, Plan& p, int M, int N, int K, int group, int bits, bool have_scratch) {
  const bool ok = small_ok(M, K, group);
  p = Plan{};
  p.path = c->w4_path ? c->w4_path : (ok && M <= c->fused_max_m) || !have_scratch ? 1 : 2;
  if (p.path == 2) return 0;
  if (!ok) {
    llmq::set_error(c,
                    "the WNA16 kernel runs M ≤ %d and groups that are powers of two ≥ 32 or one per column (M=%d "
                    "group=%d); larger M and other groups need the K·N fp16 scratch of the dequantize+cuBLAS path",
                    kMaxSmallM, M, group);
    return 1;
  }
  return plan_small(c, p, M, N, K, group, bits);
}

template <int BITS, int NT>
int launch_small(llmq_ctx* c, const Plan& p, const half* A, const void* B, const void* S, const void* Z, half* C, int M,
                 int N, int K) {
  constexpr int D = Tune<BITS, NT>::depth;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((N / 16 + kWarps - 1) / kWarps, p.splits);
  cfg.blockDim = dim3(kWarps * 32);
  cfg.dynamicSmemBytes = ring_bytes<BITS, NT, D>();
  cfg.stream = c->stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = 1;
  cluster[0].val.clusterDim.y = p.splits;
  cluster[0].val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = p.splits > 1 ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, wna16_small<BITS, NT, D>, A, (const uint4*)B, (const uint32_t*)S, (const uint8_t*)Z, C, M, N,
                        K, p.gshift, p.splits));
  return 0;
}

}  // namespace

namespace llmq {

size_t w4a16_workspace_bytes(int M, int N) {
  return (size_t)M * N * sizeof(float) + (size_t)((N + 15) / 16) * sizeof(int);
}

int w4a16_set_path(llmq_ctx* c, int path) {
  c->w4_path = path;
  return 0;
}

int w4_dequant(llmq_ctx* c, const void* B, const void* S, const void* Z, void* W, int N, int K, int group, int bits) {
  if (check_shape(c, 1, N, K, group, bits)) return 1;
  const dim3 grid((N / 16 + 3) / 4, (K + 63) / 64);
  if (bits == 4)
    dequant_kernel<4><<<grid, 128, 0, c->stream>>>((const uint4*)B, (const uint32_t*)S, (const uint8_t*)Z, (half*)W, N,
                                                   K, group);
  else
    dequant_kernel<8><<<grid, 128, 0, c->stream>>>((const uint4*)B, (const uint32_t*)S, (const uint8_t*)Z, (half*)W, N,
                                                   K, group);
  CK_LAUNCH("dequant_kernel");
  return 0;
}

int gemm_f16(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K) {
  const float alpha = 1.f, beta = 0.f;
  // Row-major C = A·W is column-major Cᵀ = Wᵀ·Aᵀ.
  cublasStatus_t s = cublasGemmEx(c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, W, CUDA_R_16F, N, A, CUDA_R_16F,
                                  K, &beta, C, CUDA_R_16F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    set_error(c, "cublasGemmEx failed: status %d (M=%d N=%d K=%d)", (int)s, M, N, K);
    return 1;
  }
  return 0;
}

int w4a16_plan(llmq_ctx* c, int M, int N, int K, int group, int bits, char* out, int n) {
  if (check_shape(c, M, N, K, group, bits)) return 1;
  Plan p;
  if (plan(c, p, M, N, K, group, bits, true)) return 1;
  if (p.path == 2)
    snprintf(out, n, "dequant+cublas");
  else
    snprintf(out, n, "swap-mma w%d nt%d depth%d splits%d", bits, p.nt, p.depth, p.splits);
  return 0;
}

int w4a16_gemm(llmq_ctx* c, const void* A, const void* B, const void* scales, const void* zeros, const int32_t* perm,
               void* a_perm, void* C, void* workspace, void* scratch, int M, int N, int K, int group, int bits) {
  if (check_shape(c, M, N, K, group, bits)) return 1;
  const half* a = (const half*)A;
  if (perm) {
    if (!a_perm) {
      set_error(c, "act-order weights need an a_perm scratch of M·K fp16");
      return 1;
    }
    const size_t n = (size_t)M * K;
    gather_cols<<<(unsigned)((n + 255) / 256), 256, 0, c->stream>>>(a, perm, (half*)a_perm, M, K);
    CK_LAUNCH("gather_cols");
    a = (const half*)a_perm;
  }
  Plan p;
  if (plan(c, p, M, N, K, group, bits, scratch != nullptr)) return 1;
  if (p.path == 2) {
    if (!scratch) {
      set_error(c, "the dequantize+cuBLAS path needs a K·N fp16 scratch");
      return 1;
    }
    if (w4_dequant(c, B, scales, zeros, scratch, N, K, group, bits)) return 1;
    return gemm_f16(c, a, scratch, C, M, N, K);
  }
  half* out = (half*)C;
  if (bits == 4) {
    if (p.nt == 1) return launch_small<4, 1>(c, p, a, B, scales, zeros, out, M, N, K);
    if (p.nt == 2) return launch_small<4, 2>(c, p, a, B, scales, zeros, out, M, N, K);
    return launch_small<4, 4>(c, p, a, B, scales, zeros, out, M, N, K);
  }
  if (p.nt == 1) return launch_small<8, 1>(c, p, a, B, scales, zeros, out, M, N, K);
  if (p.nt == 2) return launch_small<8, 2>(c, p, a, B, scales, zeros, out, M, N, K);
  return launch_small<8, 4>(c, p, a, B, scales, zeros, out, M, N, K);
}

}  // namespace llmq

// Causal self-attention over windows of consecutive rows (prefill and
// calibration), in the manner of FlashAttention-2 (Dao 2023): a block
// takes 64 query rows of one head (16 a warp) and walks the keys up to its
// last row 64 at a time; Q·Kᵀ and P·V are mma.sync m16n8k16 products
// (fp16 in, fp32 accumulation), the softmax is kept online (running max m
// and sum l per row, the output rescaled when m grows), and K and V tiles
// are staged in shared memory once for the block's four warps. Nothing of
// size T² is written: the score tile lives in registers, and its C
// fragment is, register for register, the A fragment of the P·V product.
//
// Rows are windows of T consecutive positions: row w·T + p is position p
// of window w, attending to positions 0..p of the same window, with q
// [rows][heads·hd], k and v [rows][kv_heads·hd] (RoPE applied) and out
// [rows][heads·hd], all fp16.
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include "common.cuh"

namespace llmq {
namespace {

constexpr int kTile = 64;  // query rows per block, keys per step

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_floats(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack_halves(half lo, half hi) {
  __half2 h = __halves2half2(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Lane l of a warp is thread (g, t) = (l/4, l%4) of the mma fragments: it
// holds rows g and g+8 of the warp's 16, and columns 2t, 2t+1 (and +8).
template <int HD>
__global__ void __launch_bounds__(128) attention_causal_kernel(const half* __restrict__ q, const half* __restrict__ k,
                                                               const half* __restrict__ v, half* __restrict__ out, int T,
                                                               int heads, int kv_heads, float scale_log2, int window) {
  constexpr int kPad = HD + 8;  // a padded shared row: lanes of a quad hit different banks
  __shared__ __align__(16) half Ks[kTile * kPad];
  __shared__ __align__(16) half Vs[kTile * kPad];
  const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kvh = h / (heads / kv_heads), qd = heads * HD, kvd = kv_heads * HD;
  const size_t row0 = (size_t)blockIdx.z * T;  // the window's first row
  const int q0 = blockIdx.x * kTile + warp * 16;   // the warp's first query position
  const bool active = q0 < T;

  // Q as A fragments, one per 16 dimensions: R0 row g, R1 row g+8, R2 and
  // R3 the same rows 8 dimensions on.
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int ks = 0; ks < HD / 16; ks++) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int p = q0 + g + 8 * r;
      uint32_t lo = 0, hi = 0;
      if (p < T) {
        const half* qr = q + (row0 + p) * qd + h * HD + ks * 16 + 2 * t;
        lo = *reinterpret_cast<const uint32_t*>(qr);
        hi = *reinterpret_cast<const uint32_t*>(qr + 8);
      }
      qf[ks][r] = lo;
      qf[ks][2 + r] = hi;
    }
  }
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const int last = min(T - 1, (int)blockIdx.x * kTile + kTile - 1);  // the block's last query position
  // A sliding window W: the block's first row sees keys from its position
  // − W + 1 on, so whole tiles before that are skipped.
  const int first = window > 0 ? max(0, (int)blockIdx.x * kTile - window + 1) / kTile * kTile : 0;
  for (int k0 = first; k0 <= last; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous tiles
    for (int i = threadIdx.x; i < kTile * HD / 8; i += blockDim.x) {
      const int r = i / (HD / 8), c8 = (i % (HD / 8)) * 8, p = k0 + r;
      uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
      if (p < T) {
        kx = *reinterpret_cast<const uint4*>(k + (row0 + p) * kvd + kvh * HD + c8);
        vx = *reinterpret_cast<const uint4*>(v + (row0 + p) * kvd + kvh * HD + c8);
      }
      *reinterpret_cast<uint4*>(Ks + r * kPad + c8) = kx;
      *reinterpret_cast<uint4*>(Vs + r * kPad + c8) = vx;
    }
    __syncthreads();
    if (!active) continue;  // rows past the window's end (the warp still shares the barriers)

    // S = Q·Kᵀ for the warp's 16 rows and the tile's 64 keys: 8 n8 tiles;
    // B[dim][key] = K[key][dim], two consecutive dimensions a register.
    float s[kTile / 8][4];
#pragma unroll
    for (int j = 0; j < kTile / 8; j++) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < HD / 16; ks++) {
        const half* kr = Ks + (j * 8 + g) * kPad + ks * 16 + 2 * t;
        mma16816(s[j], qf[ks], *reinterpret_cast<const uint32_t*>(kr), *reinterpret_cast<const uint32_t*>(kr + 8));
      }
    }
    // Causal (and sliding-window) mask, scale (to base 2), and the rows'
    // new maxima; a quad's four lanes hold one row between them.
    float mnew[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < kTile / 8; j++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = k0 + j * 8 + 2 * t + (e & 1), qp = q0 + g + 8 * (e >> 1);
        const bool hidden = key > qp || (window > 0 && key <= qp - window);
        const float x = hidden ? -INFINITY : s[j][e] * scale_log2;
        s[j][e] = x;
        mnew[e >> 1] = fmaxf(mnew[e >> 1], x);
      }
    }
    float alpha[2], mu[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 1));
      mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 2));
      mu[r] = mnew[r] == -INFINITY ? 0.f : mnew[r];  // a row with no key yet: nothing to rescale
      alpha[r] = exp2f(m[r] - mu[r]);
      m[r] = mnew[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < kTile / 8; j++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        // P goes into the P·V product in fp16: round it here, so that the
        // normaliser l sums the same values.
        const float p = __half2float(__float2half_rn(exp2f(s[j][e] - mu[e >> 1])));
        s[j][e] = p;
        l[e >> 1] += p;
      }
    }
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    // O += P·V, 16 keys a step: the C fragments of score tiles 2kk and
    // 2kk+1 are the A fragment of P; B[key][dim] = V[key][dim].
#pragma unroll
    for (int kk = 0; kk < kTile / 16; kk++) {
      const uint32_t a[4] = {pack_floats(s[2 * kk][0], s[2 * kk][1]), pack_floats(s[2 * kk][2], s[2 * kk][3]),
                             pack_floats(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_floats(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < HD / 8; n++) {
        const half* vb = Vs + (kk * 16 + 2 * t) * kPad + n * 8 + g;
        mma16816(o[n], a, pack_halves(vb[0], vb[kPad]), pack_halves(vb[8 * kPad], vb[9 * kPad]));
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int qp = q0 + g + 8 * r;
    if (qp >= T) continue;
    const float inv = 1.f / l[r];
    half* orow = out + (row0 + qp) * qd + h * HD + 2 * t;
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
      *reinterpret_cast<__half2*>(orow + n * 8) = __floats2half2_rn(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }
}

template <int HD>
int launch_causal(llmq_ctx* c, const void* q, const void* k, const void* v, void* out, int windows, int T, int heads,
                  int kv_heads, int window, float scale) {
  const dim3 grid((T + kTile - 1) / kTile, heads, windows);
  const float scale_log2 = 1.4426950408889634f * (scale > 0 ? scale : 1.f / sqrtf((float)HD));
  attention_causal_kernel<HD><<<grid, 128, 0, c->stream>>>((const half*)q, (const half*)k, (const half*)v, (half*)out, T,
                                                           heads, kv_heads, scale_log2, window);
  CK_LAUNCH("attention_causal_kernel");
  return 0;
}

}  // namespace

int attention_causal(llmq_ctx* c, const void* q, const void* k, const void* v, void* out, int windows, int T, int heads,
                     int kv_heads, int hd, int window, float scale) {
  if (windows <= 0 || windows > 65535 || T <= 0 || heads <= 0 || heads > 65535 || kv_heads <= 0 || heads % kv_heads ||
      window < 0) {
    set_error(c, "attention_causal: %d windows of %d rows, heads %d, kv_heads %d, sliding window %d", windows, T, heads,
              kv_heads, window);
    return 1;
  }
  switch (hd) {
    case 32:
      return launch_causal<32>(c, q, k, v, out, windows, T, heads, kv_heads, window, scale);
    case 64:
      return launch_causal<64>(c, q, k, v, out, windows, T, heads, kv_heads, window, scale);
    case 128:
      return launch_causal<128>(c, q, k, v, out, windows, T, heads, kv_heads, window, scale);
  }
  set_error(c, "attention_causal: head_dim %d (the kernel takes 32, 64 and 128)", hd);
  return 1;
}

}  // namespace llmq

// Sampled next tokens on the GPU: llm.Sampler's pick, one block a row, so
// that a sampled decode step copies one id a sequence to the host instead
// of its 128k logits.
//
// The rule is the host's (llm/generate.go, Sample and walk): the tokens in
// descending order of logit (ties by id), cut to the TopK first and to the
// smallest prefix whose probability reaches TopP, walked until the share
// u·Σp of their mass is used up, p = exp(−(max − logit)/T). The host draws
// u from the request's seeded stream and passes it in, so from the same
// logits a seed gives the same text (up to the rounding of a sum: the host adds
// in index order, the block in a tree). As on the host, the vocabulary is
// not sorted: tokens fall in buckets of (max − logit)/T, eight to a nat,
// and only the first buckets — as many as hold the TopK tokens and the
// mass the walk can reach, and one more — are gathered (at most kCand of
// them) and sorted in shared memory, their weights summed by a parallel
// prefix scan, the cuts and the walk found as the first prefix past each
// bound. A row whose
// candidates do not fit, or whose walk would run past them, gets −1: the
// caller picks it on the host from its logits with the same u.
#include <cuda_fp16.h>

#include <climits>
#include <cmath>

#include "common.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kBuckets = 256;  // the last holds every token 32 nats or more below the most likely
constexpr int kPerNat = 8;
constexpr int kCand = 4096;  // candidates sorted in shared memory
constexpr int kPer = kCand / kThreads;  // candidates a thread in the prefix scan
static_assert(kCand % kThreads == 0, "the prefix scan takes kPer whole candidates a thread");
constexpr int kWarpsPerBlock = kThreads / 32;
// The dynamic shared memory: first each warp's bucket counts and masses
// (a histogram a warp: 1024 threads adding into one would wait on each
// other, most tokens falling in a few buckets), then, once those are
// merged, the candidates: their weights' prefix sums, logits and ids.
constexpr size_t kHistBytes = (size_t)kWarpsPerBlock * kBuckets * (sizeof(int) + sizeof(float));
constexpr size_t kCandBytes = (size_t)kCand * (sizeof(double) + sizeof(float) + sizeof(int));
constexpr size_t kSampleSmem = kHistBytes > kCandBytes ? kHistBytes : kCandBytes;

// bucket_of is the host's bucket of a token d = (max − logit)/T nats down
// (NaN: the last).
__device__ __forceinline__ int bucket_of(double d) { return d < kBuckets / kPerNat ? (int)(d * kPerNat) : kBuckets - 1; }

// before: token (la, ia) comes before (lb, ib) in the walk's order.
__device__ __forceinline__ bool before(float la, int ia, float lb, int ib) { return la > lb || (la == lb && ia < ib); }

// sample_kernel: block r picks row r's token (params[4r … 4r+3]: T, TopK,
// TopP, u; T = 0 is the argmax, as argmax_kernel).
__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ logits, const double* __restrict__ params,
                                                          int32_t* __restrict__ out, int V) {
  pdl_gate();  // before any global access: see common.cuh
  __shared__ double mass[kBuckets];  // the buckets' masses and counts, every warp's merged
  __shared__ int count[kBuckets];
  extern __shared__ double dyn[];  // kSampleSmem bytes: see there
  int* wcount = reinterpret_cast<int*>(dyn);                           // [warps][kBuckets]
  float* wmass = reinterpret_cast<float*>(wcount + kWarpsPerBlock * kBuckets);  // [warps][kBuckets]
  double* cs = dyn;                                                   // [kCand] the sorted weights' prefix sums
  float* cl = reinterpret_cast<float*>(cs + kCand);                   // [kCand] the candidates' logits
  int* ci = reinterpret_cast<int*>(cl + kCand);                       // [kCand] and ids
  __shared__ double dred[32];
  __shared__ float rv[32];
  __shared__ int ri[32];
  __shared__ int s_best, s_nbw, s_n, s_first;
  __shared__ double s_total;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
  const float* l = logits + (size_t)blockIdx.x * V;
  const double* q = params + 4 * (size_t)blockIdx.x;
  const double T = q[0], topP = q[2], u = q[3];
  const int keep = q[1] > 0 && q[1] < V ? (int)q[1] : V;  // the TopK cut

  // The argmax (llm.Argmax's rules): the greedy answer, and the max.
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int i = tid; i < V; i += blockDim.x) argmax_merge(bv, bi, l[i], i);
  warp_argmax(bv, bi);
  if (lane == 0) rv[w] = bv, ri[w] = bi;
  for (int i = tid; i < kWarpsPerBlock * kBuckets; i += blockDim.x) wcount[i] = 0, wmass[i] = 0.f;
  if (tid == 0) s_n = 0;
  __syncthreads();
  if (w == 0) {
    bv = lane < nw ? rv[lane] : -INFINITY;
    bi = lane < nw ? ri[lane] : INT_MAX;
    warp_argmax(bv, bi);
    if (lane == 0) s_best = (l[0] != l[0] || bi == INT_MAX) ? 0 : bi;
  }
  __syncthreads();
  if (!(T > 0)) {
    if (tid == 0) out[blockIdx.x] = s_best;
    return;
  }
  const double mx = l[s_best];

  // Every token's weight p and bucket: the buckets' counts and masses
  // (the last bucket's follow from the totals: it would take most of the
  // atomics), the total in a fixed order of addition.
  double total = 0;
  for (int i = tid; i < V; i += blockDim.x) {
    const double d = (mx - (double)l[i]) / T, p = exp(-d);
    total += p;
    const int b = bucket_of(d);
    if (b < kBuckets - 1) {
      atomicAdd(&wcount[w * kBuckets + b], 1);
      atomicAdd(&wmass[w * kBuckets + b], (float)p);
    }
  }
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane == 0) dred[w] = total;
  __syncthreads();
  // The warps' histograms merged. A bucket's mass in float only sets how
  // many buckets are gathered (with one to spare); the walk's sums are
  // the candidates' own, in double.
  if (tid < kBuckets) {
    int c = 0;
    double m = 0;
    for (int i = 0; i < nw; ++i) c += wcount[i * kBuckets + tid], m += wmass[i * kBuckets + tid];
    count[tid] = c, mass[tid] = m;
  }
  __syncthreads();  // the histograms' memory becomes the candidates' below
  if (tid == 0) {
    total = 0;
    for (int i = 0; i < nw; ++i) total += dred[i];
    s_total = total;
    int inner = 0;
    double inner_mass = 0;
    for (int b = 0; b < kBuckets - 1; ++b) inner += count[b], inner_mass += mass[b];
    count[kBuckets - 1] = V - inner;
    mass[kBuckets - 1] = total - inner_mass;
    // The buckets a walk can reach (Sample's loop), and one more.
    const double reach = (topP > 0 && topP < 1 ? topP : u) * total;
    int nb = 0, tokens = 0;
    double have = 0;
    while (nb < kBuckets && ((tokens < keep && keep < V) || have < reach * (1 + 1e-9))) {
      tokens += count[nb];
      have += mass[nb];
      ++nb;
    }
    s_nbw = min(nb + 1, kBuckets);
  }
  __syncthreads();
  total = s_total;
  const int nbw = s_nbw;
  for (int i = tid; i < V; i += blockDim.x) {
    if (bucket_of((mx - (double)l[i]) / T) < nbw) {
      const int k = atomicAdd(&s_n, 1);
      if (k < kCand) cl[k] = l[i], ci[k] = i;
    }
  }
  __syncthreads();
  const int n = s_n;
  if (n > kCand) {  // too many candidates: the host picks
    if (tid == 0) out[blockIdx.x] = -1;
    return;
  }
  // Bitonic sort of the candidates into the walk's order.
  int np = 2;
  while (np < n) np <<= 1;
  for (int i = n + tid; i < np; i += blockDim.x) cl[i] = -INFINITY, ci[i] = INT_MAX;
  __syncthreads();
  for (int k = 2; k <= np; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < np; i += blockDim.x) {
        const int x = i ^ j;
        if (x > i) {
          const bool up = (i & k) == 0;
          if (up == before(cl[x], ci[x], cl[i], ci[i])) {
            const float tl = cl[i];
            const int ti = ci[i];
            cl[i] = cl[x], ci[i] = ci[x], cl[x] = tl, ci[x] = ti;
          }
        }
      }
      __syncthreads();
    }
  // Inclusive prefix sums cs[k] of the sorted weights p_k (kPer a thread:
  // the thread's own, then a warp's scan of their totals, then the
  // warps'), zero past n.
  {
    const int e = kPer * tid;
    double a[kPer], v = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      v += e + i < n ? exp(-(mx - (double)cl[e + i]) / T) : 0;
      a[i] = v;  // the thread's inclusive sums
    }
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += up;
    }
    if (lane == 31) dred[w] = v;
    __syncthreads();
    if (w == 0) {
      double t = lane < nw ? dred[lane] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const double up = __shfl_up_sync(0xffffffffu, t, o);
        if (lane >= o) t += up;
      }
      dred[lane] = t;
    }
    double ex = __shfl_up_sync(0xffffffffu, v, 1);  // the lanes before this one
    if (lane == 0) ex = 0;
    __syncthreads();
    const double prior = (w > 0 ? dred[w - 1] : 0) + ex;
#pragma unroll
    for (int i = 0; i < kPer; ++i) cs[e + i] = prior + a[i];
  }
  __syncthreads();
  // first_at is the first k < end with cs[k] ≥ bound (end when none).
  // Every thread calls it (the bounds are the same in all).
  auto first_at = [&](double bound, int end) {
    __syncthreads();  // the last call's answer has been read
    if (tid == 0) s_first = end;
    __syncthreads();
    for (int k = tid; k < end; k += blockDim.x)
      if (cs[k] >= bound && (k == 0 || cs[k - 1] < bound)) atomicMin(&s_first, k);
    __syncthreads();
    return s_first;
  };
  // walk (llm/generate.go) over the n sorted candidates: cs[k] ≥ r is its
  // "r − p_0 − … − p_k ≤ 0".
  int id = -1;
  double sum = total;
  bool ok = true;
  if (keep < V) {
    ok = n >= keep;
    if (ok) sum = cs[keep - 1];
  }
  int limit = keep;
  if (ok && topP > 0 && topP < 1) {
    const int k = first_at(topP * sum, min(keep, n));
    if (k < min(keep, n)) limit = k + 1;
    ok = limit <= n;
    if (ok) sum = cs[limit - 1];
  }
  if (ok) {
    const int end = min(limit, n), k = first_at(u * sum, end);
    if (k < end)
      id = ci[k];
    else if (limit <= n)
      id = ci[limit - 1];
  }
  if (tid == 0) out[blockIdx.x] = id;
}

}  // namespace

namespace llmq {

int sample_rows(llmq_ctx* c, const float* logits, const double* params, int32_t* out, int T, int V) {
  if (T <= 0 || V <= 0) {
    set_error(c, "sample_rows: %d rows of %d logits (want positive counts)", T, V);
    return 1;
  }
  if (allow_smem(c, sample_kernel, kSampleSmem)) return 1;
  CK(launch(c, (sample_kernel), T, kThreads, kSampleSmem, logits, params, out, V));
  return 0;
}

}  // namespace llmq

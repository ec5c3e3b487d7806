// stream-probe: how fast can the SMs stream weights the way the W4 GEMV
// kernels do, and what does it take?
//
// The M ≤ 8 kernels (w4a16_gemv, v11, v15) reach 83–86% of the H100's
// read bandwidth on the large layers and only 55–65% of the H200's, at
// the same microseconds on both cards (cuda/NOTES.md, "The tenth
// session"), while cuBLAS and the 8-bit GEMV stream at 85%+ of either.
// That says the SM side limits them — but which part: bytes in flight
// (Little's law: the H200 needs ~1.45× the H100's at the same latency),
// instruction issue, or the way the loads are made. Each design tried so
// far (per-lane cp.async, per-warp bulk copies, more steps in registers)
// changed several of these at once. This program separates them: it
// streams a cold region the size of a layer's codes with the GEMV's
// access pattern — each warp walks its own contiguous range in 512-byte
// steps (a lane's 16 bytes a step), U steps a batch, two batches in
// registers in turn as v15 does — and varies one thing at a time:
//   ldg      loads straight into registers (the kernels' ld_stream);
//            U steps a batch; PF > 0: lane 0 asks L2 for the warp's batch
//            PF batches ahead (cp.async.bulk.prefetch.L2, v15 variants 3/4);
//   cpasync  each lane cp.asyncs its own 16 bytes into a private ring of
//            S batches in shared memory and reads them back (v8's transport);
//   tma      one bulk copy a CTA stage (the 4 warps' U steps each,
//            contiguous: 2·U KiB) into a ring of S stages on mbarriers,
//            warps reading their steps from shared memory (what v12's
//            notes proposed: fewer, larger copies than its per-warp ones);
//   tma4     the same stages in four copies, one from each warp's own
//            contiguous range (a GEMV whose warps keep their K ranges);
// against CTAs an SM (P: 4 warps each, as the GEMV's CTA) and W, the
// instructions of work a lane does a step on what it loaded (LOP3s in 8
// independent chains: v15's M = 1 step is about 83 instructions, ~44 of
// them integer work on the codes). Reading the table: the W = 0 rows are
// the transport's own ceiling for the bytes in flight P·U gives; the W
// rows say at what issue load the rate falls, i.e. whether the GEMV
// (at W ≈ 80) can reach the bandwidth by more bytes in flight alone.
//
// Every kernel reads a region of --mb MiB (default 56: 8B gate+up's codes)
// from a buffer 16× larger, a different region each launch, so nothing is
// in L2; all CTAs are resident (grid = SMs × P, checked against the
// occupancy calculator) and each warp reads an equal share, so the time is
// the steady rate plus one ramp, as in a kernel of one wave.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o build/stream-probe cuda/probe/stream.cu
//   build/stream-probe [--mb 56] [--iters 20] [--quick] > stream-probe.json
//
// Output: one JSON document (device, clocks, the rows); device-model.sh
// probe adds the command and commit.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>
#include "../stream.cuh"  // the kernels' loads (ld_stream, prefetch_l2) and bulk copies (mbar_*, bulk_copy)
#include "check.cuh"  // CHECK

namespace {

constexpr int kWarps = 4;    // a CTA's warps, as the GEMV kernels'
constexpr int kStep = kStepBytes;  // bytes a warp reads a step (a lane's 16)
constexpr int kChains = 8;   // independent chains of the emulated work

__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// work: W instructions on a step's 16 bytes, in kChains chains that carry
// from step to step (so the loads must have landed; the chains are
// independent, as a step's code pairs are).
template <int W>
__device__ __forceinline__ void work(uint32_t (&acc)[kChains], const uint4& v) {
  static_assert(W % kChains == 0, "W: a multiple of the chains");
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < W / kChains; ++j)
#pragma unroll
    for (int c = 0; c < kChains; ++c) acc[c] = lop3(acc[c], w[c & 3], 0x9e3779b9u + j);
  if constexpr (W == 0) {  // keep the loads: one XOR a word
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] ^= w[c];
  }
}

__device__ __forceinline__ void keep(const uint32_t (&acc)[kChains], unsigned* out) {
  uint32_t x = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) x ^= acc[c];
  if (x == 0x12345679u) *out = x;  // practically never: keeps the work
}

// ldg_kernel: each warp streams `steps` steps (a multiple of 2U) from its
// own range, two register batches of U in turn: batch b+1's loads are
// issued before batch b is worked on (v15's loop).
template <int U, int PF, int W>
__global__ void __launch_bounds__(kWarps * 32) ldg_kernel(const uint4* __restrict__ buf, int steps, unsigned* out) {
  const int lane = threadIdx.x & 31;
  const size_t warp = (size_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const uint4* bp = buf + warp * steps * (kStep / 16) + lane;
  uint32_t acc[kChains] = {};
  uint4 qa[U], qb[U];
  auto load = [&](uint4 (&q)[U], int kb) {
    if constexpr (PF > 0) {
      const int kp = kb + PF * U;
      if (lane == 0 && kp < steps) prefetch_l2(bp - lane + (size_t)kp * (kStep / 16), (uint32_t)(min(U, steps - kp) * kStep));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) q[u] = ld_stream(bp + (size_t)(kb + u) * (kStep / 16));
    // A branch ptxas keeps ends the block here, so the batch's loads are
    // issued together before the work that follows. Never taken: over the
    // 0x5a fill acc[0] is only ever 0 or its change a step (0x5a5a5a5a at
    // W = 0; 0x4, 0x78, 0x7c at W = 32, 64, 96). Without it ptxas sank
    // most of batch b+1's loads into batch b's work at W > 0 (SASS: one
    // load, then ~220 LOP3s, then the other three), so the W rows would
    // not have the bytes in flight the table says.
    if (acc[0] == 0x2468ace1u) asm volatile("trap;");
  };
  auto use = [&](const uint4 (&q)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) work<W>(acc, q[u]);
  };
  load(qa, 0);
  for (int kb = 0; kb < steps; kb += 2 * U) {
    load(qb, kb + U);
    use(qa);
    if (kb + 2 * U < steps) load(qa, kb + 2 * U);
    use(qb);
  }
  keep(acc, out);
}

// cpasync_kernel: each lane copies its own 16 bytes a step into a private
// ring of S batches of U steps (no barrier: a lane reads only its copies),
// S − 1 batches ahead of the one it works on.
template <int U, int S, int W>
__global__ void __launch_bounds__(kWarps * 32) cpasync_kernel(const uint4* __restrict__ buf, int steps, unsigned* out) {
  extern __shared__ uint4 lane_ring[];  // [S][U][kWarps·32]
  const int lane = threadIdx.x & 31;
  const size_t warp = (size_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const uint4* bp = buf + warp * steps * (kStep / 16) + lane;
  const int nb = steps / U;
  uint32_t acc[kChains] = {};
  auto issue = [&](int b) {
    if (b < nb) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t dst = (uint32_t)__cvta_generic_to_shared(&lane_ring[((b % S) * U + u) * kWarps * 32 + threadIdx.x]);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
                     "l"(__cvta_generic_to_global(bp + (size_t)(b * U + u) * (kStep / 16)))
                     : "memory");
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");  // an empty group past the end keeps the count
  };
#pragma unroll
  for (int b = 0; b < S - 1; ++b) issue(b);
  for (int b = 0; b < nb; ++b) {
    issue(b + S - 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1) : "memory");  // the ring reads below stay after it
#pragma unroll
    for (int u = 0; u < U; ++u) work<W>(acc, lane_ring[((b % S) * U + u) * kWarps * 32 + threadIdx.x]);
  }
  keep(acc, out);
}

// tma_kernel: a CTA's stage is its 4 warps' U steps each (warp w's at
// stage offset w·U·512), copied by thread 0 — one bulk copy of a
// contiguous range (the CTA's, in stages), or with SPLIT four, one from
// each warp's own contiguous range (how a GEMV whose warps keep their own
// K ranges would be fed: mode tma4). Thread 0 keeps S stages in flight
// on `full`; each warp, done with a stage, arrives on `empty`, and thread
// 0 refills a slot a stage after it was read, once all four have (as v17,
// w4a16_gemv_staged, did before it was removed), so S − 1 to S stages are
// in flight.
template <int U, int S, int W, bool SPLIT>
__global__ void __launch_bounds__(kWarps * 32) tma_kernel(const uint4* __restrict__ buf, int stages, unsigned* out) {
  constexpr uint32_t kStage = kWarps * U * kStep, kPart = U * kStep;
  extern __shared__ __align__(128) uint4 ring[];  // [S][kWarps][U][32]
  __shared__ __align__(8) uint64_t full[S], empty[S];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const char* src = reinterpret_cast<const char*>(buf) + (size_t)blockIdx.x * stages * kStage;  // warp w's range: + w·stages·kPart with SPLIT
  auto issue = [&](int slot, int stage) {
    mbar_expect_tx(&full[slot], kStage);
    if constexpr (SPLIT) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        bulk_copy(ring + ((size_t)slot * kStage + w * kPart) / 16, src + ((size_t)w * stages + stage) * kPart, kPart, &full[slot]);
    } else {
      bulk_copy(ring + (size_t)slot * kStage / 16, src + (size_t)stage * kStage, kStage, &full[slot]);
    }
  };
  ring_init<S>(full, empty, kWarps);
  if (threadIdx.x == 0)
    for (int s = 0; s < S && s < stages; ++s) issue(s, s);
  uint32_t acc[kChains] = {};
  for (int i = 0; i < stages; ++i) {
    const int s = i % S;
    const uint32_t parity = (i / S) & 1;
    mbar_wait(&full[s], parity);
    const uint4* slot = ring + (size_t)s * kStage / 16 + warp * U * 32 + lane;
    uint4 q[U];
#pragma unroll
    for (int u = 0; u < U; ++u) q[u] = slot[u * 32];
#pragma unroll
    for (int u = 0; u < U; ++u) work<W>(acc, q[u]);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
    if (threadIdx.x == 0 && i > 0 && i - 1 + S < stages) {  // the previous stage's slot, as v17 refilled it
      const int prev = (i - 1) % S;
      mbar_wait(&empty[prev], ((i - 1) / S) & 1);
      issue(prev, i - 1 + S);
    }
  }
  keep(acc, out);
}

// touch_kernel: the library's read probe (runtime.cu), the bandwidth the
// "% of read bandwidth" figures are relative to.
__global__ void touch_kernel(const uint4* __restrict__ p, size_t n, unsigned* out) { touch_range(p, n, out); }

struct Probe {
  std::string mode;
  bool staged;         // a CTA's stages through shared memory (tma, tma4): n counts stages, not steps
  int P, U, S, PF, W;  // CTAs an SM, steps a batch, ring depth, prefetch distance, work
  const void* fn;      // the kernel (for the occupancy query)
  void (*launch)(dim3, size_t, const uint4*, int, unsigned*);
  size_t smem;
};

template <int U, int PF, int W>
void launch_ldg(dim3 g, size_t smem, const uint4* b, int n, unsigned* o) { ldg_kernel<U, PF, W><<<g, kWarps * 32, smem>>>(b, n, o); }
template <int U, int S, int W>
void launch_cpasync(dim3 g, size_t smem, const uint4* b, int n, unsigned* o) { cpasync_kernel<U, S, W><<<g, kWarps * 32, smem>>>(b, n, o); }
template <int U, int S, int W, bool SPLIT>
void launch_tma(dim3 g, size_t smem, const uint4* b, int n, unsigned* o) { tma_kernel<U, S, W, SPLIT><<<g, kWarps * 32, smem>>>(b, n, o); }

template <int U, int PF, int W>
Probe ldg(int P) { return {"ldg", false, P, U, 0, PF, W, (const void*)ldg_kernel<U, PF, W>, launch_ldg<U, PF, W>, 0}; }
template <int U, int S, int W>
Probe cpasync(int P) {
  return {"cpasync", false, P, U, S, 0, W, (const void*)cpasync_kernel<U, S, W>, launch_cpasync<U, S, W>,
          (size_t)S * U * kWarps * 32 * 16};
}
template <int U, int S, int W, bool SPLIT = false>
Probe tma(int P) {
  return {SPLIT ? "tma4" : "tma", true, P, U, S, 0, W, (const void*)tma_kernel<U, S, W, SPLIT>, launch_tma<U, S, W, SPLIT>,
          (size_t)S * kWarps * U * kStep};
}

// The table: the GEMV's shape (U = 4, P = 4: v15 bounded) first, then one
// thing varied at a time.
std::vector<Probe> probes(bool quick) {
  std::vector<Probe> v;
  for (int P : {1, 2, 3, 4, 6, 8}) v.push_back(ldg<4, 0, 0>(P));  // bytes in flight by warps an SM
  for (int P : {2, 4}) {                                             // by steps a batch
    v.push_back(ldg<1, 0, 0>(P)), v.push_back(ldg<2, 0, 0>(P)), v.push_back(ldg<8, 0, 0>(P));
  }
  for (int P : {2, 4}) v.push_back(ldg<4, 2, 0>(P)), v.push_back(ldg<4, 4, 0>(P)), v.push_back(ldg<4, 8, 0>(P));  // L2 prefetch
  for (int P : {2, 4, 6}) {  // issue load at the GEMV's occupancy and around it
    v.push_back(ldg<4, 0, 32>(P)), v.push_back(ldg<4, 0, 64>(P)), v.push_back(ldg<4, 0, 96>(P));
    v.push_back(ldg<4, 4, 64>(P));
  }
  if (!quick) v.push_back(ldg<8, 0, 64>(4)), v.push_back(ldg<2, 0, 64>(4));
  for (int P : {2, 4}) {  // per-lane cp.async rings
    v.push_back(cpasync<4, 2, 0>(P)), v.push_back(cpasync<4, 4, 0>(P)), v.push_back(cpasync<4, 4, 64>(P));
  }
  for (int P : {1, 2, 4}) {  // a CTA's bulk copies (2·U KiB a stage)
    // (rings that fit 4 CTAs in an SM's 228 KiB; in flight: about S − 1 stages)
    v.push_back(tma<4, 4, 0>(P)), v.push_back(tma<8, 3, 0>(P)), v.push_back(tma<4, 6, 0>(P));
    v.push_back(tma<4, 4, 64>(P)), v.push_back(tma<8, 3, 64>(P));
  }
  for (int P : {2, 4}) {  // the same from each warp's own range (four copies a stage)
    v.push_back(tma<4, 4, 0, true>(P)), v.push_back(tma<8, 3, 0, true>(P)), v.push_back(tma<8, 3, 64, true>(P));
  }
  if (!quick) v.push_back(tma<16, 4, 0>(1)), v.push_back(tma<16, 3, 64>(2)), v.push_back(tma<8, 6, 64>(2));
  return v;
}

int clock_mhz(cudaDeviceAttr a) {
  int v = 0;
  cudaDeviceGetAttribute(&v, a, 0);
  return v / 1000;
}

}  // namespace

int main(int argc, char** argv) {
  double mb = 56;
  int iters = 20;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--mb") && i + 1 < argc) mb = atof(argv[++i]);
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--quick")) quick = true;
    else {
      fprintf(stderr, "usage: stream-probe [--mb MiB (default 56)] [--iters N (default 20)] [--quick]\n");
      return 2;
    }
  }
  if (mb < 1 || mb > 4096 || iters < 1) {
    fprintf(stderr, "stream-probe: --mb must be in [1, 4096] and --iters at least 1\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t region = (size_t)(mb * (1 << 20)) / 4096 * 4096;
  constexpr int kRegions = 16;
  uint4* buf;
  unsigned* sink;
  CHECK(cudaMalloc(&buf, region * kRegions + (1 << 20)));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(buf, 0x5a, region * kRegions + (1 << 20)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto timed = [&](auto&& run) {  // µs a launch, each launch on the next region
    run(0);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) run(1 + i % (kRegions - 1));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1000.0 * ms / iters;
  };
  auto at = [&](int r) { return buf + (size_t)r * region / 16; };

  printf("{\n  \"device\": \"%s\", \"sms\": %d, \"sm_clock_max_mhz\": %d, \"mem_clock_max_mhz\": %d, \"bus_bits\": %d,\n",
         prop.name, sms, clock_mhz(cudaDevAttrClockRate), clock_mhz(cudaDevAttrMemoryClockRate), prop.memoryBusWidth);
  printf("  \"region_bytes\": %zu, \"iters\": %d,\n", region, iters);
  const double touch = timed([&](int r) { touch_kernel<<<sms * 8, 512>>>(at(r), region / 16, sink); });
  printf("  \"read_probe\": {\"us\": %.2f, \"GBps\": %.0f},\n  \"rows\": [\n", touch, region / touch / 1e3);
  fprintf(stderr, "read probe (touch_kernel): %.2f us, %.0f GB/s\n", touch, region / touch / 1e3);
  const std::vector<Probe> ps = probes(quick);
  for (size_t i = 0; i < ps.size(); ++i) {
    const Probe& p = ps[i];
    if (p.smem > 0) {
      // Opted in whatever the size: 48 KiB of ring beside the kernel's static mbarriers is already past the
      // default limit (the first H200 run's tma rows at U = 8, S = 3 and U = 4, S = 6 found no CTA resident).
      CHECK(cudaFuncSetAttribute(p.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem));
      // the whole carveout for shared memory, so the P CTAs the calculator counts are what runs
      CHECK(cudaFuncSetAttribute(p.fn, cudaFuncAttributePreferredSharedMemoryCarveout, (int)cudaSharedmemCarveoutMaxShared));
    }
    int resident = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, p.fn, kWarps * 32, p.smem));
    cudaFuncAttributes fa;
    CHECK(cudaFuncGetAttributes(&fa, p.fn));
    const int ctas = sms * p.P;
    // Each warp (tma: each CTA) an equal whole number of units that divide
    // the loop: 2U steps (ldg), U (cpasync), a stage (tma).
    const bool staged = p.staged;
    const size_t unit = staged ? (size_t)kWarps * p.U * kStep : (size_t)(p.mode == "ldg" ? 2 : 1) * p.U * kStep;
    const size_t per = staged ? ctas : (size_t)ctas * kWarps;
    const int units = (int)(region / unit / per);
    const size_t bytes = (size_t)units * unit * per;
    const int n = staged ? units : units * (p.mode == "ldg" ? 2 : 1) * p.U;  // steps (stages for tma, tma4)
    double us = -1;
    if (units >= 1 && resident >= p.P) us = timed([&](int r) { p.launch(dim3(ctas), p.smem, at(r), n, sink); });
    printf("    {\"mode\": \"%s\", \"ctas_per_sm\": %d, \"resident\": %d, \"warps_per_sm\": %d, \"steps_a_batch\": %d, "
           "\"ring\": %d, \"l2_prefetch\": %d, \"work\": %d, \"registers\": %d, \"smem\": %zu, \"bytes\": %zu, "
           "\"us\": %.2f, \"GBps\": %.0f, \"of_read_probe\": %.3f}%s\n",
           p.mode.c_str(), p.P, resident, p.P * kWarps, p.U, p.S, p.PF, p.W, fa.numRegs, p.smem, bytes, us,
           us > 0 ? bytes / us / 1e3 : 0.0, us > 0 ? (bytes / us) / (region / touch) : 0.0, i + 1 < ps.size() ? "," : "");
    fprintf(stderr, "%-8s P=%d U=%d S=%d PF=%d W=%-3d regs=%3d resident=%d: %8.2f us %6.0f GB/s\n", p.mode.c_str(), p.P,
            p.U, p.S, p.PF, p.W, fa.numRegs, resident, us, us > 0 ? bytes / us / 1e3 : 0.0);
  }
  printf("  ]\n}\n");
  return 0;
}

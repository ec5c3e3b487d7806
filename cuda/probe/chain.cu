// chain-probe: what a dependency between two kernels of a decode step
// costs, and how much of it one persistent kernel would take back — the
// question behind cuda/NOTES.md's "A persistent decode step".
//
// A batch-1 step of llama3-8b W4 is 32 layers of nine dependent ops: four
// GEMVs that stream their codes from memory (q/k/v 12.6 MB, o 8.4 MB,
// gate+up 58.7 MB, down 29.4 MB) and five small ops that read a few
// kilobytes of activations from L2 (two norms, RoPE, attention over 128
// keys, its combine); --model qwen3-30b-a3b, issue 20's mixture, is 48
// layers of nine such ops whose GEMVs read 4–13 MB. This program runs
// that chain of reads — each op
// reads, after its wait, the value the op before it wrote, so no op can
// begin its dependent part early — in these ways:
//   graph            one kernel an op, captured in a CUDA graph;
//   graph-pdl        the same with programmatic dependent launch: a GEMV's
//                    CTAs ask for their first batch of codes, then wait
//                    (griddepcontrol.wait), as the GEMV kernels do;
//   persistent       one kernel for the whole step, every CTA resident,
//                    each op's CTAs waiting on the op before's counter in
//                    global memory (ld.acquire by one thread, then a
//                    barrier), a GEMV's first batch asked for before the
//                    wait;
//   persistent-late  the same with the first batch asked for after it;
//   graph-pdl-smem   graph-pdl with a GEMV's warps copying their ranges of
//                    the codes into shared memory before the wait (each its
//                    first steps, up to a quarter of the 56 KB a CTA has at
//                    4 CTAs an SM: all of every GEMV's but llama's gate+up,
//                    half of that), not just the first batch into
//                    registers; under PDL that overlaps only the one op
//                    launched before (the norm before q/k/v, the combine
//                    before o);
//   persistent-smem  persistent, each CTA copying its share of the next
//                    GEMV's codes into shared memory as soon as it has
//                    finished its part of the GEMV before (and the first
//                    GEMV's at the start): the small ops between two GEMVs
//                    then run while the second one's codes arrive, as in a
//                    megakernel that prefetches across ops (a decode step's
//                    weights are written at load only, so any op may read
//                    them at any time);
//   stream           the GEMVs' bytes read by one kernel with no
//                    dependency at all: the floor the others approach.
// Each runs with the small ops (the step as it is) and without them (the
// four GEMVs alone), so the small ops' share shows too. With the small
// ops, graph-pdl and persistent also run the GEMVs on the runtime's own
// grids at M = 1 — 64-column tiles × K splits (q/k/v 96 × 5, o 64 × 8,
// gate+up 448 × 1, down 64 × 8) — first without, then with the splits'
// tail as the GEMV kernels pay it (the tile's workspace row, a count, the
// last CTA's read-back), which prices the tail in the chain (its rows'
// GB/s count the every-CTA grid's bytes: within 3% an op). The streaming is
// v15's: each warp a contiguous range of 512-byte steps (a lane's 16
// bytes), two register batches of U = 4 steps in turn; the work on the
// bytes is one XOR a word: the probe prices the hops, not the arithmetic.
// GEMV regions are distinct for every layer (3.5 GB a step), so the codes
// come from memory as in a real step.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o build/chain-probe cuda/probe/chain.cu
//   build/chain-probe [--model llama3-8b|qwen3-30b-a3b] [--layers N] [--iters 20] [--skip rope,combine] > chain-probe.json
//
// --skip leaves the named small ops out of every layer: the chain a kernel
// that took over their work (RoPE in q/k/v's epilogue, say) would leave.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <string>
#include <vector>
#include "../common.cuh"  // cp_async16
#include "../stream.cuh"  // ld_stream
#include "check.cuh"  // CHECK

namespace {

constexpr int kWarps = 4;   // a CTA's warps, as the GEMV kernels'
constexpr int kU = 4;       // steps a register batch (v15's)
constexpr int kP = 4;       // CTAs an SM (v15's at M = 1)

// Op is one op of the chain: `tasks` CTAs, each warp reading `steps`
// 512-byte steps of its own contiguous range from src. With splits > 1
// the CTAs are tiles × splits of a GEMV's K and pay its split tail as the
// GEMV kernels do (finish_splits): 64 sums added into the tile's
// workspace row ws, a count on cnt, the last CTA reading the row back,
// writing it out and zeroing it.
struct Op {
  const uint4* src;
  int steps, tasks;
  int gemv;  // 1: weights (the first batch may be asked for before the wait)
  int splits;
  float* ws;  // [tiles][64]
  int* cnt;   // [tiles]
  __half* out;  // [tiles][64]
};

enum Mode { kGraph = 0, kPDL = 1, kPersistent = 2, kLate = 3, kPDLSmem = 4, kPersistSmem = 5, kStream = 6 };
constexpr int kLine = 32;  // an op's done counter on a 128-byte line of its own

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// prefetch copies each warp's first steps of CTA t's share of GEMV op's
// codes into smem (warp w's at smem + w·pf·32, up to cap chunks of 16
// bytes for the CTA), each lane the chunks it will read itself, with
// cp.async (waited on by op_task), and returns pf, the steps a warp has
// there.
__device__ __forceinline__ int prefetch(const Op& op, int t, uint4* smem, int cap) {
  const int pf = min(op.steps, cap / (kWarps * 32)), w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* bp = op.src + ((size_t)t * kWarps + w) * op.steps * 32 + lane;
  for (int k = 0; k < pf; ++k) cp_async16(smem + (w * pf + k) * 32 + lane, bp + (size_t)k * 32);
  cp_async_commit();
  return pf;
}

// op_task is CTA t's part of op i: ask for the first batch (a GEMV, unless
// mode is kLate), wait for op i − 1 (mode's way), read its value, stream
// the rest, and add one bit of the sums into val[i]; in the persistent
// modes it then counts itself done on done[i]. SMEM (the smem modes'
// kernels, so that the other modes' code stays as it was): each warp's
// first pf steps are in smem (graph-pdl-smem asks for them here, before
// the wait; persistent-smem passes those it asked for an op or more ago),
// and a warp with more steps streams the rest as the others do.
template <bool SMEM>
__device__ __forceinline__ void op_task(const Op* ops, int i, int t, float* val, int* done, int mode, uint4* smem,
                                        int cap, int pf) {
  const Op op = ops[i];
  const int lane = threadIdx.x & 31;
  const size_t warp = (size_t)t * kWarps + (threadIdx.x >> 5);
  const uint4* bp = op.src + warp * op.steps * 32 + lane;
  uint32_t acc = 0;
  uint4 qa[kU], qb[kU];
  auto load = [&](uint4 (&q)[kU], int kb) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = kb + u;
      if constexpr (SMEM)
        q[u] = k >= op.steps ? make_uint4(0, 0, 0, 0)
               : k < pf      ? smem[((threadIdx.x >> 5) * pf + k) * 32 + lane]
                             : ld_stream(bp + (size_t)k * 32);
      else
        q[u] = k < op.steps ? ld_stream(bp + (size_t)k * 32) : make_uint4(0, 0, 0, 0);
    }
  };
  if (SMEM && mode == kPDLSmem && op.gemv) pf = prefetch(op, t, smem, cap);
  auto use = [&](const uint4 (&q)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) acc ^= q[u].x ^ q[u].y ^ q[u].z ^ q[u].w;
  };
  // the first batch early from memory (not in the smem modes: it is in pool, or a warp's copies come first)
  const bool early = !SMEM && op.gemv && mode != kLate && mode != kGraph;
  const bool persistent = SMEM ? mode == kPersistSmem : mode >= kPersistent;
  if (early) load(qa, 0);
  if (i > 0) {
    if (mode == (SMEM ? kPDLSmem : kPDL)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    } else if (persistent) {
      if (threadIdx.x == 0) {
        const int need = ops[i - 1].tasks;
        const uint64_t t0 = globaltimer();
        while (ld_acquire(&done[(i - 1) * kLine]) < need)
          if (globaltimer() - t0 > 2000000000ull) __trap();  // 2 s: a hang is a bug, not a figure
      }
      __syncthreads();
    }
    acc ^= __float_as_uint(__ldcg(&val[i - 1]));
  }
  if (SMEM && pf > 0) cp_async_wait<0>();  // the lane's own copies have landed (it reads no other lane's)
  if (!early) load(qa, 0);
  for (int kb = 0; kb < op.steps; kb += 2 * kU) {
    load(qb, kb + kU);
    use(qa);
    if (kb + 2 * kU < op.steps) load(qa, kb + 2 * kU);
    use(qb);
  }
  // the CTA's one bit, into val[i]
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t red[kWarps];
  if (lane == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (op.splits > 1) {  // the split tail
    const int tile = t / op.splits;
    float* w = op.ws + (size_t)tile * 64;
    if (threadIdx.x < 64) atomicAdd(&w[threadIdx.x], (float)((red[threadIdx.x & 3] >> (threadIdx.x >> 2)) & 1));
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(&op.cnt[tile], 1) == op.splits - 1;
    __syncthreads();
    if (last) {
      __threadfence();
      if (threadIdx.x < 64) {
        op.out[(size_t)tile * 64 + threadIdx.x] = __float2half(__ldcg(&w[threadIdx.x]));
        w[threadIdx.x] = 0.f;
      }
      if (threadIdx.x == 0) op.cnt[tile] = 0;
    }
    __syncthreads();  // the op counts as done once its tail is
  }
  if (threadIdx.x == 0) {
    const uint32_t x = red[0] ^ red[1] ^ red[2] ^ red[3];
    atomicAdd(&val[i], (float)(x & 1));
    if (persistent) {
      __threadfence();
      atomicAdd(&done[i * kLine], 1);
    }
  }
  __syncthreads();  // red is reused by the CTA's next op
}

// Both kernels are launched with dynamic shared memory they do not use,
// sized so that at most kP CTAs fit an SM: the runtime's GEMVs at M = 1
// fit 4 (v15 and the CUDA-core GEMV, by their registers), and a probe
// kernel that fit 8 would let a whole next grid sit beside the running
// one under PDL, asking for its codes a kernel early.
template <bool SMEM>
__global__ void __launch_bounds__(kWarps * 32, kP) op_kernel(const Op* ops, int i, float* val, int* done, int mode,
                                                               int cap) {
  extern __shared__ uint4 pool[];
  op_task<SMEM>(ops, i, blockIdx.x, val, done, mode, pool, cap, 0);
}

// persistent_kernel: every op of the step in order; a CTA takes op i's
// tasks blockIdx.x, + gridDim.x, … (every CTA is resident: the grid is
// checked against the occupancy, so a wait never waits on a CTA that has
// not started).
// In persistent-smem a CTA asks for its share of GEMV op g (its task
// blockIdx.x there) once it is done with the GEMV before g (g: the next
// GEMV with such a task).
template <bool SMEM>
__global__ void __launch_bounds__(kWarps * 32, kP) persistent_kernel(const Op* ops, int n, float* val, int* done, int mode,
                                                                     int cap) {
  extern __shared__ uint4 pool[];
  int g = -1, pf = 0;  // the GEMV whose codes are on their way into pool, and how many chunks
  auto ask_next = [&](int from) {
    g = -1, pf = 0;
    for (int j = from + 1; SMEM && g < 0 && j < n; ++j)
      if (ops[j].gemv && (int)blockIdx.x < ops[j].tasks) g = j, pf = prefetch(ops[j], blockIdx.x, pool, cap);
  };
  ask_next(-1);
  for (int i = 0; i < n; ++i) {
    for (int t = blockIdx.x; t < ops[i].tasks; t += gridDim.x)
      op_task<SMEM>(ops, i, t, val, done, mode, pool, cap, i == g && t == (int)blockIdx.x ? pf : 0);
    if (i == g) ask_next(i);  // (op_task's last barrier: pool is no longer read)
  }
}

struct Timing {
  double median_us, min_us;
};

// time_graph: the graph's replay time, kReps replays back to back
// between two events (a decode's steady state), median and least of iters.
constexpr int kReps = 10;
Timing time_graph(cudaGraphExec_t exec, cudaStream_t s, int iters) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int w = 0; w < 3; ++w) CHECK(cudaGraphLaunch(exec, s));
  std::vector<double> us;
  for (int it = 0; it < iters; ++it) {
    CHECK(cudaEventRecord(a, s));
    for (int r = 0; r < kReps; ++r) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000.0 / kReps);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return {us[us.size() / 2], us[0]};
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 0, iters = 20;
  std::string model = "llama3-8b", skip;
  for (int a = 1; a < argc; ++a) {
    if (!strcmp(argv[a], "--layers") && a + 1 < argc)
      layers = atoi(argv[++a]);
    else if (!strcmp(argv[a], "--iters") && a + 1 < argc)
      iters = atoi(argv[++a]);
    else if (!strcmp(argv[a], "--model") && a + 1 < argc)
      model = argv[++a];
    else if (!strcmp(argv[a], "--skip") && a + 1 < argc)
      skip = argv[++a];
    else {
      fprintf(stderr, "usage: chain-probe [--model llama3-8b|qwen3-30b-a3b] [--layers N] [--iters N] [--skip OP,...]\n");
      return 2;
    }
  }
  if (model != "llama3-8b" && model != "qwen3-30b-a3b") {
    fprintf(stderr, "chain-probe: --model %s: want llama3-8b or qwen3-30b-a3b\n", model.c_str());
    return 2;
  }
  if (layers == 0) layers = model == "llama3-8b" ? 32 : 48;
  if (layers < 1 || iters < 1) {
    fprintf(stderr, "chain-probe: --layers and --iters must be positive\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  // the padding: an SM's shared memory over kP CTAs, less each CTA's reserve and a little static
  const size_t pad = prop.sharedMemPerMultiprocessor / kP - prop.reservedSharedMemPerBlock - 256;
  const int cap = (int)(pad / 512) * 32;  // the smem modes' chunks a CTA: whole 512-byte steps of the padding
  // every kernel (each mode's: op_kernel and persistent_kernel, the smem modes' instantiations and the others')
  for (const void* k : {(const void*)op_kernel<false>, (const void*)op_kernel<true>, (const void*)persistent_kernel<false>,
                        (const void*)persistent_kernel<true>}) {
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pad));
    int occ = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, kWarps * 32, pad));
    if (occ != kP) {
      fprintf(stderr, "chain-probe: %d CTAs an SM fit with %zu bytes of padding, want %d\n", occ, pad, kP);
      return 1;
    }
  }
  const int per_sm = kP;
  const int G = prop.multiProcessorCount * per_sm;  // every GEMV's CTAs, and the persistent grid

  // A layer's ops at batch 1: bytes, tasks, gemv; for llama3-8b a GEMV's
  // 64-column tiles and K splits as the runtime's plan takes them at M = 1
  // on 132 SMs (gemm-h100.json: q/k/v 5 splits, o and down 8, gate+up 1).
  // qwen3-30b-a3b (issue 20's mixture: hidden 2048, 48 layers, 8 of 128
  // experts of 768): the norm with the router (fp32, 1 MB, 32 CTAs as
  // rmsnorm_router), q/k/v, RoPE, attention over 128 keys of 4 key heads,
  // its combine, o, the second norm with the router, the 8 experts'
  // gate+up and down as one GEMV each (the grouped kernel's); its rows run
  // the every-CTA grid only (its GEMVs' plans are the grouped kernel's).
  struct Shape {
    const char* name;
    size_t bytes;
    int tasks, gemv, tiles, splits;
  };
  std::vector<Shape> layer;
  if (model == "llama3-8b")
    layer = {
        {"norm", 16 << 10, 1, 0, 0, 1},
        {"qkv", 4096ull * 6144 / 2, G, 1, 96, 5},
        {"rope", 16 << 10, 8, 0, 0, 1},
        {"attention", 512 << 10, 64, 0, 0, 1},
        {"combine", 64 << 10, 32, 0, 0, 1},
        {"o", 4096ull * 4096 / 2, G, 1, 64, 8},
        {"norm", 16 << 10, 1, 0, 0, 1},
        {"gate+up", 4096ull * 28672 / 2, G, 1, 448, 1},
        {"down", 14336ull * 4096 / 2, G, 1, 64, 8},
    };
  else
    layer = {
        {"norm+router", 1 << 20, 32, 0, 0, 1},
        {"qkv", 2048ull * 5120 / 2, G, 1, 0, 1},
        {"rope", 16 << 10, 8, 0, 0, 1},
        {"attention", 256 << 10, 32, 0, 0, 1},
        {"combine", 64 << 10, 32, 0, 0, 1},
        {"o", 4096ull * 2048 / 2, G, 1, 0, 1},
        {"norm+router", 1 << 20, 32, 0, 0, 1},
        {"experts gate+up", 8ull * 2048 * 1536 / 2, G, 1, 0, 1},
        {"experts down", 8ull * 768 * 2048 / 2, G, 1, 0, 1},
    };
  // --skip leaves small ops out of every layer (each name once a layer, the
  // first such op: "norm" twice for both of llama3-8b's): the chain a
  // fused kernel would leave, its hops' worth against the full layer's.
  for (size_t at = 0; at <= skip.size();) {
    const size_t comma = std::min(skip.find(',', at), skip.size());
    const std::string name = skip.substr(at, comma - at);
    at = comma + 1;
    if (name.empty()) continue;
    auto it = std::find_if(layer.begin(), layer.end(), [&](const Shape& s) { return !s.gemv && name == s.name; });
    if (it == layer.end()) {
      fprintf(stderr, "chain-probe: --skip %s: no small op of that name left in a %s layer\n", name.c_str(),
              model.c_str());
      return 2;
    }
    layer.erase(it);
  }
  const int kLayerOps = (int)layer.size();
  const bool plan_grids = model == "llama3-8b";
  auto steps_of = [](size_t bytes, int tasks) {
    return (int)std::max<size_t>(1, (bytes + (size_t)tasks * kWarps * 512 / 2) / ((size_t)tasks * kWarps * 512));
  };
  size_t gemv_bytes = 0, small_bytes = 0;  // as read (steps rounded)
  for (const Shape& s : layer) {
    const size_t b = (size_t)steps_of(s.bytes, s.tasks) * s.tasks * kWarps * 512;
    (s.gemv ? gemv_bytes : small_bytes) += b;
  }
  const size_t total = gemv_bytes * layers;
  uint4 *weights, *acts;
  CHECK(cudaMalloc(&weights, total + (64 << 20)));
  CHECK(cudaMalloc(&acts, small_bytes + (1 << 20)));
  CHECK(cudaMemset(weights, 0x5a, total + (64 << 20)));
  CHECK(cudaMemset(acts, 0x33, small_bytes + (1 << 20)));

  // The chains: with the small ops or the GEMVs alone; a GEMV over every
  // CTA in one contiguous range each (grid 0), or over the plan's tiles ×
  // splits (1), with their split tails too (2).
  const size_t max_ops = (size_t)layers * kLayerOps;
  constexpr int kMaxTiles = 448;
  float* ws;
  int* cnt;
  __half* outs;
  CHECK(cudaMalloc(&ws, max_ops * kMaxTiles * 64 * sizeof(float)));
  CHECK(cudaMalloc(&cnt, max_ops * kMaxTiles * sizeof(int)));
  CHECK(cudaMalloc(&outs, max_ops * kMaxTiles * 64 * sizeof(__half)));
  CHECK(cudaMemset(ws, 0, max_ops * kMaxTiles * 64 * sizeof(float)));
  CHECK(cudaMemset(cnt, 0, max_ops * kMaxTiles * sizeof(int)));
  auto chain = [&](bool small, int grid) {
    std::vector<Op> ops;
    size_t w = 0;
    for (int l = 0; l < layers; ++l) {
      size_t a = 0;
      for (const Shape& s : layer) {
        const size_t b0 = (size_t)steps_of(s.bytes, s.tasks) * s.tasks * kWarps * 512;  // the bytes, as gemv_bytes counts them
        if (s.gemv) {
          const int tasks = grid ? s.tiles * s.splits : s.tasks;
          const size_t k = ops.size();
          // (the plan's grid rounds a warp's steps its own way: within 2% of b0)
          ops.push_back({weights + w / 16, steps_of(b0, tasks), tasks, 1, grid == 2 ? s.splits : 1,
                         ws + k * kMaxTiles * 64, cnt + k * kMaxTiles, outs + k * kMaxTiles * 64});
          w += b0;
        } else {
          if (small) ops.push_back({acts + a / 16, steps_of(s.bytes, s.tasks), s.tasks, 0, 1, nullptr, nullptr, nullptr});
          a += b0;
        }
      }
    }
    return ops;
  };
  Op* d_ops;
  CHECK(cudaMalloc(&d_ops, max_ops * sizeof(Op)));
  float* val;
  int* done;
  CHECK(cudaMalloc(&val, max_ops * sizeof(float)));
  CHECK(cudaMalloc(&done, max_ops * kLine * sizeof(int)));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  printf("{\n \"model\": \"%s\", \"device\": \"%s\", \"sms\": %d, \"ctas_an_sm\": %d, \"padding_bytes\": %zu, \"grid\": %d, \"reps\": %d,\n",
         model.c_str(), prop.name, prop.multiProcessorCount, per_sm, pad, G, kReps);
  printf(" \"layers\": %d, \"iters\": %d, \"layer_ops\": %d, \"skipped\": \"%s\", \"gemv_bytes_a_layer\": %zu,"
         " \"small_bytes_a_layer\": %zu,\n \"rows\": [\n",
         layers, iters, kLayerOps, skip.c_str(), gemv_bytes, small_bytes);
  bool first = true;
  const char* grids[] = {"every CTA", "tiles x splits", "tiles x splits + tails"};
  for (int pass = 1; pass <= 2; ++pass)  // twice, so the spread between runs of a row shows
  for (int variant = 0; variant < 4; ++variant) {
    // with small ops: every CTA, then tiles × splits, then with tails; the GEMVs alone: every CTA
    const int small = variant < 3, grid = variant < 3 ? variant : 0;
    if (grid > 0 && !plan_grids) continue;
    std::vector<Op> ops = chain(small, grid);
    const int n = (int)ops.size();
    CHECK(cudaMemcpy(d_ops, ops.data(), n * sizeof(Op), cudaMemcpyHostToDevice));
    const char* names[] = {"graph", "graph-pdl", "persistent", "persistent-late", "graph-pdl-smem", "persistent-smem", "stream"};
    for (int mode = 0; mode <= kStream; ++mode) {
      if (mode == kStream && small) continue;  // the floor: the GEMVs' bytes only
      if (grid > 0 && (mode == kGraph || mode == kLate)) continue;  // the plan's grids: PDL and persistent (smem too)
      // the floor's one op over every GEMV byte of the step, no wait (after
      // the chain's ops: the chain without small ops is shorter than max_ops)
      Op* d_all = d_ops + n;
      if (mode == kStream) {
        const Op all = {weights, steps_of(total, G), G, 1, 1, nullptr, nullptr, nullptr};
        CHECK(cudaMemcpy(d_all, &all, sizeof(Op), cudaMemcpyHostToDevice));
      }
      cudaGraph_t graph;
      CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      CHECK(cudaMemsetAsync(val, 0, n * sizeof(float), s));
      CHECK(cudaMemsetAsync(done, 0, n * kLine * sizeof(int), s));
      if (mode == kGraph || mode == kPDL || mode == kPDLSmem) {
        for (int i = 0; i < n; ++i) {
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(ops[i].tasks);
          cfg.blockDim = dim3(kWarps * 32);
          cfg.dynamicSmemBytes = pad;
          cfg.stream = s;
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr;
          cfg.numAttrs = (mode == kPDL || mode == kPDLSmem) && i > 0 ? 1 : 0;
          CHECK(cudaLaunchKernelEx(&cfg, mode == kPDLSmem ? op_kernel<true> : op_kernel<false>, (const Op*)d_ops, i, val, done,
                                   mode, cap));
        }
      } else if (mode == kStream) {
        op_kernel<false><<<G, kWarps * 32, pad, s>>>(d_all, 0, val, done, kGraph, cap);
      } else {
        (mode == kPersistSmem ? persistent_kernel<true> : persistent_kernel<false>)<<<G, kWarps * 32, pad, s>>>(
            d_ops, n, val, done, mode, cap);
      }
      CHECK(cudaGetLastError());
      CHECK(cudaStreamEndCapture(s, &graph));
      cudaGraphExec_t exec;
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const Timing t = time_graph(exec, s, iters);
      CHECK(cudaGetLastError());
      const double bytes = (double)gemv_bytes * layers;
      printf("%s  {\"pass\": %d, \"mode\": \"%s\", \"small_ops\": %s, \"gemv_grid\": \"%s\", \"ops\": %d, "
             "\"us_step\": %.2f, \"us_step_min\": %.2f, \"us_layer\": %.3f, \"gemv_gbps\": %.1f}",
             first ? "" : ",\n", pass, names[mode], small ? "true" : "false", grids[grid], mode == kStream ? 1 : n,
             t.median_us, t.min_us, t.median_us / layers, bytes / (t.median_us * 1e3));
      first = false;
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
    }
  }
  printf("\n ]\n}\n");
  return 0;
}

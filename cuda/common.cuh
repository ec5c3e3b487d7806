// Shared definitions of the llmq CUDA library: the context every entry
// point works on, error reporting, and the entry points of each file that
// runtime.cu gathers into the API table.
#pragma once
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <unordered_map>
#include <unordered_set>
#include "llmq.h"

// llmq_ctx owns a stream and everything issued on it (see llmq.h).
struct llmq_ctx {
  int device = 0;
  int sms = 0;
  int cc_major = 0;  // compute capability's major (9: Hopper, whose wgmma the fused kernel's v19 variants need)
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_ws = nullptr;
  size_t cublas_ws_bytes = 0;
  // Device memory allocated through the context: pointer → bytes.
  std::unordered_map<void*, size_t> allocs;
  size_t live_bytes = 0, peak_bytes = 0;
  std::unordered_set<void*> graphs, events;
  // Tuning: the forced W4A16 path (0 automatic), the largest M of the
  // GEMV and of the fused kernel in automatic mode, each kernel
  // instantiation's resident CTAs per SM (queried on first use), the
  // attention kernel's raised dynamic shared memory limit.
  int w4_path = 0;
  int gemv_max_m = -1;  // the CUDA-core GEMV serves M ≤ this (−1: the measured 1, 2 for 8-bit codes)
  int mma_max_m = 64;   // v11 (the GEMV on the Tensor Cores) serves M ≤ this, after the GEMV
  int swap_forced_variant = -1;  // v15's instantiation, forced (LLMQ_W4_SWAP_VARIANT; sweeps)
  int mma_forced_variant = -1;   // v11's instantiation, forced (LLMQ_W4_MMA_VARIANT; sweeps)
  int fused_forced_variant = -1; // the fused kernel's instantiation, forced (LLMQ_W4_FUSED_VARIANT; sweeps)
  // v15 (v11 with the operands swapped) serves 4-bit M = 2–8 ahead of the
  // GEMV and v11, M = 1 on layers of 2^26 weights or more, and M = 9 …
  // this on layers that need no K split (LLMQ_W4_SWAP_MAX_M; 8 keeps it to
  // M ≤ 8, 0 turns it off).
  int swap_max_m = 32;
  int fused_max_m = 128;
  // On Hopper the fused path runs v21 (wgmma, the weights in registers)
  // at M = 33 … this for 4-bit codes in groups of 32 or more, v18
  // otherwise (LLMQ_W4_WGMMA_MAX_M; 32 or less: v18 throughout), past
  // fused_max_m too (w4a16.cu, kWgmmaVariant: what it was measured against).
  int wgmma_max_m = 256;
  int w4_splits = 0;  // the W4A16 kernels' K splits, forced (LLMQ_W4_SPLITS; 0: the plan's, one wave)
  void* tmap_encode = nullptr;  // the driver's cuTensorMapEncodeTiled, once looked up (w4a16.cu's act_map, v21)
  int resident[96] = {};  // resident CTAs per SM by kernel instantiation (w4a16.cu's resident_slot)
  // The dynamic shared memory each kernel is allowed (allow_smem).
  std::unordered_map<const void*, size_t> smem_allowed;
  int decode_wave = 0;  // the decode attention's grid target in blocks (0: 4 an SM; LLMQ_DECODE_WAVE, for tests)
  // Programmatic dependent launch of the model kernels (launch(); on
  // Hopper unless LLMQ_PDL=0: with weights_then_gate the decode gains
  // 4–7% at batch 1 and 8, NOTES.md "The ninth session").
  bool pdl = true;
  // The decode attention kernel reads the rows' positions and block
  // tables, and asks L2 for its first keys and values, before its gate,
  // and its combine the rows' positions (to bound their records);
  // qk_rope_store_kernel reads its row's position, cache slot and first
  // cos/sin values before its gate (model.cu; LLMQ_ATTN_EARLY=0: after,
  // for A/Bs).
  bool attn_early = true;
  // A mixture's combine (rmsnorm with y) orders its rows' slots — reads
  // their ids and weights — before its gate (model.cu, rmsnorm_kernel;
  // LLMQ_COMBINE_EARLY=0: after, for A/Bs).
  bool combine_early = true;
  // A decode step's mixture routes inside the experts' gate/up GEMV
  // (moe_gemv_routed in one launch; LLMQ_MOE_ROUTED=0: route+plan, then
  // the GEMV, for A/Bs).
  bool moe_routed = true;
  // API 27: the routed gate/up GEMV asks L2 for the routed experts' down
  // codes (LLMQ_MOE_PREFETCH: 0 no, 1 right after routing, 2 after each
  // CTA's loop; w4a16.cu, MoEPrefetch; ctx_create refuses other values).
  // Off until a decode A/B says.
  int moe_prefetch = 0;
  // API 28: a routed gated pass given its down layer and that layer's
  // output runs down in the same launch (LLMQ_MOE_FUSED_DOWN=1; w4a16.cu,
  // MoEDown), else in a launch of its own after (0). Off until a decode
  // A/B says. On, the combine reads the routing after its gate (not
  // early: the launch before it may be the one that routed).
  bool moe_fused_down = false;
  // A fused down's CTAs keep their gate/up's codes, scales and zeros in
  // shared memory, asked for at once after routing (w4a16.cu, FusedStage;
  // LLMQ_MOE_FUSED_STAGE=0: streamed as the unfused pass's, for A/Bs).
  bool moe_fused_stage = true;
  // API 19: a mixture's gated gate/up GEMV writes act(gate)·up itself
  // (LLMQ_MOE_FUSED_ACT=0: the sums, then moe_act), and the norm before
  // the experts computes the router's logits (LLMQ_MOE_NORM_ROUTER=0: the
  // norm, then moe_router); the switches are for A/Bs.
  bool moe_fused_act = true;
  int moe_splits = 0;  // the grouped expert GEMV's K splits, forced (LLMQ_MOE_SPLITS; 0: moe_splits'; fused gated: 1)
  bool moe_norm_router = true;
  // quant.cu: the cuSOLVER handle (made on first use) and its workspace
  // (an allocation of the context).
  void* cusolver = nullptr;
  void* solver_ws = nullptr;
  size_t solver_ws_bytes = 0;
  char err[1024] = {0};
};

namespace llmq {
// set_error records a message on c, or in the calling thread's error when
// c is null (calls without a context).
void set_error(llmq_ctx* c, const char* fmt, ...);
}  // namespace llmq

// CK turns a failed CUDA runtime call into an error naming it, recorded on
// the context `c` in scope.
#define CK(call)                                                                                     \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      llmq::set_error(c, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                                      \
    }                                                                                                \
  } while (0)

// CK_LAUNCH checks a kernel launch.
#define CK_LAUNCH(name)                                                   \
  do {                                                                    \
    cudaError_t e_ = cudaGetLastError();                                  \
    if (e_ != cudaSuccess) {                                              \
      llmq::set_error(c, "kernel %s: %s", name, cudaGetErrorString(e_)); \
      return 1;                                                           \
    }                                                                     \
  } while (0)

// allow_smem lets kernel launch with `bytes` of dynamic shared memory,
// once a context for the most it launches with (c->smem_allowed
// remembers). Without asking, a kernel's dynamic and static shared memory
// together must stay within 48 KB, so it asks for any dynamic amount: the
// fused kernel's M ≤ 32 instantiation, exactly 48 KB of dynamic memory and
// one static int, fails to launch otherwise ("invalid argument").
template <typename Kernel>
int allow_smem(llmq_ctx* c, Kernel kernel, size_t bytes) {
  if (bytes == 0) return 0;
  size_t& have = c->smem_allowed[reinterpret_cast<const void*>(kernel)];
  if (have >= bytes) return 0;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  have = bytes;
  return 0;
}

// Programmatic dependent launch (Hopper; on by default, LLMQ_PDL=0 off):
// launch() then lets a kernel be scheduled while the kernel before it on
// the stream is still running, so that a decode step's few hundred small
// kernels do not each wait out a launch. Every kernel launched through it
// calls pdl_gate() before it touches global memory (the GEMV kernels:
// before anything but their weights, below): griddepcontrol.wait holds
// it until the previous grid has finished and its writes are
// visible (so reads and writes order exactly as without PDL), then
// griddepcontrol.launch_dependents lets the next kernel be scheduled.
// Without the attribute both instructions return at once. (The decode
// attention kernel and its combine, qk_rope_store_kernel and a mixture's
// combine also read, before their gate, what only the host or kernels before the one
// ahead of them wrote: model.cu, their `early`.)
//
// weights_then_gate: the GEMV kernels (w4a16_gemv, _mma, _swap)
// ask for their first batch of codes (with PF > 0, L2 for a later one),
// and their first two groups' scales and zeros (GroupStream::start),
// before pdl_gate(), and for everything else after it (the fused
// kernel, w4a16_fused, its first groups' scales and zeros only). Weights are
// written only at load, never by a kernel of a step, so reading them early
// orders nothing; under PDL a GEMV's CTAs, once resident beside the
// previous kernel's tail (a norm's few blocks, attention's combine,
// the gate+up GEMM's last CTAs), have their first codes on the way while
// they wait, instead of starting the memory's latency after it.
static __device__ __forceinline__ void pdl_gate() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// cp.async (Ampere on): 16 bytes from global to shared memory without a
// register, in the background. A thread's copies since its last commit
// form a group; cp_async_wait<N> returns once at most N of its groups are
// still in flight. The copies are visible to the thread that made them
// after the wait (to others after a barrier too). The zfill form writes
// zeros, reading nothing, where !valid (gmem must still be a valid
// address).
static __device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem));
}
static __device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// warp_sum / warp_max reduce v over the warp; every lane gets the result.
static __device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
static __device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// argmax_merge keeps the better of (bv, bi) and (v, i): the larger value,
// the lower index among equals (so any order of merging gives the first
// index of the largest value, as llm.Argmax); NaNs never win.
static __device__ __forceinline__ void argmax_merge(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

// warp_argmax merges the warp's (value, index) pairs into every lane's.
static __device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    argmax_merge(bv, bi, ov, oi);
  }
}

// launch runs kernel<<<grid, block, smem, c->stream>>>(args…), as a
// programmatic dependent launch when c->pdl, and returns the launch's error.
template <typename... KArgs, typename... Args>
cudaError_t launch(llmq_ctx* c, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = c->stream;
  cfg.attrs = attr;
  cfg.numAttrs = c->pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  // A refused launch also leaves its error as the thread's last error, which
  // the next CK_LAUNCH would then report against an innocent kernel: the
  // caller gets it here, so clear it.
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

// act_of is a gated MLP's activation: SiLU (SwiGLU, act 0), or GELU with
// the tanh approximation (Gemma's GeGLU, act 1). model.cu's gated_act and
// the W4A16 kernels' gated epilogue (w4a16.cu) both use it.
static __device__ __forceinline__ float act_of(float a, int act) {
  return act == 1 ? 0.5f * a * (1.f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a))) : a / (1.f + __expf(-a));
}

// gated_pair is act(g)·u as gated_act computes it from its fp16 inputs:
// g and u rounded to fp16 first, so that a GEMM that applies it in its
// epilogue writes what the GEMM and gated_act would have.
static __device__ __forceinline__ half gated_pair(float g, float u, int act) {
  return __float2half(act_of(__half2float(__float2half_rn(g)), act) * __half2float(__float2half_rn(u)));
}

// Entry points, by file; llmq.h documents each.
namespace llmq {
// w4a16.cu
size_t w4a16_workspace_bytes(int M, int N);
int w4a16_gemm(llmq_ctx* c, const void* A, const void* B, const void* scales, const void* zeros, const int32_t* perm,
               void* a_perm, void* const* outs, const int* out_cols, int n_outs, int act, void* workspace, void* scratch,
               int M, int N, int K, int group, int bits);
int w4a16_set_path(llmq_ctx* c, int path);
int w4a16_plan(llmq_ctx* c, int M, int N, int K, int group, int bits, char* out, int n);
int w4_dequant(llmq_ctx* c, const void* B, const void* scales, const void* zeros, void* W, int N, int K, int group,
               int bits);
int gemm_f16(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K);
int moe_gemv_w4(llmq_ctx* c, const void* A, int a_div, const int32_t* order, const int32_t* chunks, int max_chunks, int mt,
                int slots, const void* B, const void* scales, const void* zeros, float* out, int N, int K, int group,
                void* g, int act);
int moe_gemv_routed(llmq_ctx* c, const void* A, const float* logits, int T, int E, int k, int norm, int32_t* ids,
                    float* weights, int32_t* order, int32_t* chunks, const void* B, const void* scales, const void* zeros,
                    float* out, int N, int K, int group, void* g, int act, const void* nB, const void* nS,
                    const void* nZ, int nN, int nK, int ngroup, float* nout);
int check_gated(llmq_ctx* c, const char* fn, const void* g, int act);
// model.cu
int embed(llmq_ctx* c, const int32_t* ids, const void* E, float* x, int T, int H, float scale);
int rmsnorm(llmq_ctx* c, float* x, const void* delta, float* sums, const float* delta_norm, float* y, const int32_t* ids,
            const float* weights, int k, const int32_t* rows, const float* w, void* out, int n, int H, float eps);
int rmsnorm_router(llmq_ctx* c, const float* x, const void* delta, const float* sums, const float* w, void* out,
                   const float* W, float* logits, int n, int H, int E, float eps);
int add(llmq_ctx* c, float* x, const void* delta, size_t n);
int add_bias(llmq_ctx* c, void* y, const void* b, int T, int N);
int qk_rope_store(llmq_ctx* c, void* q, void* k, void* v, float* sums, const float* q_norm, const float* k_norm,
                  float eps, const int32_t* row_seq, const int32_t* row_pos, const uint64_t* kv_base,
                  const int32_t* kv_cap, const float* cos_t, const float* sin_t, int layer, int layers, int T, int heads,
                  int kv_heads, int hd);
size_t attention_workspace_bytes(int T, int heads, int hd, int max_keys);
int attention(llmq_ctx* c, const void* q, void* out, void* workspace, const int32_t* row_seq, const int32_t* row_pos,
              const uint64_t* kv_base, const int32_t* kv_cap, int layer, int layers, int T, int heads, int kv_heads,
              int hd, int max_keys, int window, float scale);
int gated_act(llmq_ctx* c, void* g, const void* u, size_t n, int act);
int nll(llmq_ctx* c, const float* logits, const int32_t* targets, float* nll, int T, int V);
int argmax_rows(llmq_ctx* c, const float* logits, int32_t* out, int T, int V);
int f16_to_f32(llmq_ctx* c, const void* src, float* dst, size_t n);
// sample.cu
int sample_rows(llmq_ctx* c, const float* logits, const double* params, int32_t* out, int T, int V);
int fake_quant(llmq_ctx* c, const void* in, void* out, int rows, int cols, int bits, int fp8, int per_token,
               float threshold);
int moe_route(llmq_ctx* c, const float* logits, int32_t* ids, float* weights, int T, int E, int k, int norm);
int moe_router(llmq_ctx* c, const void* h, const float* W, float* logits, int T, int E, int H);
int moe_plan(llmq_ctx* c, const int32_t* ids, int S, int E, int mt, int32_t* order, int32_t* chunks, int max_chunks);
int moe_route_plan(llmq_ctx* c, const float* logits, int32_t* ids, float* weights, int T, int E, int k, int norm, int mt,
                   int32_t* order, int32_t* chunks, int max_chunks);
int moe_gemv(llmq_ctx* c, const void* A, int a_div, const int32_t* order, const int32_t* chunks, int max_chunks, int mt,
             int slots, const void* B, const void* scales, const void* zeros, const void* W16, float* out, int N, int K,
             int group, void* g, int act);
int moe_act(llmq_ctx* c, float* gu, void* g, int S, int I, int act, int interleaved);
int gemm_nt(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K, int c_fp32);
// quant.cu
int hessian_add(llmq_ctx* c, const void* X, float* H, int rows, int n);
int hessian_diag(llmq_ctx* c, const float* H, float* d, int n);
size_t gptq_factor_workspace_bytes(int n);
int gptq_factor(llmq_ctx* c, const float* Hsum, double s, const int32_t* perm, double lambda, float* U, void* workspace,
                int n, int* ok);
int gptq_quantize(llmq_ctx* c, float* W, const float* Hinv, uint8_t* Q, float* scale, uint8_t* zero, const int32_t* group_of,
                  float* err1, double* loss, int out, int in, int group, int bits, int sym, int fit_groups,
                  int from_start);
// awq.cu
int f32_to_f16(llmq_ctx* c, const float* src, void* dst, size_t n);
int memcpy_2d(llmq_ctx* c, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height);
int col_abs_sum(llmq_ctx* c, const void* X, double* part, int rows, int d);
int sq_diff_sum(llmq_ctx* c, const void* a, const void* b, double* part, size_t n);
int awq_quant(llmq_ctx* c, const float* W, const float* s, void* Wq, int out, int in, int group, int bits, int sym, int minmax);
int awq_clip(llmq_ctx* c, const float* W, const float* s, const float* H, float* D, float* P, double* best_err, float* best_max,
             int out, int in, int group, int bits, int sym, int minmax, int n_shrink);
void destroy_cusolver(llmq_ctx* c);
// flash.cu
int attention_causal(llmq_ctx* c, const void* q, const void* k, const void* v, void* out, int windows, int T, int heads,
                     int kv_heads, int hd, int window, float scale);
}  // namespace llmq

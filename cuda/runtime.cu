// The context (stream, cuBLAS handle, allocations, graphs, events), copies,
// device information, and the API table: the library's one exported symbol.
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "common.cuh"
#include "stream.cuh"

namespace llmq {
static thread_local char t_err[1024];

void set_error(llmq_ctx* c, const char* fmt, ...) {
  char* dst = c ? c->err : t_err;
  const size_t n = c ? sizeof c->err : sizeof t_err;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(dst, n, fmt, ap);
  va_end(ap);
}

namespace {
const char* last_error(void) { return t_err; }

int device_info(char* name, int name_len, size_t* free_bytes, size_t* total_bytes, int* sms) {
  llmq_ctx* c = nullptr;
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n == 0) {
    set_error(c, "no CUDA device");
    return 1;
  }
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  snprintf(name, name_len, "%s", p.name);
  CK(cudaMemGetInfo(free_bytes, total_bytes));
  *sms = p.multiProcessorCount;
  return 0;
}

int ctx_malloc(llmq_ctx* c, void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (bytes == 0) return 0;
  CK(cudaMalloc(ptr, bytes));
  c->allocs[*ptr] = bytes;
  c->live_bytes += bytes;
  if (c->live_bytes > c->peak_bytes) c->peak_bytes = c->live_bytes;
  return 0;
}

int ctx_free(llmq_ctx* c, void* ptr) {
  if (!ptr) return 0;
  auto it = c->allocs.find(ptr);
  if (it == c->allocs.end()) {
    set_error(c, "free of %p, which this context did not allocate (or freed already)", ptr);
    return 1;
  }
  c->live_bytes -= it->second;
  c->allocs.erase(it);
  CK(cudaFree(ptr));
  return 0;
}

int ctx_destroy(llmq_ctx* c);

// ctx_create makes a context on device: a non-blocking stream and a cuBLAS
// handle bound to it, with an explicit workspace (which lets cuBLAS calls
// be captured in CUDA graphs).
int ctx_create(int device, llmq_ctx** out) {
  *out = nullptr;
  llmq_ctx* c = new llmq_ctx();
  c->device = device;
  if (const char* e = getenv("LLMQ_W4_FUSED_MAX_M")) c->fused_max_m = atoi(e);  // tuning overrides
  if (const char* e = getenv("LLMQ_W4_GEMV_MAX_M")) c->gemv_max_m = atoi(e);
  if (const char* e = getenv("LLMQ_W4_MMA_MAX_M")) c->mma_max_m = atoi(e);
  if (const char* e = getenv("LLMQ_W4_SWAP_MAX_M")) c->swap_max_m = atoi(e);
  if (const char* e = getenv("LLMQ_W4_SWAP_VARIANT")) c->swap_forced_variant = atoi(e);
  if (const char* e = getenv("LLMQ_W4_MMA_VARIANT")) c->mma_forced_variant = atoi(e);
  if (const char* e = getenv("LLMQ_W4_FUSED_VARIANT")) c->fused_forced_variant = atoi(e);
  if (const char* e = getenv("LLMQ_W4_WGMMA_MAX_M")) c->wgmma_max_m = atoi(e);
  if (const char* e = getenv("LLMQ_W4_SPLITS")) c->w4_splits = atoi(e);
  if (const char* e = getenv("LLMQ_DECODE_WAVE")) c->decode_wave = atoi(e);
  if (const char* e = getenv("LLMQ_PDL")) c->pdl = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_ATTN_EARLY")) c->attn_early = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_COMBINE_EARLY")) c->combine_early = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_MOE_ROUTED")) c->moe_routed = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_MOE_PREFETCH")) c->moe_prefetch = atoi(e);
  if (const char* e = getenv("LLMQ_MOE_FUSED_DOWN")) c->moe_fused_down = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_MOE_FUSED_STAGE")) c->moe_fused_stage = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_MOE_FUSED_ACT")) c->moe_fused_act = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_MOE_NORM_ROUTER")) c->moe_norm_router = atoi(e) != 0;
  if (const char* e = getenv("LLMQ_MOE_SPLITS")) c->moe_splits = atoi(e);
  auto fail = [&]() {
    set_error(nullptr, "%s", c->err);
    ctx_destroy(c);
    return 1;
  };
  if (c->moe_prefetch < 0 || c->moe_prefetch > 2) {
    set_error(c, "LLMQ_MOE_PREFETCH=%d: want 0 (none), 1 (after routing) or 2 (after the loop)", c->moe_prefetch);
    return fail();
  }
  if (cudaSetDevice(device) != cudaSuccess || cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    set_error(c, "cudaSetDevice(%d): %s", device, cudaGetErrorString(cudaGetLastError()));
    return fail();
  }
  // Programmatic dependent launch needs compute capability 9.0 (Hopper);
  // older GPUs launch as before, whatever LLMQ_PDL says.
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9)
    c->pdl = false;
  c->cc_major = major;
  cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    set_error(c, "cudaStreamCreateWithFlags failed: %s", cudaGetErrorString(e));
    return fail();
  }
  cublasStatus_t s = cublasCreate(&c->cublas);
  if (s != CUBLAS_STATUS_SUCCESS) {
    c->cublas = nullptr;
    set_error(c, "cublasCreate failed: status %d", (int)s);
    return fail();
  }
  const size_t ws = 64u << 20;
  if (ctx_malloc(c, &c->cublas_ws, ws)) return fail();
  c->cublas_ws_bytes = ws;
  if (cublasSetStream(c->cublas, c->stream) != CUBLAS_STATUS_SUCCESS ||
      cublasSetWorkspace(c->cublas, c->cublas_ws, ws) != CUBLAS_STATUS_SUCCESS) {
    set_error(c, "cublasSetStream/cublasSetWorkspace failed");
    return fail();
  }
  *out = c;
  return 0;
}

// ctx_destroy waits for the stream, then releases everything the context
// still holds; it returns the first error but releases all it can.
int ctx_destroy(llmq_ctx* c) {
  if (!c) return 0;
  int rc = 0;
  auto note = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && rc == 0) {
      set_error(nullptr, "%s failed: %s", what, cudaGetErrorString(e));
      rc = 1;
    }
  };
  if (c->stream) note(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
  for (void* g : c->graphs) note(cudaGraphExecDestroy((cudaGraphExec_t)g), "cudaGraphExecDestroy");
  for (void* e : c->events) note(cudaEventDestroy((cudaEvent_t)e), "cudaEventDestroy");
  destroy_cusolver(c);
  if (c->cublas && cublasDestroy(c->cublas) != CUBLAS_STATUS_SUCCESS && rc == 0) {
    set_error(nullptr, "cublasDestroy failed");
    rc = 1;
  }
  for (auto& a : c->allocs) note(cudaFree(a.first), "cudaFree");
  if (c->stream) note(cudaStreamDestroy(c->stream), "cudaStreamDestroy");
  delete c;
  return rc;
}

const char* ctx_error(llmq_ctx* c) { return c->err; }

int ctx_memory(llmq_ctx* c, llmq_memory* m) {
  m->live_bytes = c->live_bytes;
  m->peak_bytes = c->peak_bytes;
  m->cublas_bytes = c->cublas_ws_bytes;
  m->live_allocations = (int)c->allocs.size();
  m->graphs = (int)c->graphs.size();
  m->events = (int)c->events.size();
  return 0;
}

// memcpy_h2d copies n host bytes to d in the stream's order and waits for
// the stream, so that an error of the copy (or of a kernel queued before
// it) shows here. Returning before the wait (the source being pageable,
// staged by the runtime) was measured in the decode and gained nothing:
// NOTES.md, the thirty-first session.
int memcpy_h2d(llmq_ctx* c, void* d, const void* s, size_t n) {
  CK(cudaMemcpyAsync(d, s, n, cudaMemcpyHostToDevice, c->stream));
  CK(cudaStreamSynchronize(c->stream));
  return 0;
}
int memcpy_d2h(llmq_ctx* c, void* d, const void* s, size_t n) {
  CK(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToHost, c->stream));
  CK(cudaStreamSynchronize(c->stream));
  return 0;
}
int memcpy_d2d(llmq_ctx* c, void* d, const void* s, size_t n) {
  CK(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, c->stream));
  return 0;
}
int memset_(llmq_ctx* c, void* d, int v, size_t n) {
  CK(cudaMemsetAsync(d, v, n, c->stream));
  return 0;
}
int sync(llmq_ctx* c) {
  CK(cudaStreamSynchronize(c->stream));
  return 0;
}

int capture_begin(llmq_ctx* c) {
  CK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed));
  return 0;
}
int capture_end(llmq_ctx* c, void** exec) {
  *exec = nullptr;
  cudaGraph_t g;
  CK(cudaStreamEndCapture(c->stream, &g));
  cudaGraphExec_t e;
  cudaError_t err = cudaGraphInstantiate(&e, g, 0);
  cudaGraphDestroy(g);
  CK(err);
  c->graphs.insert((void*)e);
  *exec = (void*)e;
  return 0;
}
int graph_launch(llmq_ctx* c, void* exec) {
  CK(cudaGraphLaunch((cudaGraphExec_t)exec, c->stream));
  return 0;
}
int graph_destroy(llmq_ctx* c, void* exec) {
  if (!exec) return 0;
  if (!c->graphs.erase(exec)) {
    set_error(c, "graph %p does not belong to this context (or was destroyed already)", exec);
    return 1;
  }
  CK(cudaGraphExecDestroy((cudaGraphExec_t)exec));
  return 0;
}

int event_create(llmq_ctx* c, void** ev) {
  CK(cudaEventCreate((cudaEvent_t*)ev));
  c->events.insert(*ev);
  return 0;
}
int event_destroy(llmq_ctx* c, void* ev) {
  if (!c->events.erase(ev)) {
    set_error(c, "event %p does not belong to this context", ev);
    return 1;
  }
  CK(cudaEventDestroy((cudaEvent_t)ev));
  return 0;
}
int event_record(llmq_ctx* c, void* ev) {
  CK(cudaEventRecord((cudaEvent_t)ev, c->stream));
  return 0;
}
int event_elapsed(llmq_ctx* c, void* a, void* b, float* ms) {
  CK(cudaEventSynchronize((cudaEvent_t)b));
  CK(cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b));
  return 0;
}

// touch_kernel reads every 16 bytes of a buffer once (a read-bandwidth
// probe for the benchmark's "fraction of HBM bandwidth").
__global__ void touch_kernel(const uint4* __restrict__ p, size_t n, unsigned* out) { touch_range(p, n, out); }

int read_probe(llmq_ctx* c, const void* p, size_t bytes, void* out) {
  touch_kernel<<<c->sms * 8, 512, 0, c->stream>>>((const uint4*)p, bytes / 16, (unsigned*)out);
  CK_LAUNCH("touch_kernel");
  return 0;
}

const llmq_api kAPI = {
    LLMQ_API_VERSION,
    sizeof(llmq_api),
    last_error,
    device_info,
    ctx_create,
    ctx_destroy,
    ctx_error,
    ctx_memory,
    ctx_malloc,
    ctx_free,
    memcpy_h2d,
    memcpy_d2h,
    memcpy_d2d,
    memset_,
    sync,
    capture_begin,
    capture_end,
    graph_launch,
    graph_destroy,
    event_create,
    event_destroy,
    event_record,
    event_elapsed,
    w4a16_workspace_bytes,
    w4a16_gemm,
    w4a16_plan,
    w4a16_set_path,
    w4_dequant,
    gemm_f16,
    read_probe,
    embed,
    rmsnorm,
    add,
    add_bias,
    qk_rope_store,
    attention_workspace_bytes,
    attention,
    gated_act,
    nll,
    argmax_rows,
    gemm_nt,
    hessian_add,
    hessian_diag,
    gptq_factor_workspace_bytes,
    gptq_factor,
    gptq_quantize,
    f32_to_f16,
    memcpy_2d,
    col_abs_sum,
    sq_diff_sum,
    awq_quant,
    awq_clip,
    attention_causal,
    fake_quant,
    moe_route,
    moe_router,
    moe_plan,
    moe_route_plan,
    moe_gemv,
    moe_act,
    sample_rows,
    moe_gemv_routed,
    rmsnorm_router,
    f16_to_f32,
};
}  // namespace
}  // namespace llmq

extern "C" __attribute__((visibility("default"))) const llmq_api* llmq_api_get(void) { return &llmq::kAPI; }

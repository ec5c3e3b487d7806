// trace.c: every kernel's start and end on the GPU, for machines without
// nsys — a CUPTI injection library (the CUDA driver loads the library that
// CUDA_INJECTION64_PATH names at cuInit and calls its InitializeInjection).
//
//   CUDA_INJECTION64_PATH=$PWD/build/libllmqtrace.so LLMQ_TRACE_OUT=trace.csv
//   build/device/llmq bench decode MODEL --device cuda ...
//
// It enables CUPTI's concurrent-kernel activity records, which time each
// kernel of a CUDA graph as its own record (the node level of nsys's
// --cuda-graph-trace=node), and writes them as they arrive, one CSV row a
// kernel: "Start (ns)", "Duration (ns)", stream, graph node id and the
// demangled name — the columns evals/trace_summary.py reads from nsys's
// cuda_gpu_trace report. Rows come in the order CUPTI delivers its
// buffers, not sorted; the summary sorts them.
//
// CUPTI hands a buffer back when it is full or when asked: a thread here
// asks every LLMQ_TRACE_FLUSH_MS (default 100) for the buffers whose
// records are all complete (cuptiActivityFlushAll(0)), and when the
// process destroys a stream or a context (llmq's Close) the rest are
// forced out, since a Go program exits without running C's atexit
// handlers. A process that exits without Close loses at most the last
// period's records; a forced flush may hand back records whose kernel
// has not ended, which are counted and left out.
//
// The kernel record's struct has a version number that changes between
// CUDA releases (CUpti_ActivityKernel9, 10, 11, ...); the fields read here
// (start, end, streamId, graphNodeId, name) keep their names in every
// version since graphs were added, so the build passes the newest the
// installed cupti_activity.h declares as KERNEL_RECORD.
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#ifndef KERNEL_RECORD
#error "build with -DKERNEL_RECORD=CUpti_ActivityKernelN (the newest cupti_activity.h declares)"
#endif

// libstdc++'s demangler (the library links it): a malloc'd string, or NULL.
char *__cxa_demangle(const char *mangled, char *buf, size_t *n, int *status);

static FILE *out;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long kernels, dropped, incomplete;
static unsigned flush_ms = 100;

#define CHECK(call)                                                             \
  do {                                                                          \
    CUptiResult r_ = (call);                                                    \
    if (r_ != CUPTI_SUCCESS) {                                                  \
      const char *s_ = "?";                                                     \
      cuptiGetResultString(r_, &s_);                                            \
      fprintf(stderr, "llmqtrace: %s: %s\n", #call, s_);                        \
      return 0;                                                                 \
    }                                                                           \
  } while (0)

static void CUPTIAPI request(uint8_t **buf, size_t *size, size_t *max_records) {
  *size = 4 << 20;
  *buf = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, *size);
  *max_records = 0;  // as many as fit
}

static void CUPTIAPI complete(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *r = NULL;
  pthread_mutex_lock(&mu);
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const KERNEL_RECORD *k = (const KERNEL_RECORD *)r;
    if (k->start == 0 || k->end < k->start) {  // forced out before the kernel ended
      incomplete++;
      continue;
    }
    int status = 0;
    char *name = k->name ? __cxa_demangle(k->name, NULL, NULL, &status) : NULL;
    fprintf(out, "%llu,%llu,%u,%llu,\"%s\"\n", (unsigned long long)k->start,
            (unsigned long long)(k->end - k->start), k->streamId, (unsigned long long)k->graphNodeId,
            name ? name : k->name ? k->name : "?");
    free(name);
    kernels++;
  }
  size_t d = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &d) == CUPTI_SUCCESS) dropped += d;
  fflush(out);
  pthread_mutex_unlock(&mu);
  free(buf);
}

// on_api flushes every record at a stream's or a context's destruction.
static void CUPTIAPI on_api(void *user, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void *data) {
  (void)user;
  const CUpti_CallbackData *cb = (const CUpti_CallbackData *)data;
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API || cb->callbackSite != CUPTI_API_ENTER) return;
  if (id == CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2 || id == CUPTI_DRIVER_TRACE_CBID_cuCtxDestroy_v2) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&mu);
    fprintf(stderr, "llmqtrace: %llu kernels written, %llu records dropped, %llu incomplete\n", kernels, dropped,
            incomplete);
    pthread_mutex_unlock(&mu);
  }
}

// flusher asks CUPTI for its completed buffers every flush_ms.
static void *flusher(void *arg) {
  (void)arg;
  for (;;) {
    usleep(flush_ms * 1000);
    cuptiActivityFlushAll(0);
  }
  return NULL;
}

int InitializeInjection(void) {
  const char *path = getenv("LLMQ_TRACE_OUT");
  out = fopen(path ? path : "llmq-trace.csv", "w");
  if (!out) {
    perror("llmqtrace: LLMQ_TRACE_OUT");
    return 0;
  }
  fprintf(out, "Start (ns),Duration (ns),Stream,Graph node,Name\n");
  const char *ms = getenv("LLMQ_TRACE_FLUSH_MS");
  CUpti_SubscriberHandle sub;
  CHECK(cuptiSubscribe(&sub, on_api, NULL));
  CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2));
  CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuCtxDestroy_v2));
  CHECK(cuptiActivityRegisterCallbacks(request, complete));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  if (ms && atoi(ms) > 0) flush_ms = (unsigned)atoi(ms);
  pthread_t th;
  if (pthread_create(&th, NULL, flusher, NULL) == 0)
    pthread_detach(th);
  else
    fprintf(stderr, "llmqtrace: no flush thread: records come at Close only\n");
  fprintf(stderr, "llmqtrace: kernels to %s\n", path ? path : "llmq-trace.csv");
  return 1;
}

//go:build cgo

// Package cuda runs llmq's models and kernels on an NVIDIA GPU. The
// kernels live in a shared library built by nvcc (`make cuda` →
// build/libllmqcuda.so); this package loads it at run time with dlopen, so
// llmq builds with plain `go build` anywhere and reports plainly when no
// GPU library is present.
//
// Three layers:
//
//   - Lib is the loaded library: its C API (llmq.h) is one table of typed
//     function pointers, resolved once by Open and checked against the
//     version this package was built for. Lib holds no GPU state.
//   - Context is what the library calls a context (llmq_ctx): one CUDA
//     stream, a cuBLAS handle bound to it, and everything allocated or
//     captured through it (buffers, graphs, events), which Close releases.
//     Kernels, copies and graphs of a context run in order on its stream.
//     A Context is not safe for concurrent use; Model serialises.
//   - Model (model.go) is the GPU backend of llm.Backend: a checkpoint's
//     weights in its own Context, forward passes, perplexity windows and a
//     memory report, behind one mutex.
//
// Every CUDA error comes back as a Go error naming the call that failed.
// Device pointers travel as integers, never as Go pointers.
package cuda

/*
#cgo CFLAGS: -I${SRCDIR}
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "llmq.h"

typedef uintptr_t P;
typedef const llmq_api* A;
static void* lib_open(const char* path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static const char* lib_error(void) { const char* e = dlerror(); return e ? e : "unknown dlopen error"; }
static A lib_api(void* h) {
	void* f = dlsym(h, "llmq_api_get");
	return f ? ((A (*)(void))f)() : 0;
}
static int api_version(A a) { return a->version; }
static size_t api_size(A a) { return a->size; }

// Calls without a context report through a thread-local message, copied
// here in the same C call (a goroutine may change threads between calls).
static void copy_err(A a, char* err, int n) { strncpy(err, a->last_error(), n - 1); err[n - 1] = 0; }
static int c_info(A a, char* name, int n, size_t* fr, size_t* tot, int* sms, char* err, int en) {
	int r = a->device_info(name, n, fr, tot, sms);
	if (r) copy_err(a, err, en);
	return r;
}
static int c_ctx_create(A a, llmq_ctx** c, char* err, int en) {
	int r = a->ctx_create(0, c);
	if (r) copy_err(a, err, en);
	return r;
}
static int c_ctx_destroy(A a, llmq_ctx* c, char* err, int en) {
	int r = a->ctx_destroy(c);
	if (r) copy_err(a, err, en);
	return r;
}
static const char* c_ctx_error(A a, llmq_ctx* c) { return a->ctx_error(c); }
static int c_memory(A a, llmq_ctx* c, llmq_memory* m) { return a->ctx_memory(c, m); }

static int c_malloc(A a, llmq_ctx* c, P* p, size_t n) { void* v = 0; int r = a->mem_alloc(c, &v, n); *p = (P)v; return r; }
static int c_free(A a, llmq_ctx* c, P p) { return a->mem_free(c, (void*)p); }
static int c_h2d(A a, llmq_ctx* c, P dst, const void* src, size_t n) { return a->memcpy_h2d(c, (void*)dst, src, n); }
static int c_d2h(A a, llmq_ctx* c, void* dst, P src, size_t n) { return a->memcpy_d2h(c, dst, (const void*)src, n); }
static int c_d2d(A a, llmq_ctx* c, P dst, P src, size_t n) { return a->memcpy_d2d(c, (void*)dst, (const void*)src, n); }
static int c_memset(A a, llmq_ctx* c, P p, int v, size_t n) { return a->mem_set(c, (void*)p, v, n); }
static int c_sync(A a, llmq_ctx* c) { return a->sync(c); }
static int c_capture_begin(A a, llmq_ctx* c) { return a->capture_begin(c); }
static int c_capture_end(A a, llmq_ctx* c, P* g) { void* v = 0; int r = a->capture_end(c, &v); *g = (P)v; return r; }
static int c_graph_launch(A a, llmq_ctx* c, P g) { return a->graph_launch(c, (void*)g); }
static int c_graph_destroy(A a, llmq_ctx* c, P g) { return a->graph_destroy(c, (void*)g); }
static int c_event_create(A a, llmq_ctx* c, P* e) { void* v = 0; int r = a->event_create(c, &v); *e = (P)v; return r; }
static int c_event_destroy(A a, llmq_ctx* c, P e) { return a->event_destroy(c, (void*)e); }
static int c_event_record(A a, llmq_ctx* c, P e) { return a->event_record(c, (void*)e); }
static int c_event_elapsed(A a, llmq_ctx* c, P s, P e, float* ms) { return a->event_elapsed(c, (void*)s, (void*)e, ms); }

static size_t c_ws(A a, int m, int n) { return a->w4a16_workspace_bytes(m, n); }
static int c_gemm_w4(A a, llmq_ctx* c, P A_, P B, P S, P Z, P perm, P aperm, P c0, P c1, P c2, int n0, int n1, int n2, int act,
		P ws, P scratch, int M, int N, int K, int g, int bits) {
	void* outs[3] = {(void*)c0, (void*)c1, (void*)c2};
	int cols[3] = {n0, n1, n2};
	return a->w4a16_gemm(c, (const void*)A_, (const void*)B, (const void*)S, (const void*)Z, (const int32_t*)perm, (void*)aperm,
		outs, cols, !n0 ? 0 : n2 ? 3 : n1 ? 2 : 1, act, (void*)ws, (void*)scratch, M, N, K, g, bits);
}
static int c_set_path(A a, llmq_ctx* c, int p) { return a->w4a16_set_path(c, p); }
static int c_plan(A a, llmq_ctx* c, int M, int N, int K, int g, int bits, char* out, int n) {
	return a->w4a16_plan(c, M, N, K, g, bits, out, n);
}
static int c_dequant(A a, llmq_ctx* c, P B, P S, P Z, P W, int N, int K, int g, int bits) {
	return a->w4_dequant(c, (const void*)B, (const void*)S, (const void*)Z, (void*)W, N, K, g, bits);
}
static int c_gemm_f16(A a, llmq_ctx* c, P A_, P W, P C, int M, int N, int K) {
	return a->gemm_f16(c, (const void*)A_, (const void*)W, (void*)C, M, N, K);
}
static int c_probe(A a, llmq_ctx* c, P p, size_t n, P out) { return a->read_probe(c, (const void*)p, n, (void*)out); }
static int c_embed(A a, llmq_ctx* c, P ids, P E, P x, int T, int H, float scale) {
	return a->embed(c, (const int32_t*)ids, (const void*)E, (float*)x, T, H, scale);
}
static int c_rmsnorm(A a, llmq_ctx* c, P x, P d, P sums, P dn, P y, P ids, P wts, int k, P rows, P w, P out, int n, int H, float eps) {
	return a->rmsnorm(c, (float*)x, (const void*)d, (float*)sums, (const float*)dn, (float*)y, (const int32_t*)ids, (const float*)wts, k,
		(const int32_t*)rows, (const float*)w, (void*)out, n, H, eps);
}
static int c_add(A a, llmq_ctx* c, P x, P d, size_t n) { return a->add(c, (float*)x, (const void*)d, n); }
static int c_bias(A a, llmq_ctx* c, P y, P b, int T, int N) { return a->add_bias(c, (void*)y, (const void*)b, T, N); }
static int c_qk_rope_store(A a, llmq_ctx* c, P q, P k, P v, P sums, P qn, P kn, float eps, P rs, P rp, P base, P cap, P cs, P sn,
		int layer, int layers, int T, int heads, int kvh, int hd) {
	return a->qk_rope_store(c, (void*)q, (void*)k, (void*)v, (float*)sums, (const float*)qn, (const float*)kn, eps,
		(const int32_t*)rs, (const int32_t*)rp, (const uint64_t*)base, (const int32_t*)cap, (const float*)cs,
		(const float*)sn, layer, layers, T, heads, kvh, hd);
}
static size_t c_attn_ws(A a, int T, int heads, int hd, int maxk) { return a->attention_workspace_bytes(T, heads, hd, maxk); }
static int c_attention(A a, llmq_ctx* c, P q, P out, P ws, P rs, P rp, P base, P cap, int layer, int layers, int T, int heads,
		int kvh, int hd, int maxk, int window, float scale) {
	return a->attention(c, (const void*)q, (void*)out, (void*)ws, (const int32_t*)rs, (const int32_t*)rp, (const uint64_t*)base,
		(const int32_t*)cap, layer, layers, T, heads, kvh, hd, maxk, window, scale);
}
static int c_gated_act(A a, llmq_ctx* c, P g, P u, size_t n, int act) { return a->gated_act(c, (void*)g, (const void*)u, n, act); }
static int c_nll(A a, llmq_ctx* c, P logits, P targets, P nll, int T, int V) {
	return a->nll(c, (const float*)logits, (const int32_t*)targets, (float*)nll, T, V);
}
static int c_argmax_rows(A a, llmq_ctx* c, P logits, P out, int T, int V) {
	return a->argmax_rows(c, (const float*)logits, (int32_t*)out, T, V);
}
static int c_gemm_nt(A a, llmq_ctx* c, P A_, P W, P C, int M, int N, int K, int c32) {
	return a->gemm_nt(c, (const void*)A_, (const void*)W, (void*)C, M, N, K, c32);
}
static int c_hessian_add(A a, llmq_ctx* c, P X, P H, int rows, int n) { return a->hessian_add(c, (const void*)X, (float*)H, rows, n); }
static int c_hessian_diag(A a, llmq_ctx* c, P H, P d, int n) { return a->hessian_diag(c, (const float*)H, (float*)d, n); }
static size_t c_factor_ws(A a, int n) { return a->gptq_factor_workspace_bytes(n); }
static int c_gptq_factor(A a, llmq_ctx* c, P H, double s, P perm, double lambda, P U, P ws, int n, int* ok) {
	return a->gptq_factor(c, (const float*)H, s, (const int32_t*)perm, lambda, (float*)U, (void*)ws, n, ok);
}
static int c_gptq_quantize(A a, llmq_ctx* c, P W, P Hinv, P Q, P scale, P zero, P gof, P err1, P loss, int out, int in, int group,
		int bits, int sym, int fit, int from_start) {
	return a->gptq_quantize(c, (float*)W, (const float*)Hinv, (uint8_t*)Q, (float*)scale, (uint8_t*)zero, (const int32_t*)gof,
		(float*)err1, (double*)loss, out, in, group, bits, sym, fit, from_start);
}
static int c_f32_to_f16(A a, llmq_ctx* c, P src, P dst, size_t n) { return a->f32_to_f16(c, (const float*)src, (void*)dst, n); }
static int c_memcpy_2d(A a, llmq_ctx* c, P dst, size_t dp, P src, size_t sp, size_t w, size_t h) {
	return a->memcpy_2d(c, (void*)dst, dp, (const void*)src, sp, w, h);
}
static int c_col_abs_sum(A a, llmq_ctx* c, P X, P part, int rows, int d) { return a->col_abs_sum(c, (const void*)X, (double*)part, rows, d); }
static int c_sq_diff_sum(A a, llmq_ctx* c, P x, P y, P part, size_t n) {
	return a->sq_diff_sum(c, (const void*)x, (const void*)y, (double*)part, n);
}
static int c_awq_quant(A a, llmq_ctx* c, P W, P s, P Wq, int out, int in, int group, int bits, int sym, int minmax) {
	return a->awq_quant(c, (const float*)W, (const float*)s, (void*)Wq, out, in, group, bits, sym, minmax);
}
static int c_awq_clip(A a, llmq_ctx* c, P W, P s, P H, P D, P Pm, P err, P best, int out, int in, int group, int bits, int sym,
		int minmax, int n) {
	return a->awq_clip(c, (const float*)W, (const float*)s, (const float*)H, (float*)D, (float*)Pm, (double*)err, (float*)best,
		out, in, group, bits, sym, minmax, n);
}
static int c_attention_causal(A a, llmq_ctx* c, P q, P k, P v, P out, int windows, int T, int heads, int kvh, int hd,
		int window, float scale) {
	return a->attention_causal(c, (const void*)q, (const void*)k, (const void*)v, (void*)out, windows, T, heads, kvh, hd,
		window, scale);
}
static int c_fake_quant(A a, llmq_ctx* c, P in, P out, int rows, int cols, int bits, int fp8, int per_token, float t) {
	return a->fake_quant(c, (const void*)in, (void*)out, rows, cols, bits, fp8, per_token, t);
}
static int c_moe_route(A a, llmq_ctx* c, P logits, P ids, P weights, int T, int E, int k, int norm) {
	return a->moe_route(c, (const float*)logits, (int32_t*)ids, (float*)weights, T, E, k, norm);
}
static int c_moe_router(A a, llmq_ctx* c, P h, P W, P logits, int T, int E, int H) {
	return a->moe_router(c, (const void*)h, (const float*)W, (float*)logits, T, E, H);
}
static int c_moe_plan(A a, llmq_ctx* c, P ids, int S, int E, int mt, P order, P chunks, int max_chunks) {
	return a->moe_plan(c, (const int32_t*)ids, S, E, mt, (int32_t*)order, (int32_t*)chunks, max_chunks);
}
static int c_moe_route_plan(A a, llmq_ctx* c, P logits, P ids, P weights, int T, int E, int k, int norm, int mt, P order, P chunks,
		int max_chunks) {
	return a->moe_route_plan(c, (const float*)logits, (int32_t*)ids, (float*)weights, T, E, k, norm, mt, (int32_t*)order,
		(int32_t*)chunks, max_chunks);
}
static int c_moe_gemv(A a, llmq_ctx* c, P A_, int a_div, P order, P chunks, int max_chunks, int mt, int slots, P B, P S, P Z, P W16,
		P out, int N, int K, int group, P gated, int act) {
	return a->moe_gemv(c, (const void*)A_, a_div, (const int32_t*)order, (const int32_t*)chunks, max_chunks, mt, slots, (const void*)B,
		(const void*)S, (const void*)Z, (const void*)W16, (float*)out, N, K, group, (void*)gated, act);
}
static int c_moe_act(A a, llmq_ctx* c, P gu, P g, int S, int I, int act, int interleaved) {
	return a->moe_act(c, (float*)gu, (void*)g, S, I, act, interleaved);
}
static int c_moe_gemv_routed(A a, llmq_ctx* c, P A_, P logits, int T, int E, int k, int norm, P ids, P weights, P order, P chunks,
		P B, P S, P Z, P out, int N, int K, int group, P gated, int act, P nB, P nS, P nZ, int nN, int nK, int ngroup, P nout) {
	return a->moe_gemv_routed(c, (const void*)A_, (const float*)logits, T, E, k, norm, (int32_t*)ids, (float*)weights,
		(int32_t*)order, (int32_t*)chunks, (const void*)B, (const void*)S, (const void*)Z, (float*)out, N, K, group, (void*)gated, act,
		(const void*)nB, (const void*)nS, (const void*)nZ, nN, nK, ngroup, (float*)nout);
}
static int c_rmsnorm_router(A a, llmq_ctx* c, P x, P d, P sums, P w, P out, P W, P logits, int n, int H, int E, float eps) {
	return a->rmsnorm_router(c, (const float*)x, (const void*)d, (const float*)sums, (const float*)w, (void*)out, (const float*)W,
		(float*)logits, n, H, E, eps);
}
static int c_f16_to_f32(A a, llmq_ctx* c, P src, P dst, size_t n) { return a->f16_to_f32(c, (const void*)src, (float*)dst, n); }
static int c_sample_rows(A a, llmq_ctx* c, P logits, P params, P out, int T, int V) {
	return a->sample_rows(c, (const float*)logits, (const double*)params, (int32_t*)out, T, V);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"

	"github.com/llmq/llmq/pack"
)

// Lib is a loaded llmq CUDA library: its API table, resolved once.
type Lib struct {
	path string
	api  C.A
}

// Candidates are the absolute paths Open("") tries, in order:
// $LLMQ_CUDA_LIB, libllmqcuda.so beside the executable (build/llmq →
// build/libllmqcuda.so), and build/libllmqcuda.so under the working
// directory.
func Candidates() []string {
	var out []string
	add := func(p string) {
		if abs, err := filepath.Abs(p); err == nil && !slices.Contains(out, abs) {
			out = append(out, abs)
		}
	}
	if p := os.Getenv("LLMQ_CUDA_LIB"); p != "" {
		add(p)
	}
	if exe, err := os.Executable(); err == nil {
		add(filepath.Join(filepath.Dir(exe), "libllmqcuda.so"))
	}
	add(filepath.Join("build", "libllmqcuda.so"))
	return out
}

// DefaultPath is the first of Candidates that exists ("" when none does).
func DefaultPath() string {
	for _, p := range Candidates() {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// Open loads the library at path ("" for DefaultPath) and resolves its
// API table. The library stays loaded for the life of the process (dlopen
// counts references: opening it again is cheap).
func Open(path string) (*Lib, error) {
	if path == "" {
		if path = DefaultPath(); path == "" {
			return nil, fmt.Errorf("GPU unavailable: no llmq CUDA library (tried %s; `make cuda` builds it)", strings.Join(Candidates(), ", "))
		}
	}
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	h := C.lib_open(cp)
	if h == nil {
		return nil, fmt.Errorf("GPU unavailable: cannot load %s: %s", path, C.GoString(C.lib_error()))
	}
	api := C.lib_api(h)
	if api == nil {
		return nil, fmt.Errorf("%s is not a matching llmq CUDA library: no llmq_api_get symbol; rebuild it with `make cuda`", path)
	}
	if v, n := int(C.api_version(api)), uintptr(C.api_size(api)); v != C.LLMQ_API_VERSION || n != unsafe.Sizeof(C.llmq_api{}) {
		return nil, fmt.Errorf("%s has API version %d (%d bytes), this llmq needs version %d (%d bytes); rebuild it with `make cuda`",
			path, v, n, C.LLMQ_API_VERSION, unsafe.Sizeof(C.llmq_api{}))
	}
	return &Lib{path: path, api: api}, nil
}

// Path is where the library was loaded from.
func (l *Lib) Path() string { return l.path }

const errLen = 1024

// Device describes the GPU.
type Device struct {
	Name        string
	FreeBytes   uint64
	TotalBytes  uint64
	SMs         int
	LibraryPath string
}

// Device queries GPU 0 (its free memory counts every process's use).
func (l *Lib) Device() (Device, error) {
	var name [256]C.char
	var msg [errLen]C.char
	var fr, tot C.size_t
	var sms C.int
	if C.c_info(l.api, &name[0], 256, &fr, &tot, &sms, &msg[0], errLen) != 0 {
		return Device{}, fmt.Errorf("llmq device_info: %s", C.GoString(&msg[0]))
	}
	return Device{Name: C.GoString(&name[0]), FreeBytes: uint64(fr), TotalBytes: uint64(tot), SMs: int(sms), LibraryPath: l.path}, nil
}

// Context is a library context on GPU 0: a stream, a cuBLAS handle and
// everything allocated, captured or created through it. Not safe for
// concurrent use.
type Context struct {
	lib *Lib
	c   *C.llmq_ctx
}

var errClosed = errors.New("the GPU context is closed")

// NewContext creates a context; Close releases it.
func (l *Lib) NewContext() (*Context, error) {
	var c *C.llmq_ctx
	var msg [errLen]C.char
	if C.c_ctx_create(l.api, &c, &msg[0], errLen) != 0 {
		return nil, fmt.Errorf("creating a GPU context (llmq ctx_create): %s", C.GoString(&msg[0]))
	}
	return &Context{lib: l, c: c}, nil
}

// Lib is the library the context belongs to.
func (x *Context) Lib() *Lib { return x.lib }

// Close waits for the context's stream and frees everything it holds:
// buffers, graphs, events, the cuBLAS handle and the stream. Closing twice
// is harmless.
func (x *Context) Close() error {
	if x.c == nil {
		return nil
	}
	var msg [errLen]C.char
	rc := C.c_ctx_destroy(x.lib.api, x.c, &msg[0], errLen)
	x.c = nil
	if rc != 0 {
		return fmt.Errorf("llmq ctx_destroy: %s", C.GoString(&msg[0]))
	}
	return nil
}

// do runs f, a call of the library on the context, and turns a nonzero
// return code into an error naming call with the context's message; on a
// closed context it returns an error without calling f.
func (x *Context) do(call string, f func() C.int) error {
	if err := x.live(); err != nil {
		return fmt.Errorf("llmq %s: %w", call, err)
	}
	if f() == 0 {
		return nil
	}
	return fmt.Errorf("llmq %s: %s", call, C.GoString(C.c_ctx_error(x.lib.api, x.c)))
}

// live reports a closed context as an error.
func (x *Context) live() error {
	if x == nil || x.c == nil {
		return errClosed
	}
	return nil
}

// ContextMemory is what a context holds on the device.
type ContextMemory struct {
	LiveBytes, PeakBytes int64 // allocated through the context (cuBLAS workspace included)
	CuBLASBytes          int64 // the cuBLAS workspace
	Allocations          int
	Graphs, Events       int
}

// Memory reports the context's allocations, graphs and events.
func (x *Context) Memory() (ContextMemory, error) {
	if err := x.live(); err != nil {
		return ContextMemory{}, err
	}
	var m C.llmq_memory
	if err := x.do("ctx_memory", func() C.int { return C.c_memory(x.lib.api, x.c, &m) }); err != nil {
		return ContextMemory{}, err
	}
	return ContextMemory{LiveBytes: int64(m.live_bytes), PeakBytes: int64(m.peak_bytes), CuBLASBytes: int64(m.cublas_bytes),
		Allocations: int(m.live_allocations), Graphs: int(m.graphs), Events: int(m.events)}, nil
}

// Buf is device memory.
type Buf struct {
	p     C.P
	Bytes int
}

// Alloc allocates device memory (cudaMalloc) owned by the context.
func (x *Context) Alloc(bytes int) (Buf, error) {
	if err := x.live(); err != nil {
		return Buf{}, err
	}
	var p C.P
	if err := x.do("malloc", func() C.int { return C.c_malloc(x.lib.api, x.c, &p, C.size_t(bytes)) }); err != nil {
		return Buf{}, fmt.Errorf("allocating %d bytes on the GPU: %w", bytes, err)
	}
	return Buf{p: p, Bytes: bytes}, nil
}

// Free releases device memory allocated through the context; freeing an
// unset Buf does nothing.
func (x *Context) Free(b Buf) error {
	if b.p == 0 {
		return nil
	}
	if err := x.live(); err != nil {
		return err
	}
	return x.do("free", func() C.int { return C.c_free(x.lib.api, x.c, b.p) })
}

// Offset returns a view of b starting bytes in.
func (b Buf) Offset(bytes int) Buf { return Buf{p: b.p + C.P(bytes), Bytes: b.Bytes - bytes} }

// Nil reports whether b is unset.
func (b Buf) Nil() bool { return b.p == 0 }

// Ptr is the device address of b, for arrays of pointers.
func (b Buf) Ptr() uint64 { return uint64(b.p) }

// Upload copies a host slice into device memory, in the stream's order
// after the work queued before it, and waits for the copy.
func Upload[T any](x *Context, dst Buf, src []T) error {
	if len(src) == 0 {
		return nil
	}
	if err := x.live(); err != nil {
		return err
	}
	n := len(src) * int(unsafe.Sizeof(src[0]))
	if n > dst.Bytes {
		return fmt.Errorf("upload of %d bytes into a %d-byte buffer", n, dst.Bytes)
	}
	return x.do("memcpy_h2d", func() C.int { return C.c_h2d(x.lib.api, x.c, dst.p, unsafe.Pointer(&src[0]), C.size_t(n)) })
}

// Download copies device memory into a host slice, after the work queued
// before it.
func Download[T any](x *Context, dst []T, src Buf) error {
	if len(dst) == 0 {
		return nil
	}
	if err := x.live(); err != nil {
		return err
	}
	n := len(dst) * int(unsafe.Sizeof(dst[0]))
	if n > src.Bytes {
		return fmt.Errorf("download of %d bytes from a %d-byte buffer", n, src.Bytes)
	}
	return x.do("memcpy_d2h", func() C.int { return C.c_d2h(x.lib.api, x.c, unsafe.Pointer(&dst[0]), src.p, C.size_t(n)) })
}

// AllocFrom allocates a buffer holding a copy of src.
func AllocFrom[T any](x *Context, src []T) (Buf, error) {
	var zero T
	b, err := x.Alloc(max(1, len(src)) * int(unsafe.Sizeof(zero)))
	if err != nil {
		return b, err
	}
	if err := Upload(x, b, src); err != nil {
		x.Free(b)
		return Buf{}, err
	}
	return b, nil
}

// Copy copies n bytes between device buffers.
func (x *Context) Copy(dst, src Buf, n int) error {
	return x.do("memcpy_d2d", func() C.int { return C.c_d2d(x.lib.api, x.c, dst.p, src.p, C.size_t(n)) })
}

// Memset fills n bytes with v.
func (x *Context) Memset(b Buf, v byte, n int) error {
	return x.do("memset", func() C.int { return C.c_memset(x.lib.api, x.c, b.p, C.int(v), C.size_t(n)) })
}

// Sync waits for queued work and reports any asynchronous error.
func (x *Context) Sync() error {
	if err := x.live(); err != nil {
		return err
	}
	return x.do("sync", func() C.int { return C.c_sync(x.lib.api, x.c) })
}

// Event is a CUDA event for timing, owned by its context.
type Event struct{ p C.P }

// NewEvent creates an event.
func (x *Context) NewEvent() (Event, error) {
	var p C.P
	err := x.do("event_create", func() C.int { return C.c_event_create(x.lib.api, x.c, &p) })
	return Event{p}, err
}

// Record records e on the context's stream.
func (x *Context) Record(e Event) error {
	return x.do("event_record", func() C.int { return C.c_event_record(x.lib.api, x.c, e.p) })
}

// Elapsed returns milliseconds between two recorded events.
func (x *Context) Elapsed(a, b Event) (float64, error) {
	var ms C.float
	err := x.do("event_elapsed", func() C.int { return C.c_event_elapsed(x.lib.api, x.c, a.p, b.p, &ms) })
	return float64(ms), err
}

// DestroyEvent releases an event.
func (x *Context) DestroyEvent(e Event) error {
	return x.do("event_destroy", func() C.int { return C.c_event_destroy(x.lib.api, x.c, e.p) })
}

// WorkspaceBytes is the zeroed workspace GemmW4 needs for M×N.
func (l *Lib) WorkspaceBytes(M, N int) int { return int(C.c_ws(l.api, C.int(M), C.int(N))) }

// Path values for SetPath.
const (
	PathAuto   = 0
	PathFused  = 1
	PathCuBLAS = 2
	PathGEMV   = 3 // M ≤ 2
	PathMMA    = 4 // the GEMV on the Tensor Cores (v11), M ≤ 64
	PathSwap   = 5 // v11 with the operands swapped (v15), M ≤ 32
)

// SetPath forces the context's W4A16 path (tests and benchmarks).
func (x *Context) SetPath(p int) error {
	return x.do("w4a16_set_path", func() C.int { return C.c_set_path(x.lib.api, x.c, C.int(p)) })
}

// GemmW4 computes C[M,N] = A[M,K]·dequant(w) in fp16. ws must hold
// WorkspaceBytes(M, N) zeroed bytes; scratch (K·N fp16) enables the
// dequantize+cuBLAS path (large M; group sizes that are not powers of
// two, at every M); aperm (M·K fp16) is needed for act-order.
func (x *Context) GemmW4(A, C_ Buf, w *W4, M int, ws, scratch, aperm Buf) error {
	return x.GemmW4Into(A, []Buf{C_}, w, M, ws, scratch, aperm)
}

// GemmW4Into is GemmW4 for a joined layer (w.Cols: the widths of the
// layers it joins, e.g. q, k and v): outs[i] gets the M rows of the
// i-th layer's columns. With one output it is GemmW4. A gated layer
// (w.Gated) writes act(gate)·up, M × N/2, to its one output.
func (x *Context) GemmW4Into(A Buf, outs []Buf, w *W4, M int, ws, scratch, aperm Buf) error {
	cols := w.Cols
	if len(cols) == 0 {
		cols = []int{w.N}
	}
	if w.Gated != NotGated {
		cols = []int{w.N / 2}
	}
	if len(outs) != len(cols) || len(outs) > 3 {
		return fmt.Errorf("w4a16_gemm: %d outputs for a layer joining %d (at most 3)", len(outs), len(cols))
	}
	var p [3]C.P
	var n [3]C.int
	for i := range outs {
		p[i], n[i] = outs[i].p, C.int(cols[i])
	}
	return x.do("w4a16_gemm", func() C.int {
		return C.c_gemm_w4(x.lib.api, x.c, A.p, w.B.p, w.S.p, w.Z.p, w.Perm.p, aperm.p, p[0], p[1], p[2], n[0], n[1], n[2],
			C.int(w.Gated.act()), ws.p, scratch.p, C.int(M), C.int(w.N), C.int(w.K), C.int(w.Group), C.int(w.codeBits()))
	})
}

// GemmW4Sums adds the fp32 sums A·W (M × w.N) into ws and leaves them
// there (w4a16_gemm with no outputs, API 21): the kernels skip their K
// splits' last step (the tile counter, the last CTA's read-back into fp16
// outputs), which later kernels do instead and zero them: for o and
// down RMSNormExperts with sums (a mixture's o: RMSNormRouter reads them
// first), for a joined q/k/v QKRoPEStore with sums. ws must be zero, as
// GemmW4 leaves it; w must not be gated. The GEMV kernels serve M ≤ 8, the
// dequantize + cuBLAS path (a scratch) any M; the library refuses a plan
// that picks another kernel.
func (x *Context) GemmW4Sums(A Buf, w *W4, M int, ws, scratch, aperm Buf) error {
	if w.Gated != NotGated {
		return fmt.Errorf("w4a16_gemm: a gated layer's sums cannot stay in the workspace (its epilogue pairs them)")
	}
	return x.do("w4a16_gemm", func() C.int {
		return C.c_gemm_w4(x.lib.api, x.c, A.p, w.B.p, w.S.p, w.Z.p, w.Perm.p, aperm.p, 0, 0, 0, 0, 0, 0,
			C.int(-1), ws.p, scratch.p, C.int(M), C.int(w.N), C.int(w.K), C.int(w.Group), C.int(w.codeBits()))
	})
}

// Plan names the kernel variant GemmW4 runs for M rows of w on this
// context when given a scratch (for benchmark tables).
func (x *Context) Plan(w *W4, M int) (string, error) {
	var buf [128]C.char
	err := x.do("w4a16_plan", func() C.int {
		return C.c_plan(x.lib.api, x.c, C.int(M), C.int(w.N), C.int(w.K), C.int(w.Group), C.int(w.codeBits()), &buf[0], C.int(len(buf)))
	})
	return C.GoString(&buf[0]), err
}

// Dequant writes W[K,N] fp16 = dequant(w).
func (x *Context) Dequant(w *W4, W Buf) error {
	return x.do("w4_dequant", func() C.int {
		return C.c_dequant(x.lib.api, x.c, w.B.p, w.S.p, w.Z.p, W.p, C.int(w.N), C.int(w.K), C.int(w.Group), C.int(w.codeBits()))
	})
}

// GemmF16 computes C[M,N] = A[M,K]·W[K,N] with cuBLAS (fp16, fp32 accumulation).
func (x *Context) GemmF16(A, W, C_ Buf, M, N, K int) error {
	return x.do("gemm_f16", func() C.int { return C.c_gemm_f16(x.lib.api, x.c, A.p, W.p, C_.p, C.int(M), C.int(N), C.int(K)) })
}

// ReadProbe reads n bytes of b once; out is 4 bytes of scratch.
func (x *Context) ReadProbe(b Buf, n int, out Buf) error {
	return x.do("read_probe", func() C.int { return C.c_probe(x.lib.api, x.c, b.p, C.size_t(n), out.p) })
}

// Graph is an instantiated CUDA graph, owned by its context.
type Graph struct{ p C.P }

// Capture records the GPU work fn issues on the context into a graph
// instead of running it.
func (x *Context) Capture(fn func() error) (Graph, error) {
	if err := x.live(); err != nil {
		return Graph{}, err
	}
	if err := x.do("capture_begin", func() C.int { return C.c_capture_begin(x.lib.api, x.c) }); err != nil {
		return Graph{}, err
	}
	ferr := fn()
	var p C.P
	err := x.do("capture_end", func() C.int { return C.c_capture_end(x.lib.api, x.c, &p) })
	if ferr != nil {
		if p != 0 {
			x.DestroyGraph(Graph{p})
		}
		return Graph{}, ferr
	}
	return Graph{p}, err
}

// Launch replays a graph.
func (x *Context) Launch(g Graph) error {
	return x.do("graph_launch", func() C.int { return C.c_graph_launch(x.lib.api, x.c, g.p) })
}

// DestroyGraph releases a graph.
func (x *Context) DestroyGraph(g Graph) error {
	return x.do("graph_destroy", func() C.int { return C.c_graph_destroy(x.lib.api, x.c, g.p) })
}

// TimeGraph captures calls calls of op (i: the call's index, to rotate
// through copies of its inputs) in one CUDA graph, replays it warmup
// times, then replays times between events, and returns each timed
// replay's milliseconds a call: launch latency is amortised, as it is
// when a model's decode step runs as one graph.
func (x *Context) TimeGraph(calls int, op func(i int) error, warmup, replays int) ([]float64, error) {
	g, err := x.Capture(func() error {
		for i := 0; i < calls; i++ {
			if err := op(i); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	defer x.DestroyGraph(g)
	start, err := x.NewEvent()
	if err != nil {
		return nil, err
	}
	defer x.DestroyEvent(start)
	stop, err := x.NewEvent()
	if err != nil {
		return nil, err
	}
	defer x.DestroyEvent(stop)
	for i := 0; i < warmup; i++ {
		if err := x.Launch(g); err != nil {
			return nil, err
		}
	}
	if err := x.Sync(); err != nil {
		return nil, err
	}
	times := make([]float64, replays)
	for i := range times {
		if err := errors.Join(x.Record(start), x.Launch(g), x.Record(stop)); err != nil {
			return nil, err
		}
		ms, err := x.Elapsed(start, stop)
		if err != nil {
			return nil, err
		}
		times[i] = ms / float64(calls)
	}
	return times, nil
}

// The model kernels (model.cu); see llmq.h for their contracts.

// Embed gathers fp16 embedding rows E[ids[t]] into the fp32 rows x,
// times scale (0: 1; Gemma 3: √hidden).
func (x *Context) Embed(ids, E, xs Buf, T, H int, scale float32) error {
	return x.do("embed", func() C.int {
		return C.c_embed(x.lib.api, x.c, ids.p, E.p, xs.p, C.int(T), C.int(H), C.float(scale))
	})
}

// RMSNorm: with rows unset, x += delta (when set; with deltaNorm set, x +=
// RMSNorm(delta)·deltaNorm, Gemma 3's post norms) and out = RMSNorm(x)·w
// over n rows; with rows, out row i = RMSNorm(x[rows[i]])·w. H is a
// multiple of 4, at most MaxNormHidden.
func (x *Context) RMSNorm(xs, delta, deltaNorm, rows, w, out Buf, n, H int, eps float32) error {
	return x.RMSNormExperts(xs, delta, Buf{}, ExpertSum{}, deltaNorm, rows, w, out, n, H, eps)
}

// MaxNormHidden is the widest row RMSNorm takes (a thread holds 4 chunks
// of 4 values, 1024 threads a row).
const MaxNormHidden = 16384

// ExpertSum is a mixture of experts' output still spread over its slots:
// row t's delta is Σ_j Weights[t][j] · Y[t·K + j] over its K experts (Y
// fp32 [T·K][H], IDs and Weights [T][K]).
type ExpertSum struct {
	Y, IDs, Weights Buf
	K               int
}

// RMSNormExperts is RMSNorm whose delta may come as fp32 sums and may
// hold e, a mixture's output: the mixture's combine joined to the norm
// after it. sums (not with delta) are the fp32 rows [n][H] a GemmW4Sums
// left in its workspace (o's, down's), added as delta would be and zeroed
// on return. e's slots are added in fp32 in ascending expert order (the
// CPU's order of additions), and e.Y is zeroed on return (the expert GEMVs
// accumulate into it). With both a delta (or sums) and e — what an
// RMSNormRouter left pending — the delta is added first, then the
// experts, and deltaNorm must be Nil.
func (x *Context) RMSNormExperts(xs, delta, sums Buf, e ExpertSum, deltaNorm, rows, w, out Buf, n, H int, eps float32) error {
	if e.K > 0 && (e.Y.Nil() || e.IDs.Nil() || e.Weights.Nil()) || e.K == 0 && !e.Y.Nil() {
		return fmt.Errorf("rmsnorm: an experts' sum needs its outputs, ids and weights and a top k (have k=%d)", e.K)
	}
	return x.do("rmsnorm", func() C.int { // (the library refuses sums with a delta or with rows)
		return C.c_rmsnorm(x.lib.api, x.c, xs.p, delta.p, sums.p, deltaNorm.p, e.Y.p, e.IDs.p, e.Weights.p, C.int(e.K), rows.p, w.p,
			out.p, C.int(n), C.int(H), C.float(eps))
	})
}

// RMSNormRouter is a mixture's norm and router in one launch: out =
// RMSNorm(xs + delta)·w (fp16 [n][H]) and logits = out · routerᵀ (fp32
// [n][E], router fp32 [E][H]), as RMSNorm then MoERouter compute them,
// except that xs is left as it was: the caller passes the same delta to
// the next norm (RMSNormExperts), which adds it before the experts. The
// delta comes as fp16 rows (delta) or as a GemmW4Sums' fp32 sums (sums),
// one of the two; sums are left in place for that next norm to zero.
func (x *Context) RMSNormRouter(xs, delta, sums, w, out, router, logits Buf, n, H, E int, eps float32) error {
	if delta.Nil() == sums.Nil() || router.Nil() || logits.Nil() {
		return fmt.Errorf("rmsnorm_router: one of a delta and sums, the router's weights and room for its logits are needed "+
			"(have delta %v, sums %v, router %v, logits %v)", !delta.Nil(), !sums.Nil(), !router.Nil(), !logits.Nil())
	}
	return x.do("rmsnorm_router", func() C.int {
		return C.c_rmsnorm_router(x.lib.api, x.c, xs.p, delta.p, sums.p, w.p, out.p, router.p, logits.p, C.int(n), C.int(H), C.int(E),
			C.float(eps))
	})
}

// Add does x += delta over n values (fp32 += fp16).
func (x *Context) Add(xs, delta Buf, n int) error {
	return x.do("add", func() C.int { return C.c_add(x.lib.api, x.c, xs.p, delta.p, C.size_t(n)) })
}

// AddBias adds b [N] to each of T rows of y.
func (x *Context) AddBias(y, b Buf, T, N int) error {
	return x.do("add_bias", func() C.int { return C.c_bias(x.lib.api, x.c, y.p, b.p, C.int(T), C.int(N)) })
}

// RowMeta are the per-row and per-sequence arrays of a forward pass.
type RowMeta struct{ RowSeq, RowPos, KVBase, KVCap Buf }

// QKRoPEStore prepares a pass's q [T][heads·hd] and k [T][kvHeads·hd]
// for attention, in place: Qwen3's per-head RMSNorm (qNorm, kNorm; Nil
// when the model has none), then RoPE by each row's position (cos, sin:
// the [positions][hd/2] tables). With store, k's rows (rotated) and v's
// also go into their sequences' caches at layer. With sums (not Nil), q,
// k and v are first written from the fp32 sums a joined q/k/v
// GemmW4Sums left there ([T][(heads + 2·kvHeads)·hd]), which it zeroes.
func (x *Context) QKRoPEStore(q, k, v, sums, qNorm, kNorm Buf, eps float32, m RowMeta, cos, sin Buf, layer, layers, T, heads, kvHeads, hd int, store bool) error {
	base := m.KVBase
	if !store {
		base = Buf{}
	}
	return x.do("qk_rope_store", func() C.int {
		return C.c_qk_rope_store(x.lib.api, x.c, q.p, k.p, v.p, sums.p, qNorm.p, kNorm.p, C.float(eps), m.RowSeq.p, m.RowPos.p,
			base.p, m.KVCap.p, cos.p, sin.p, C.int(layer), C.int(layers), C.int(T), C.int(heads), C.int(kvHeads), C.int(hd))
	})
}

// AttentionWorkspaceBytes is the scratch Attention needs.
func (l *Lib) AttentionWorkspaceBytes(T, heads, hd, maxKeys int) int {
	return int(C.c_attn_ws(l.api, C.int(T), C.int(heads), C.int(hd), C.int(maxKeys)))
}

// Attention writes causal attention over each row's cache to out; ws
// holds AttentionWorkspaceBytes bytes.
func (x *Context) Attention(q, out, ws Buf, m RowMeta, layer, layers, T, heads, kvHeads, hd, maxKeys int, o AttnOptions) error {
	return x.do("attention", func() C.int {
		return C.c_attention(x.lib.api, x.c, q.p, out.p, ws.p, m.RowSeq.p, m.RowPos.p, m.KVBase.p, m.KVCap.p,
			C.int(layer), C.int(layers), C.int(T), C.int(heads), C.int(kvHeads), C.int(hd), C.int(maxKeys),
			C.int(o.Window), C.float(o.Scale))
	})
}

// AttnOptions are a layer's attention settings beside the shapes: Window
// > 0 limits a row at position p to keys p−Window+1 … p (Mistral's sliding
// window, Gemma's sliding layers); Scale multiplies q·k (0: head_dim^-½;
// Gemma: query_pre_attn_scalar^-½).
type AttnOptions struct {
	Window int
	Scale  float32
}

// GatedAct does g = act(g)·u over n fp16 values, act a config.json
// hidden_act: SiLU (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU).
func (x *Context) GatedAct(g, u Buf, n int, act string) error {
	return x.do("gated_act", func() C.int { return C.c_gated_act(x.lib.api, x.c, g.p, u.p, C.size_t(n), actCode(act)) })
}

// actCode is the kernels' code for a gated MLP's activation (Config.Act):
// 1 for GELU with the tanh approximation, 0 for SiLU.
func actCode(act string) C.int { return C.int(GatingFor(act).act()) }

// GatingFor is the gated epilogue for a gated MLP's activation
// (Config.Act): GELU with the tanh approximation for
// "gelu_pytorch_tanh", SiLU otherwise.
func GatingFor(act string) Gating {
	if act == "gelu_pytorch_tanh" {
		return GatedGELU
	}
	return GatedSiLU
}

// FakeQuant writes in quantized and dequantized into out (rows of cols
// fp16 values) with threshold (per tensor) or each row's max |x|.
func (x *Context) FakeQuant(in, out Buf, rows, cols int, a *ActQuant, threshold float32) error {
	return x.do("fake_quant", func() C.int {
		return C.c_fake_quant(x.lib.api, x.c, in.p, out.p, C.int(rows), C.int(cols), C.int(a.Bits), cbool(a.FP8), cbool(a.PerToken),
			C.float(threshold))
	})
}

// MoERoute routes T rows of fp32 router logits [T][E] to their top k
// experts (int32 ids and fp32 weights [T][k], most probable first), as
// llm.RouteLogits does; norm renormalises the k weights.
func (x *Context) MoERoute(logits, ids, weights Buf, T, E, k int, norm bool) error {
	return x.do("moe_route", func() C.int {
		return C.c_moe_route(x.lib.api, x.c, logits.p, ids.p, weights.p, C.int(T), C.int(E), C.int(k), cbool(norm))
	})
}

// MoERouter writes the router logits [T][E] (fp32) of T rows of normed
// activations h [T][H] (fp16) by the router W [E][H] (fp32).
func (x *Context) MoERouter(h, W, logits Buf, T, E, H int) error {
	return x.do("moe_router", func() C.int {
		return C.c_moe_router(x.lib.api, x.c, h.p, W.p, logits.p, C.int(T), C.int(E), C.int(H))
	})
}

// MoEMaxChunks is the room MoEPlan needs for S slots of E experts cut
// into chunks of mt: exactly S chunks of one slot, else each expert's
// last chunk may be partial.
func MoEMaxChunks(S, E, mt int) int {
	if mt == 1 {
		return S
	}
	return (S+mt-1)/mt + min(E, S)
}

// MoEPlan groups the S slots of a routed pass (ids [S] int32, row t's
// j-th expert at t·k + j) by expert: order [S] int32 and chunks
// [maxChunks][3] int32 of at most mt slots of one expert, for MoEGemv.
func (x *Context) MoEPlan(ids, order, chunks Buf, S, E, mt, maxChunks int) error {
	return x.do("moe_plan", func() C.int {
		return C.c_moe_plan(x.lib.api, x.c, ids.p, C.int(S), C.int(E), C.int(mt), order.p, chunks.p, C.int(maxChunks))
	})
}

// MoERoutePlan is MoERoute then MoEPlan of its ids, in one launch.
func (x *Context) MoERoutePlan(logits, ids, weights Buf, T, E, k int, norm bool, mt int, order, chunks Buf, maxChunks int) error {
	return x.do("moe_route_plan", func() C.int {
		return C.c_moe_route_plan(x.lib.api, x.c, logits.p, ids.p, weights.p, C.int(T), C.int(E), C.int(k), cbool(norm), C.int(mt),
			order.p, chunks.p, C.int(maxChunks))
	})
}

// MoEGemv runs a mixture's experts of one kind (all E alike, N×K) over a
// plan of S slots (MoEPlan with the same mt): out row s (fp32 [S][N],
// zero before) += A row s/aDiv · W_e for each slot s of expert e. w holds
// 4-bit experts one after another (UploadExperts), or w16 fp16 experts
// [E][N][K]. Gated experts (w.Gated: each expert's gate and up
// interleaved, pack.InterleaveGPU) write g [S][N/2] fp16 = act(gate)·up
// instead, leaving out as it was (LLMQ_MOE_FUSED_ACT=0: their sums go
// through out, which MoEAct then leaves zeroed); g is Nil for plain ones.
func (x *Context) MoEGemv(A Buf, aDiv int, order, chunks Buf, maxChunks, mt, S int, w *W4, w16, out, g Buf, N, K int) error {
	var b, s, z C.P
	group, act := K, NotGated.act()
	if w == nil && !g.Nil() {
		return fmt.Errorf("moe_gemv: fp16 experts are not gated: no g")
	}
	if w != nil {
		if w.N != N || w.K != K {
			return fmt.Errorf("moe_gemv: experts of %d×%d run as %d×%d", w.N, w.K, N, K)
		}
		if err := checkGated("moe_gemv", w, g); err != nil {
			return err
		}
		b, s, z, group, act = w.B.p, w.S.p, w.Z.p, w.Group, w.Gated.act()
	}
	return x.do("moe_gemv", func() C.int {
		return C.c_moe_gemv(x.lib.api, x.c, A.p, C.int(aDiv), order.p, chunks.p, C.int(maxChunks), C.int(mt), C.int(S), b, s, z, w16.p,
			out.p, C.int(N), C.int(K), C.int(group), g.p, C.int(act))
	})
}

// checkGated: gated experts have a g to write, and plain ones none.
func checkGated(fn string, w *W4, g Buf) error {
	if (w.Gated != NotGated) == g.Nil() {
		return fmt.Errorf("%s: gated experts need an output g for act(gate)·up, plain ones none (gated: %v)", fn, w.Gated != NotGated)
	}
	return nil
}

// MoEGemvRouted is MoERoutePlan (chunks of one slot) then MoEGemv of E
// 4-bit experts w (UploadExperts) over the T rows A, in one launch: every
// CTA routes the rows from logits [T][E] itself. It serves a decode step
// (MoERoutable); the routing (ids, weights [T·k]) and the plan (order
// [T·k], chunks [T·k][3]: MoEGemv's with mt 1 and maxChunks T·k) are left
// as MoERoutePlan leaves them (LLMQ_MOE_ROUTED=0 runs the two launches,
// for A/Bs). Gated experts write g, as MoEGemv's. next (nil: none) is
// the grouped GEMV that reads this one's output over the plan (down):
// with LLMQ_MOE_PREFETCH 1 or 2 the launch asks L2 for the routed
// experts' share of it (llmq.h); the results do not depend on it.
// With nextOut (API 28; Nil: none; fp32 [T·k][next.N], zero before) the
// call runs next too, gated experts only: nextOut += g · next over the
// plan, what MoEGemv(g, 1, order, chunks, T·k, 1, T·k, next, …, nextOut,
// …) adds — in the same launch with LLMQ_MOE_FUSED_DOWN=1 where llmq.h
// says it can, else in one after — so a decode step's whole mixture is
// one call.
func (x *Context) MoEGemvRouted(A, logits Buf, T, E, k int, norm bool, ids, weights, order, chunks Buf, w *W4, out, g Buf, N, K int, next *W4, nextOut Buf) error {
	if err := checkRoutedExperts("", w, E, N, K); err != nil {
		return err
	}
	if !nextOut.Nil() && (next == nil || w.Gated == NotGated) {
		return fmt.Errorf("moe_gemv_routed: an output for the next layer needs gated experts and their next layer (gated: %v, next layer: %v)",
			w.Gated != NotGated, next != nil)
	}
	if !nextOut.Nil() && nextOut.Bytes < T*k*next.N*4 {
		return fmt.Errorf("moe_gemv_routed: the next layer's output holds %d bytes, want %d rows of %d fp32", nextOut.Bytes, T*k, next.N)
	}
	var nB, nS, nZ C.P
	var nN, nK, nGroup int
	if next != nil {
		// Run here (nextOut), the next layer reads g = act(gate)·up, half
		// as wide as out; only asked of L2, it may be any E experts (the
		// model's down reads g after MoEAct where the experts write out).
		K2 := next.K
		if !nextOut.Nil() {
			K2 = N / 2
		}
		if err := checkRoutedExperts("next layer's ", next, E, next.N, K2); err != nil {
			return err
		}
		nB, nS, nZ, nN, nK, nGroup = next.B.p, next.S.p, next.Z.p, next.N, next.K, next.Group
	}
	if err := checkGated("moe_gemv_routed", w, g); err != nil {
		return err
	}
	return x.do("moe_gemv_routed", func() C.int {
		return C.c_moe_gemv_routed(x.lib.api, x.c, A.p, logits.p, C.int(T), C.int(E), C.int(k), cbool(norm), ids.p, weights.p,
			order.p, chunks.p, w.B.p, w.S.p, w.Z.p, out.p, C.int(N), C.int(K), C.int(w.Group), g.p, C.int(w.Gated.act()),
			nB, nS, nZ, C.int(nN), C.int(nK), C.int(nGroup), nextOut.p)
	})
}

// checkRoutedExperts: w holds E 4-bit experts of N×K as UploadExperts
// leaves them (what MoEGemvRouted reads, or asks L2 for: which).
func checkRoutedExperts(which string, w *W4, E, N, K int) error {
	switch {
	case w == nil:
		return fmt.Errorf("moe_gemv_routed: no %sexperts", which)
	case w.N != N || w.K != K:
		return fmt.Errorf("moe_gemv_routed: %sexperts of %d×%d run as %d×%d", which, w.N, w.K, N, K)
	case w.Bits == 8 || !w.Perm.Nil():
		return fmt.Errorf("moe_gemv_routed: the %sexperts must be UploadExperts' (4-bit, no act order)", which)
	case E > 0 && w.B.Bytes < E*N*K/2:
		return fmt.Errorf("moe_gemv_routed: %d bytes of %scodes hold fewer than %d experts of %d×%d", w.B.Bytes, which, E, N, K)
	}
	return nil
}

// MoERoutable says whether MoEGemvRouted takes a pass of T rows of k
// experts each (llmq.h: LLMQ_MOE_ROUTED_ROWS, LLMQ_MOE_ROUTED_SLOTS).
func MoERoutable(T, k int) bool {
	return T >= 1 && T <= C.LLMQ_MOE_ROUTED_ROWS && T*k <= C.LLMQ_MOE_ROUTED_SLOTS
}

// MoEAct writes g [S][I] fp16 = act(gate)·up from a joined gate/up output
// gu [S][2I] fp32, which it zeroes (act as GatedAct, from gate and up
// rounded to fp16): gate gu[:, :I] and up gu[:, I:], or interleaved in
// 32-column halves (pack.InterleaveGPU).
func (x *Context) MoEAct(gu, g Buf, S, I int, act string, interleaved bool) error {
	return x.do("moe_act", func() C.int {
		return C.c_moe_act(x.lib.api, x.c, gu.p, g.p, C.int(S), C.int(I), actCode(act), cbool(interleaved))
	})
}

// ArgmaxRows writes out[t] (int32) = llm.Argmax of row t of logits (fp32
// [T][V]): the first index of the largest value, 0 when the first is NaN.
func (x *Context) ArgmaxRows(logits, out Buf, T, V int) error {
	return x.do("argmax_rows", func() C.int { return C.c_argmax_rows(x.lib.api, x.c, logits.p, out.p, C.int(T), C.int(V)) })
}

// F16ToF32 writes n fp32 values into dst from n fp16 values of src (n
// even): a packed LM head's logits, which GemmW4Into writes in fp16.
func (x *Context) F16ToF32(src, dst Buf, n int) error {
	return x.do("f16_to_f32", func() C.int { return C.c_f16_to_f32(x.lib.api, x.c, src.p, dst.p, C.size_t(n)) })
}

// SampleRows writes out[t] (int32) = the token llm.Sampler.SampleWith
// picks from row t of logits (fp32 [T][V]) with params[4t:4t+4] (fp64:
// temperature, top-k, top-p, the draw u, as drawParams lays them out;
// temperature 0: ArgmaxRows's answer), or −1 where its candidates do not
// fit the kernel (pick that row on the host).
func (x *Context) SampleRows(logits, params, out Buf, T, V int) error {
	return x.do("sample_rows", func() C.int {
		return C.c_sample_rows(x.lib.api, x.c, logits.p, params.p, out.p, C.int(T), C.int(V))
	})
}

// NLL writes −log softmax(logits row t)[targets[t]] for T fp32 rows of V.
func (x *Context) NLL(logits, targets, nll Buf, T, V int) error {
	return x.do("nll", func() C.int { return C.c_nll(x.lib.api, x.c, logits.p, targets.p, nll.p, C.int(T), C.int(V)) })
}

// GemmNT computes C[M,N] = A[M,K]·W[N,K]ᵀ with cuBLAS; C is fp32 when f32.
func (x *Context) GemmNT(A, W, C_ Buf, M, N, K int, f32 bool) error {
	c32 := 0
	if f32 {
		c32 = 1
	}
	return x.do("gemm_nt", func() C.int {
		return C.c_gemm_nt(x.lib.api, x.c, A.p, W.p, C_.p, C.int(M), C.int(N), C.int(K), C.int(c32))
	})
}

// The GPTQ kernels (quant.cu); see llmq.h for their contracts.

// HessianAdd does H [n][n] fp32 += Xᵀ·X for rows of X [rows][n] fp16.
func (x *Context) HessianAdd(X, H Buf, rows, n int) error {
	return x.do("hessian_add", func() C.int { return C.c_hessian_add(x.lib.api, x.c, X.p, H.p, C.int(rows), C.int(n)) })
}

// HessianDiag writes d[i] = H[i][i] (fp32).
func (x *Context) HessianDiag(H, d Buf, n int) error {
	return x.do("hessian_diag", func() C.int { return C.c_hessian_diag(x.lib.api, x.c, H.p, d.p, C.int(n)) })
}

// FactorWorkspaceBytes is the scratch GPTQFactor needs for n inputs.
func (l *Lib) FactorWorkspaceBytes(n int) int { return int(C.c_factor_ws(l.api, C.int(n))) }

// GPTQFactor writes U, the upper Cholesky factor of (P·(s·Hsum)·Pᵀ + λI)⁻¹
// in the column order perm; ok is false when the damped matrix is not
// positive definite.
func (x *Context) GPTQFactor(Hsum Buf, s float64, perm Buf, lambda float64, U, ws Buf, n int) (ok bool, err error) {
	var cok C.int
	err = x.do("gptq_factor", func() C.int {
		return C.c_gptq_factor(x.lib.api, x.c, Hsum.p, C.double(s), perm.p, C.double(lambda), U.p, ws.p, C.int(n), &cok)
	})
	return cok != 0, err
}

// GPTQQuantize runs GPTQ's column updates on W [out][in] (column order,
// overwritten), writing codes Q, group scales and zeros [G][out] (fitted
// when fit, else read; fromStart: gptq.Options.GroupsFromBlockStart) and
// per-row losses.
func (x *Context) GPTQQuantize(W, Hinv, Q, scale, zero, groupOf, err1, loss Buf, out, in, group, bits int, sym, fit, fromStart bool) error {
	return x.do("gptq_quantize", func() C.int {
		return C.c_gptq_quantize(x.lib.api, x.c, W.p, Hinv.p, Q.p, scale.p, zero.p, groupOf.p, err1.p, loss.p, C.int(out), C.int(in),
			C.int(group), C.int(bits), cbool(sym), cbool(fit), cbool(fromStart))
	})
}

// The AWQ kernels (awq.cu); see llmq.h for their contracts.

// Partial-sum slices of ColAbsSum and SqDiffSum.
const (
	ColSplits = C.LLMQ_COL_SPLITS
	SqParts   = C.LLMQ_SQ_PARTS
)

// F32ToF16 converts n fp32 values of src to fp16 in dst.
func (x *Context) F32ToF16(src, dst Buf, n int) error {
	return x.do("f32_to_f16", func() C.int { return C.c_f32_to_f16(x.lib.api, x.c, src.p, dst.p, C.size_t(n)) })
}

// Copy2D copies height rows of width bytes from src (spitch bytes apart)
// to dst (dpitch apart).
func (x *Context) Copy2D(dst Buf, dpitch int, src Buf, spitch, width, height int) error {
	return x.do("memcpy_2d", func() C.int {
		return C.c_memcpy_2d(x.lib.api, x.c, dst.p, C.size_t(dpitch), src.p, C.size_t(spitch), C.size_t(width), C.size_t(height))
	})
}

// ColAbsSum adds Σ|X[r][c]| over X [rows][d] fp16 to part [ColSplits][d] fp64.
func (x *Context) ColAbsSum(X, part Buf, rows, d int) error {
	return x.do("col_abs_sum", func() C.int { return C.c_col_abs_sum(x.lib.api, x.c, X.p, part.p, C.int(rows), C.int(d)) })
}

// SqDiffSum adds Σ(a−b)² over n fp16 values to part [SqParts] fp64.
func (x *Context) SqDiffSum(a, b, part Buf, n int) error {
	return x.do("sq_diff_sum", func() C.int { return C.c_sq_diff_sum(x.lib.api, x.c, a.p, b.p, part.p, C.size_t(n)) })
}

// cbool is a C flag.
func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// AWQQuant writes Wq fp16 = Q(W·diag(s))·diag(s)⁻¹ (s may be nil) on grid g.
func (x *Context) AWQQuant(W, s, Wq Buf, out, in int, g pack.Grid) error {
	return x.do("awq_quant", func() C.int {
		return C.c_awq_quant(x.lib.api, x.c, W.p, s.p, Wq.p, C.int(out), C.int(in), C.int(g.Group(in)), C.int(g.Bits),
			cbool(g.Sym), cbool(g.MinMax))
	})
}

// AWQClip runs AWQ's clip search on W [out][in] fp32 (llmq.h), writing
// best [out][in/group] thresholds; D, P, err are scratch.
func (x *Context) AWQClip(W, s, H, D, P, errs, best Buf, out, in int, g pack.Grid, nShrink int) error {
	return x.do("awq_clip", func() C.int {
		return C.c_awq_clip(x.lib.api, x.c, W.p, s.p, H.p, D.p, P.p, errs.p, best.p, C.int(out), C.int(in), C.int(g.Group(in)),
			C.int(g.Bits), cbool(g.Sym), cbool(g.MinMax), C.int(nShrink))
	})
}

// CausalHeadDims are the head dimensions AttentionCausal takes.
func CausalHeadDims(hd int) bool { return hd == 32 || hd == 64 || hd == 128 }

// AttentionCausal writes causal self-attention within windows of T
// consecutive rows (flash.cu): q, out [windows·T][heads·hd], k, v
// [windows·T][kvHeads·hd], fp16 with RoPE applied.
func (x *Context) AttentionCausal(q, k, v, out Buf, windows, T, heads, kvHeads, hd int, o AttnOptions) error {
	return x.do("attention_causal", func() C.int {
		return C.c_attention_causal(x.lib.api, x.c, q.p, k.p, v.p, out.p, C.int(windows), C.int(T), C.int(heads), C.int(kvHeads),
			C.int(hd), C.int(o.Window), C.float(o.Scale))
	})
}

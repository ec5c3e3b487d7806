//go:build cgo

// Package cuda runs llmq's CUDA kernels from Go. The kernels live in a
// shared library built by nvcc (`make cuda` → build/libllmqcuda.so); this
// package loads it at run time with dlopen, so llmq builds with plain
// `go build` anywhere and reports plainly when no GPU library is present.
// Every CUDA error comes back as a Go error naming the call that failed.
// Device pointers travel as integers, never as Go pointers.
package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef uintptr_t P;
static void* lib_open(const char* path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static const char* lib_error(void) { const char* e = dlerror(); return e ? e : "unknown dlopen error"; }
static void* lib_sym(void* h, const char* name) { return dlsym(h, name); }

static const char* c_str(void* f) { return ((const char* (*)(void))f)(); }
static int c_i(void* f) { return ((int (*)(void))f)(); }
static int c_i_i(void* f, int a) { return ((int (*)(int))f)(a); }
static int c_info(void* f, char* name, int n, size_t* fr, size_t* tot, int* sms) {
	return ((int (*)(char*, int, size_t*, size_t*, int*))f)(name, n, fr, tot, sms);
}
static int c_malloc(void* f, P* p, size_t n) { void* v = 0; int r = ((int (*)(void**, size_t))f)(&v, n); *p = (P)v; return r; }
static int c_p(void* f, P a) { return ((int (*)(void*))f)((void*)a); }
static int c_pp_n(void* f, P a, P b, size_t n) { return ((int (*)(void*, const void*, size_t))f)((void*)a, (const void*)b, n); }
static int c_h2d(void* f, P dst, const void* src, size_t n) { return ((int (*)(void*, const void*, size_t))f)((void*)dst, src, n); }
static int c_d2h(void* f, void* dst, P src, size_t n) { return ((int (*)(void*, const void*, size_t))f)(dst, (const void*)src, n); }
static int c_memset(void* f, P a, int v, size_t n) { return ((int (*)(void*, int, size_t))f)((void*)a, v, n); }
// c_out_ptr calls an int f(void** out) and returns *out as an integer
// (event creation, graph instantiation).
static int c_out_ptr(void* f, P* p) { void* v = 0; int r = ((int (*)(void**))f)(&v); *p = (P)v; return r; }
static int c_elapsed(void* f, P a, P b, float* ms) { return ((int (*)(void*, void*, float*))f)((void*)a, (void*)b, ms); }
static size_t c_ws(void* f, int m, int n) { return ((size_t (*)(int, int))f)(m, n); }
static int c_gemm_w4(void* f, P A, P B, P S, P Z, P perm, P aperm, P C, P ws, P scratch, int M, int N, int K, int g) {
	return ((int (*)(const void*, const void*, const void*, const void*, const int32_t*, void*, void*, void*, void*, int, int, int, int))f)(
		(const void*)A, (const void*)B, (const void*)S, (const void*)Z, (const int32_t*)perm, (void*)aperm, (void*)C, (void*)ws, (void*)scratch, M, N, K, g);
}
static int c_dequant(void* f, P B, P S, P Z, P W, int N, int K, int g) {
	return ((int (*)(const void*, const void*, const void*, void*, int, int, int))f)((const void*)B, (const void*)S, (const void*)Z, (void*)W, N, K, g);
}
static int c_probe(void* f, P p, size_t n, P out) { return ((int (*)(const void*, size_t, void*))f)((const void*)p, n, (void*)out); }
static int c_gemm_f16(void* f, P A, P W, P C, int M, int N, int K) {
	return ((int (*)(const void*, const void*, void*, int, int, int))f)((const void*)A, (const void*)W, (void*)C, M, N, K);
}
static int c_embed(void* f, P ids, P E, P x, int T, int H) {
	return ((int (*)(const int32_t*, const void*, float*, int, int))f)((const int32_t*)ids, (const void*)E, (float*)x, T, H);
}
static int c_rmsnorm(void* f, P x, P d, P rows, P w, P out, int n, int H, float eps) {
	return ((int (*)(float*, const void*, const int32_t*, const float*, void*, int, int, float))f)(
		(float*)x, (const void*)d, (const int32_t*)rows, (const float*)w, (void*)out, n, H, eps);
}
static int c_add(void* f, P x, P d, size_t n) { return ((int (*)(float*, const void*, size_t))f)((float*)x, (const void*)d, n); }
static int c_bias(void* f, P y, P b, int T, int N) { return ((int (*)(void*, const void*, int, int))f)((void*)y, (const void*)b, T, N); }
static int c_rope(void* f, P x, P pos, P cs, P sn, int T, int heads, int hd) {
	return ((int (*)(void*, const int32_t*, const float*, const float*, int, int, int))f)((void*)x, (const int32_t*)pos, (const float*)cs, (const float*)sn, T, heads, hd);
}
static int c_kv_store(void* f, P k, P v, P rs, P rp, P base, P cap, int layer, int layers, int T, int kvdim) {
	return ((int (*)(const void*, const void*, const int32_t*, const int32_t*, const uint64_t*, const int32_t*, int, int, int, int))f)(
		(const void*)k, (const void*)v, (const int32_t*)rs, (const int32_t*)rp, (const uint64_t*)base, (const int32_t*)cap, layer, layers, T, kvdim);
}
static int c_attention(void* f, P q, P out, P ws, P rs, P rp, P base, P cap, int layer, int layers, int T, int heads, int kvh, int hd, int maxk) {
	return ((int (*)(const void*, void*, void*, const int32_t*, const int32_t*, const uint64_t*, const int32_t*, int, int, int, int, int, int, int))f)(
		(const void*)q, (void*)out, (void*)ws, (const int32_t*)rs, (const int32_t*)rp, (const uint64_t*)base, (const int32_t*)cap, layer, layers, T, heads, kvh, hd, maxk);
}
static size_t c_attn_ws(void* f, int T, int heads, int hd, int maxk) { return ((size_t (*)(int, int, int, int))f)(T, heads, hd, maxk); }
static int c_silu_mul(void* f, P g, P u, size_t n) { return ((int (*)(void*, const void*, size_t))f)((void*)g, (const void*)u, n); }
static int c_nll(void* f, P logits, P targets, P nll, int T, int V) {
	return ((int (*)(const float*, const int32_t*, float*, int, int))f)((const float*)logits, (const int32_t*)targets, (float*)nll, T, V);
}
static int c_gemm_nt(void* f, P A, P W, P C, int M, int N, int K, int c32) {
	return ((int (*)(const void*, const void*, void*, int, int, int, int))f)((const void*)A, (const void*)W, (void*)C, M, N, K, c32);
}
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"unsafe"
)

// Lib is a loaded llmq CUDA library.
type Lib struct {
	path string
	f    map[string]unsafe.Pointer
}

var symbols = []string{
	"llmq_last_error", "llmq_version", "llmq_device_info", "llmq_malloc", "llmq_free",
	"llmq_memcpy_h2d", "llmq_memcpy_d2h", "llmq_memcpy_d2d", "llmq_memset", "llmq_sync",
	"llmq_event_create", "llmq_event_destroy", "llmq_event_record", "llmq_event_elapsed",
	"llmq_w4a16_workspace_bytes", "llmq_w4a16_gemm", "llmq_w4a16_set_path", "llmq_w4_dequant", "llmq_gemm_f16", "llmq_read_probe",
	"llmq_capture_begin", "llmq_capture_end", "llmq_graph_launch", "llmq_graph_destroy",
	"llmq_embed", "llmq_rmsnorm", "llmq_add", "llmq_add_bias", "llmq_rope", "llmq_kv_store", "llmq_attention", "llmq_attention_workspace_bytes",
	"llmq_silu_mul", "llmq_nll", "llmq_gemm_nt",
}

// DefaultPath is $LLMQ_CUDA_LIB, else build/libllmqcuda.so beside the
// executable's directory (build/llmq → build/libllmqcuda.so), else in the
// working directory.
func DefaultPath() string {
	if p := os.Getenv("LLMQ_CUDA_LIB"); p != "" {
		return p
	}
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "libllmqcuda.so")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return filepath.Join("build", "libllmqcuda.so")
}

// Open loads the library at path ("" for DefaultPath).
func Open(path string) (*Lib, error) {
	if path == "" {
		path = DefaultPath()
	}
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	h := C.lib_open(cp)
	if h == nil {
		return nil, fmt.Errorf("GPU unavailable: cannot load the llmq CUDA library %s (%s); build it with `make cuda` on a machine with nvcc, or point LLMQ_CUDA_LIB at it", path, C.GoString(C.lib_error()))
	}
	l := &Lib{path: path, f: map[string]unsafe.Pointer{}}
	for _, s := range symbols {
		cs := C.CString(s)
		p := C.lib_sym(h, cs)
		C.free(unsafe.Pointer(cs))
		if p == nil {
			return nil, fmt.Errorf("%s is not a matching llmq CUDA library: symbol %s missing; rebuild with `make cuda`", path, s)
		}
		l.f[s] = p
	}
	return l, nil
}

// Path is where the library was loaded from.
func (l *Lib) Path() string { return l.path }

func (l *Lib) check(call string, rc C.int) error {
	if rc == 0 {
		return nil
	}
	return fmt.Errorf("%s: %s", call, C.GoString(C.c_str(l.f["llmq_last_error"])))
}

// Device describes the GPU.
type Device struct {
	Name        string
	FreeBytes   uint64
	TotalBytes  uint64
	SMs         int
	LibraryPath string
}

// Device queries GPU 0.
func (l *Lib) Device() (Device, error) {
	var name [256]C.char
	var fr, tot C.size_t
	var sms C.int
	if err := l.check("llmq_device_info", C.c_info(l.f["llmq_device_info"], &name[0], 256, &fr, &tot, &sms)); err != nil {
		return Device{}, err
	}
	return Device{Name: C.GoString(&name[0]), FreeBytes: uint64(fr), TotalBytes: uint64(tot), SMs: int(sms), LibraryPath: l.path}, nil
}

// Buf is device memory.
type Buf struct {
	p     C.P
	Bytes int
}

// Alloc allocates device memory (cudaMalloc).
func (l *Lib) Alloc(bytes int) (Buf, error) {
	var p C.P
	if err := l.check("llmq_malloc", C.c_malloc(l.f["llmq_malloc"], &p, C.size_t(bytes))); err != nil {
		return Buf{}, fmt.Errorf("allocating %d bytes on the GPU: %w", bytes, err)
	}
	return Buf{p: p, Bytes: bytes}, nil
}

// Free releases device memory.
func (l *Lib) Free(b Buf) error {
	if b.p == 0 {
		return nil
	}
	return l.check("llmq_free", C.c_p(l.f["llmq_free"], b.p))
}

// Offset returns a view of b starting bytes in.
func (b Buf) Offset(bytes int) Buf { return Buf{p: b.p + C.P(bytes), Bytes: b.Bytes - bytes} }

// Nil reports whether b is unset.
func (b Buf) Nil() bool { return b.p == 0 }

// Upload copies a host slice into device memory.
func Upload[T any](l *Lib, dst Buf, src []T) error {
	if len(src) == 0 {
		return nil
	}
	n := len(src) * int(unsafe.Sizeof(src[0]))
	if n > dst.Bytes {
		return fmt.Errorf("upload of %d bytes into a %d-byte buffer", n, dst.Bytes)
	}
	return l.check("llmq_memcpy_h2d", C.c_h2d(l.f["llmq_memcpy_h2d"], dst.p, unsafe.Pointer(&src[0]), C.size_t(n)))
}

// Download copies device memory into a host slice.
func Download[T any](l *Lib, dst []T, src Buf) error {
	if len(dst) == 0 {
		return nil
	}
	n := len(dst) * int(unsafe.Sizeof(dst[0]))
	if n > src.Bytes {
		return fmt.Errorf("download of %d bytes from a %d-byte buffer", n, src.Bytes)
	}
	return l.check("llmq_memcpy_d2h", C.c_d2h(l.f["llmq_memcpy_d2h"], unsafe.Pointer(&dst[0]), src.p, C.size_t(n)))
}

// AllocFrom allocates a buffer holding a copy of src.
func AllocFrom[T any](l *Lib, src []T) (Buf, error) {
	var zero T
	b, err := l.Alloc(max(1, len(src)) * int(unsafe.Sizeof(zero)))
	if err != nil {
		return b, err
	}
	return b, Upload(l, b, src)
}

// Copy copies n bytes between device buffers.
func (l *Lib) Copy(dst, src Buf, n int) error {
	return l.check("llmq_memcpy_d2d", C.c_pp_n(l.f["llmq_memcpy_d2d"], dst.p, src.p, C.size_t(n)))
}

// Memset fills n bytes with v.
func (l *Lib) Memset(b Buf, v byte, n int) error {
	return l.check("llmq_memset", C.c_memset(l.f["llmq_memset"], b.p, C.int(v), C.size_t(n)))
}

// Sync waits for queued work and reports any asynchronous error.
func (l *Lib) Sync() error { return l.check("llmq_sync", C.c_i(l.f["llmq_sync"])) }

// Event is a CUDA event for timing.
type Event struct{ p C.P }

// NewEvent creates an event.
func (l *Lib) NewEvent() (Event, error) {
	var p C.P
	err := l.check("llmq_event_create", C.c_out_ptr(l.f["llmq_event_create"], &p))
	return Event{p}, err
}

// Record records e on the library's stream.
func (l *Lib) Record(e Event) error {
	return l.check("llmq_event_record", C.c_p(l.f["llmq_event_record"], e.p))
}

// Elapsed returns milliseconds between two recorded events.
func (l *Lib) Elapsed(a, b Event) (float64, error) {
	var ms C.float
	err := l.check("llmq_event_elapsed", C.c_elapsed(l.f["llmq_event_elapsed"], a.p, b.p, &ms))
	return float64(ms), err
}

// DestroyEvent releases an event.
func (l *Lib) DestroyEvent(e Event) error {
	return l.check("llmq_event_destroy", C.c_p(l.f["llmq_event_destroy"], e.p))
}

// WorkspaceBytes is the zeroed workspace GemmW4 needs for M×N.
func (l *Lib) WorkspaceBytes(M, N int) int {
	return int(C.c_ws(l.f["llmq_w4a16_workspace_bytes"], C.int(M), C.int(N)))
}

// Path values for SetPath.
const (
	PathAuto   = 0
	PathFused  = 1
	PathCuBLAS = 2
)

// SetPath forces the W4A16 path (tests and benchmarks).
func (l *Lib) SetPath(p int) { C.c_i_i(l.f["llmq_w4a16_set_path"], C.int(p)) }

// GemmW4 computes C[M,N] = A[M,K]·dequant(w) in fp16. ws must hold
// WorkspaceBytes(M, N) zeroed bytes; scratch (K·N fp16) enables the
// cuBLAS path for large M; aperm (M·K fp16) is needed for act-order.
func (l *Lib) GemmW4(A, C_ Buf, w *W4, M int, ws, scratch, aperm Buf) error {
	return l.check("llmq_w4a16_gemm", C.c_gemm_w4(l.f["llmq_w4a16_gemm"], A.p, w.B.p, w.S.p, w.Z.p, w.Perm.p, aperm.p, C_.p, ws.p, scratch.p,
		C.int(M), C.int(w.N), C.int(w.K), C.int(w.Group)))
}

// Dequant writes W[K,N] fp16 = dequant(w).
func (l *Lib) Dequant(w *W4, W Buf) error {
	return l.check("llmq_w4_dequant", C.c_dequant(l.f["llmq_w4_dequant"], w.B.p, w.S.p, w.Z.p, W.p, C.int(w.N), C.int(w.K), C.int(w.Group)))
}

// GemmF16 computes C[M,N] = A[M,K]·W[K,N] with cuBLAS (fp16, fp32 accumulation).
func (l *Lib) GemmF16(A, W, C_ Buf, M, N, K int) error {
	return l.check("llmq_gemm_f16", C.c_gemm_f16(l.f["llmq_gemm_f16"], A.p, W.p, C_.p, C.int(M), C.int(N), C.int(K)))
}

// ReadProbe reads n bytes of b once; out is 4 bytes of scratch.
func (l *Lib) ReadProbe(b Buf, n int, out Buf) error {
	return l.check("llmq_read_probe", C.c_probe(l.f["llmq_read_probe"], b.p, C.size_t(n), out.p))
}

// Graph is an instantiated CUDA graph.
type Graph struct{ p C.P }

// Capture records the GPU work fn issues into a graph instead of running it.
func (l *Lib) Capture(fn func() error) (Graph, error) {
	if err := l.check("llmq_capture_begin", C.c_i(l.f["llmq_capture_begin"])); err != nil {
		return Graph{}, err
	}
	ferr := fn()
	var p C.P
	err := l.check("llmq_capture_end", C.c_out_ptr(l.f["llmq_capture_end"], &p))
	if ferr != nil {
		return Graph{}, ferr
	}
	return Graph{p}, err
}

// Launch replays a graph.
func (l *Lib) Launch(g Graph) error {
	return l.check("llmq_graph_launch", C.c_p(l.f["llmq_graph_launch"], g.p))
}

// DestroyGraph releases a graph.
func (l *Lib) DestroyGraph(g Graph) error {
	return l.check("llmq_graph_destroy", C.c_p(l.f["llmq_graph_destroy"], g.p))
}

// The model kernels (model.cu); see llmq.h for their contracts.

// Embed gathers fp16 embedding rows E[ids[t]] into the fp32 rows x.
func (l *Lib) Embed(ids, E, x Buf, T, H int) error {
	return l.check("llmq_embed", C.c_embed(l.f["llmq_embed"], ids.p, E.p, x.p, C.int(T), C.int(H)))
}

// RMSNorm: with rows unset, x += delta (when set) and out = RMSNorm(x)·w
// over n rows; with rows, out row i = RMSNorm(x[rows[i]])·w.
func (l *Lib) RMSNorm(x, delta, rows, w, out Buf, n, H int, eps float32) error {
	return l.check("llmq_rmsnorm", C.c_rmsnorm(l.f["llmq_rmsnorm"], x.p, delta.p, rows.p, w.p, out.p, C.int(n), C.int(H), C.float(eps)))
}

// Add does x += delta over n values (fp32 += fp16).
func (l *Lib) Add(x, delta Buf, n int) error {
	return l.check("llmq_add", C.c_add(l.f["llmq_add"], x.p, delta.p, C.size_t(n)))
}

// AddBias adds b [N] to each of T rows of y.
func (l *Lib) AddBias(y, b Buf, T, N int) error {
	return l.check("llmq_add_bias", C.c_bias(l.f["llmq_add_bias"], y.p, b.p, C.int(T), C.int(N)))
}

// RoPE rotates every head of x [T][heads·hd] by its row's position, with
// the rotary tables cos and sin [positions][hd/2].
func (l *Lib) RoPE(x, pos, cos, sin Buf, T, heads, hd int) error {
	return l.check("llmq_rope", C.c_rope(l.f["llmq_rope"], x.p, pos.p, cos.p, sin.p, C.int(T), C.int(heads), C.int(hd)))
}

// RowMeta are the per-row and per-sequence arrays of a forward pass.
type RowMeta struct{ RowSeq, RowPos, KVBase, KVCap Buf }

// KVStore writes rows of k and v into their sequences' caches.
func (l *Lib) KVStore(k, v Buf, m RowMeta, layer, layers, T, kvDim int) error {
	return l.check("llmq_kv_store", C.c_kv_store(l.f["llmq_kv_store"], k.p, v.p, m.RowSeq.p, m.RowPos.p, m.KVBase.p, m.KVCap.p,
		C.int(layer), C.int(layers), C.int(T), C.int(kvDim)))
}

// AttentionWorkspaceBytes is the scratch Attention needs.
func (l *Lib) AttentionWorkspaceBytes(T, heads, hd, maxKeys int) int {
	return int(C.c_attn_ws(l.f["llmq_attention_workspace_bytes"], C.int(T), C.int(heads), C.int(hd), C.int(maxKeys)))
}

// Attention writes causal attention over each row's cache to out; ws
// holds AttentionWorkspaceBytes bytes.
func (l *Lib) Attention(q, out, ws Buf, m RowMeta, layer, layers, T, heads, kvHeads, hd, maxKeys int) error {
	return l.check("llmq_attention", C.c_attention(l.f["llmq_attention"], q.p, out.p, ws.p, m.RowSeq.p, m.RowPos.p, m.KVBase.p, m.KVCap.p,
		C.int(layer), C.int(layers), C.int(T), C.int(heads), C.int(kvHeads), C.int(hd), C.int(maxKeys)))
}

// SiLUMul does g = SiLU(g)·u over n fp16 values.
func (l *Lib) SiLUMul(g, u Buf, n int) error {
	return l.check("llmq_silu_mul", C.c_silu_mul(l.f["llmq_silu_mul"], g.p, u.p, C.size_t(n)))
}

// NLL writes −log softmax(logits row t)[targets[t]] for T fp32 rows of V.
func (l *Lib) NLL(logits, targets, nll Buf, T, V int) error {
	return l.check("llmq_nll", C.c_nll(l.f["llmq_nll"], logits.p, targets.p, nll.p, C.int(T), C.int(V)))
}

// GemmNT computes C[M,N] = A[M,K]·W[N,K]ᵀ with cuBLAS; C is fp32 when f32.
func (l *Lib) GemmNT(A, W, C_ Buf, M, N, K int, f32 bool) error {
	c32 := 0
	if f32 {
		c32 = 1
	}
	return l.check("llmq_gemm_nt", C.c_gemm_nt(l.f["llmq_gemm_nt"], A.p, W.p, C_.p, C.int(M), C.int(N), C.int(K), C.int(c32)))
}

// Ptr is the device address of b, for arrays of pointers.
func (b Buf) Ptr() uint64 { return uint64(b.p) }

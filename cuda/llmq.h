/* llmq CUDA library: the C API the Go package cuda loads at run time with
 * dlopen. Every function returns 0 on success, or a nonzero code with a
 * message (naming the CUDA call that failed) available from
 * llmq_last_error(). Device pointers are plain void*.
 *
 * W4A16 GEMM: C[M,N] = A[M,K] · dequant(B)[K,N], A and C fp16 row-major,
 * B 4-bit in the tile-interleaved layout pack.GPULayout writes:
 *   B      uint4 chunks, chunk (nt, kt) for the 64 columns nt·64… and the
 *          16 rows kt·16…, at index nt·(K/16) + kt; lane l of a warp owns
 *          16 bytes of the chunk = its mma.m16n8k16 B fragments for 8 n8 tiles
 *   scales fp16 [G][N/64][8][8]: scales[g][nt][gid][j] = s[g][nt·64 + j·8 + gid]
 *   zeros  u32  [G][N/64][8]:    nibble j = z[g][nt·64 + j·8 + gid]
 * with G = K/group groups of `group` consecutive rows of K.
 */
#ifndef LLMQ_H
#define LLMQ_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

const char* llmq_last_error(void);
int llmq_version(void);
int llmq_device_info(char* name, int name_len, size_t* free_bytes, size_t* total_bytes, int* sms);

int llmq_malloc(void** ptr, size_t bytes);
int llmq_free(void* ptr);
int llmq_memcpy_h2d(void* dst, const void* src, size_t bytes);
int llmq_memcpy_d2h(void* dst, const void* src, size_t bytes);
int llmq_memcpy_d2d(void* dst, const void* src, size_t bytes);
int llmq_memset(void* dst, int value, size_t bytes);
int llmq_sync(void);

/* CUDA graphs: calls between begin and end are captured, not run; the
 * graph then replays them with one launch. */
int llmq_capture_begin(void);
int llmq_capture_end(void** graph_exec);
int llmq_graph_launch(void* graph_exec);
int llmq_graph_destroy(void* graph_exec);

/* Timing with CUDA events on the library's stream. */
int llmq_event_create(void** ev);
int llmq_event_destroy(void* ev);
int llmq_event_record(void* ev);
int llmq_event_elapsed(void* start, void* stop, float* ms);

/* Workspace the W4A16 kernel needs for M rows and N columns: an fp32
 * buffer of M·N and counters; both must start zeroed (llmq_memset) and are
 * left zeroed by every call. */
size_t llmq_w4a16_workspace_bytes(int M, int N);

/* C = A·dequant(B). perm (may be NULL): act-order checkpoints, A's columns
 * are gathered through perm into a_perm (M·K fp16 scratch) first.
 * scratch (may be NULL): K·N fp16, used for large M, where B is
 * dequantized once and multiplied by cuBLAS. */
int llmq_w4a16_gemm(const void* A, const void* B, const void* scales, const void* zeros,
                    const int32_t* perm, void* a_perm, void* C, void* workspace, void* scratch,
                    int M, int N, int K, int group);

/* Force a path, for tests and benchmarks: 0 automatic, 1 fused kernel,
 * 2 dequantize + cuBLAS. */
int llmq_w4a16_set_path(int path);

/* Reads bytes of p once (bandwidth probe); out is a 4-byte scratch. */
int llmq_read_probe(const void* p, size_t bytes, void* out);

/* W[K,N] fp16 = dequant(B). */
int llmq_w4_dequant(const void* B, const void* scales, const void* zeros, void* W, int N, int K, int group);

/* cuBLAS fp16 baseline: C[M,N] = A[M,K] · W[K,N], fp32 accumulation. */
int llmq_gemm_f16(const void* A, const void* W, void* C, int M, int N, int K);

/* Model kernels (model.cu): residual stream x fp32, activations fp16.
 * Row t of a forward pass belongs to sequence row_seq[t] at position
 * row_pos[t]; sequence s's cache is fp16 [2][layers][kv_cap[s]][kv_dim]
 * at kv_base[s] (keys, then values). All these arrays are device memory. */
int llmq_embed(const int32_t* ids, const void* E, float* x, int T, int H);
/* rows NULL: x += delta (if not NULL), out = RMSNorm(x)·w over n rows;
 * otherwise out row i = RMSNorm(x[rows[i]])·w. */
int llmq_rmsnorm(float* x, const void* delta, const int32_t* rows, const float* w, void* out, int n, int H, float eps);
int llmq_add(float* x, const void* delta, size_t n);
int llmq_add_bias(void* y, const void* b, int T, int N);
/* cos_t, sin_t: [positions][hd/2] fp32 rotary tables. */
int llmq_rope(void* x, const int32_t* pos, const float* cos_t, const float* sin_t, int T, int heads, int hd);
int llmq_kv_store(const void* k, const void* v, const int32_t* row_seq, const int32_t* row_pos, const uint64_t* kv_base,
                  const int32_t* kv_cap, int layer, int layers, int T, int kv_dim);
/* max_keys bounds row_pos+1 over the rows; workspace holds
 * llmq_attention_workspace_bytes(T, heads, hd, max_keys) bytes. */
size_t llmq_attention_workspace_bytes(int T, int heads, int hd, int max_keys);
int llmq_attention(const void* q, void* out, void* workspace, const int32_t* row_seq, const int32_t* row_pos,
                   const uint64_t* kv_base, const int32_t* kv_cap, int layer, int layers, int T, int heads, int kv_heads,
                   int hd, int max_keys);
int llmq_silu_mul(void* g, const void* u, size_t n);
int llmq_nll(const float* logits, const int32_t* targets, float* nll, int T, int V);
/* C[M,N] = A[M,K]·W[N,K]ᵀ (W in PyTorch's [out][in] layout); C fp32 when c_fp32. */
int llmq_gemm_nt(const void* A, const void* W, void* C, int M, int N, int K, int c_fp32);

#ifdef __cplusplus
}
#endif
#endif

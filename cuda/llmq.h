/* llmq CUDA library: the C API the Go package cuda loads at run time with
 * dlopen.
 *
 * State. Everything the library holds lives in a context (llmq_ctx), made
 * by llmq_ctx_create and released by llmq_ctx_destroy: its CUDA stream
 * (every kernel, copy and graph of the context runs on it, in order), its
 * cuBLAS handle and that handle's workspace, the device memory allocated
 * through it, its CUDA graphs and events, and the tuning it caches
 * (occupancy, the forced W4A16 path). Destroying a context waits for its
 * stream and frees all of that, whatever the caller forgot. The library
 * has no other mutable state. A context is not thread-safe: its caller
 * serialises the calls on one context (package cuda's Model holds a mutex);
 * two contexts may be used from two threads at once.
 *
 * Symbols. The library exports one function, llmq_api_get, returning a
 * table of typed function pointers (llmq_api) that the caller resolves
 * once at load and checks against LLMQ_API_VERSION.
 *
 * Errors. Every int function returns 0 on success, or nonzero with a
 * message naming the CUDA call that failed: llmq_ctx_error(ctx) for calls
 * on a context, llmq_last_error() (thread-local) for the calls without one
 * (ctx_create, device_info).
 *
 * W4A16 GEMM: C[M,N] = A[M,K] · dequant(B)[K,N], A and C fp16 row-major,
 * B 4-bit in the tile-interleaved layout pack.GPULayout writes:
 *   B      uint4 chunks (2-, 3- and 4-bit codes, one per nibble), chunk
 *          (nt, kt) for the 64 columns nt·64… and the
 *          16 rows kt·16…, at index nt·(K/16) + kt; lane l of a warp owns
 *          16 bytes of the chunk = its mma.m16n8k16 B fragments for 8 n8 tiles
 *   scales fp16 [G][N/64][8][8]: scales[g][nt][gid][j] = s[g][nt·64 + j·8 + gid]
 *   zeros  u32  [G][N/64][8]:    nibble j = z[g][nt·64 + j·8 + gid]
 * with G = K/group groups of `group` consecutive rows of K.
 *
 * Model kernels (model.cu): residual stream x fp32, activations fp16.
 * Row t of a forward pass belongs to sequence row_seq[t] at position
 * row_pos[t]; sequence s's cache is fp16 [2][layers][kv_cap[s]][kv_dim]
 * at kv_base[s] (keys, then values), or, when kv_cap[s] < 0, paged:
 * kv_base[s] is then a block table of device addresses [pos/16][layers],
 * each block fp16 [2][16][kv_dim] (keys, then values; llm.BlockTable).
 * All these arrays are device memory.
 */
#ifndef LLMQ_H
#define LLMQ_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define LLMQ_API_VERSION 28

/* The most rows and slots (rows × top k) moe_gemv_routed routes. */
#define LLMQ_MOE_ROUTED_ROWS 4
#define LLMQ_MOE_ROUTED_SLOTS 32

/* Partial-sum slices of col_abs_sum and sq_diff_sum (awq.cu). */
#define LLMQ_COL_SPLITS 32
#define LLMQ_SQ_PARTS 1024

typedef struct llmq_ctx llmq_ctx;

/* What a context holds on the device. */
typedef struct {
  size_t live_bytes;     /* allocated through the context and not freed (cuBLAS workspace included) */
  size_t peak_bytes;     /* the most live_bytes has been */
  size_t cublas_bytes;   /* the cuBLAS workspace's share of live_bytes */
  int live_allocations;
  int graphs;            /* instantiated graphs not destroyed */
  int events;
} llmq_memory;

typedef struct {
  int version; /* LLMQ_API_VERSION */
  size_t size; /* sizeof(llmq_api) */

  const char* (*last_error)(void);
  int (*device_info)(char* name, int name_len, size_t* free_bytes, size_t* total_bytes, int* sms);

  /* device: the CUDA device ordinal (0). */
  int (*ctx_create)(int device, llmq_ctx** out);
  int (*ctx_destroy)(llmq_ctx* c);
  const char* (*ctx_error)(llmq_ctx* c);
  int (*ctx_memory)(llmq_ctx* c, llmq_memory* out);

  int (*mem_alloc)(llmq_ctx* c, void** ptr, size_t bytes);
  /* Frees memory allocated through c; a pointer c did not allocate is an error. */
  int (*mem_free)(llmq_ctx* c, void* ptr);
  /* h2d and d2h wait for the stream (the host buffer is free or filled on return). */
  int (*memcpy_h2d)(llmq_ctx* c, void* dst, const void* src, size_t bytes);
  int (*memcpy_d2h)(llmq_ctx* c, void* dst, const void* src, size_t bytes);
  int (*memcpy_d2d)(llmq_ctx* c, void* dst, const void* src, size_t bytes);
  int (*mem_set)(llmq_ctx* c, void* dst, int value, size_t bytes);
  int (*sync)(llmq_ctx* c);

  /* CUDA graphs: calls on c between begin and end are captured, not run;
   * the graph then replays them with one launch. */
  int (*capture_begin)(llmq_ctx* c);
  int (*capture_end)(llmq_ctx* c, void** graph_exec);
  int (*graph_launch)(llmq_ctx* c, void* graph_exec);
  int (*graph_destroy)(llmq_ctx* c, void* graph_exec);

  /* Timing with CUDA events on the context's stream. */
  int (*event_create)(llmq_ctx* c, void** ev);
  int (*event_destroy)(llmq_ctx* c, void* ev);
  int (*event_record)(llmq_ctx* c, void* ev);
  int (*event_elapsed)(llmq_ctx* c, void* start, void* stop, float* ms);

  /* Workspace the W4A16 kernel needs for M rows and N columns: an fp32
   * buffer of M·N and counters; both must start zeroed (memset) and are
   * left zeroed by every call. */
  size_t (*w4a16_workspace_bytes)(int M, int N);
  /* C = A·dequant(B), C [M][N] fp16 written as n_outs (1–3) row-major
   * tensors side by side: outs[i] gets out_cols[i] of the N columns (each
   * a multiple of 64 when there are several; a joined q/k/v layer writes
   * q, k and v). perm (may be NULL): act-order checkpoints, A's columns
   * are gathered through perm into a_perm (M·K fp16 scratch) first.
   * scratch (may be NULL): K·N fp16, used for large M and for group sizes
   * the kernels do not run (not powers of two), where B is dequantized
   * and multiplied by cuBLAS. bits: 4 (codes of 2 to 4 bits, one a
   * nibble) or 8 (one a byte: the GEMV kernel at M ≤ 4, dequantize +
   * cuBLAS beyond). act ≥ 0 (API 16): B is a gated MLP's gate and up
   * interleaved in 32-column halves (n-tile t: gate columns 32t…32t+31,
   * then up's; pack.InterleaveGPU), and the one output (n_outs 1,
   * out_cols N/2) gets act(gate)·up, act 0 SiLU or 1 GELU-tanh, as
   * gated_act computes it from the two fp16 results; −1: a plain GEMM.
   * Every output must start on 8 bytes and the workspace on 16 (the
   * epilogues store several columns at once); refused otherwise.
   * n_outs 0 with act −1 (API 21): no outputs; the fp32 sums [M][N] are
   * added into the workspace and left there, no K split's last CTA
   * finishing them, for the caller's later kernels to read and zero
   * (rmsnorm's sums, which rmsnorm_router may read first; qk_rope_store's
   * sums). The GEMV kernels do this for
   * M ≤ 8, dequantize + cuBLAS (a scratch) for any M; a plan that picks
   * another kernel (more rows, or a forced path) is refused. */
  int (*w4a16_gemm)(llmq_ctx* c, const void* A, const void* B, const void* scales, const void* zeros, const int32_t* perm,
                    void* a_perm, void* const* outs, const int* out_cols, int n_outs, int act, void* workspace,
                    void* scratch, int M, int N, int K, int group, int bits);
  /* The kernel variant w4a16_gemm runs for this shape on c (path,
   * instantiation, K splits), written to out (n bytes): for benchmark
   * tables. */
  int (*w4a16_plan)(llmq_ctx* c, int M, int N, int K, int group, int bits, char* out, int n);
  /* Force a path on c, for tests and benchmarks: 0 automatic, 1 fused
   * kernel, 2 dequantize + cuBLAS, 3 GEMV kernel (M ≤ 4). */
  int (*w4a16_set_path)(llmq_ctx* c, int path);
  /* W[K,N] fp16 = dequant(B), codes of `bits` (4 or 8, as w4a16_gemm). */
  int (*w4_dequant)(llmq_ctx* c, const void* B, const void* scales, const void* zeros, void* W, int N, int K, int group,
                    int bits);
  /* cuBLAS fp16 baseline: C[M,N] = A[M,K] · W[K,N], fp32 accumulation. */
  int (*gemm_f16)(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K);
  /* Reads bytes of p once (bandwidth probe); out is a 4-byte scratch. */
  int (*read_probe)(llmq_ctx* c, const void* p, size_t bytes, void* out);

  /* x[t] = E[ids[t]]·scale (0: 1; Gemma: √hidden). */
  int (*embed)(llmq_ctx* c, const int32_t* ids, const void* E, float* x, int T, int H, float scale);
  /* rows NULL: x += delta (if not NULL; with delta_norm, fp32 [H], x +=
   * RMSNorm(delta)·delta_norm: Gemma 3's post-attention and
   * post-feedforward norms), out = RMSNorm(x)·w over n rows; otherwise
   * out row i = RMSNorm(x[rows[i]])·w. With y (fp32 [n·k][H], zeroed on
   * return), the delta is also a mixture's output: row t's Σ_j
   * weights[t·k+j] · y[t·k+j], added in fp32 in ascending expert order
   * (ids), as the CPU does; k ≤ 16. With both delta and y (a delta
   * rmsnorm_router left pending), x + delta comes first, then the
   * experts' sum (no delta_norm then). API 23: sums (fp32 [n][H], not
   * with delta or rows) is the delta as the fp32 sums a w4a16_gemm with
   * no outputs left in its workspace (o's or down's), added where delta
   * would be (before y's experts too) and zeroed on return. API 25: with y and
   * no rows, ids and weights are read before the kernel waits on the
   * launch before it (programmatic dependent launch; LLMQ_COMBINE_EARLY=0:
   * after): they must come from the host or from a launch before that one
   * (the routing, ahead of the expert GEMVs).
   * H % 4 == 0, H ≤ 16384; x, w, delta_norm, sums and y 16-byte aligned,
   * delta and out 8-byte aligned (rows of H values from an aligned start
   * are). */
  int (*rmsnorm)(llmq_ctx* c, float* x, const void* delta, float* sums, const float* delta_norm, float* y,
                 const int32_t* ids, const float* weights, int k, const int32_t* rows, const float* w, void* out, int n,
                 int H, float eps);
  int (*add)(llmq_ctx* c, float* x, const void* delta, size_t n);
  int (*add_bias)(llmq_ctx* c, void* y, const void* b, int T, int N);
  /* q [T][heads·hd] and k [T][kv_heads·hd] fp16, in place: per-head
   * RMSNorm by q_norm / k_norm (fp32 [hd]; NULL: none, Qwen3 has them),
   * then RoPE by row_pos from cos_t, sin_t ([positions][hd/2] fp32
   * tables). With kv_base (NULL: no cache), k's rotated rows and v's
   * rows [T][kv_heads·hd] are also written to their sequences' caches
   * at layer. With sums (API 22; NULL: none), q, k and v are first
   * written from the fp32 sums [T][(heads + 2·kv_heads)·hd] a joined
   * q/k/v w4a16_gemm with no outputs left in its workspace (each rounded
   * to fp16 once), which are zeroed. */
  int (*qk_rope_store)(llmq_ctx* c, void* q, void* k, void* v, float* sums, const float* q_norm, const float* k_norm,
                       float eps, const int32_t* row_seq, const int32_t* row_pos, const uint64_t* kv_base,
                       const int32_t* kv_cap, const float* cos_t, const float* sin_t, int layer, int layers, int T,
                       int heads, int kv_heads, int hd);
  /* max_keys bounds row_pos+1 over the rows; workspace holds
   * attention_workspace_bytes(T, heads, hd, max_keys) bytes. window > 0:
   * a row at position p sees keys p−window+1 … p (a sliding window), 0:
   * all of 0 … p. scale multiplies q·k (0: head_dim^-½). (API 24 and 25
   * also took the next GEMM's codes to ask L2 for while the decode kernel
   * ran; API 26 dropped them: no form of the request made attention then
   * o faster, and in the decode it gained at most 0.9%, on one model.) */
  size_t (*attention_workspace_bytes)(int T, int heads, int hd, int max_keys);
  int (*attention)(llmq_ctx* c, const void* q, void* out, void* workspace, const int32_t* row_seq, const int32_t* row_pos,
                   const uint64_t* kv_base, const int32_t* kv_cap, int layer, int layers, int T, int heads, int kv_heads,
                   int hd, int max_keys, int window, float scale);
  /* g = act(g)·u over n fp16 values: act 0 SiLU, 1 GELU (tanh approximation). */
  int (*gated_act)(llmq_ctx* c, void* g, const void* u, size_t n, int act);
  int (*nll)(llmq_ctx* c, const float* logits, const int32_t* targets, float* nll, int T, int V);
  /* out[t] = the index of row t's largest logit (logits fp32 [T][V]): the
   * first on ties, NaNs never chosen, 0 when logits[t][0] is NaN or no
   * value exceeds it (llm.Argmax's rules). logits 16-byte aligned when
   * V % 4 == 0. */
  int (*argmax_rows)(llmq_ctx* c, const float* logits, int32_t* out, int T, int V);
  /* C[M,N] = A[M,K]·W[N,K]ᵀ (W in PyTorch's [out][in] layout); C fp32 when c_fp32. */
  int (*gemm_nt)(llmq_ctx* c, const void* A, const void* W, void* C, int M, int N, int K, int c_fp32);

  /* GPTQ (quant.cu). H [n][n] fp32 += Xᵀ·X for X [rows][n] fp16. */
  int (*hessian_add)(llmq_ctx* c, const void* X, float* H, int rows, int n);
  /* d[i] = H[i][i]. */
  int (*hessian_diag)(llmq_ctx* c, const float* H, float* d, int n);
  size_t (*gptq_factor_workspace_bytes)(int n);
  /* U [n][n] fp32 row-major = the upper Cholesky factor of (P·(s·Hsum)·Pᵀ + λI)⁻¹,
   * P the column order perm (Hp[i][j] = s·Hsum[perm[i]][perm[j]]), zero
   * diagonal entries of Hsum taken as 1 before damping. *ok = 0 (and U
   * unset) when the damped matrix is not positive definite. workspace holds
   * gptq_factor_workspace_bytes(n) bytes. Waits for the stream. */
  int (*gptq_factor)(llmq_ctx* c, const float* Hsum, double s, const int32_t* perm, double lambda, float* U, void* workspace,
                     int n, int* ok);
  /* GPTQ's blocked column updates (blocks of 128) on W [out][in] fp32 in
   * column order (overwritten): codes Q [out][in] (column order), per-group
   * scale fp32 / zero u8 [G][out] (fitted at each group's first column on
   * the current weights when fit_groups, else read), group_of [in] (the
   * group of each position), err1 [out][128] fp32 scratch, loss [out]
   * fp64 = Σ (w−q)²/(2·U_jj²). from_start: a group starting inside a
   * block is fitted on the block's weights as the block began. */
  int (*gptq_quantize)(llmq_ctx* c, float* W, const float* Hinv, uint8_t* Q, float* scale, uint8_t* zero, const int32_t* group_of,
                       float* err1, double* loss, int out, int in, int group, int bits, int sym, int fit_groups, int from_start);

  /* AWQ (awq.cu). dst fp16 = src fp32, n values. */
  int (*f32_to_f16)(llmq_ctx* c, const float* src, void* dst, size_t n);
  /* height rows of width bytes from src (rows spitch bytes apart) to dst (dpitch apart), device to device. */
  int (*memcpy_2d)(llmq_ctx* c, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height);
  /* part [LLMQ_COL_SPLITS][d] fp64 += Σ |X[r][c]| over the rows of X [rows][d] fp16, row slice y into part[y]. */
  int (*col_abs_sum)(llmq_ctx* c, const void* X, double* part, int rows, int d);
  /* part [LLMQ_SQ_PARTS] fp64 += Σ (a−b)² over n fp16 values, each part a fixed subset. */
  int (*sq_diff_sum)(llmq_ctx* c, const void* a, const void* b, double* part, size_t n);
  /* Wq [out][in] fp16 = Q(W·diag(s))·diag(s)⁻¹ for W fp32, s [in] fp32
   * (NULL: no scaling), Q the grid of pack.Grid (bits, group, sym, minmax)
   * fitted per row and group. */
  int (*awq_quant)(llmq_ctx* c, const float* W, const float* s, void* Wq, int out, int in, int group, int bits, int sym,
                   int minmax);
  /* AWQ's clip search on W [out][in] fp32: for each row and group, of the
   * n_shrink thresholds max|w|·(1 − k/(2·n_shrink)) the one minimising
   * dᵀ·G·d, d = (Q(clip(w)) − w)/s over the group (s NULL: 1) and G the
   * group's diagonal block of H [in][in] fp32 (Σ x·xᵀ of the sampled
   * unscaled inputs). Writes best_max [out][in/group]; D, P [out][in]
   * fp32 and best_err [out][in/group] fp64 are scratch. */
  int (*awq_clip)(llmq_ctx* c, const float* W, const float* s, const float* H, float* D, float* P, double* best_err,
                  float* best_max, int out, int in, int group, int bits, int sym, int minmax, int n_shrink);

  /* Causal self-attention within windows of T consecutive rows (flash.cu):
   * row w·T + p attends to rows w·T … w·T + p. q, out [windows·T][heads·hd],
   * k, v [windows·T][kv_heads·hd], fp16, RoPE applied; hd 32, 64 or 128;
   * window and scale as for attention (a sliding window counts rows of
   * the same window only). */
  int (*attention_causal)(llmq_ctx* c, const void* q, const void* k, const void* v, void* out, int windows, int T, int heads,
                          int kv_heads, int hd, int window, float scale);

  /* out = in quantized and dequantized, rows of cols fp16 values (the
   * input of a linear layer in a W8A8-style simulation, as package
   * actquant does it on the CPU): bits-bit symmetric integers, or E4M3
   * (fp8, bits 8); the scale from each row's max |x| (per_token) or from
   * threshold; in and out may be the same. */
  int (*fake_quant)(llmq_ctx* c, const void* in, void* out, int rows, int cols, int bits, int fp8, int per_token,
                    float threshold);

  /* A mixture of experts' routing (model.cu): for T rows of router logits
   * [T][E] (fp32), the softmax over all E experts, the top k (ties: the
   * lower expert), most probable first, into ids and weights [T][k]; the
   * weights renormalised to sum to 1 when norm. E ≤ 256, k ≤ 16. A row of
   * NaN logits gets the lowest experts with NaN weights (as the CPU). */
  int (*moe_route)(llmq_ctx* c, const float* logits, int32_t* ids, float* weights, int T, int E, int k, int norm);
  /* logits [T][E] fp32 = h [T][H] fp16 · Wᵀ, W [E][H] fp32: the router,
   * kept in full precision. H % 4 == 0, T ≤ 65535. */
  int (*moe_router)(llmq_ctx* c, const void* h, const float* W, float* logits, int T, int E, int H);
  /* The S = T·k slots of a routed pass (row t's j-th expert, ids[t·k + j],
   * is slot t·k + j) grouped by expert for moe_gemv: order [S] lists the
   * slots expert by expert, ascending; chunks [max_chunks][3] = (expert,
   * first index into order, slots ≤ mt) cut each expert's list, chunks past
   * the last having 0 slots. max_chunks must be ≥ ⌈S/mt⌉ + min(E, S) (a
   * bound for every routing), or S when mt is 1 (a chunk a slot). ids
   * outside [0, E) are left out. One block. */
  int (*moe_plan)(llmq_ctx* c, const int32_t* ids, int S, int E, int mt, int32_t* order, int32_t* chunks, int max_chunks);
  /* moe_route then moe_plan of its ids, in one launch (one block). */
  int (*moe_route_plan)(llmq_ctx* c, const float* logits, int32_t* ids, float* weights, int T, int E, int k, int norm,
                        int mt, int32_t* order, int32_t* chunks, int max_chunks);
  /* The experts' linear layer over a plan (moe_plan, the same mt: 1 or 4;
   * slots its S, which tunes how K is split): out row s (fp32 [S][N],
   * zeroed before, summed into with atomics) += A row s / a_div · W_e for
   * each slot s of expert e (a_div k: A holds the pass's rows; 1: A holds a
   * row per slot). The experts' weights lie one after another: 4-bit in
   * w4a16_gemm's layout (B, scales, zeros; N % 64 == 0, group a power of
   * two or K; act order not supported), or fp16 [E][N][K] in W16 (not
   * NULL; K % 8 == 0). */
  /* API 19, act ≥ 0 (0 SiLU, 1 GELU-tanh; 4-bit experts): each expert's
   * gate and up are interleaved in 32-column halves (pack.InterleaveGPU,
   * N = 2I) and the layer writes g [S][I] fp16 = act(gate)·up as moe_act
   * computes it: in the GEMV's epilogue where one K split serves, else
   * (and with LLMQ_MOE_FUSED_ACT=0) the sums into out then moe_act over
   * the S = slots rows, so slots must be S and out [S][N] zeroed as
   * without act, which it is left. act −1: not gated (g unused). */
  int (*moe_gemv)(llmq_ctx* c, const void* A, int a_div, const int32_t* order, const int32_t* chunks, int max_chunks, int mt,
                  int slots, const void* B, const void* scales, const void* zeros, const void* W16, float* out, int N,
                  int K, int group, void* g, int act);
  /* g [S][I] fp16 = act(gate) · up from a joined gate/up output gu [S][2I]
   * fp32, which it zeroes: gate and up rounded to fp16 first, as
   * gated_act computes them from fp16 GEMM outputs. gate gu[:, :I] and up
   * gu[:, I:]; interleaved (API 19): in 32-column halves of each 64-column
   * tile (pack.InterleaveGPU; I % 32 == 0). */
  int (*moe_act)(llmq_ctx* c, float* gu, void* g, int S, int I, int act, int interleaved);
  /* out[t] = the token llm.Sampler would pick from row t of logits (fp32
   * [T][V]) with params[4t … 4t+3] = temperature, top-k, top-p and its
   * uniform draw u (fp64); temperature 0 gives argmax_rows's answer. −1
   * where the candidates the walk needs do not fit the kernel (then pick
   * on the host with the same u). */
  int (*sample_rows)(llmq_ctx* c, const float* logits, const double* params, int32_t* out, int T, int V);
  /* API 17: moe_route_plan (mt 1) then moe_gemv of 4-bit experts in one
   * launch, for a decode step's T ≤ LLMQ_MOE_ROUTED_ROWS rows of T·k ≤
   * LLMQ_MOE_ROUTED_SLOTS slots: every CTA routes the rows from their
   * logits [T][E] itself and takes its slot; the routing (ids, weights
   * [T·k]) and the plan (order [T·k]; chunks [T·k][3], one slot each: the
   * plan moe_gemv reads with mt 1 and max_chunks T·k) are written as
   * moe_route_plan writes them (the order within an expert by slot; in any
   * order with LLMQ_MOE_ROUTED=0, which runs the two launches). A holds
   * the T rows (a_div k). g and act (API 19): gated experts, as moe_gemv.
   * API 27: nB, nS, nZ (NULL: none), nN × nK in groups of ngroup: the next
   * grouped GEMV's 4-bit experts (down), whose routed experts this launch
   * asks L2 for when LLMQ_MOE_PREFETCH is 1 (after routing) or 2 (after
   * each CTA's loop); only a hint, the results do not change. API 28:
   * nout (NULL: none), fp32 [T·k][nN], zero before: the launch runs the
   * next layer too, nout += g · its experts over the plan, as moe_gemv
   * would (gated experts only, nK = N/2): inside this launch with
   * LLMQ_MOE_FUSED_DOWN=1 where this launch writes g itself (one K split:
   * LLMQ_MOE_FUSED_ACT on, and one split planned or this pass's tiles
   * filling the SMs), the next layer's groups are of 32 rows or more and
   * nout, zeros and nZ are 16-byte aligned — each CTA multiplies its 32
   * values of g by their rows of the next layer and adds into nout, the
   * same sums but for the order of the additions (w4a16.cu, MoEDown) —,
   * else by moe_gemv's launch after this one. */
  int (*moe_gemv_routed)(llmq_ctx* c, const void* A, const float* logits, int T, int E, int k, int norm, int32_t* ids,
                         float* weights, int32_t* order, int32_t* chunks, const void* B, const void* scales,
                         const void* zeros, float* out, int N, int K, int group, void* g, int act, const void* nB,
                         const void* nS, const void* nZ, int nN, int nK, int ngroup, float* nout);
  /* API 19: a mixture's norm and router in one launch: out [n][H] fp16 =
   * RMSNorm(x + delta)·w, as rmsnorm with delta (no delta_norm, experts
   * or rows), except that x is not written: the caller passes delta again
   * to the next norm (rmsnorm with delta and y); and logits [n][E] fp32 =
   * out · Wᵀ as moe_router computes them (W [E][H] fp32). E ≤ 256.
   * LLMQ_MOE_NORM_ROUTER=0: the norm, then moe_router. API 23: sums
   * instead of delta (one of the two): fp32 sums as rmsnorm's, read and
   * left as they are for the next rmsnorm (its sums with y). */
  int (*rmsnorm_router)(llmq_ctx* c, const float* x, const void* delta, const float* sums, const float* w, void* out,
                        const float* W, float* logits, int n, int H, int E, float eps);
  /* API 20: dst fp32 = src fp16, n values (n even; src 4-byte, dst 8-byte
   * aligned): a packed LM head's logits, written by w4a16_gemm in fp16. */
  int (*f16_to_f32)(llmq_ctx* c, const void* src, float* dst, size_t n);
} llmq_api;

/* The library's one exported symbol. */
const llmq_api* llmq_api_get(void);

#ifdef __cplusplus
}
#endif
#endif

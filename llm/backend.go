// Package llm loads Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3,
// Gemma 3, and the mixtures of experts Mixtral and Qwen3-MoE) and runs
// them: the decoder-only transformer of Touvron et al. 2023 with RMSNorm,
// rotary position embeddings (Su et al. 2021), grouped-query attention
// (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020):
//
//	x₀ = E[tokens]
//	for each block:  h = x + Wo·Attn(RoPE(Wq·n), RoPE(Wk·n), Wv·n),  n = RMSNorm(x)
//	                 x = h + Wdown·(SiLU(Wgate·m) ⊙ Wup·m),          m = RMSNorm(h)
//	logits = Wlm·RMSNorm(x)
//
// The later families change pieces of it:
//
//   - Qwen3 (and Qwen3-MoE, Gemma 3) norm each head of the queries and
//     keys before RoPE: q_h = RMSNorm(q_h)·w_q, k_h = RMSNorm(k_h)·w_k.
//   - Mixtral and Qwen3-MoE replace the MLP by a mixture of experts (MoE):
//     a router picks the top-k experts of each token by softmax
//     probability and sums their SwiGLU outputs weighted by it.
//   - Gemma 3 scales x₀ by √hidden, applies norms as x̂·(1+w), norms the
//     attention and MLP outputs before each residual add
//     (h = x + RMSNorm(Wo·Attn(…)), x = h + RMSNorm(MLP(RMSNorm(h)))),
//     uses GELU (tanh) in place of SiLU, scales scores by
//     query_pre_attn_scalar^-½, and alternates sliding-window layers (with
//     their own RoPE base) with full-attention ones.
//   - Mistral's sliding window W (every layer) and Gemma's sliding layers
//     let the query at position p see only keys p−W+1 … p; their KV cache
//     keeps a ring of the last W positions.
//
// A Backend runs that network; the CPU backend (Model) computes in float32
// with weights converted on load, and quantized checkpoints are dequantized
// to float32 ("fake quantization", what a correct W4A16 kernel computes).
// The CUDA backend in package cuda satisfies the same interface: callers
// (generation, perplexity, the engine, benchmarks) use Backend alone and
// never ask which implementation they hold. A backend loads its layers
// from the table of names and shapes that BlockLinears and HeadLinear give
// (LoadBlock and LoadEmbeddings build the CPU's Linear layers from it).
package llm

import (
	"context"

	"github.com/llmq/llmq/llm/checkpoint"
)

// Backend runs a model's forward pass over a key/value cache.
type Backend interface {
	// Config is the architecture being run.
	Config() *checkpoint.Config
	// NewCache makes an empty cache for one sequence of up to capacity
	// tokens; the caller closes it.
	NewCache(capacity int) (Cache, error)
	// Forward appends each step's tokens to its cache and writes logits.
	// Steps are independent sequences processed together.
	Forward(ctx context.Context, steps []Step) error
	// WindowNLL runs ids as one sequence from an empty context and returns
	// Σ_{i=1}^{len−1} −log p(ids[i] | ids[:i]) and the number of terms,
	// len(ids)−1: the unit of work of perplexity. The CPU computes it from
	// the window's logits with NLL; the GPU computes it on the device.
	WindowNLL(ctx context.Context, ids []int) (sum float64, count int, err error)
	// Memory reports what the backend holds.
	Memory() (Memory, error)
	// Name says what runs the model, e.g. "cpu (openblas)".
	Name() string
	// Close releases what the backend holds (GPU memory); caches still
	// open are released with it. The backend is unusable afterwards.
	Close() error
}

// Cache holds the keys and values of the tokens a sequence has seen.
type Cache interface {
	Len() int       // tokens stored
	Cap() int       // tokens it can hold
	Truncate(n int) // forget everything after the first n tokens
	// Close releases the cache's memory; closing twice is harmless.
	Close() error
}

// Paged is a Backend whose caches take their memory a block at a time
// from one BlockPool as their sequences grow, and give it back when they
// are truncated or closed: a cache's memory follows the tokens it holds,
// not its capacity. A scheduler admits sequences while the pool has room
// and preempts one when it runs out (package engine does). The CPU
// backend is one, and so is the GPU's (cuda.Model).
type Paged interface {
	Backend
	// KVPool is the pool the backend's caches draw from.
	KVPool() *BlockPool
	// SetKVCacheBytes bounds the pool to bytes of keys and values
	// (≤ 0: unbounded, blocks allocated as needed, the default). It fails
	// when open caches hold more already, or bytes is less than a block.
	SetKVCacheBytes(bytes int64) error
	// Trim gives the memory of blocks handed back to the operating
	// system, as far as the backend can; a scheduler calls it when idle.
	Trim()
}

// PagedCache is a Paged backend's cache.
type PagedCache interface {
	Cache
	// Need is how many blocks beyond those it holds the next Forward
	// appending n tokens takes from the pool.
	Need(n int) int
	// Blocks is how many blocks it holds.
	Blocks() int
}

// Memory is what a backend holds, in bytes. Weights, Caches, Activations
// and Workspace are the backend's own accounting and add up to Total; on
// the GPU they are every byte allocated through the model's context.
type Memory struct {
	Weights     int64 `json:"weights_bytes"`
	Caches      int64 `json:"caches_bytes"`      // key/value caches: the CPU, the blocks open caches hold now; the GPU, its segments of blocks and the caches' tables
	Activations int64 `json:"activations_bytes"` // buffers kept between forward passes, decode graphs' included
	Workspace   int64 `json:"workspace_bytes"`   // library scratch (cuBLAS workspace, dequantize scratch)
	Graphs      int   `json:"graphs"`            // captured decode graphs held
	// DeviceUsed and DeviceTotal are the whole device's memory (every
	// process, the CUDA context included); zero on the CPU.
	DeviceUsed  int64 `json:"device_used_bytes,omitempty"`
	DeviceTotal int64 `json:"device_total_bytes,omitempty"`
}

// Total is the memory the backend accounts for.
func (m Memory) Total() int64 { return m.Weights + m.Caches + m.Activations + m.Workspace }

// Step is one sequence's share of a batched forward pass.
type Step struct {
	Cache  Cache
	Tokens []int
	// Logits receives len(Tokens)×vocab values, or vocab values (the last
	// position's) when LastOnly is set.
	Logits   []float32
	LastOnly bool
	// Greedy, with LastOnly, asks for the last position's argmax (as the
	// function Argmax takes it: the first on ties) in the field Argmax,
	// instead of the logits: the GPU then copies one id to the host, not a
	// vocabulary of floats. Callers send Greedy steps only to Greediers
	// (IsGreedier); other backends ignore the flag, and so does a
	// Greedier on a step without LastOnly (its Logits buffer is needed).
	Greedy bool
	// Argmax is the token the backend picked: the argmax of a Greedy step,
	// or a Draw's pick.
	Argmax int
	// Draw, with LastOnly, asks a Drawer (IsDrawer) for the token
	// Draw.Pick would choose from the last position's logits (on a device,
	// up to the rounding of its sums), in Argmax, instead of the logits.
	// Sampler.AskBackend sets it (or Greedy) when the backend answers it,
	// taking the request's draw, and the caller then uses Argmax instead of
	// sampling; other backends ignore it.
	Draw *Draw
}

// Greedier is a Backend that answers Step.Greedy: it sets Step.Argmax and
// may leave Logits unwritten on the steps that ask. The CPU model is not
// one (it computes the logits anyway); the GPU model (cuda.Model) is. A
// wrapper that edits logits after Forward must not be one either:
// embedding the llm.Backend interface keeps it out, but embedding a
// concrete Greedier would pass the method on, and greedy steps would skip
// the edits.
type Greedier interface {
	Backend
	AnswersGreedy()
}

// IsGreedier reports whether b answers Step.Greedy.
func IsGreedier(b Backend) bool {
	_, ok := b.(Greedier)
	return ok
}

// Chainer is a Greedier that runs several greedy decode steps back to
// back on its device, each step's token the argmax of the step before,
// with no round trip to the host between them: the host queues the steps
// ahead of the kernels, so the device does not wait on it between steps
// (cuda.Model). The same caution as Greedier for wrappers.
type Chainer interface {
	Greedier
	// DecodeGreedy runs n greedy steps from each step's one token (its
	// Cache and Tokens; the other fields are ignored; each cache needs
	// room for n more tokens) and returns each sequence's n picked tokens
	// — the Argmax values n single Greedy steps would give, up to
	// near-ties (the device may sum a step's attention in another order).
	// Every cache advances by n: the last token picked is not in it yet.
	// ctx is checked once, before the chain: a chain runs whole. On an
	// error no cache has advanced.
	DecodeGreedy(ctx context.Context, steps []Step, n int) ([][]int, error)
}

// Drawer is a Backend that answers Step.Draw: it sets Step.Argmax to the
// sampled token and may leave Logits unwritten on the steps that ask
// (cuda.Model; the same caution as Greedier for wrappers).
type Drawer interface {
	Backend
	AnswersDraw()
}

// IsDrawer reports whether b answers Step.Draw.
func IsDrawer(b Backend) bool {
	_, ok := b.(Drawer)
	return ok
}

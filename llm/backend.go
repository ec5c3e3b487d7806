// Package llm loads Llama-family checkpoints (Llama, Mistral, Qwen2) and runs
// them: the decoder-only transformer of Touvron et al. 2023 with RMSNorm,
// rotary position embeddings (Su et al. 2021), grouped-query attention
// (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020):
//
//	x₀ = E[tokens]
//	for each block:  h = x + Wo·Attn(RoPE(Wq·n), RoPE(Wk·n), Wv·n),  n = RMSNorm(x)
//	                 x = h + Wdown·(SiLU(Wgate·m) ⊙ Wup·m),          m = RMSNorm(h)
//	logits = Wlm·RMSNorm(x)
//
// A Backend runs that network; the CPU backend (Model) computes in float32
// with weights converted on load, and quantized checkpoints are dequantized
// to float32 ("fake quantization", what a correct W4A16 kernel computes).
// The CUDA backend in package cuda satisfies the same interface.
package llm

import (
	"context"

	"github.com/llmq/llmq/llm/checkpoint"
)

// Backend runs a model's forward pass over a key/value cache.
type Backend interface {
	// Config is the architecture being run.
	Config() *checkpoint.Config
	// NewCache makes an empty cache for one sequence of up to capacity tokens.
	NewCache(capacity int) (Cache, error)
	// Forward appends each step's tokens to its cache and writes logits.
	// Steps are independent sequences processed together.
	Forward(ctx context.Context, steps []Step) error
	// Name says what runs the model, e.g. "cpu (openblas)".
	Name() string
}

// Cache holds the keys and values of the tokens a sequence has seen.
type Cache interface {
	Len() int       // tokens stored
	Cap() int       // tokens it can hold
	Truncate(n int) // forget everything after the first n tokens
}

// Step is one sequence's share of a batched forward pass.
type Step struct {
	Cache  Cache
	Tokens []int
	// Logits receives len(Tokens)×vocab values, or vocab values (the last
	// position's) when LastOnly is set.
	Logits   []float32
	LastOnly bool
}

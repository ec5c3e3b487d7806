// Package hostchain makes any backend an llm.Chainer for tests, so that
// the code that drives a Chainer (llm.Generate, the engine) can be checked
// on the CPU against single steps: greedy steps and chains are answered on
// the host, one batched Forward a step — or, where the backend chains
// itself (cuda.Model), by the backend. It records each chain's length.
// A chain answered on the host that fails part way leaves the caches
// advanced (the GPU's does not): tests must not rely on a failed chain.
package hostchain

import (
	"context"
	"sync"

	"github.com/llmq/llmq/llm"
)

// Chainer answers Step.Greedy with the argmax of the logits it computed,
// and DecodeGreedy with n greedy steps.
type Chainer struct {
	llm.Backend
	mu     sync.Mutex
	chains []int
}

// New wraps b.
func New(b llm.Backend) *Chainer { return &Chainer{Backend: b} }

// Chains is the length of every chain run so far, in order.
func (c *Chainer) Chains() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]int(nil), c.chains...)
}

// AnswersGreedy marks c as an llm.Greedier.
func (*Chainer) AnswersGreedy() {}

// Forward runs b's forward pass and sets Argmax on the greedy steps
// (b's own when b answers them).
func (c *Chainer) Forward(ctx context.Context, steps []llm.Step) error {
	if err := c.Backend.Forward(ctx, steps); err != nil || llm.IsGreedier(c.Backend) {
		return err
	}
	for i, s := range steps {
		if s.Greedy && s.LastOnly {
			steps[i].Argmax = llm.Argmax(s.Logits)
		}
	}
	return nil
}

// DecodeGreedy runs n greedy steps of the sequences together — the
// backend's own chain where it has one, else each step one batched
// Forward — and returns each sequence's n picks.
func (c *Chainer) DecodeGreedy(ctx context.Context, steps []llm.Step, n int) ([][]int, error) {
	c.mu.Lock()
	c.chains = append(c.chains, n)
	c.mu.Unlock()
	if b, ok := c.Backend.(llm.Chainer); ok {
		return b.DecodeGreedy(ctx, steps, n)
	}
	V := c.Config().Vocab
	st := make([]llm.Step, len(steps))
	for i, s := range steps {
		st[i] = llm.Step{Cache: s.Cache, Tokens: s.Tokens, Logits: make([]float32, V), LastOnly: true, Greedy: true}
	}
	out := make([][]int, len(steps))
	for range n {
		if err := c.Forward(ctx, st); err != nil {
			return nil, err
		}
		for i := range st {
			out[i] = append(out[i], st[i].Argmax)
			st[i].Tokens = []int{st[i].Argmax}
		}
	}
	return out, nil
}

// Paged is a Chainer over a paged backend that stays one (llm.Paged), so
// that a scheduler bounds its KV pool as it does the backend's.
type Paged struct {
	*Chainer
	paged llm.Paged
}

// NewPaged wraps b.
func NewPaged(b llm.Paged) *Paged { return &Paged{Chainer: New(b), paged: b} }

// KVPool is b's pool.
func (p *Paged) KVPool() *llm.BlockPool { return p.paged.KVPool() }

// SetKVCacheBytes bounds b's pool.
func (p *Paged) SetKVCacheBytes(bytes int64) error { return p.paged.SetKVCacheBytes(bytes) }

// Trim trims b's pool.
func (p *Paged) Trim() { p.paged.Trim() }

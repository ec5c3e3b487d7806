package llm

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
)

// SampleOptions choose the next token from logits. Temperature 0 is greedy
// (argmax, deterministic); otherwise logits are divided by Temperature, cut
// to the TopK most likely (0: no cut) and to the smallest set whose
// probability reaches TopP (1 or 0: no cut), and sampled with a PCG
// generator seeded by Seed, so a given seed always gives the same text.
type SampleOptions struct {
	Temperature float64
	TopK        int
	TopP        float64
	Seed        uint64
}

// Validate reports options outside their ranges.
func (o SampleOptions) Validate() error {
	switch {
	case o.Temperature < 0 || math.IsNaN(o.Temperature):
		return fmt.Errorf("temperature must be ≥ 0, got %v", o.Temperature)
	case o.TopK < 0:
		return fmt.Errorf("top-k must be ≥ 0, got %d", o.TopK)
	case o.TopP < 0 || o.TopP > 1 || math.IsNaN(o.TopP):
		return fmt.Errorf("top-p must be in [0, 1], got %v", o.TopP)
	}
	return nil
}

// Sampler draws tokens according to SampleOptions.
type Sampler struct {
	opt SampleOptions
	rng *rand.Rand
	idx []int
	p   []float64
}

// NewSampler makes a sampler; its random stream starts from opt.Seed.
func NewSampler(opt SampleOptions) *Sampler {
	return &Sampler{opt: opt, rng: rand.New(rand.NewPCG(opt.Seed, opt.Seed^0x9e3779b97f4a7c15))}
}

// NLL is −log softmax(logits)[target], computed stably in float64: the
// per-token loss that perplexity averages.
func NLL(logits []float32, target int) float64 {
	return logSumExp(logits) - float64(logits[target])
}

// logSumExp is log Σ exp(logits), with the maximum subtracted first so
// that no term overflows.
func logSumExp(logits []float32) float64 {
	mx := float64(logits[0])
	for _, v := range logits {
		mx = math.Max(mx, float64(v))
	}
	var s float64
	for _, v := range logits {
		s += math.Exp(float64(v) - mx)
	}
	return mx + math.Log(s)
}

// Argmax is the index of the largest value (the first on ties; NaNs are
// never chosen over a number before them). The best value stays in a
// variable: reading x[best] back for every element made it about 1.5×
// slower (BenchmarkArgmax, evals/results/bench-argmax-cpu.txt).
func Argmax(x []float32) int {
	best, bv := 0, float32(math.Inf(-1))
	if len(x) > 0 {
		bv = x[0]
	}
	for i, v := range x {
		if v > bv {
			best, bv = i, v
		}
	}
	return best
}

// Sample picks a token id from one row of logits.
func (s *Sampler) Sample(logits []float32) int {
	if s.opt.Temperature == 0 {
		return Argmax(logits)
	}
	n := len(logits)
	if cap(s.idx) < n {
		s.idx, s.p = make([]int, n), make([]float64, n)
	}
	idx, p := s.idx[:n], s.p[:n]
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return logits[idx[a]] > logits[idx[b]] })
	if s.opt.TopK > 0 && s.opt.TopK < n {
		n = s.opt.TopK
	}
	mx := float64(logits[idx[0]])
	var sum float64
	for i := 0; i < n; i++ {
		p[i] = math.Exp((float64(logits[idx[i]]) - mx) / s.opt.Temperature)
		sum += p[i]
	}
	if s.opt.TopP > 0 && s.opt.TopP < 1 {
		var c float64
		for i := 0; i < n; i++ {
			c += p[i] / sum
			if c >= s.opt.TopP {
				n = i + 1
				break
			}
		}
		sum = 0
		for i := 0; i < n; i++ {
			sum += p[i]
		}
	}
	r := s.rng.Float64() * sum
	for i := 0; i < n; i++ {
		r -= p[i]
		if r <= 0 {
			return idx[i]
		}
	}
	return idx[n-1]
}

// GenerateOptions bound a generation.
type GenerateOptions struct {
	MaxTokens int   // new tokens at most
	Stop      []int // token ids that end generation (not emitted)
	Sample    SampleOptions
}

// Generate continues prompt with up to opt.MaxTokens tokens, calling emit
// with each new token as soon as it is chosen; emit may return an error to
// stop early. The prompt is run in one prefill, then one token a step
// through the KV cache. It returns the new tokens.
func Generate(ctx context.Context, b Backend, prompt []int, opt GenerateOptions, emit func(id int) error) ([]int, error) {
	if len(prompt) == 0 {
		return nil, fmt.Errorf("empty prompt: at least one token is needed")
	}
	if err := opt.Sample.Validate(); err != nil {
		return nil, err
	}
	capacity := len(prompt) + opt.MaxTokens
	if max := b.Config().MaxPositions; capacity > max {
		return nil, fmt.Errorf("prompt of %d tokens + %d new tokens exceeds the model's context of %d", len(prompt), opt.MaxTokens, max)
	}
	cache, err := b.NewCache(capacity)
	if err != nil {
		return nil, err
	}
	defer cache.Close()
	stop := map[int]bool{}
	for _, id := range opt.Stop {
		stop[id] = true
	}
	sampler := NewSampler(opt.Sample)
	logits := make([]float32, b.Config().Vocab)
	greedy := opt.Sample.Temperature == 0 && IsGreedier(b) // the backend picks the token (on the GPU: only its id comes back)
	var out []int
	next := prompt
	for len(out) < opt.MaxTokens {
		step := []Step{{Cache: cache, Tokens: next, Logits: logits, LastOnly: true, Greedy: greedy}}
		if err := b.Forward(ctx, step); err != nil {
			return out, err
		}
		id := step[0].Argmax
		if !greedy {
			id = sampler.Sample(logits)
		}
		if stop[id] {
			break
		}
		out = append(out, id)
		if emit != nil {
			if err := emit(id); err != nil {
				return out, err
			}
		}
		next = []int{id}
	}
	return out, nil
}

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
	opt    SampleOptions
	rng    *rand.Rand
	p      []float64 // exp((logit − max)/T) of each token
	bucket []uint8   // each token's bucket (see Sample)
	cand   []int     // the tokens a walk may visit, in its order
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

// Buckets of (max − logit)/T, sampleBucketsPerNat to a unit; the last
// holds every token at least 32 units below the most likely.
const (
	sampleBucketsPerNat = 8
	sampleBuckets       = 256
)

// Draw is one sampled pick with its uniform draw made: the options and
// the draw U that Sample would take from its stream. A backend that picks
// on the device (a Drawer) chooses with it the token SampleWith(logits, U)
// would (up to the rounding of the device's sums, which may move a draw
// that falls on a boundary), and only the id crosses to the host.
type Draw struct {
	Temperature float64
	TopK        int
	TopP        float64
	U           float64
}

// Draw takes the next draw from the sampler's stream, as Sample does for
// a temperature above 0, so that picks made from Draws (on a Drawer) and
// by Sample follow the same seeded sequence. Call it only for a
// temperature above 0: it takes a draw at 0 too, where Sample takes none.
func (s *Sampler) Draw() Draw {
	return Draw{Temperature: s.opt.Temperature, TopK: s.opt.TopK, TopP: s.opt.TopP, U: s.rng.Float64()}
}

// AskBackend marks st (a LastOnly step) for b to pick its token when b
// can: Greedy at temperature 0 on a Greedier, a Draw (taken from the
// stream now, as Sample would take it) above 0 on a Drawer. It reports
// whether b picks it, in st.Argmax, instead of the caller sampling st's
// logits.
func (s *Sampler) AskBackend(b Backend, st *Step) bool {
	switch {
	case s.opt.Temperature == 0 && IsGreedier(b):
		st.Greedy = true
	case s.opt.Temperature > 0 && IsDrawer(b):
		d := s.Draw()
		st.Draw = &d
	default:
		return false
	}
	return true
}

// Pick is the token SampleWith picks from logits with d's options and
// draw: the host's answer for a Draw (a new sampler's scratch each call).
func (d Draw) Pick(logits []float32) int {
	return NewSampler(SampleOptions{Temperature: d.Temperature, TopK: d.TopK, TopP: d.TopP}).SampleWith(logits, d.U)
}

// Sample picks a token id from one row of logits: the tokens in
// descending order of logit (ties by id), cut to the TopK first and to the
// smallest prefix whose probability reaches TopP, walked until a uniform
// draw's share of their mass is used up.
//
// A walk visits only the first tokens of that order, so the vocabulary is
// not sorted (128,256 tokens took ~15 ms a token on the host,
// bench-sample-cpu.txt): tokens fall in buckets of (max − logit)/T, and
// only the first buckets, as many as hold the TopK tokens and the mass the
// walk can reach (TopP or the draw's share of the whole, with a margin),
// are sorted. Should a walk still run past them, it is redone on the
// whole vocabulary.
func (s *Sampler) Sample(logits []float32) int {
	if s.opt.Temperature == 0 {
		return Argmax(logits)
	}
	return s.SampleWith(logits, s.rng.Float64())
}

// SampleWith is Sample with the uniform draw u in [0, 1) given instead of
// taken from the stream (Draw.Pick; a temperature of 0 ignores it).
func (s *Sampler) SampleWith(logits []float32, u float64) int {
	if s.opt.Temperature == 0 {
		return Argmax(logits)
	}
	n, T := len(logits), s.opt.Temperature
	if cap(s.p) < n {
		s.p, s.bucket = make([]float64, n), make([]uint8, n)
	}
	p, bucket := s.p[:n], s.bucket[:n]
	mx := float64(logits[Argmax(logits)])
	var count [sampleBuckets]int
	var mass [sampleBuckets]float64
	var total float64
	for i, l := range logits {
		d := (mx - float64(l)) / T
		p[i] = math.Exp(-d)
		total += p[i]
		b := sampleBuckets - 1
		if d < sampleBuckets/sampleBucketsPerNat { // false for NaN: the last bucket
			b = int(d * sampleBucketsPerNat)
		}
		bucket[i] = uint8(b)
		count[b]++
		mass[b] += p[i]
	}
	keep := n // the TopK cut
	if s.opt.TopK > 0 && s.opt.TopK < n {
		keep = s.opt.TopK
	}
	// The mass a walk can reach: TopP of the kept tokens' (at most of all
	// tokens'), or without a TopP cut the draw's share of it.
	reach := u * total
	if s.opt.TopP > 0 && s.opt.TopP < 1 {
		reach = s.opt.TopP * total
	}
	nb, tokens, have := 0, 0, 0.0
	for nb < sampleBuckets && (tokens < keep && keep < n || have < reach*(1+1e-9)) {
		tokens += count[nb]
		have += mass[nb]
		nb++
	}
	if id, ok := s.walk(logits, bucket, min(nb+1, sampleBuckets), keep, total, u); ok {
		return id
	}
	id, _ := s.walk(logits, bucket, sampleBuckets, keep, total, u)
	return id
}

// walk is Sample's walk over the tokens of the first nb buckets, sorted:
// it reports false when the walk would need tokens beyond them (never
// when they are the whole vocabulary).
func (s *Sampler) walk(logits []float32, bucket []uint8, nb, keep int, total, u float64) (int, bool) {
	p := s.p
	s.cand = s.cand[:0]
	for i, b := range bucket {
		if int(b) < nb {
			s.cand = append(s.cand, i)
		}
	}
	cand := s.cand
	sort.Slice(cand, func(a, b int) bool {
		la, lb := logits[cand[a]], logits[cand[b]]
		return la > lb || la == lb && cand[a] < cand[b]
	})
	sum := total
	if keep < len(logits) {
		if len(cand) < keep {
			return 0, false
		}
		sum = 0
		for _, i := range cand[:keep] {
			sum += p[i]
		}
	}
	limit := keep // the tokens the walk may visit
	if s.opt.TopP > 0 && s.opt.TopP < 1 {
		var c float64
		for k, i := range cand[:min(keep, len(cand))] {
			c += p[i] / sum
			if c >= s.opt.TopP {
				limit = k + 1
				break
			}
		}
		if limit > len(cand) {
			return 0, false
		}
		sum = 0
		for _, i := range cand[:limit] {
			sum += p[i]
		}
	}
	r := u * sum
	for _, i := range cand[:min(limit, len(cand))] {
		r -= p[i]
		if r <= 0 {
			return i, true
		}
	}
	if limit > len(cand) {
		return 0, false
	}
	return cand[limit-1], true
}

// GenerateOptions bound a generation.
type GenerateOptions struct {
	MaxTokens int   // new tokens at most
	Stop      []int // token ids that end generation (not emitted)
	Sample    SampleOptions
	// Chain is how many greedy tokens a Chainer backend (the GPU) decodes
	// a call, with no round trip to the host between them (0:
	// DefaultChain; 1: one a call). emit then gets a chain's tokens
	// together when it ends, and the tokens a chain decodes past a stop
	// token are dropped.
	Chain int
}

// DefaultChain is the greedy steps a Chainer runs a call unless told
// otherwise (GenerateOptions.Chain, the engine's Options.Chain): on an
// H100, chains of 8 gave llama3-8b W4 ×1.020 at batch 1 and ×1.013 at
// batch 8 over single steps, the host's part of a step paid once a chain
// (evals/results/decode-h100-llama3-8b-w4-envab-chain8.txt).
const DefaultChain = 8

// Generate continues prompt with up to opt.MaxTokens tokens, calling emit
// with each new token as soon as it is chosen; emit may return an error to
// stop early. The prompt is run in one prefill, then one token a step
// through the KV cache (or opt.Chain a call, greedy on a Chainer). It
// returns the new tokens.
func Generate(ctx context.Context, b Backend, prompt []int, opt GenerateOptions, emit func(id int) error) ([]int, error) {
	if len(prompt) == 0 {
		return nil, fmt.Errorf("empty prompt: at least one token is needed")
	}
	if err := opt.Sample.Validate(); err != nil {
		return nil, err
	}
	if opt.Chain < 0 {
		return nil, fmt.Errorf("GenerateOptions.Chain %d: want 0 or more", opt.Chain)
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
	var out []int
	add := func(id int) (bool, error) {
		if stop[id] {
			return false, nil
		}
		out = append(out, id)
		if emit != nil {
			if err := emit(id); err != nil {
				return false, err
			}
		}
		return true, nil
	}
	next := prompt
	chainer, chained := b.(Chainer)
	if opt.Chain == 0 {
		opt.Chain = DefaultChain
	}
	chained = chained && opt.Chain > 1 && opt.Sample.Temperature == 0
	for len(out) < opt.MaxTokens {
		if chained && len(out) > 0 {
			// One token in, n picked on the device: the cache takes the n
			// fed (next and the first n-1 picks), as n single steps would.
			n := min(opt.Chain, opt.MaxTokens-len(out))
			picks, err := chainer.DecodeGreedy(ctx, []Step{{Cache: cache, Tokens: next}}, n)
			if err != nil {
				return out, err
			}
			for _, id := range picks[0] {
				if ok, err := add(id); !ok {
					return out, err
				}
			}
			next = picks[0][n-1:]
			continue
		}
		// The backend picks the token where it can (on the GPU: only its
		// id comes back).
		step := []Step{{Cache: cache, Tokens: next, Logits: logits, LastOnly: true}}
		picked := sampler.AskBackend(b, &step[0])
		if err := b.Forward(ctx, step); err != nil {
			return out, err
		}
		id := step[0].Argmax
		if !picked {
			id = sampler.Sample(logits)
		}
		if ok, err := add(id); !ok {
			return out, err
		}
		next = []int{id}
	}
	return out, nil
}

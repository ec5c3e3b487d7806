package llm

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// sortSample is Sample as it was before buckets: the whole vocabulary
// sorted, the same cuts and walk (and one draw from s.rng a call).
func sortSample(s *Sampler, logits []float32) int {
	n := len(logits)
	idx, p := make([]int, n), make([]float64, n)
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

// TestSampleMatchesFullSort: on rows without ties, peaked like a language
// model's or flat, the bucketed sampler picks the token the full sort
// picks from the same draw, for temperatures, top-k and top-p cuts across
// their range; a greedy-like temperature picks the argmax.
func TestSampleMatchesFullSort(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	row := func(V int, peaked bool) []float32 {
		x := make([]float32, V)
		seen := map[float32]bool{}
		for i := range x {
			for {
				v := float32(r.NormFloat64() * 2.5)
				if !peaked {
					v = float32(r.Float64()*10 - 5)
				} else if r.IntN(500) == 0 {
					v += 10
				}
				if !seen[v] { // no ties: the old sort's order of equal logits is unspecified
					seen[v], x[i] = true, v
					break
				}
			}
		}
		return x
	}
	opts := []SampleOptions{
		{Temperature: 0.8, TopP: 0.95}, {Temperature: 1}, {Temperature: 0.7, TopK: 40}, {Temperature: 1.2, TopK: 50, TopP: 0.9},
		{Temperature: 0.3, TopP: 0.5}, {Temperature: 2}, {Temperature: 50, TopP: 0.99}, {Temperature: 1, TopP: 0.01},
		{Temperature: 1, TopK: 1}, {Temperature: 0.6, TopK: 3000},
	}
	for _, peaked := range []bool{true, false} {
		for oi, o := range opts {
			o.Seed = uint64(100 + oi)
			got, want := NewSampler(o), NewSampler(o)
			for trial := 0; trial < 20; trial++ {
				x := row(4000, peaked)
				g, w := got.Sample(x), sortSample(want, x)
				if g != w {
					t.Fatalf("peaked %v, %+v, trial %d: bucketed sampler chose %d (logit %v), full sort %d (logit %v)", peaked, o, trial, g, x[g], w, x[w])
				}
			}
		}
	}
	x := row(4000, true)
	if id := NewSampler(SampleOptions{Temperature: 1e-9, Seed: 5}).Sample(x); id != Argmax(x) {
		t.Errorf("temperature 1e-9: %d, argmax %d", id, Argmax(x))
	}
}

// TestDrawPicksWhatSampleDoes: a sampler's Draws, picked on the host,
// follow the same seeded sequence as its Sample calls — the contract a
// Drawer (the GPU) keeps; TestSamplingIsSeeded runs Generate on one.
func TestDrawPicksWhatSampleDoes(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	rows := make([][]float32, 50)
	for i := range rows {
		rows[i] = make([]float32, 3000)
		for j := range rows[i] {
			rows[i][j] = float32(r.NormFloat64() * 3)
		}
	}
	for _, o := range []SampleOptions{{Temperature: 0.8, TopP: 0.95, Seed: 9}, {Temperature: 1.3, TopK: 20, Seed: 10}} {
		a, b := NewSampler(o), NewSampler(o)
		for i, x := range rows {
			d := b.Draw()
			if got, want := d.Pick(x), a.Sample(x); got != want {
				t.Fatalf("%+v, row %d: Draw().Pick chose %d, Sample %d", o, i, got, want)
			}
		}
	}
}

package llm

import (
	"math"
	"testing"
)

// Hand-computed: logits (1, 3, 2, 3): Σ exp = e + 2e³ + e²,
// log p = x − log Σ exp; the top two are ids 1 and 3 (a tie: lower id first).
func TestLogprobs(t *testing.T) {
	logits := []float32{1, 3, 2, 3}
	lse := math.Log(math.E + 2*math.Exp(3) + math.Exp(2))
	lp, top := Logprobs(logits, 2, 2)
	if math.Abs(lp-(2-lse)) > 1e-6 {
		t.Errorf("log p(2) = %v, want %v", lp, 2-lse)
	}
	if len(top) != 2 || top[0].ID != 1 || top[1].ID != 3 || math.Abs(top[0].Logprob-(3-lse)) > 1e-6 || top[1].Logprob != top[0].Logprob {
		t.Errorf("top = %+v, want ids 1, 3 at %v", top, 3-lse)
	}
	if _, top := Logprobs(logits, 0, 0); top != nil {
		t.Errorf("k = 0 gave %v", top)
	}
	if _, top := Logprobs(logits, 0, 9); len(top) != 4 || top[3].ID != 0 {
		t.Errorf("k > V gave %+v", top)
	}
	// Large logits: the max subtraction keeps it finite.
	if lp, _ := Logprobs([]float32{1000, 1000}, 0, 0); math.Abs(lp-math.Log(0.5)) > 1e-12 {
		t.Errorf("log p = %v, want log ½", lp)
	}
}

// exp32 against math.Exp over its range, and the log Σ exp of Logprobs
// against the float64 logSumExp (NLL's) on a vocabulary of spread-out
// logits: within the accuracy Logprobs promises.
func TestExp32(t *testing.T) {
	worst := 0.0
	for x := float32(-87); x <= 0; x += 0.00173 {
		want := math.Exp(float64(x))
		worst = max(worst, math.Abs(float64(exp32(x))-want)/want)
	}
	t.Logf("exp32: worst relative error %.2e over [-87, 0]", worst)
	if worst > 3e-7 || exp32(0) != 1 {
		t.Errorf("exp32: relative error %.2e, exp32(0) = %v", worst, exp32(0))
	}
	logits := make([]float32, 128257)
	for i := range logits {
		logits[i] = float32((i*7919)%10007)/400 - 12
	}
	// log p = logit − log Σ exp: LogprobsIn's log Σ exp against the float64
	// logSumExp (NLL's), whole and in pieces.
	for _, parts := range []int{1, 4} {
		lp, _ := LogprobsIn(logits, 3, 0, parts)
		if d := math.Abs((float64(logits[3]) - lp) - logSumExp(logits)); d > 1e-6 {
			t.Errorf("%d pieces: log Σ exp differs from logSumExp by %.2e", parts, d)
		}
	}
	// A NaN logit (a broken model) gives NaN, not a made-up distribution.
	for _, at := range []int{0, 5} {
		logits[at] = float32(math.NaN())
		if lp, top := Logprobs(logits, 1, 3); !math.IsNaN(lp) || len(top) != 3 || !math.IsNaN(top[0].Logprob) {
			t.Errorf("NaN at %d: log p %v, top %+v", at, lp, top)
		}
		logits[at] = 0
	}
}

// LogprobsIn cut into 2 to 16 pieces gives Logprobs' answer: the same top
// 20 ids in the same order — ties across pieces included (every value
// repeats many times, so equal logits straddle the cuts) — and log p
// within rounding of the serial sum.
func TestLogprobsInPieces(t *testing.T) {
	logits := make([]float32, 128257)
	for i := range logits {
		logits[i] = float32((i*7919)%1009) / 100 // values below 10.08
	}
	for i := 0; i < 20; i++ {
		logits[i*6411] = 20 // the top 20, equal, spread over the row: ties straddle every cut below
	}
	lp, top := Logprobs(logits, 4242, 20)
	for _, parts := range []int{2, 3, 5, 8, 16} {
		lp2, top2 := LogprobsIn(logits, 4242, 20, parts)
		if math.Abs(lp2-lp) > 1e-12*math.Abs(lp) {
			t.Errorf("%d pieces: log p %v, serial %v", parts, lp2, lp)
		}
		if len(top2) != len(top) {
			t.Fatalf("%d pieces: %d alternatives, serial %d", parts, len(top2), len(top))
		}
		for i := range top {
			if top2[i].ID != top[i].ID || math.Abs(top2[i].Logprob-top[i].Logprob) > 1e-12*math.Abs(top[i].Logprob) {
				t.Errorf("%d pieces: alternative %d is %+v, serial %+v", parts, i, top2[i], top[i])
			}
		}
	}
	// The top 20 are the equal 20s, by increasing id (0, 6411, …, 121809).
	for i := range top {
		if top[i].ID != i*6411 || top[i].Logprob != top[0].Logprob {
			t.Fatalf("the serial top is not the tied 20s by id: %+v", top)
		}
	}
	logits[70000] = float32(math.NaN()) // in a later piece: every answer NaN, as serially
	if lp, top := LogprobsIn(logits, 1, 3, 4); !math.IsNaN(lp) || len(top) != 3 || !math.IsNaN(top[0].Logprob) {
		t.Errorf("NaN in a piece: log p %v, top %+v", lp, top)
	}
}

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

// exp32 against math.Exp over its range, and logSumExp32 against the
// float64 logSumExp (NLL's) on a vocabulary of spread-out logits: within
// the accuracy Logprobs promises.
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
	if d := math.Abs(logSumExp32(logits) - logSumExp(logits)); d > 1e-6 {
		t.Errorf("logSumExp32 differs from logSumExp by %.2e", d)
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

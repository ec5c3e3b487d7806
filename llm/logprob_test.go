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
	if math.Abs(lp-(2-lse)) > 1e-12 {
		t.Errorf("log p(2) = %v, want %v", lp, 2-lse)
	}
	if len(top) != 2 || top[0].ID != 1 || top[1].ID != 3 || math.Abs(top[0].Logprob-(3-lse)) > 1e-12 || top[1].Logprob != top[0].Logprob {
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

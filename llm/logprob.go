package llm

import "math"

// Logprob is a token id with its log-probability.
type Logprob struct {
	ID      int
	Logprob float64
}

// Logprobs returns log softmax(logits)[id] and the k most likely tokens
// with their log-probabilities, most likely first (equal values: the
// lower id first). It computes in float64 from the float32 logits, the
// maximum subtracted before exponentiating:
//
//	log p(i) = logits[i] − max − log Σ_j exp(logits[j] − max).
//
// k ≤ 0 returns no alternatives; id outside the logits returns NaN.
func Logprobs(logits []float32, id, k int) (float64, []Logprob) {
	if len(logits) == 0 {
		return math.NaN(), nil
	}
	lse := logSumExp(logits)
	lp := math.NaN()
	if id >= 0 && id < len(logits) {
		lp = float64(logits[id]) - lse
	}
	k = min(k, len(logits))
	if k <= 0 {
		return lp, nil
	}
	// Insertion into a sorted list of k: O(V·k), k is small (≤ 20).
	top := make([]Logprob, 0, k)
	for i, v := range logits {
		x := float64(v)
		if len(top) == k && x <= top[k-1].Logprob {
			continue
		}
		j := len(top)
		if j < k {
			top = append(top, Logprob{})
		} else {
			j = k - 1
		}
		for j > 0 && top[j-1].Logprob < x {
			top[j] = top[j-1]
			j--
		}
		top[j] = Logprob{ID: i, Logprob: x}
	}
	for i := range top {
		top[i].Logprob -= lse
	}
	return lp, top
}

package llm

import (
	"math"
	"sync"
)

// Logprob is a token id with its log-probability.
type Logprob struct {
	ID      int
	Logprob float64
}

// Logprobs returns log softmax(logits)[id] and the k most likely tokens
// with their log-probabilities, most likely first (equal values: the
// lower id first), the maximum subtracted before exponentiating:
//
//	log p(i) = logits[i] − max − log Σ_j exp(logits[j] − max).
//
// The exponentials are float32 (exp32) summed in float64, so the result
// is within about 1e-6 of the float64 computation (NLL's) at a fraction
// of its cost: this runs for every token a request wants logprobs of, over
// the whole vocabulary (BenchmarkLogprobs).
//
// k ≤ 0 returns no alternatives, and at most k come back: −∞ and NaN
// logits are never listed. id outside the logits returns NaN, as does a
// NaN among the logits.
func Logprobs(logits []float32, id, k int) (float64, []Logprob) {
	return LogprobsIn(logits, id, k, 1)
}

// LogprobsIn is Logprobs with the row cut into up to parts pieces worked
// on in parallel (one goroutine each; pieces of at least minLogprobPart
// logits): what the engine uses when a batch has fewer rows wanting
// logprobs than there are cores. The top k are Logprobs' exactly; the
// sum of exponentials adds the pieces' sums in another order, which moves
// the result by rounding only (about 1e-15 relative).
func LogprobsIn(logits []float32, id, k, parts int) (float64, []Logprob) {
	if len(logits) == 0 {
		return math.NaN(), nil
	}
	k = min(k, len(logits))
	parts = max(1, min(parts, len(logits)/minLogprobPart))
	size := (len(logits) + parts - 1) / parts
	pieces := make([]logprobPiece, (len(logits)+size-1)/size)
	each := func(fn func(p *logprobPiece, lo, hi int)) {
		if len(pieces) == 1 {
			fn(&pieces[0], 0, len(logits))
			return
		}
		var wg sync.WaitGroup
		for i := range pieces {
			lo := i * size
			wg.Add(1)
			go func() {
				defer wg.Done()
				fn(&pieces[i], lo, min(lo+size, len(logits)))
			}()
		}
		wg.Wait()
	}
	// First the max (and any NaN) and the top k of each piece, then the
	// sum of exponentials below the max.
	each(func(p *logprobPiece, lo, hi int) {
		p.max, p.nan = rowMax(logits[lo:hi])
		p.top = topLogits(logits[lo:hi], lo, k)
	})
	mx, nan := pieces[0].max, false
	for _, p := range pieces {
		mx, nan = max(mx, p.max), nan || p.nan
	}
	lse := math.NaN()
	if !nan && mx == mx {
		each(func(p *logprobPiece, lo, hi int) { p.sum = sumExp32(logits[lo:hi], mx) })
		var sum float64
		for _, p := range pieces {
			sum += p.sum
		}
		lse = float64(mx) + math.Log(sum)
	}
	lp := math.NaN()
	if id >= 0 && id < len(logits) {
		lp = float64(logits[id]) - lse
	}
	if k <= 0 {
		return lp, nil
	}
	top := pieces[0].top
	for _, p := range pieces[1:] {
		top = mergeTop(top, p.top, k)
	}
	for i := range top {
		top[i].Logprob -= lse
	}
	return lp, top
}

// minLogprobPart is the fewest logits LogprobsIn gives a goroutine.
const minLogprobPart = 8192

// logprobPiece is one piece of a row in LogprobsIn.
type logprobPiece struct {
	max float32
	nan bool
	sum float64
	top []Logprob
}

// rowMax is the largest of the logits, and whether one is NaN.
func rowMax(logits []float32) (float32, bool) {
	mx := logits[0]
	for _, v := range logits {
		if v > mx {
			mx = v
		} else if v != v {
			return mx, true
		}
	}
	return mx, mx != mx
}

// topLogits is the k largest logits (NaN never), largest first, equal
// values by lower id, their ids offset by base; the values are the
// logits themselves (the caller subtracts log Σ exp).
func topLogits(logits []float32, base, k int) []Logprob {
	if k <= 0 {
		return nil
	}
	// Insertion into a sorted list of k: O(V·k), k is small (≤ 20); once
	// the list is full, the k-th value, kept in a float32, turns most
	// logits away with one comparison.
	top := make([]Logprob, 0, k)
	floor := float32(math.Inf(-1))
	for i, v := range logits {
		if v <= floor || v != v { // v != v: NaN, never listed
			continue
		}
		x := float64(v)
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
		top[j] = Logprob{ID: base + i, Logprob: x}
		if len(top) == k {
			floor = float32(top[k-1].Logprob)
		}
	}
	return top
}

// mergeTop is the first k of two such lists, a's ids all below b's: on
// equal values a's come first, as one pass over the whole row would
// order them.
func mergeTop(a, b []Logprob, k int) []Logprob {
	out := make([]Logprob, 0, min(k, len(a)+len(b)))
	for len(out) < k && (len(a) > 0 || len(b) > 0) {
		if len(b) == 0 || len(a) > 0 && a[0].Logprob >= b[0].Logprob {
			out, a = append(out, a[0]), a[1:]
		} else {
			out, b = append(out, b[0]), b[1:]
		}
	}
	return out
}

// sumExp32 is Σ exp(x − mx) with float32 exponentials (exp32), summed in
// float64 in four interleaved partial sums (independent chains the CPU
// overlaps); terms below e⁻⁸⁷ (near the bottom of float32's normal range,
// and nothing a sum holding e⁰ = 1 can feel) are taken at e⁻⁸⁷, exp32's
// domain.
func sumExp32(logits []float32, mx float32) float64 {
	clamp := func(x float32) float32 {
		if x < -87 {
			return -87
		}
		return x
	}
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(logits); i += 4 {
		s0 += float64(exp32(clamp(logits[i] - mx)))
		s1 += float64(exp32(clamp(logits[i+1] - mx)))
		s2 += float64(exp32(clamp(logits[i+2] - mx)))
		s3 += float64(exp32(clamp(logits[i+3] - mx)))
	}
	for ; i < len(logits); i++ {
		s0 += float64(exp32(clamp(logits[i] - mx)))
	}
	return s0 + s1 + s2 + s3
}

// exp32 is eˣ for −87 ≤ x ≤ 0 in float32, within a few float32 ulps;
// outside that domain its result is meaningless (the exponent bits wrap),
// so callers clamp. x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in two so
// that n·ln2 is exact, as Cephes' expf does), eʳ by its Taylor polynomial
// to degree 7 (truncation under 1e-8) evaluated in Estrin's order (a
// shorter chain of dependent operations than Horner's), 2ⁿ written into
// the exponent bits. Small enough for the compiler to inline, which a
// clamp inside would not leave it (BenchmarkLogprobs slows down by half).
func exp32(x float32) float32 {
	const log2e, ln2hi, ln2lo = 1.44269504, 0.693359375, -2.12194440e-4
	n := int32(x*log2e - 0.5) // the nearest integer, for x ≤ 0
	r := x - float32(n)*ln2hi - float32(n)*ln2lo
	r2 := r * r
	p := (1 + r) + r2*((1.0/2+r*(1.0/6))+r2*((1.0/24+r*(1.0/120))+r2*(1.0/720+r*(1.0/5040))))
	return p * math.Float32frombits(uint32(n+127)<<23)
}

//go:build cgo

package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/llm"
)

// TestMoERouteMatchesCPU: the route kernel against llm.RouteLogits on
// random router logits — Mixtral's 8 experts top 2, Qwen3-MoE's 128 top 8,
// 256 (the most) top 1, with and without renormalisation — the same
// experts in the same order and the same weights to fp32 rounding; logits
// drawn apart (no near-ties, where the exponentials' last bit could swap
// two experts) except for one row of exact ties (the lower expert first).
func TestMoERouteMatchesCPU(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(5, 6))
	for _, tc := range []struct {
		T, E, k int
		norm    bool
	}{{37, 8, 2, true}, {19, 128, 8, true}, {19, 128, 8, false}, {5, 256, 1, false}, {70, 60, 4, true}} {
		logits := make([]float32, tc.T*tc.E)
		for row := 0; row < tc.T; row++ {
			perm := r.Perm(tc.E) // distinct values 0.05 apart
			for e := range perm {
				logits[row*tc.E+e] = float32(perm[e])*0.05 - 2
			}
		}
		for e := 0; e < tc.E; e++ { // row 0: every logit equal
			logits[e] = 0.5
		}
		lb, err := AllocFrom(x, logits)
		if err != nil {
			t.Fatal(err)
		}
		ib, _ := x.Alloc(tc.T * tc.k * 4)
		wb, _ := x.Alloc(tc.T * tc.k * 4)
		if err := x.MoERoute(lb, ib, wb, tc.T, tc.E, tc.k, tc.norm); err != nil {
			t.Fatal(err)
		}
		ids, w := make([]int32, tc.T*tc.k), make([]float32, tc.T*tc.k)
		if err := Download(x, ids, ib); err != nil {
			t.Fatal(err)
		}
		if err := Download(x, w, wb); err != nil {
			t.Fatal(err)
		}
		want := llm.RouteLogits(logits, tc.T, tc.E, tc.k, tc.norm)
		worst := 0.0
		for i := range ids {
			if int(ids[i]) != want.Expert[i] {
				t.Fatalf("%+v: row %d choice %d: expert %d, want %d", tc, i/tc.k, i%tc.k, ids[i], want.Expert[i])
			}
			worst = max(worst, math.Abs(float64(w[i]-want.Weight[i]))/float64(want.Weight[i]))
		}
		t.Logf("%+v: same experts; weights within %.1e (relative)", tc, worst)
		if worst > 1e-5 {
			t.Errorf("%+v: weights differ by %.1e", tc, worst)
		}
		for _, b := range []Buf{lb, ib, wb} {
			x.Free(b)
		}
	}
	if err := x.MoERoute(Buf{}, Buf{}, Buf{}, 1, 300, 2, false); err == nil {
		t.Error("300 experts: no error")
	}
}

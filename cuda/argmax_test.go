//go:build cgo

package cuda

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/llm"
)

// TestArgmaxRowsMatchesCPU checks the device argmax against llm.Argmax on
// rows built to catch each rule: random rows (a vocabulary a multiple of
// 4 and one not, which take the kernel's two load paths), a maximum tied
// at several places far apart (the first wins), NaNs around the maximum
// (never chosen), a NaN first value (0, as the CPU's loop leaves it), all
// −Inf (0), the maximum in the last place, and a tie whose lower index
// a higher-numbered thread holds (4092 and 4096: the merge goes by index,
// not by thread).
func TestArgmaxRowsMatchesCPU(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(13, 14))
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	for _, V := range []int{128256, 32003, 7} {
		const T = 8
		logits := make([]float32, T*V)
		for i := range logits {
			logits[i] = float32(r.NormFloat64())
		}
		row := func(t int) []float32 { return logits[t*V : (t+1)*V] }
		row(1)[V-1], row(1)[V/2], row(1)[3] = 50, 50, 50 // ties: 3
		row(2)[0], row(2)[V-1] = nan, 60                 // NaN first: 0
		for i := range row(3) {
			row(3)[i] = float32(math.Inf(-1))
		}
		row(4)[V/3], row(4)[V/3+1] = nan, 40 // NaN beside the largest
		row(5)[V-1] = inf                    // the last place
		for i := 1; i < V; i += 2 {
			row(6)[i] = nan
		}
		if V > 4096 {
			row(7)[4096], row(7)[4092] = 70, 70
		}
		ld, _, od := rowBuffers(t, x, logits, nil, T)
		got := make([]int32, T)
		if err := errors.Join(x.ArgmaxRows(ld, od, T, V), Download(x, got, od)); err != nil {
			t.Fatal(err)
		}
		for i := range T {
			if want := llm.Argmax(row(i)); int(got[i]) != want {
				t.Errorf("V %d row %d: argmax %d, want %d (llm.Argmax)", V, i, got[i], want)
			}
		}
		x.Free(ld)
		x.Free(od)
	}
	if err := x.ArgmaxRows(Buf{}, Buf{}, 0, 10); err == nil {
		t.Error("0 rows: no error")
	}
}

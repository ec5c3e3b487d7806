package actquant

import (
	"context"
	"math"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
)

func tinyModel(t *testing.T) *llm.Model {
	t.Helper()
	ck, err := checkpoint.Open(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	m, err := llm.Load(ck, llm.DenseLoader)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// meanNLL of one window of ids under m.
func meanNLL(t *testing.T, m *llm.Model, ids []int) float64 {
	t.Helper()
	sum, n, err := m.WindowNLL(context.Background(), ids)
	if err != nil {
		t.Fatal(err)
	}
	return sum / float64(n)
}

// TestActivationQuantizationOnLlamaTiny: on llama-tiny, INT8 and FP8
// activations cost little (per-token dynamic and per-tensor with min-max
// thresholds), 4-bit activations cost a lot — the quantizers are really
// in the path — and SmoothQuant's folding leaves the unquantized network's
// function unchanged.
func TestActivationQuantizationOnLlamaTiny(t *testing.T) {
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	calib := [][]int{ids[10000:10256], ids[20000:20256]}
	eval := ids[:512]
	base := meanNLL(t, tinyModel(t), eval)
	cost := func(s Scheme, method string, alpha float64) float64 {
		m := tinyModel(t)
		var sc *Scales
		if !s.PerToken || alpha > 0 {
			var err error
			if sc, err = Calibrate(context.Background(), m, calib, CalibrateOptions{Scheme: s, Method: method, Percentile: 99.99, Alpha: alpha}); err != nil {
				t.Fatal(err)
			}
			if alpha > 0 { // folded, not yet quantized: the same network
				if d := math.Abs(meanNLL(t, m, eval) - base); d > 1e-4 {
					t.Errorf("smoothing α=%v changed the mean NLL by %.2e", alpha, d)
				}
				m = tinyModel(t) // Apply folds the recorded factors itself
			}
		}
		if err := Apply(m, s, sc); err != nil {
			t.Fatal(err)
		}
		d := meanNLL(t, m, eval) - base
		t.Logf("%s %s α=%v: mean NLL +%.4f", s, method, alpha, d)
		return d
	}
	for _, c := range []struct {
		s      Scheme
		method string
		alpha  float64
		max    float64
	}{
		{Scheme{Bits: 8, PerToken: true}, "", 0, 0.01},
		{Scheme{Bits: 8}, MinMax, 0, 0.05},
		{Scheme{Bits: 8}, KL, 0, 0.05},
		{Scheme{Bits: 8, FP8: true, PerToken: true}, "", 0, 0.02},
		{Scheme{Bits: 8, PerToken: true}, MinMax, 0.5, 0.01},
	} {
		if d := cost(c.s, c.method, c.alpha); d > c.max || d < -c.max {
			t.Errorf("%s %s α=%v: mean NLL changed by %.4f, more than %v", c.s, c.method, c.alpha, d, c.max)
		}
	}
	if d := cost(Scheme{Bits: 4, PerToken: true}, "", 0); d < 0.05 {
		t.Errorf("4-bit activations cost only %.4f nats: are they quantized?", d)
	}
}

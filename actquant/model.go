package actquant

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"

	"github.com/llmq/llmq/llm"
)

// Linear is a layer whose input is quantized (or observed) first.
type Linear struct {
	llm.Linear
	Scheme    Scheme
	Threshold float32   // the static threshold (per-tensor schemes)
	Observer  *Observer // when set, the input is observed, not quantized
}

// Forward observes x, or runs the layer on x quantized and dequantized.
func (l *Linear) Forward(y, x []float32, rows int) {
	if l.Observer != nil {
		l.Observer.Add(x, rows)
		l.Linear.Forward(y, x, rows)
		return
	}
	q := append([]float32(nil), x[:rows*l.In()]...)
	l.Scheme.FakeQuant(q, rows, l.In(), l.Threshold)
	l.Linear.Forward(y, q, rows)
}

// Scales is the result of calibration, what `llmq calibrate` writes and
// `llmq eval ppl --act-scales` reads: a threshold per quantized layer
// input (and its max |x|), for one method and scheme; and, when
// SmoothQuant's smoothing was calibrated, the per-channel factors folded
// into each block before the thresholds were measured.
type Scales struct {
	Method     string            `json:"method"`
	Percentile float64           `json:"percentile,omitempty"`
	Scheme     string            `json:"scheme"`
	Alpha      float64           `json:"smooth_alpha,omitempty"`
	Layers     map[string]Layer  `json:"layers"`
	Smooth     map[int]SmoothFor `json:"smooth,omitempty"` // by block index
}

// Layer is one layer input's calibration.
type Layer struct {
	Threshold float32 `json:"threshold"`
	Amax      float32 `json:"amax"`
}

// SmoothFor are one block's smoothing factors: the attention norm's inputs
// to q/k/v and the MLP norm's to gate/up are divided by them, the weight
// columns reading them multiplied.
type SmoothFor struct {
	Attn []float32 `json:"attn"`
	MLP  []float32 `json:"mlp"`
}

// wrap replaces every decoder linear layer of m by f's wrapper, returning
// a function that puts the originals back.
func wrap(m *llm.Model, f func(name string, l llm.Linear) llm.Linear) (restore func()) {
	var undo []func()
	for i, b := range m.Blocks {
		for _, nl := range b.Linears() {
			orig, p := *nl.L, nl.L
			*p = f(fmt.Sprintf("model.layers.%d.%s", i, nl.Name), orig)
			undo = append(undo, func() { *p = orig })
		}
	}
	return func() {
		for _, u := range undo {
			u()
		}
	}
}

// CalibrateOptions configure Calibrate.
type CalibrateOptions struct {
	Scheme     Scheme
	Method     string  // MinMax, Percentile or KL
	Percentile float64 // for Percentile, e.g. 99.99
	// Alpha, when positive, first calibrates SmoothQuant's migration
	// strength α: s_j = max|X_j|^α / max|W_j|^(1−α) per input channel of
	// each norm-fed group, folded into m before the thresholds are taken.
	Alpha float64
	// Observed, if set, is given every layer input's final observer (for
	// plots of its histogram and channel maxima).
	Observed func(name string, o *Observer)
}

// Calibrate runs m on the calibration windows (each from an empty cache)
// and returns each layer input's threshold. With Alpha it changes m: the
// smoothing factors are folded into its norms and weights.
func Calibrate(ctx context.Context, m *llm.Model, windows [][]int, opt CalibrateOptions) (*Scales, error) {
	if err := opt.Scheme.Validate(); err != nil {
		return nil, err
	}
	if len(windows) == 0 {
		return nil, fmt.Errorf("no calibration windows")
	}
	observe := func() (map[string]*Observer, error) {
		obs := map[string]*Observer{}
		restore := wrap(m, func(name string, l llm.Linear) llm.Linear {
			o := NewObserver(l.In())
			obs[name] = o
			return &Linear{Linear: l, Observer: o}
		})
		defer restore()
		for _, w := range windows {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			c, err := m.NewCache(len(w))
			if err != nil {
				return nil, err
			}
			logits := make([]float32, m.Cfg.Vocab)
			if err := m.Forward(ctx, []llm.Step{{Cache: c, Tokens: w, Logits: logits, LastOnly: true}}); err != nil {
				return nil, err
			}
		}
		return obs, nil
	}
	obs, err := observe()
	if err != nil {
		return nil, err
	}
	sc := &Scales{Method: opt.Method, Percentile: opt.Percentile, Scheme: opt.Scheme.String(), Alpha: opt.Alpha}
	if opt.Alpha > 0 {
		if opt.Alpha >= 1 {
			return nil, fmt.Errorf("smoothing α %v: want a value in (0, 1)", opt.Alpha)
		}
		sc.Smooth = map[int]SmoothFor{}
		for i, b := range m.Blocks {
			p := fmt.Sprintf("model.layers.%d.", i)
			f := SmoothFor{
				Attn: smoothing(obs[p+"self_attn.q_proj"].ChannelMax, opt.Alpha, b.Q, b.K, b.V),
				MLP:  smoothing(obs[p+"mlp.gate_proj"].ChannelMax, opt.Alpha, b.Gate, b.Up),
			}
			if err := ApplySmoothing(b, f); err != nil {
				return nil, fmt.Errorf("block %d: %w", i, err)
			}
			sc.Smooth[i] = f
		}
		if obs, err = observe(); err != nil { // the smoothed inputs
			return nil, err
		}
	}
	if opt.Observed != nil {
		for name, o := range obs {
			opt.Observed(name, o)
		}
	}
	if sc.Layers, err = Thresholds(obs, opt.Method, opt.Percentile, opt.Scheme); err != nil {
		return nil, err
	}
	return sc, nil
}

// Thresholds takes each observed layer input's threshold by method: what
// Calibrate records, and what another method would record from the same
// observations (the observers Calibrate hands to Observed).
func Thresholds(obs map[string]*Observer, method string, pct float64, s Scheme) (map[string]Layer, error) {
	layers := map[string]Layer{}
	for name, o := range obs {
		t, err := o.Threshold(method, pct, s)
		if err != nil {
			return nil, err
		}
		layers[name] = Layer{Threshold: t, Amax: o.Amax}
	}
	return layers, nil
}

// smoothing is SmoothQuant's s_j = max|X_j|^α / max|W_:j|^(1−α), the
// weight maximum taken over every layer reading the input (1 where a
// channel is dead).
func smoothing(xmax []float32, alpha float64, ls ...llm.Linear) []float32 {
	in := len(xmax)
	wmax := make([]float64, in)
	for _, l := range ls {
		d := l.(*llm.Dense)
		for r := 0; r < d.Out(); r++ {
			for j, v := range d.W[r*in : (r+1)*in] {
				wmax[j] = math.Max(wmax[j], math.Abs(float64(v)))
			}
		}
	}
	s := make([]float32, in)
	for j := range s {
		s[j] = 1
		if xmax[j] > 0 && wmax[j] > 0 {
			s[j] = float32(math.Pow(float64(xmax[j]), alpha) / math.Pow(wmax[j], 1-alpha))
		}
	}
	return s
}

// ApplySmoothing folds a block's factors in: norm weights divided, the
// columns of the layers reading them multiplied; the block computes the
// same function.
func ApplySmoothing(b *llm.Block, f SmoothFor) error {
	fold := func(norm, s []float32, ls ...llm.Linear) error {
		if len(s) != len(norm) {
			return fmt.Errorf("%d smoothing factors for a norm of %d", len(s), len(norm))
		}
		for j := range norm {
			norm[j] /= s[j]
		}
		for _, l := range ls {
			d, ok := l.(*llm.Dense)
			if !ok {
				return fmt.Errorf("smoothing needs float32 layers")
			}
			for r := 0; r < d.Out(); r++ {
				row := d.W[r*d.In() : (r+1)*d.In()]
				for j := range row {
					row[j] *= s[j]
				}
			}
		}
		return nil
	}
	if b.MoE != nil {
		return fmt.Errorf("smoothing a mixture of experts is not supported")
	}
	if err := fold(b.AttnNorm, f.Attn, b.Q, b.K, b.V); err != nil {
		return err
	}
	return fold(b.MLPNorm, f.MLP, b.Gate, b.Up)
}

// Apply makes m quantize every decoder linear layer's input with the
// scheme: per token needs no scales (nil is fine, unless it carries
// smoothing); per tensor takes each layer's threshold from sc. Smoothing
// recorded in sc is folded into m first.
func Apply(m *llm.Model, s Scheme, sc *Scales) error {
	if err := s.Validate(); err != nil {
		return err
	}
	if sc != nil {
		for i, f := range sc.Smooth {
			if i < 0 || i >= len(m.Blocks) {
				return fmt.Errorf("smoothing for block %d of a %d-block model", i, len(m.Blocks))
			}
			if err := ApplySmoothing(m.Blocks[i], f); err != nil {
				return fmt.Errorf("block %d: %w", i, err)
			}
		}
	}
	var missing string
	wrap(m, func(name string, l llm.Linear) llm.Linear {
		ql := &Linear{Linear: l, Scheme: s}
		if !s.PerToken {
			lay, ok := sc.layer(name)
			if !ok && missing == "" {
				missing = name
			}
			ql.Threshold = lay.Threshold
		}
		return ql
	})
	if missing != "" {
		return fmt.Errorf("per-tensor activation scales need a calibrated threshold for every layer; none for %s", missing)
	}
	return nil
}

func (sc *Scales) layer(name string) (Layer, bool) {
	if sc == nil {
		return Layer{}, false
	}
	l, ok := sc.Layers[name]
	return l, ok
}

// ReadScales reads a file written by WriteScales.
func ReadScales(path string) (*Scales, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var sc Scales
	if err := json.Unmarshal(data, &sc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(sc.Layers) == 0 {
		return nil, fmt.Errorf("%s: no layers", path)
	}
	return &sc, nil
}

package quantize

import (
	"fmt"
	"math"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/pack"
)

// FP8 quantizes each layer's weights to FP8 E4M3 (pack.FP8): scale =
// max|W| / 448 per output channel, or PerTensor one for the layer. The
// checkpoint is written in compressed-tensors' float-quantized format with
// FP8 activations: per token and dynamic (llm-compressor's FP8_DYNAMIC),
// or, with StaticActivations, one static scale per layer input, max|x| /
// 448 over the calibration data (input_scale; llm-compressor's FP8 scheme,
// with PerTensor). Only StaticActivations reads calibration data.
type FP8 struct{ PerTensor, StaticActivations bool }

func (m FP8) Name() string { return "fp8" }
func (m FP8) Grid() pack.Grid {
	return pack.Grid{Bits: 8, GroupSize: -1, Sym: true, FP8: true, PerTensor: m.PerTensor}
}
func (m FP8) Calibrated() bool                    { return m.StaticActivations }
func (m FP8) Prepare(*Block) ([][]float32, error) { return nil, nil }
func (m FP8) Describe(*pack.QuantConfig)          {}

func (m FP8) NewStats(int) Stats {
	if !m.StaticActivations {
		return nil
	}
	return &absMax{}
}

func (m FP8) Quantize(l Layer, s Stats) (*pack.Linear, float64, error) {
	if !l.Grid.FP8 {
		return nil, 0, fmt.Errorf("%s: FP8 quantization cannot apply a %s grid (mixed-precision plans are integer)", l.Name, l.Grid.Describe())
	}
	lin, err := pack.FP8(l.W, l.Out, l.In, l.Grid.PerTensor)
	if err != nil {
		return nil, 0, err
	}
	if m.StaticActivations {
		a, ok := s.(*absMax)
		if !ok || a == nil || a.n == 0 {
			return nil, 0, fmt.Errorf("%s: static FP8 activations need calibration rows of the layer's input", l.Name)
		}
		lin.InputScale = 1
		if a.max > 0 {
			lin.InputScale = a.max / actquant.E4M3Max
		}
	}
	return lin, 0, nil
}

// absMax is the largest |x| of a layer input over the calibration rows.
type absMax struct {
	max float32
	n   int
}

func (a *absMax) Add(x []float32, rows int) error {
	for _, v := range x {
		if v != v {
			return fmt.Errorf("NaN in the calibration activations")
		}
		a.max = max(a.max, float32(math.Abs(float64(v))))
	}
	a.n += rows
	return nil
}

// ctConfig is the compressed-tensors quantization_config of the layers
// written: the method's grid is config group "group_0", targeting every
// Linear; each other grid a plan gave is a group targeting its layers by
// name (names win over the class in the format's matching); layers kept
// unquantized, mixtures' routers, and lm_head unless it was quantized,
// are ignored.
func (d *driver) ctConfig(meta *pack.QuantMeta) *pack.QuantConfig {
	base := d.m.Grid()
	f, _ := d.m.(FP8)
	static := f.StaticActivations
	var described pack.QuantConfig
	d.m.Describe(&described)
	actorder := any(nil)
	switch {
	case described.DescAct && described.StaticGroups:
		actorder = "weight" // weights reordered, groups in channel order
	case described.DescAct:
		actorder = "group"
	}
	ct := &pack.CTConfig{ConfigGroups: map[string]*pack.CTScheme{}, QuantizationStatus: "compressed"}
	schemes := map[pack.Grid]*pack.CTScheme{}
	formats := map[string]bool{}
	add := func(g pack.Grid) *pack.CTScheme {
		if s, ok := schemes[g]; ok {
			return s
		}
		s := ctScheme(g, actorder, static)
		schemes[g] = s
		ct.ConfigGroups[fmt.Sprintf("group_%d", len(ct.ConfigGroups))] = s
		formats[s.Format] = true
		return s
	}
	add(base).Targets = []string{"Linear"}
	for _, l := range d.grids {
		if l.grid != base {
			s := add(l.grid)
			s.Targets = append(s.Targets, l.name)
		}
	}
	if !d.opt.QuantizeLMHead {
		ct.Ignore = append(ct.Ignore, "lm_head")
	}
	ct.Ignore = append(ct.Ignore, d.skipped...)
	ct.Ignore = append(ct.Ignore, d.routers()...)
	if len(formats) == 1 {
		for _, s := range ct.ConfigGroups {
			ct.Format, s.Format = s.Format, ""
		}
	} else {
		ct.Format = pack.CTMixed
	}
	return &pack.QuantConfig{QuantMethod: pack.MethodCT, CT: ct, Meta: meta}
}

// ctScheme is the scheme of one grid, its weights' QuantizationArgs
// spelled out as llm-compressor writes them (W4A16, W8A16, FP8_DYNAMIC,
// FP8 with static activations).
func ctScheme(g pack.Grid, actorder any, staticActivations bool) *pack.CTScheme {
	bits, sym := g.Bits, g.Sym
	observer := "minmax"
	w := &pack.CTArgs{NumBits: &bits, Type: "int", Symmetric: &sym, Dynamic: false,
		Observer: &observer, ObserverKwargs: map[string]any{}}
	s := &pack.CTScheme{Weights: w, Format: pack.CTPackQuantized}
	if g.FP8 {
		w.Type, w.Strategy = "float", "channel"
		if g.PerTensor {
			w.Strategy = "tensor"
		}
		abits, asym := 8, true
		s.InputActivations = &pack.CTArgs{NumBits: &abits, Type: "float", Symmetric: &asym,
			Strategy: "token", Dynamic: true, ObserverKwargs: map[string]any{}}
		if staticActivations {
			s.InputActivations.Strategy, s.InputActivations.Dynamic = "tensor", false
			s.InputActivations.Observer = &observer
		}
		s.Format = pack.CTFloatQuantized
		return s
	}
	gs := g.GroupSize
	w.GroupSize = &gs
	w.Strategy = "group"
	if gs <= 0 {
		w.Strategy = "channel"
		gs = -1
	} else {
		w.Actorder = actorder
	}
	return s
}

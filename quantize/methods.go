package quantize

import (
	"fmt"
	"strings"

	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// RTN rounds each weight to the nearest point of its group's grid: no
// calibration.
type RTN struct{ G pack.Grid }

func (m RTN) Name() string                        { return "rtn" }
func (m RTN) Grid() pack.Grid                     { return m.G }
func (m RTN) Calibrated() bool                    { return false }
func (m RTN) Prepare(*Block) ([][]float32, error) { return nil, nil }
func (m RTN) NewStats(int) Stats                  { return nil }
func (m RTN) Describe(*pack.QuantConfig)          {}
func (m RTN) Quantize(l Layer, _ Stats) (*pack.Linear, float64, error) {
	lin, err := pack.RTN(l.W, l.Out, l.In, l.Grid)
	return lin, 0, err
}

// GPTQ quantizes each layer with package gptq, given the Hessian of its
// input; layers that read one input (q, k, v; gate, up) share one
// Hessian and its factorization.
type GPTQ struct{ Opt gptq.Options }

func (m GPTQ) Name() string                        { return "gptq" }
func (m GPTQ) Grid() pack.Grid                     { return m.Opt.Grid }
func (m GPTQ) Calibrated() bool                    { return true }
func (m GPTQ) Prepare(*Block) ([][]float32, error) { return nil, nil }
func (m GPTQ) NewStats(in int) Stats               { return &hessian{h: gptq.NewHessian(in)} }

func (m GPTQ) Describe(qc *pack.QuantConfig) {
	qc.DescAct, qc.StaticGroups, qc.DampPercent = m.Opt.ActOrder, m.Opt.StaticGroups, m.Opt.Damp
	if qc.Meta != nil {
		qc.Meta.GroupsFromBlockStart = m.Opt.GroupsFromBlockStart
	}
}

func (m GPTQ) Quantize(l Layer, s Stats) (*pack.Linear, float64, error) {
	h, ok := s.(*hessian)
	if !ok || h == nil {
		return nil, 0, fmt.Errorf("GPTQ needs the Hessian of the layer's input")
	}
	if h.prep == nil {
		p, err := gptq.Prepare(h.h.Matrix(), h.h.In, m.Opt)
		if err != nil {
			return nil, 0, err
		}
		h.prep = p
	}
	opt := m.Opt
	opt.Grid = l.Grid
	res, err := gptq.Quantize(l.W, l.Out, l.In, h.prep, opt)
	if err != nil {
		return nil, 0, err
	}
	return res.Linear, res.Loss, nil
}

// hessian is GPTQ's statistic: H and, once the first layer reading the
// input is quantized, its damped inverse Cholesky factor.
type hessian struct {
	h    *gptq.Hessian
	prep *gptq.Prepared
}

func (h *hessian) Add(x []float32, rows int) error { return h.h.Add(x, rows) }

// AWQ searches each block's scales (and clipping thresholds) with package
// awq on the unquantized block, folds them in, and rounds the scaled
// weights to nearest on AWQ's grid. The next block reads the unquantized
// block's outputs, as in the reference code. When Record is non-nil, the
// input statistics and search results of every block are appended to it
// (what --stats writes).
type AWQ struct {
	Opt    awq.Options
	Record *[]awq.LinearStats
}

func (m AWQ) Name() string               { return "awq" }
func (m AWQ) Grid() pack.Grid            { return m.Opt.Grid }
func (m AWQ) Calibrated() bool           { return true }
func (m AWQ) NewStats(int) Stats         { return nil }
func (m AWQ) Describe(*pack.QuantConfig) {}

func (m AWQ) Quantize(l Layer, _ Stats) (*pack.Linear, float64, error) {
	lin, err := pack.RTN(l.W, l.Out, l.In, l.Grid)
	return lin, 0, err
}

func (m AWQ) Prepare(b *Block) ([][]float32, error) {
	blk := b.Block
	b.Progress("features")
	f, err := awq.Collect(b.Ctx, b.Stages, blk, b.X, b.SeqLen, b.Experts)
	if err != nil {
		return nil, err
	}
	b.Rows = f.Rows
	// Input statistics come from the unscaled features (folding divides
	// them by the scales).
	var st []awq.LinearStats
	if m.Record != nil {
		st = awq.BlockStats(b.Stages, b.Prefix, blk, f)
	}
	sc, err := scaleBlock(b, f, m.Opt)
	if err != nil {
		return nil, err
	}
	var shrink [4]map[string]float64
	if m.Opt.Clip {
		b.Progress("clip")
		shrink = awq.ClipBlock(b.Stages, blk, f, m.Opt)
	}
	if m.Record != nil {
		awq.AddSearchResults(st, sc, shrink)
		*m.Record = append(*m.Record, st...)
	}
	return f.Out, nil
}

// AWQGPTQ folds AWQ's scales (searched on up to 32 calibration windows)
// into each block, then quantizes the scaled weights with GPTQ. There is
// no clip search (GPTQ fits its own grid): Scales.Clip is ignored.
type AWQGPTQ struct {
	GPTQ
	Scales awq.Options
}

func (m AWQGPTQ) Name() string { return "awq+gptq" }

func (m AWQGPTQ) Prepare(b *Block) ([][]float32, error) {
	b.Progress("awq features")
	f, err := awq.Collect(b.Ctx, b.Stages, b.Block, b.X[:min(32, len(b.X))], b.SeqLen, b.Experts)
	if err != nil {
		return nil, err
	}
	_, err = scaleBlock(b, f, m.Scales)
	return nil, err
}

// scaleBlock searches and folds a block's AWQ scales and records the
// changed norms (and v bias) in the output as F32.
func scaleBlock(b *Block, f *awq.Features, opt awq.Options) (*awq.Scales, error) {
	blk := b.Block
	b.Progress("scales")
	sc, err := awq.SearchBlock(b.Ctx, b.Stages, blk, f, opt)
	if err != nil {
		return nil, err
	}
	foldScales(b, sc, f, opt)
	return sc, nil
}

// foldScales folds a block's AWQ scales into it (and into the cached
// features f, when not nil) and records the changed norms (and v bias,
// and a mixture's router) in the output as F32.
func foldScales(b *Block, sc *awq.Scales, f *awq.Features, opt awq.Options) {
	blk := b.Block
	if n := awq.Apply(blk, sc, f); n > 0 && opt.Log != nil {
		opt.Log("%s: %d folded values clamped to the float16 range ±65504", b.Prefix, n)
	}
	cfg := b.Stages.Config()
	for _, n := range blk.Norms(cfg) {
		if n.W == &blk.AttnNorm || n.W == &blk.MLPNorm { // the two norms AWQ folds into
			b.SetFloat32(n.Name, llm.StoredNorm(cfg, *n.W))
		}
	}
	if bias := awq.VBias(blk); bias != nil && sc.VO.Scales != nil {
		b.SetFloat32("self_attn.v_proj.bias", bias)
	}
	if r := blk.MoE; r != nil && sc.GateUp.Scales != nil { // its columns carry the gate/up scale
		b.SetFloat32(strings.TrimPrefix(llm.RouterName(cfg, b.Index), b.Prefix)+".weight", r.Router.W, r.Router.Out(), r.Router.In())
	}
}

package quantize

import (
	"context"
	"fmt"
	"strings"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// Mixtures of experts (Mixtral, Qwen3-MoE). Each expert's gate, up and
// down are quantized with statistics of their own, gathered on the
// expert's calibration rows:
//
//   - MoECalib "routed" (the default): the rows the router sends the
//     expert (top-k of the real routing, unweighted: what the expert
//     computes on), as GPTQModel and AutoGPTQ hook them;
//   - MoECalib "all": every calibration row goes through every expert,
//     for the statistics only.
//
// In both the block's outputs (the next block's input) follow the real
// routing. Fallback: an expert the router sent fewer than MoEMinTokens
// rows over the whole calibration set (default: the hidden size, below
// which its gate/up Hessian is singular) is calibrated on all rows, as
// with "all"; the report lists it. The router is not quantized: it is
// written as the source stores it, or in float32 when AWQ folded a scale
// into its columns (it reads the norm the experts' gate/up scale divides).
//
// A dense MLP is the one-expert case every row reaches, so one piece of
// code gathers the statistics of both.

// MoE calibration modes (Options.MoECalib).
const (
	MoECalibRouted = "routed"
	MoECalibAll    = "all"
)

// expertCalib is the run's rule for the experts' calibration rows.
func (d *driver) expertCalib() llm.ExpertCalib {
	n := d.opt.MoEMinTokens
	if n == 0 {
		n = d.ck.Config.Hidden
	}
	return llm.ExpertCalib{All: d.opt.MoECalib == MoECalibAll, MinTokens: n}
}

// validMoE checks the MoE options.
func validMoE(opt Options) error {
	switch opt.MoECalib {
	case "", MoECalibRouted, MoECalibAll:
	default:
		return fmt.Errorf("MoECalib %q: want %s or %s", opt.MoECalib, MoECalibRouted, MoECalibAll)
	}
	if opt.MoEMinTokens < 0 {
		return fmt.Errorf("MoEMinTokens %d: want 0 (the hidden size) or a positive number of tokens", opt.MoEMinTokens)
	}
	return nil
}

// ExpertReport is one expert of a sparse block: how many calibration
// tokens the router sent it, and how many its statistics came from.
type ExpertReport struct {
	Name   string `json:"name"` // e.g. "model.layers.0.mlp.experts.3"
	Layer  int    `json:"layer"`
	Expert int    `json:"expert"`
	Routed int    `json:"routed_tokens"`
	// Tokens is the rows its statistics came from: Routed, or every
	// calibration token when AllTokens.
	Tokens int `json:"calibration_tokens"`
	// AllTokens: calibrated on every token (MoECalib "all", or Fallback).
	AllTokens bool `json:"all_tokens,omitempty"`
	// Fallback: routed fewer than MoEMinTokens tokens, so calibrated on
	// all of them.
	Fallback bool `json:"fallback,omitempty"`
}

// reportExperts adds a sparse block's experts to the report, from the
// routing its statistics used.
func (d *driver) reportExperts(bl *Block) {
	r := bl.Rows
	if r == nil {
		return
	}
	names := bl.Block.Linears()[4:]
	total := 0
	for _, x := range d.X {
		total += len(x) / d.ck.Config.Hidden
	}
	calib := d.expertCalib()
	for e, n := range r.Routed {
		gate := bl.Prefix + names[3*e].Name // "….experts.E.gate_proj" (Mixtral: ".w1")
		name := gate[:strings.LastIndexByte(gate, '.')]
		rep := ExpertReport{Name: name, Layer: bl.Index, Expert: e, Routed: n, Tokens: n, AllTokens: r.All[e]}
		if r.All[e] {
			rep.Tokens = total
			rep.Fallback = !calib.All
		}
		d.rep.Experts = append(d.rep.Experts, rep)
	}
}

// ffnUnit is one gated MLP: a dense block's, or one expert of a mixture.
type ffnUnit struct {
	expert       int      // -1: a dense MLP
	gateUp, down []string // layer names, relative to the block's prefix
	gate, up     *llm.Linear
	sUp, sDown   Stats
}

// ffn gathers the statistics of a block's MLP inputs and quantizes its
// layers.
type ffn struct {
	d     *driver
	bl    *Block
	units []*ffnUnit
	// allUp is the gate/up statistics shared by the units calibrated on
	// every row (they read the same input).
	allUp Stats
}

func (d *driver) newFFN(bl *Block) *ffn {
	f := &ffn{d: d, bl: bl}
	ls := bl.Block.Linears()[4:] // gate, up, down, or each expert's
	for i := 0; i+2 < len(ls); i += 3 {
		u := &ffnUnit{expert: -1, gateUp: []string{ls[i].Name, ls[i+1].Name}, down: []string{ls[i+2].Name}, gate: ls[i].L, up: ls[i+1].L}
		if bl.Block.MoE != nil {
			u.expert = i / 3
		}
		f.units = append(f.units, u)
	}
	return f
}

// route routes the MLP inputs mlpIn(w) of every window of a sparse block
// and decides each expert's calibration rows (Block.Rows).
func (f *ffn) route(ctx context.Context, mlpIn func(w int) []float32) error {
	moe := f.bl.Block.MoE
	if moe == nil {
		return nil
	}
	routes := make([]*llm.Routing, len(f.d.X))
	if err := f.d.each(ctx, func(w int) error {
		routes[w] = moe.Route(mlpIn(w), f.d.opt.SeqLen)
		return nil
	}); err != nil {
		return err
	}
	f.bl.Rows = llm.NewExpertRows(routes, len(moe.Experts), f.d.expertCalib())
	return nil
}

// rows are the rows of window w that calibrate u (nil: all).
func (f *ffn) rows(u *ffnUnit, w int) []int {
	if u.expert < 0 {
		return nil
	}
	return f.bl.Rows.Rows(u.expert, w)
}

// start creates the statistics (after route, in a sparse block).
func (f *ffn) start() {
	cfg := f.d.ck.Config
	f.allUp = nil
	for _, u := range f.units {
		if u.expert < 0 || f.bl.Rows.All[u.expert] {
			if f.allUp == nil {
				f.allUp = f.d.m.NewStats(cfg.Hidden)
			}
			u.sUp = f.allUp
		} else {
			u.sUp = f.d.m.NewStats(cfg.Hidden)
		}
		u.sDown = f.d.m.NewStats((*u.gate).Out())
	}
}

// addGateUp adds window w's rows of the MLP input m to the gate/up
// statistics.
func (f *ffn) addGateUp(w int, m []float32) error {
	T, H := f.d.opt.SeqLen, f.d.ck.Config.Hidden
	if f.allUp != nil {
		if err := f.allUp.Add(m, T); err != nil {
			return err
		}
	}
	for _, u := range f.units {
		if u.sUp == f.allUp {
			continue
		}
		if r := f.rows(u, w); len(r) > 0 {
			if err := u.sUp.Add(llm.Gather(m, r, H), len(r)); err != nil {
				return fmt.Errorf("expert %d: %w", u.expert, err)
			}
		}
	}
	return nil
}

// addDown adds the gated activations of window w's rows (the input of
// each down projection) to the down statistics.
func (f *ffn) addDown(w int, m []float32) error {
	T, H := f.d.opt.SeqLen, f.d.ck.Config.Hidden
	for _, u := range f.units {
		r := f.rows(u, w)
		n := len(r)
		if r == nil {
			n = T
		}
		if n == 0 {
			continue
		}
		if err := u.sDown.Add(f.d.st.GatedAct(*u.gate, *u.up, llm.Gather(m, r, H), n), n); err != nil {
			return fmt.Errorf("expert %d: %w", u.expert, err)
		}
	}
	return nil
}

// quantize quantizes every unit's gate and up, or (down) every down.
func (f *ffn) quantize(quantize func([]string, Stats) error, down bool) error {
	for _, u := range f.units {
		names, s := u.gateUp, u.sUp
		if down {
			names, s = u.down, u.sDown
		}
		if err := quantize(names, s); err != nil {
			return err
		}
	}
	return nil
}

// routers are the checkpoint names of the mixtures' routers (kept
// unquantized), e.g. "model.layers.0.mlp.gate".
func (d *driver) routers() []string {
	cfg := d.ck.Config
	var names []string
	for l := 0; l < cfg.Layers; l++ {
		if cfg.Sparse(l) {
			names = append(names, llm.RouterName(cfg, l))
		}
	}
	return names
}

// moeMeta records the experts' calibration in the checkpoint's meta (nil
// for dense models).
func (d *driver) moeMeta() *pack.MoEMeta {
	if d.ck.Config.MoE == nil {
		return nil
	}
	mode := d.opt.MoECalib
	if mode == "" {
		mode = MoECalibRouted
	}
	m := &pack.MoEMeta{Calib: mode, MinTokens: d.expertCalib().MinTokens}
	for _, e := range d.rep.Experts {
		if len(m.Layers) == 0 || m.Layers[len(m.Layers)-1].Layer != e.Layer {
			m.Layers = append(m.Layers, pack.MoELayer{Layer: e.Layer})
		}
		ml := &m.Layers[len(m.Layers)-1]
		ml.Routed = append(ml.Routed, e.Routed)
		if e.AllTokens {
			ml.AllTokens = append(ml.AllTokens, e.Expert)
		}
	}
	return m
}

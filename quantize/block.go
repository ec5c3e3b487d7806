package quantize

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// The four inputs of a block and the layers reading each, in execution
// order.
var (
	qkvLayers    = []string{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
	oLayers      = []string{"self_attn.o_proj"}
	gateUpLayers = []string{"mlp.gate_proj", "mlp.up_proj"}
	downLayers   = []string{"mlp.down_proj"}
)

// block quantizes decoder layer l and advances d.X past it.
func (d *driver) block(ctx context.Context, l int) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	cfg := d.ck.Config
	prefix := fmt.Sprintf("model.layers.%d.", l)
	b, err := llm.LoadBlock(d.ck, l, llm.DenseLoader)
	if err != nil {
		return err
	}
	tensors := map[string]checkpoint.Out{}
	raw := []string{"input_layernorm.weight", "post_attention_layernorm.weight"}
	if cfg.QKVBias {
		raw = append(raw, "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
	}
	for _, n := range raw {
		t, err := d.ck.Tensor(prefix + n)
		if err != nil {
			return err
		}
		tensors[prefix+n] = pack.Raw(t)
	}
	if f, ok := d.smooth(l); ok {
		if err := actquant.ApplySmoothing(b, f); err != nil {
			return fmt.Errorf("smoothing: %w", err)
		}
		tensors[prefix+"input_layernorm.weight"] = checkpoint.F32(b.AttnNorm, len(b.AttnNorm))
		tensors[prefix+"post_attention_layernorm.weight"] = checkpoint.F32(b.MLPNorm, len(b.MLPNorm))
	}
	progress := func(stage string) {
		if d.opt.Progress != nil {
			d.opt.Progress(l, cfg.Layers, stage)
		}
	}
	bl := &Block{Ctx: ctx, Index: l, Prefix: prefix, Block: b, Stages: d.st, X: d.X, SeqLen: d.opt.SeqLen,
		Progress: progress, tensors: tensors}
	next, err := d.m.Prepare(bl)
	if err != nil {
		return err
	}
	linears := map[string]*llm.Linear{}
	for _, nl := range b.Linears() {
		linears[nl.Name] = nl.L
	}
	// quantize replaces each named layer by its quantized version, given
	// the statistics of their shared input.
	quantize := func(names []string, s Stats) error {
		for _, n := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			t0 := time.Now()
			dense := (*linears[n]).(*llm.Dense) // LoadBlock with DenseLoader
			g, quantized := d.opt.Plan.For(prefix+n, d.m.Grid())
			if !quantized {
				if err := d.keep(tensors, prefix+n, dense); err != nil {
					return err
				}
				continue
			}
			lin, loss, err := d.m.Quantize(Layer{Name: prefix + n, W: dense.W, Out: dense.Out(), In: dense.In(), Grid: g}, s)
			if err != nil {
				return fmt.Errorf("%s%s: %w", prefix, n, err)
			}
			if err := d.emit(tensors, prefix+n, lin, loss, t0); err != nil {
				return err
			}
			*linears[n] = llm.NewDense(lin.Dequantize(), dense.B, dense.In(), dense.Out())
		}
		return nil
	}

	if d.m.NewStats(1) == nil { // RTN, AWQ: no statistics
		progress("quantize")
		for _, names := range [][]string{qkvLayers, oLayers, gateUpLayers, downLayers} {
			if err := quantize(names, nil); err != nil {
				return err
			}
		}
		if next != nil {
			if len(next) != len(d.X) {
				return fmt.Errorf("method %s returned %d next inputs for %d windows", d.m.Name(), len(next), len(d.X))
			}
			copy(d.X, next)
		} else if err := d.propagate(ctx, b, progress); err != nil {
			return err
		}
		return d.w.WritePart(tensors)
	}

	if d.opt.TrueSequential {
		err = d.sequential(ctx, b, quantize, progress)
	} else {
		err = d.together(ctx, b, quantize, progress)
	}
	if err != nil {
		return err
	}
	if next != nil { // the method's rule for the next block's input wins
		if len(next) != len(d.X) {
			return fmt.Errorf("method %s returned %d next inputs for %d windows", d.m.Name(), len(next), len(d.X))
		}
		copy(d.X, next)
	}
	return d.w.WritePart(tensors)
}

// smooth returns block l's SmoothQuant factors, if any.
func (d *driver) smooth(l int) (actquant.SmoothFor, bool) {
	if d.opt.Smooth == nil {
		return actquant.SmoothFor{}, false
	}
	f, ok := d.opt.Smooth.Smooth[l]
	return f, ok
}

// each calls fn on every calibration window, checking for cancellation.
func (d *driver) each(ctx context.Context, fn func(w int) error) error {
	for w := range d.X {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(w); err != nil {
			return err
		}
	}
	return nil
}

// propagate runs the (quantized) block on every calibration window: X
// becomes the next block's input.
func (d *driver) propagate(ctx context.Context, b *llm.Block, progress func(string)) error {
	if d.X == nil {
		return nil
	}
	progress("outputs")
	return d.each(ctx, func(w int) error {
		d.X[w] = d.st.Block(b, d.X[w], d.opt.SeqLen)
		return nil
	})
}

// together takes the four inputs' statistics from the unquantized block in
// one pass, quantizes every layer, then runs the quantized block to get
// the next block's input.
func (d *driver) together(ctx context.Context, b *llm.Block, quantize func([]string, Stats) error, progress func(string)) error {
	cfg, T, st := d.ck.Config, d.opt.SeqLen, d.st
	sQKV, sO := d.m.NewStats(cfg.Hidden), d.m.NewStats(cfg.Heads*cfg.HeadDim)
	sUp, sDown := d.m.NewStats(cfg.Hidden), d.m.NewStats(cfg.Intermediate)
	progress("statistics")
	if err := d.each(ctx, func(w int) error {
		n := st.Norm(b.AttnNorm, d.X[w], T)
		att := st.Attention(b, n, T)
		h := append([]float32(nil), d.X[w]...)
		st.AddLinear(h, b.O, att, T)
		m := st.Norm(b.MLPNorm, h, T)
		return firstErr(sQKV.Add(n, T), sO.Add(att, T), sUp.Add(m, T), sDown.Add(st.MLPAct(b, m, T), T))
	}); err != nil {
		return err
	}
	progress("quantize")
	for _, g := range []struct {
		names []string
		s     Stats
	}{{qkvLayers, sQKV}, {oLayers, sO}, {gateUpLayers, sUp}, {downLayers, sDown}} {
		if err := quantize(g.names, g.s); err != nil {
			return err
		}
	}
	return d.propagate(ctx, b, progress)
}

// sequential quantizes [q,k,v] → [o] → [gate,up] → [down], each input's
// statistics taken with the layers before it already quantized; X is
// advanced through the quantized block as it goes.
func (d *driver) sequential(ctx context.Context, b *llm.Block, quantize func([]string, Stats) error, progress func(string)) error {
	cfg, T, st := d.ck.Config, d.opt.SeqLen, d.st
	attnIn := func(w int) []float32 { return st.Norm(b.AttnNorm, d.X[w], T) }
	mlpIn := func(x []float32) []float32 { return st.Norm(b.MLPNorm, x, T) }
	att := make([][]float32, len(d.X))

	progress("q,k,v")
	s := d.m.NewStats(cfg.Hidden)
	if err := d.each(ctx, func(w int) error { return s.Add(attnIn(w), T) }); err != nil {
		return err
	}
	if err := quantize(qkvLayers, s); err != nil {
		return err
	}
	progress("o")
	s = d.m.NewStats(cfg.Heads * cfg.HeadDim)
	if err := d.each(ctx, func(w int) error {
		att[w] = st.Attention(b, attnIn(w), T)
		return s.Add(att[w], T)
	}); err != nil {
		return err
	}
	if err := quantize(oLayers, s); err != nil {
		return err
	}
	progress("gate,up")
	s = d.m.NewStats(cfg.Hidden)
	if err := d.each(ctx, func(w int) error {
		st.AddLinear(d.X[w], b.O, att[w], T) // X now holds the attention residual
		att[w] = nil
		return s.Add(mlpIn(d.X[w]), T)
	}); err != nil {
		return err
	}
	if err := quantize(gateUpLayers, s); err != nil {
		return err
	}
	progress("down")
	s = d.m.NewStats(cfg.Intermediate)
	if err := d.each(ctx, func(w int) error { return s.Add(st.MLPAct(b, mlpIn(d.X[w]), T), T) }); err != nil {
		return err
	}
	if err := quantize(downLayers, s); err != nil {
		return err
	}
	progress("outputs")
	return d.each(ctx, func(w int) error {
		st.AddLinear(d.X[w], b.Down, st.MLPAct(b, mlpIn(d.X[w]), T), T)
		return nil
	})
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// keep writes a layer the plan leaves unquantized: as the source stored it
// when the method left its weights alone, else (AWQ folded scales into
// them) in float32.
func (d *driver) keep(tensors map[string]checkpoint.Out, name string, l *llm.Dense) error {
	src, err := d.ck.Float32(name+".weight", l.Out(), l.In())
	if err != nil {
		return err
	}
	if slices.Equal(src, l.W) {
		t, err := d.ck.Tensor(name + ".weight")
		if err != nil {
			return err
		}
		tensors[name+".weight"] = pack.Raw(t)
	} else {
		tensors[name+".weight"] = checkpoint.F32(l.W, l.Out(), l.In())
	}
	d.rep.Layers = append(d.rep.Layers, LayerReport{Name: name})
	d.skipped = append(d.skipped, name)
	return nil
}

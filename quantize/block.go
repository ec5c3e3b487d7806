package quantize

import (
	"context"
	"fmt"
	"slices"
	"strings"
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
	b, err := d.loadBlock(l)
	if err != nil {
		return err
	}
	tensors := map[string]checkpoint.Out{}
	for _, n := range rawNames(cfg, b) {
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
		Progress: progress, Experts: d.expertCalib(), tensors: tensors}
	var next [][]float32
	if d.opt.GPU != nil {
		err = d.gpuPrepare(ctx, bl)
	} else {
		next, err = d.m.Prepare(bl)
	}
	if err != nil {
		return err
	}
	if d.opt.GPU != nil && d.m.NewStats(1) != nil { // GPTQ, AWQ+GPTQ: statistics on the GPU
		return d.gpuBlock(ctx, bl)
	}
	linears := map[string]*llm.Linear{}
	for _, nl := range b.Linears() {
		linears[nl.Name] = nl.L
	}
	// RTN and AWQ read the quantized weights again only to propagate X on
	// the host: not when the method gave the next inputs (AWQ) or X lives
	// on the GPU.
	noStats := d.m.NewStats(1) == nil
	readAgain := !noStats || (next == nil && d.X != nil)
	// quantizeIn replaces each named layer by its quantized version, given
	// the statistics of their shared input, unless ctx is done.
	quantizeIn := func(ctx context.Context, names []string, s Stats) error {
		for _, n := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			dense := (*linears[n]).(*llm.Dense) // LoadBlock with DenseLoader
			lin, err := d.layer(tensors, prefix+n, dense, func(l Layer) (*pack.Linear, float64, error) { return d.m.Quantize(l, s) })
			if err != nil {
				return err
			}
			if lin != nil && readAgain {
				*linears[n] = llm.NewDense(lin.Dequantize(), dense.B, dense.In(), dense.Out())
			}
		}
		return nil
	}
	quantize := func(names []string, s Stats) error { return quantizeIn(ctx, names, s) }

	if noStats { // RTN, AWQ: no statistics
		progress("quantize")
		// round quantizes every layer of the block.
		round := func(ctx context.Context) error {
			t0 := time.Now()
			var names []string
			for _, nl := range b.Linears() {
				names = append(names, nl.Name)
			}
			if err := quantizeIn(ctx, names, nil); err != nil {
				return err
			}
			d.addTime("round", time.Since(t0).Seconds())
			return nil
		}
		if readAgain { // X advances through the quantized block
			if err := round(ctx); err != nil {
				return err
			}
			if err := d.propagate(ctx, b, progress); err != nil {
				return err
			}
			d.reportExperts(bl)
			return d.writePart(tensors)
		}
		if next != nil {
			if len(next) != len(d.X) {
				return fmt.Errorf("method %s returned %d next inputs for %d windows", d.m.Name(), len(next), len(d.X))
			}
			copy(d.X, next)
		}
		d.reportExperts(bl)
		// Nothing waits for the rounding: the next block goes on meanwhile.
		// A block handed over is finished even if the run is being
		// interrupted, so that it is saved and a resumed run starts after it.
		return d.later(func() error {
			if err := round(context.WithoutCancel(ctx)); err != nil {
				return err
			}
			return d.writePart(tensors)
		})
	}

	if d.opt.TrueSequential {
		err = d.sequential(ctx, bl, quantize, progress)
	} else {
		err = d.together(ctx, bl, quantize, progress)
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
	d.reportExperts(bl)
	return d.writePart(tensors)
}

// rawNames are the tensors of a block written as the source stores them
// (relative to its prefix): its norms (Gemma's four, q_norm and k_norm
// included), q/k/v biases, and a mixture's router. A method that changes
// one (AWQ's folded scales) replaces it with Block.SetFloat32.
func rawNames(cfg *checkpoint.Config, b *llm.Block) []string {
	var names []string
	for _, n := range b.Norms(cfg) {
		names = append(names, n.Name)
	}
	if cfg.QKVBias {
		names = append(names, "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
	}
	if cfg.OBias {
		names = append(names, "self_attn.o_proj.bias")
	}
	if b.MoE != nil {
		names = append(names, strings.TrimPrefix(llm.RouterName(cfg, b.Layer), fmt.Sprintf("model.layers.%d.", b.Layer))+".weight")
	}
	return names
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
// the next block's input. A sparse block keeps its MLP inputs until every
// window is routed: the experts' calibration rows depend on the routing
// of all of them (MoEMinTokens).
func (d *driver) together(ctx context.Context, bl *Block, quantize func([]string, Stats) error, progress func(string)) error {
	cfg, T, st, b := d.ck.Config, d.opt.SeqLen, d.st, bl.Block
	sQKV, sO := d.m.NewStats(cfg.Hidden), d.m.NewStats(cfg.Heads*cfg.HeadDim)
	f := d.newFFN(bl)
	var ms [][]float32 // a sparse block's MLP inputs
	if b.MoE == nil {
		f.start()
	}
	progress("statistics")
	if err := d.each(ctx, func(w int) error {
		n := st.Norm(b.AttnNorm, d.X[w], T)
		att := st.Attention(b, n, T)
		h := append([]float32(nil), d.X[w]...)
		st.AddAttention(b, h, att, T)
		m := st.Norm(b.MLPNorm, h, T)
		if b.MoE != nil {
			ms = append(ms, m)
			return firstErr(sQKV.Add(n, T), sO.Add(att, T))
		}
		return firstErr(sQKV.Add(n, T), sO.Add(att, T), f.addGateUp(w, m), f.addDown(w, m))
	}); err != nil {
		return err
	}
	if b.MoE != nil {
		mlpIn := func(w int) []float32 { return ms[w] }
		if err := f.route(ctx, mlpIn); err != nil {
			return err
		}
		f.start()
		if err := d.each(ctx, func(w int) error { return firstErr(f.addGateUp(w, ms[w]), f.addDown(w, ms[w])) }); err != nil {
			return err
		}
		ms = nil
	}
	progress("quantize")
	if err := firstErr(quantize(qkvLayers, sQKV), quantize(oLayers, sO)); err != nil {
		return err
	}
	if err := f.quantize(quantize, false); err != nil {
		return err
	}
	if err := f.quantize(quantize, true); err != nil {
		return err
	}
	return d.propagate(ctx, b, progress)
}

// sequential quantizes [q,k,v] → [o] → [gate,up] → [down] (each expert's
// in a sparse block), each input's statistics taken with the layers
// before it already quantized; X is advanced through the quantized block
// as it goes.
func (d *driver) sequential(ctx context.Context, bl *Block, quantize func([]string, Stats) error, progress func(string)) error {
	cfg, T, st, b := d.ck.Config, d.opt.SeqLen, d.st, bl.Block
	attnIn := func(w int) []float32 { return st.Norm(b.AttnNorm, d.X[w], T) }
	mlpIn := func(w int) []float32 { return st.Norm(b.MLPNorm, d.X[w], T) }
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
	if err := d.each(ctx, func(w int) error {
		st.AddAttention(b, d.X[w], att[w], T) // X now holds the attention residual
		att[w] = nil
		return nil
	}); err != nil {
		return err
	}
	f := d.newFFN(bl)
	if err := f.route(ctx, mlpIn); err != nil {
		return err
	}
	f.start()
	if err := d.each(ctx, func(w int) error { return f.addGateUp(w, mlpIn(w)) }); err != nil {
		return err
	}
	if err := f.quantize(quantize, false); err != nil {
		return err
	}
	progress("down")
	if err := d.each(ctx, func(w int) error { return f.addDown(w, mlpIn(w)) }); err != nil {
		return err
	}
	if err := f.quantize(quantize, true); err != nil {
		return err
	}
	progress("outputs")
	return d.each(ctx, func(w int) error {
		st.AddMLP(b, d.X[w], mlpIn(w), T)
		return nil
	})
}

// layer quantizes one layer with q, or keeps it unquantized when the plan
// says so (returning nil), and adds it to the block's tensors.
func (d *driver) layer(tensors map[string]checkpoint.Out, name string, dense *llm.Dense, q func(Layer) (*pack.Linear, float64, error)) (*pack.Linear, error) {
	t0 := time.Now()
	g, quantized := d.opt.Plan.For(name, d.m.Grid())
	if !quantized {
		return nil, d.keep(tensors, name, dense)
	}
	lin, loss, err := q(Layer{Name: name, W: dense.W, Out: dense.Out(), In: dense.In(), Grid: g})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return lin, d.emit(tensors, name, lin, loss, t0)
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

// writePart hands a block's tensors to the writer, timing it.
func (d *driver) writePart(tensors map[string]checkpoint.Out) error {
	t0 := time.Now()
	err := d.w.WritePart(tensors)
	d.addTime("write", time.Since(t0).Seconds())
	return err
}

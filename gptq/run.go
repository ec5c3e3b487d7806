package gptq

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/calib"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/llmq/llmq/pack"
)

// RunOptions describe a whole-model quantization.
type RunOptions struct {
	Src, Out string
	Method   string // "gptq", "rtn", or a name for Custom (e.g. "awq")
	// Custom, if set, quantizes each block instead of GPTQ/RTN (AWQ does).
	Custom BlockQuantizer
	// Prepare, if set, runs on each block before GPTQ collects its Hessians
	// (AWQ's scale folding, for awq+gptq).
	Prepare BlockQuantizer
	// Format is the checkpoint layout: "gptq" (default) or "awq".
	Format         string
	GPTQ           Options
	TrueSequential bool   // quantize [q,k,v] → [o] → [gate,up] → [down], each on inputs from the quantized earlier ones
	Calib          string // text file, or .i32 token file
	NSamples       int
	SeqLen         int
	QuantizeLMHead bool
	Force          bool
	// Progress, if set, is told when each block starts a stage.
	Progress func(block, blocks int, stage string)
}

// LayerReport is one quantized linear layer.
type LayerReport struct {
	Name    string  `json:"name"`
	Loss    float64 `json:"gptq_loss,omitempty"` // Σ (w−q)²/(2·Hinv_jj²); 0 for RTN
	Seconds float64 `json:"seconds"`
}

// Report summarises a run.
type Report struct {
	Method      string        `json:"method"`
	Layers      []LayerReport `json:"layers"`
	Seconds     float64       `json:"seconds"`
	BytesIn     int64         `json:"bytes_in"`
	BytesOut    int64         `json:"bytes_out"`
	Format      string        `json:"checkpoint_format"`
	CalibTokens int           `json:"calibration_tokens"`
}

// BlockContext is what a per-block quantizer works with.
type BlockContext struct {
	Ctx    context.Context
	Index  int
	Prefix string // "model.layers.N."
	Block  *llm.Block
	Stages *llm.Stages
	// X holds the calibration activations entering the block ([window]
	// [SeqLen·hidden]); the quantizer must leave there those entering the
	// next block.
	X       [][]float32
	SeqLen  int
	Tensors map[string]checkpoint.Out // this block's shard; norms and biases are pre-filled
	// Progress reports a stage of the block.
	Progress func(stage string)
	q        *quantizer
}

// Emit adds a quantized layer to the shard (in the run's format) and the
// report, and replaces the block's layer by its dequantized weights.
func (bc *BlockContext) Emit(name string, l *llm.Linear, lin *pack.Linear, loss float64, t0 time.Time) error {
	d := (*l).(*llm.Dense)
	if err := bc.q.add(bc.Tensors, bc.Prefix+name, lin); err != nil {
		return err
	}
	*l = llm.NewDense(lin.Dequantize(), d.B, d.In(), d.Out())
	bc.q.rep.Layers = append(bc.q.rep.Layers, LayerReport{Name: bc.Prefix + name, Loss: loss, Seconds: time.Since(t0).Seconds()})
	return nil
}

// SetFloat32 stores a (modified) vector such as a norm weight in the shard
// as F32, so that folded scales are kept exactly.
func (bc *BlockContext) SetFloat32(name string, v []float32) {
	bc.Tensors[bc.Prefix+name] = checkpoint.F32(v, len(v))
}

// BlockQuantizer quantizes one block.
type BlockQuantizer func(bc *BlockContext) error

// Run quantizes the checkpoint in opt.Src and writes opt.Out, streaming one
// decoder block at a time: peak memory is one block's weights plus the
// calibration activations.
func Run(ctx context.Context, opt RunOptions) (*Report, error) {
	start := time.Now()
	if opt.Custom == nil && opt.Prepare == nil && opt.Method != "gptq" && opt.Method != "rtn" {
		return nil, fmt.Errorf("--method %q: gptq.Run handles gptq and rtn (others need a Custom or Prepare hook)", opt.Method)
	}
	if opt.Format == "" {
		opt.Format = "gptq"
	}
	if opt.Format != "gptq" && opt.Format != "awq" {
		return nil, fmt.Errorf("--format %q: want gptq or awq", opt.Format)
	}
	ck, err := checkpoint.Open(opt.Src)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	cfg := ck.Config
	if cfg.Quantization != nil {
		return nil, fmt.Errorf("%s is already quantized", opt.Src)
	}
	for _, in := range []int{cfg.Hidden, cfg.Heads * cfg.HeadDim, cfg.Intermediate} {
		if err := opt.GPTQ.Grid.Validate(in); err != nil {
			return nil, err
		}
	}
	rep := &Report{Method: opt.Method, BytesIn: ck.SizeOnDisk()}

	var X [][]float32
	if opt.Method != "rtn" {
		tok, err := tokenizer.Load(filepath.Join(opt.Src, "tokenizer.json"))
		if err != nil {
			return nil, err
		}
		ids, err := calib.ReadTokens(opt.Calib, tok)
		if err != nil {
			return nil, err
		}
		windows, err := calib.Windows(ids, opt.NSamples, opt.SeqLen)
		if err != nil {
			return nil, fmt.Errorf("--calib %s: %w", opt.Calib, err)
		}
		if X, err = calib.Embed(ck, windows); err != nil {
			return nil, err
		}
		rep.CalibTokens = opt.NSamples * opt.SeqLen
	}

	w, err := pack.NewWriter(opt.Out, opt.Force, cfg.Layers+1)
	if err != nil {
		return nil, err
	}
	defer w.Abort() // a no-op once Finish has moved the directory
	q := &quantizer{opt: opt, ck: ck, st: llm.NewStages(cfg), X: X, w: w, rep: rep}
	for l := 0; l < cfg.Layers; l++ {
		if err := q.block(ctx, l); err != nil {
			return nil, fmt.Errorf("block %d: %w", l, err)
		}
	}
	if err := q.head(ctx); err != nil {
		return nil, err
	}
	qc := &pack.QuantConfig{
		QuantMethod: "gptq", Bits: opt.GPTQ.Grid.Bits, GroupSize: opt.GPTQ.Grid.GroupSize,
		DescAct: opt.GPTQ.ActOrder, Sym: &opt.GPTQ.Grid.Sym, StaticGroups: opt.GPTQ.StaticGroups,
		DampPercent: opt.GPTQ.Damp, TrueSequential: opt.TrueSequential, LMHead: opt.QuantizeLMHead,
		Meta: &pack.QuantMeta{Quantizer: "llmq", Method: opt.Method},
	}
	if opt.Method != "rtn" {
		qc.Meta.NSamples, qc.Meta.SeqLen, qc.Meta.Calib = opt.NSamples, opt.SeqLen, filepath.Base(opt.Calib)
	}
	if opt.Method != "gptq" && opt.Prepare == nil {
		qc.DampPercent, qc.TrueSequential = 0, false
	}
	if opt.Format == "awq" {
		zp := !opt.GPTQ.Grid.Sym
		qc = &pack.QuantConfig{QuantMethod: "awq", Bits: opt.GPTQ.Grid.Bits, GroupSize: opt.GPTQ.Grid.GroupSize,
			ZeroPoint: &zp, Version: "gemm", Meta: qc.Meta}
	}
	if err := w.Finish(opt.Src, qc); err != nil {
		return nil, err
	}
	rep.Format, rep.BytesOut, rep.Seconds = w.Format, w.Bytes, time.Since(start).Seconds()
	return rep, nil
}

type quantizer struct {
	opt RunOptions
	ck  *checkpoint.Checkpoint
	st  *llm.Stages
	X   [][]float32 // calibration activations entering the current block
	w   *pack.Writer
	rep *Report
}

// add lays out a quantized layer in the run's format.
func (q *quantizer) add(tensors map[string]checkpoint.Out, name string, lin *pack.Linear) error {
	if q.opt.Format == "awq" {
		t, err := lin.AWQTensors(name)
		if err != nil {
			return err
		}
		for k, v := range t {
			tensors[k] = v
		}
		return nil
	}
	return q.w.AddGPTQ(tensors, name, lin)
}

// block quantizes decoder layer l and advances X past it.
func (q *quantizer) block(ctx context.Context, l int) error {
	cfg := q.ck.Config
	prefix := fmt.Sprintf("model.layers.%d.", l)
	b, err := llm.LoadBlock(q.ck, l, llm.DenseLoader)
	if err != nil {
		return err
	}
	tensors := map[string]checkpoint.Out{}
	raw := []string{"input_layernorm.weight", "post_attention_layernorm.weight"}
	if cfg.QKVBias {
		raw = append(raw, "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
	}
	for _, n := range raw {
		t, err := q.ck.Tensor(prefix + n)
		if err != nil {
			return err
		}
		tensors[prefix+n] = pack.Raw(t)
	}
	linears := map[string]*llm.Linear{}
	for _, nl := range b.Linears() {
		linears[nl.Name] = nl.L
	}
	progress := func(stage string) {
		if q.opt.Progress != nil {
			q.opt.Progress(l, cfg.Layers, stage)
		}
	}
	bc := &BlockContext{Ctx: ctx, Index: l, Prefix: prefix, Block: b, Stages: q.st, X: q.X, SeqLen: q.opt.SeqLen,
		Tensors: tensors, Progress: progress, q: q}
	if q.opt.Custom != nil {
		if err := q.opt.Custom(bc); err != nil {
			return err
		}
		return q.w.WriteShard(tensors)
	}
	if q.opt.Prepare != nil {
		if err := q.opt.Prepare(bc); err != nil {
			return err
		}
	}

	// quantize replaces each named layer by its quantized version, given
	// the Hessian of their shared input (nil for RTN).
	quantize := func(names []string, H *Hessian) error {
		var prep *Prepared
		if H != nil {
			var err error
			if prep, err = Prepare(H.Matrix(), H.In, q.opt.GPTQ); err != nil {
				return fmt.Errorf("%s: %w", names[0], err)
			}
		}
		for _, n := range names {
			t0 := time.Now()
			d := (*linears[n]).(*llm.Dense)
			var lin *pack.Linear
			loss := 0.0
			if prep == nil {
				lin, err = pack.RTN(d.W, d.Out(), d.In(), q.opt.GPTQ.Grid)
			} else {
				var res *Result
				if res, err = Quantize(d.W, d.Out(), d.In(), prep, q.opt.GPTQ); err == nil {
					lin, loss = res.Linear, res.Loss
				}
			}
			if err != nil {
				return fmt.Errorf("%s%s: %w", prefix, n, err)
			}
			if err := bc.Emit(n, linears[n], lin, loss, t0); err != nil {
				return err
			}
		}
		return nil
	}

	if q.opt.Method == "rtn" {
		progress("rtn")
		if err := quantize([]string{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}, nil); err != nil {
			return err
		}
		return q.w.WriteShard(tensors)
	}

	T := q.opt.SeqLen
	// each calls fn on every calibration window, checking for cancellation.
	each := func(fn func(w int) error) error {
		for w := range q.X {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := fn(w); err != nil {
				return err
			}
		}
		return nil
	}
	attnIn := func(w int) []float32 { return q.st.Norm(b.AttnNorm, q.X[w], T) }
	mlpIn := func(x []float32) []float32 { return q.st.Norm(b.MLPNorm, x, T) }

	hQKV, hO := NewHessian(cfg.Hidden), NewHessian(cfg.Heads*cfg.HeadDim)
	hUp, hDown := NewHessian(cfg.Hidden), NewHessian(cfg.Intermediate)
	att := make([][]float32, len(q.X))

	if !q.opt.TrueSequential {
		// All four Hessians from the unquantized block, in one pass.
		progress("hessians")
		if err := each(func(w int) error {
			n := attnIn(w)
			att[w] = q.st.Attention(b, n, T)
			h := append([]float32(nil), q.X[w]...)
			q.st.AddLinear(h, b.O, att[w], T)
			m := mlpIn(h)
			return firstErr(hQKV.Add(n, T), hO.Add(att[w], T), hUp.Add(m, T), hDown.Add(q.st.MLPAct(b, m, T), T))
		}); err != nil {
			return err
		}
		progress("quantize")
		for _, g := range []struct {
			names []string
			h     *Hessian
		}{{[]string{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, hQKV}, {[]string{"self_attn.o_proj"}, hO},
			{[]string{"mlp.gate_proj", "mlp.up_proj"}, hUp}, {[]string{"mlp.down_proj"}, hDown}} {
			if err := quantize(g.names, g.h); err != nil {
				return err
			}
		}
		progress("outputs")
		if err := each(func(w int) error {
			q.X[w] = q.st.Block(b, q.X[w], T)
			return nil
		}); err != nil {
			return err
		}
		return q.w.WriteShard(tensors)
	}

	progress("q,k,v")
	if err := each(func(w int) error { return hQKV.Add(attnIn(w), T) }); err != nil {
		return err
	}
	if err := quantize([]string{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, hQKV); err != nil {
		return err
	}
	progress("o")
	if err := each(func(w int) error {
		att[w] = q.st.Attention(b, attnIn(w), T)
		return hO.Add(att[w], T)
	}); err != nil {
		return err
	}
	if err := quantize([]string{"self_attn.o_proj"}, hO); err != nil {
		return err
	}
	progress("gate,up")
	if err := each(func(w int) error {
		q.st.AddLinear(q.X[w], b.O, att[w], T) // X now holds the attention residual
		att[w] = nil
		return hUp.Add(mlpIn(q.X[w]), T)
	}); err != nil {
		return err
	}
	if err := quantize([]string{"mlp.gate_proj", "mlp.up_proj"}, hUp); err != nil {
		return err
	}
	progress("down")
	if err := each(func(w int) error { return hDown.Add(q.st.MLPAct(b, mlpIn(q.X[w]), T), T) }); err != nil {
		return err
	}
	if err := quantize([]string{"mlp.down_proj"}, hDown); err != nil {
		return err
	}
	progress("outputs")
	if err := each(func(w int) error {
		q.st.AddLinear(q.X[w], b.Down, q.st.MLPAct(b, mlpIn(q.X[w]), T), T)
		return nil
	}); err != nil {
		return err
	}
	return q.w.WriteShard(tensors)
}

// head writes the embeddings, the final norm and the LM head (quantized
// only with --quantize-lm-head) as the last shard.
func (q *quantizer) head(ctx context.Context) error {
	tensors := map[string]checkpoint.Out{}
	for _, n := range []string{"model.embed_tokens.weight", "model.norm.weight"} {
		t, err := q.ck.Tensor(n)
		if err != nil {
			return err
		}
		tensors[n] = pack.Raw(t)
	}
	headName := "lm_head.weight"
	if !q.ck.Has(headName) {
		headName = "model.embed_tokens.weight" // tied
	}
	if !q.opt.QuantizeLMHead {
		if q.ck.Has("lm_head.weight") {
			t, _ := q.ck.Tensor("lm_head.weight")
			tensors["lm_head.weight"] = pack.Raw(t)
		}
		return q.w.WriteShard(tensors)
	}
	t0 := time.Now()
	lin, loss, err := q.quantizeHead(ctx, headName)
	if err != nil {
		return fmt.Errorf("lm_head: %w", err)
	}
	if err := q.add(tensors, "lm_head", lin); err != nil {
		return err
	}
	q.rep.Layers = append(q.rep.Layers, LayerReport{Name: "lm_head", Loss: loss, Seconds: time.Since(t0).Seconds()})
	return q.w.WriteShard(tensors)
}

// quantizeHead quantizes the LM head, whose input is the final norm of
// the last block's output.
func (q *quantizer) quantizeHead(ctx context.Context, name string) (*pack.Linear, float64, error) {
	cfg := q.ck.Config
	W, err := q.ck.Float32(name, cfg.Vocab, cfg.Hidden)
	if err != nil {
		return nil, 0, err
	}
	if q.opt.Method == "rtn" {
		lin, err := pack.RTN(W, cfg.Vocab, cfg.Hidden, q.opt.GPTQ.Grid)
		return lin, 0, err
	}
	norm, err := q.ck.Float32("model.norm.weight", cfg.Hidden)
	if err != nil {
		return nil, 0, err
	}
	H := NewHessian(cfg.Hidden)
	for _, x := range q.X {
		if err := ctx.Err(); err != nil {
			return nil, 0, err
		}
		if err := H.Add(q.st.Norm(norm, x, q.opt.SeqLen), q.opt.SeqLen); err != nil {
			return nil, 0, err
		}
	}
	prep, err := Prepare(H.Matrix(), cfg.Hidden, q.opt.GPTQ)
	if err != nil {
		return nil, 0, err
	}
	res, err := Quantize(W, cfg.Vocab, cfg.Hidden, prep, q.opt.GPTQ)
	if err != nil {
		return nil, 0, err
	}
	return res.Linear, res.Loss, nil
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

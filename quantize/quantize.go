// Package quantize is the driver of llmq quantize: it turns an
// unquantized checkpoint into a packed one with any Method (RTN, GPTQ, AWQ,
// AWQ+GPTQ), streaming one decoder block at a time so that memory holds one
// block's weights and the calibration activations:
//
//	X = embeddings of the calibration windows (first NSamples windows of SeqLen tokens)
//	for each block:
//	    load its weights (float32)
//	    next = Method.Prepare(block, X)            AWQ: search and fold scales
//	    for each input of the block (in order when true-sequential):
//	        stats = Method.NewStats; stats.Add(input rows on X)   GPTQ: H
//	        for each layer reading it: Method.Quantize(W, stats) → packed layer
//	        replace the layer by its dequantized weights
//	    X = next, or the quantized block run on X
//	    hand the block's tensors to the writer (a part of a shard)
//	write embeddings, final norm and lm_head, then config.json with
//	quantization_config; rename the temporary directory into place.
//
// The four inputs of a Llama block are RMSNorm(x) (read by q, k, v), the
// attention output (o), RMSNorm(h) (gate, up) and SiLU(gate)·up (down).
// True-sequential order (the GPTQ reference's option) takes each input's
// statistics after the layers before it are quantized: [q,k,v] → [o] →
// [gate,up] → [down]; otherwise all four come from the unquantized block
// in one pass. The later families run through the same stages (llm.Stages
// applies q/k norms, Gemma's post-norms and sliding windows); their norms
// and routers are copied, not quantized. In a mixture of experts each
// expert's gate/up and down inputs are gathered on its own calibration
// rows (moe.go).
//
// With Options.GPU (gpu.go) the same loop keeps X on the GPU
// (cuda.Calibrator): the block's forward passes, the Hessians and GPTQ's
// factorization and column updates run there, and only weights, codes,
// scales and zeros cross to the host, where package gptq lays each layer
// out and package pack writes it. The GPU path takes dense Llama-style
// blocks (cuda.CalibratorSupports).
package quantize

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/calib"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/llmq/llmq/pack"
)

// ErrCalibration marks errors in the calibration data or its settings (an
// unreadable file, fewer windows than asked for, windows longer than the
// model's context).
var ErrCalibration = errors.New("calibration data")

// Options describe a whole-model quantization.
type Options struct {
	Src, Out string
	Method   Method
	// Format is the checkpoint layout: "gptq" (default), "awq" or
	// "compressed-tensors" (FP8 methods: only that).
	Format string
	// TrueSequential takes each input's statistics from a block whose
	// earlier layers are already quantized.
	TrueSequential bool
	Calib          string // text, JSON Lines (.jsonl, "text" fields) or .i32 token file
	NSamples       int    // calibration windows
	SeqLen         int    // tokens per window
	// Seed, when not 0, samples the windows at random offsets (the GPTQ
	// reference's way); 0 takes the first NSamples non-overlapping ones.
	Seed           uint64
	QuantizeLMHead bool
	Force          bool // replace Out if it exists (and is an llmq output); start over an interrupted run
	// Resume continues an interrupted run with the same settings from its
	// last finished block (its parts are kept in pack.PartialDir(Out)).
	Resume bool
	// Plan, if set, is a mixed-precision plan: per-layer bits and group
	// sizes, and layers kept unquantized (written as GPTQModel's "dynamic").
	Plan pack.Dynamic
	// Smooth, if set, holds SmoothQuant's per-channel factors by block
	// (llmq calibrate --smooth): each block's are folded into its norms
	// and the weight columns reading them before its layers are quantized,
	// so the weights are rounded as a smoothed W8A8 model runs them.
	Smooth *actquant.Scales
	// MaxShardBytes bounds a shard of the output
	// (pack.DefaultMaxShardBytes when 0).
	MaxShardBytes int64
	// CommandLine and Version, if set, are recorded in the model card and
	// the config's meta (how the checkpoint was made, by which llmq).
	CommandLine, Version string
	// GPU, if set, runs the calibration forward passes, the statistics
	// and the method on that GPU (methods for which RunsOnGPU is true).
	GPU *cuda.Lib
	// Progress, if set, is told when each block starts a stage.
	Progress func(block, blocks int, stage string)
	// MoECalib is how the experts of a mixture gather calibration
	// statistics: "routed" (the default, "" too) from the tokens the
	// router sends each, or "all": every token through every expert, for
	// the statistics only (see moe.go).
	MoECalib string
	// MoEMinTokens: an expert routed fewer calibration tokens is
	// calibrated on all of them, and reported (0: the hidden size).
	MoEMinTokens int
}

// LayerReport is one quantized linear layer.
type LayerReport struct {
	Name    string  `json:"name"`
	Bits    int     `json:"bits"`                // 0: kept unquantized (the plan skips it)
	Loss    float64 `json:"gptq_loss,omitempty"` // Σ (w−q)²/(2·Hinv_jj²); 0 but for GPTQ
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
	// CalibSourceTokens is how many tokens the calibration file holds.
	CalibSourceTokens int `json:"calibration_source_tokens,omitempty"`
	// ResumedAt is the first block this run quantized when it continued
	// an interrupted one (the report's layers start there).
	ResumedAt int `json:"resumed_at_block,omitempty"`
	// Device is where the calibration ran: "cpu", or the GPU's name.
	Device string `json:"device"`
	// Timing splits the run's seconds: "load" (reading blocks), "write"
	// (packing and writing), "calibration" (embedding the windows); on
	// the GPU also "upload" (weights to the GPU), "statistics" (forward
	// passes taking Hessians), "forward" (passes advancing X), "factor"
	// (Cholesky and inverse), "solve" (GPTQ's column updates); with AWQ
	// "features" (the pass keeping x̄ and the clip search's rows),
	// "search <group>" (each scale group's candidates), "clip"; with RTN
	// and AWQ "round" (rounding and packing on the host: in the
	// background, beside the next block's work, where nothing waits for
	// it).
	Timing map[string]float64 `json:"timing_s"`
	// CalibTokensPerSecond is the calibration forward passes' rate on the
	// GPU: calibration tokens × blocks quantized, over the seconds of
	// "statistics", "features" and "forward" (the passes that take
	// statistics and the passes that advance X).
	CalibTokensPerSecond float64 `json:"calibration_tokens_per_second,omitempty"`
	// PeakGPUBytes is the most GPU memory the run held at once.
	PeakGPUBytes int64 `json:"peak_gpu_bytes,omitempty"`
	// Experts lists each expert of the sparse blocks with the calibration
	// tokens it received (calibrated methods).
	Experts []ExpertReport `json:"experts,omitempty"`
}

// Run quantizes the checkpoint in opt.Src and writes opt.Out. Output goes
// to a temporary directory renamed into place at the end; an error or a
// cancelled ctx leaves nothing behind.
func Run(ctx context.Context, opt Options) (*Report, error) {
	start := time.Now()
	m := opt.Method
	if m == nil {
		return nil, fmt.Errorf("no quantization method given")
	}
	if opt.Format == "" {
		opt.Format = "gptq"
		if m.Grid().FP8 {
			opt.Format = pack.MethodCT
		}
	}
	if opt.Format != "gptq" && opt.Format != "awq" && opt.Format != pack.MethodCT {
		return nil, fmt.Errorf("checkpoint format %q: want gptq, awq or %s", opt.Format, pack.MethodCT)
	}
	if m.Grid().FP8 && opt.Format != pack.MethodCT {
		return nil, fmt.Errorf("checkpoint format %q: FP8 weights are written as %s", opt.Format, pack.MethodCT)
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
	if err := validMoE(opt); err != nil {
		return nil, err
	}
	grid := m.Grid()
	ins := []int{cfg.Hidden, cfg.Heads * cfg.HeadDim, cfg.Intermediate}
	if cfg.MoE != nil {
		ins = append(ins, cfg.MoE.Intermediate)
	}
	for _, in := range ins {
		if err := grid.Validate(in); err != nil {
			return nil, err
		}
	}
	if !m.Calibrated() && m.NewStats(1) != nil {
		return nil, fmt.Errorf("method %s gathers statistics but reads no calibration data", m.Name())
	}
	if m.Calibrated() {
		if opt.NSamples <= 0 || opt.SeqLen <= 0 {
			return nil, fmt.Errorf("%w: %d windows of %d tokens: want a positive number of each", ErrCalibration, opt.NSamples, opt.SeqLen)
		}
		if cfg.MaxPositions > 0 && opt.SeqLen > cfg.MaxPositions {
			return nil, fmt.Errorf("%w: windows of %d tokens are longer than the model's %d positions", ErrCalibration, opt.SeqLen, cfg.MaxPositions)
		}
	}
	if opt.QuantizeLMHead {
		// The packed layouts store a layer's zeros as bit streams of its
		// outputs (GPTQ) or 8 outputs a word (AWQ).
		if opt.Format == "awq" && cfg.Vocab%8 != 0 || opt.Format == "gptq" && cfg.Vocab*grid.Bits%32 != 0 {
			return nil, fmt.Errorf("lm_head's %d outputs cannot be packed at %d bits in the %s layout", cfg.Vocab, grid.Bits, opt.Format)
		}
	}
	if opt.Smooth != nil {
		if len(opt.Smooth.Smooth) == 0 {
			return nil, fmt.Errorf("the smoothing scales hold no SmoothQuant factors (calibrate with --smooth α)")
		}
		for i := range opt.Smooth.Smooth {
			if i < 0 || i >= cfg.Layers {
				return nil, fmt.Errorf("smoothing factors for block %d of a %d-block model", i, cfg.Layers)
			}
		}
	}
	rep := &Report{Method: m.Name(), BytesIn: ck.SizeOnDisk(), Device: "cpu", Timing: map[string]float64{}}
	if opt.GPU != nil && !m.Calibrated() {
		opt.GPU = nil // RTN reads no calibration data: it rounds on the host
	}
	if opt.GPU != nil {
		if !RunsOnGPU(m) {
			return nil, fmt.Errorf("method %s does not run on the GPU yet: use --device cpu", m.Name())
		}
		dev, err := opt.GPU.Device()
		if err != nil {
			return nil, err
		}
		rep.Device = dev.Name
	}

	d := &driver{opt: opt, m: m, ck: ck, st: llm.NewStages(cfg), rep: rep}
	defer d.waitPrefetch() // before ck.Close unmaps the files it reads
	fp, err := d.fingerprint()
	if err != nil {
		return nil, err
	}
	var w *pack.Writer
	var done progress
	if opt.Resume {
		if w, err = pack.ResumeWriter(opt.Out, opt.Force, &done); err != nil {
			return nil, err
		}
		if done.Fingerprint != fp {
			return nil, fmt.Errorf("the interrupted run of %s used other settings (method, grid, calibration, format or plan); start over with --force", opt.Out)
		}
		rep.ResumedAt, rep.Experts = done.Blocks, done.Experts
	} else if w, err = pack.NewWriter(opt.Out, opt.Force); err != nil {
		return nil, err
	}
	w.MaxShardBytes = opt.MaxShardBytes
	d.w = w
	defer w.Abort() // a no-op once Finish has moved the directory, or after Keep
	var X [][]float32
	if m.Calibrated() {
		if opt.Progress != nil {
			opt.Progress(0, cfg.Layers, "reading the calibration data")
		}
		t0 := time.Now()
		if X, rep.CalibSourceTokens, err = calibration(ck, opt); err != nil {
			return nil, err
		}
		rep.Timing["calibration"] = time.Since(t0).Seconds()
		rep.CalibTokens = len(X) * opt.SeqLen
	}

	d.X = X
	defer d.closeGPU()
	defer d.drain()        // before Abort (deferred above) removes what the finisher writes
	resumed := done.Blocks // done itself is the finisher's to update from here until drain
	for l := 0; l < cfg.Layers; l++ {
		if l < resumed {
			if err := d.replay(ctx, l); err != nil {
				return nil, d.stopped(ctx, fmt.Errorf("block %d (replayed): %w", l, err), done.Blocks)
			}
			continue
		}
		if err := d.block(ctx, l); err != nil {
			d.drain() // the blocks handed over before are finished (and saved) or failed
			return nil, d.stopped(ctx, fmt.Errorf("block %d: %w", l, err), done.Blocks)
		}
		// Record the block as done once its part is written: after the
		// finisher's job for it when it has one.
		p := progress{Fingerprint: fp, Blocks: l + 1, Experts: slices.Clone(rep.Experts)}
		save := func() error {
			if err := w.Save(p); err != nil {
				return err
			}
			done = p
			return nil
		}
		if d.fin != nil {
			err = d.later(save)
		} else {
			err = save()
		}
		if err != nil { // the save, or the finishing of a block before it
			d.drain()
			return nil, d.stopped(ctx, err, done.Blocks)
		}
	}
	if err := d.drain(); err != nil {
		return nil, d.stopped(ctx, err, done.Blocks)
	}
	if d.cal != nil && opt.QuantizeLMHead { // lm_head reads the last block's output
		if d.X, err = d.cal.Download(); err != nil {
			return nil, err
		}
	}
	if err := d.closeGPU(); err != nil {
		return nil, err
	}
	if passes := rep.Timing["statistics"] + rep.Timing["features"] + rep.Timing["forward"]; passes > 0 {
		rep.CalibTokensPerSecond = float64(rep.CalibTokens*(cfg.Layers-rep.ResumedAt)) / passes
	}
	if err := d.head(ctx); err != nil {
		return nil, d.stopped(ctx, err, done.Blocks)
	}
	qc := d.quantConfig()
	rep.BytesOut, rep.Format = w.Bytes, w.Format
	switch qc.QuantMethod {
	case "gptq":
		qc.CheckpointFormat = w.Format // as Finish records it
	case pack.MethodCT:
		rep.Format = qc.CT.Format
	default:
		rep.Format = "awq"
	}
	w.Card = modelCard(opt, ck, qc, rep)
	if err := w.Finish(opt.Src, qc); err != nil {
		return nil, err
	}
	rep.Seconds = time.Since(start).Seconds()
	return rep, nil
}

// calibration embeds the calibration windows (the first NSamples of
// SeqLen tokens, or with a Seed at random offsets) and says how many tokens
// the file held.
func calibration(ck *checkpoint.Checkpoint, opt Options) ([][]float32, int, error) {
	tok, err := tokenizer.Load(filepath.Join(opt.Src, "tokenizer.json"))
	if err != nil {
		return nil, 0, err
	}
	ids, err := calib.ReadTokens(opt.Calib, calib.FormatAuto, tok)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %w", ErrCalibration, err)
	}
	windows, err := calib.Sample(ids, opt.NSamples, opt.SeqLen, opt.Seed)
	if err != nil {
		return nil, 0, fmt.Errorf("%w %s: %w", ErrCalibration, opt.Calib, err)
	}
	X, err := calib.Embed(ck, windows)
	if err != nil {
		return nil, 0, fmt.Errorf("%w %s: %w", ErrCalibration, opt.Calib, err)
	}
	return X, len(ids), nil
}

// quantConfig is the checkpoint's quantization_config.
func (d *driver) quantConfig() *pack.QuantConfig {
	opt, g := d.opt, d.m.Grid()
	meta := &pack.QuantMeta{Quantizer: "llmq", Version: d.opt.Version, Method: d.m.Name()}
	if opt.Smooth != nil {
		meta.SmoothAlpha = opt.Smooth.Alpha
	}
	if d.m.Calibrated() {
		meta.NSamples, meta.SeqLen, meta.Calib, meta.Seed = opt.NSamples, opt.SeqLen, filepath.Base(opt.Calib), opt.Seed
		meta.MoE = d.moeMeta()
	}
	if opt.Format == pack.MethodCT {
		return d.ctConfig(meta)
	}
	if opt.Format == "awq" {
		zp := !g.Sym
		return &pack.QuantConfig{QuantMethod: "awq", Bits: g.Bits, GroupSize: g.GroupSize,
			ZeroPoint: &zp, Version: "gemm", Dynamic: opt.Plan, ModulesToNotConvert: d.routers(), Meta: meta}
	}
	qc := &pack.QuantConfig{QuantMethod: "gptq", Bits: g.Bits, GroupSize: g.GroupSize, Sym: &g.Sym,
		LMHead: opt.QuantizeLMHead, Dynamic: opt.Plan, ModulesInBlockToQuantize: pack.ModulesInBlock(d.ck.Config), Meta: meta}
	// true_sequential describes how statistics were gathered: only methods
	// that gather them have the setting.
	qc.TrueSequential = opt.TrueSequential && d.m.NewStats(1) != nil
	d.m.Describe(qc)
	return qc
}

// ErrInterrupted marks a run stopped by its context; its finished blocks
// are kept for Options.Resume.
var ErrInterrupted = errors.New("interrupted")

// stopped keeps the finished blocks of a run whose context ended, for a
// later Resume, and says so; other errors discard them.
func (d *driver) stopped(ctx context.Context, err error, blocks int) error {
	if ctx.Err() == nil {
		return err
	}
	d.w.Keep()
	return fmt.Errorf("%w after %d finished blocks (kept in %s for a resumed run): %w", ErrInterrupted, blocks, pack.PartialDir(d.opt.Out), err)
}

type driver struct {
	cal *cuda.Calibrator // the GPU path's, from the first block it quantizes
	// pre delivers block preBlock, read in the background (prefetch.go).
	pre      chan loadedBlock
	preBlock int
	opt      Options
	m        Method
	ck       *checkpoint.Checkpoint
	st       *llm.Stages
	X        [][]float32 // calibration activations entering the current block
	w        *pack.Writer
	rep      *Report
	// grids records each quantized layer's grid, and skipped those
	// kept unquantized (for the compressed-tensors config).
	grids   []layerGrid
	skipped []string
	// fin finishes blocks in the background (finish.go); timing guards
	// rep.Timing, which it and the calibrating goroutine both add to.
	fin    *finisher
	timing sync.Mutex
}

// addTime adds seconds to the report's timing of kind.
func (d *driver) addTime(kind string, seconds float64) {
	d.timing.Lock()
	d.rep.Timing[kind] += seconds
	d.timing.Unlock()
}

// closeGPU records the GPU's timing and peak memory and frees it.
func (d *driver) closeGPU() error {
	if d.cal == nil {
		return nil
	}
	for k, v := range d.cal.Busy {
		d.addTime(k, v)
	}
	peak, err := d.cal.PeakBytes()
	d.rep.PeakGPUBytes = max(d.rep.PeakGPUBytes, peak)
	if cerr := d.cal.Close(); err == nil {
		err = cerr
	}
	d.cal = nil
	return err
}

type layerGrid struct {
	name string
	grid pack.Grid
}

// emit adds a quantized layer to the part being built, in the run's
// format, and to the report.
func (d *driver) emit(tensors map[string]checkpoint.Out, name string, lin *pack.Linear, loss float64, t0 time.Time) error {
	d.grids = append(d.grids, layerGrid{name, lin.Grid})
	if d.opt.Format == pack.MethodCT {
		t, err := lin.CTTensors(name)
		if err != nil {
			return err
		}
		for k, v := range t {
			tensors[k] = v
		}
	} else if d.opt.Format == "awq" {
		t, err := lin.AWQTensors(name)
		if err != nil {
			return err
		}
		for k, v := range t {
			tensors[k] = v
		}
	} else if err := d.w.AddGPTQ(tensors, name, lin); err != nil {
		return err
	}
	d.rep.Layers = append(d.rep.Layers, LayerReport{Name: name, Bits: lin.Grid.Bits, Loss: loss, Seconds: time.Since(t0).Seconds()})
	return nil
}

// head writes the embeddings, the final norm and the LM head (quantized
// only with QuantizeLMHead, its input being the final norm of the last
// block's output) as the last part.
func (d *driver) head(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	cfg := d.ck.Config
	tensors := map[string]checkpoint.Out{}
	for _, n := range []string{"model.embed_tokens.weight", "model.norm.weight"} {
		t, err := d.ck.Tensor(n)
		if err != nil {
			return err
		}
		tensors[n] = pack.Raw(t)
	}
	if !d.opt.QuantizeLMHead {
		if d.ck.Has("lm_head.weight") {
			t, err := d.ck.Tensor("lm_head.weight")
			if err != nil {
				return err
			}
			tensors["lm_head.weight"] = pack.Raw(t)
		}
		return d.w.WritePart(tensors)
	}
	t0 := time.Now()
	name := "lm_head.weight"
	if !d.ck.Has(name) {
		name = "model.embed_tokens.weight" // tied
	}
	W, err := d.ck.Float32(name, cfg.Vocab, cfg.Hidden)
	if err != nil {
		return err
	}
	s := d.m.NewStats(cfg.Hidden)
	if s != nil {
		norm, err := llm.ReadNorm(d.ck, "model.norm.weight", cfg.Hidden)
		if err != nil {
			return err
		}
		for _, x := range d.X {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := s.Add(d.st.Norm(norm, x, d.opt.SeqLen), d.opt.SeqLen); err != nil {
				return fmt.Errorf("lm_head: %w", err)
			}
		}
	}
	g, ok := d.opt.Plan.For("lm_head", d.m.Grid())
	if !ok {
		return fmt.Errorf("lm_head: asked to quantize it, but the plan skips it")
	}
	lin, loss, err := d.m.Quantize(Layer{Name: "lm_head", W: W, Out: cfg.Vocab, In: cfg.Hidden, Grid: g}, s)
	if err != nil {
		return fmt.Errorf("lm_head: %w", err)
	}
	if err := d.emit(tensors, "lm_head", lin, loss, t0); err != nil {
		return err
	}
	return d.w.WritePart(tensors)
}

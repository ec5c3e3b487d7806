//go:build cgo

package cuda

import (
	"context"
	"fmt"
	"time"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// Calibrator runs the quantize driver's arithmetic for one decoder block
// at a time on the GPU: the calibration activations X stay on the device
// (fp32 residual stream, [windows·SeqLen][hidden]) from the first block
// to the last, the block's weights are uploaded as fp16, each linear
// layer's input statistics are GPTQ Hessians accumulated in fp32 from the
// fp16 activations, and GPTQ's factorization and column updates run on
// the device (GPTQFactor, GPTQ).
//
// The forward pass is the GPU backend's (Model): the same kernels, fp16
// activations, fp32 residual. The windows are processed in chunks of
// whole windows (about 16k rows), so activation memory does not grow with
// the number of windows; only X (and, for true-sequential statistics, the
// attention output of every window) does.
type Calibrator struct {
	x      *Context
	cfg    *checkpoint.Config
	T, N   int // tokens per window, windows
	chunkW int // windows per chunk

	X        Buf // fp32 [N·T][hidden]
	attAll   Buf // fp16 [N·T][heads·hd]: the attention output, kept between stages
	cos, sin Buf

	// chunk buffers
	h, q, k, v, att, delta, g, u Buf
	xtmp, kv, attnWS             Buf
	meta                         RowMeta

	blk calibBlock

	hinv     Buf // the last GPTQFactor's U, fp32 [n][n], of Hessian factored
	hinvN    int
	factored *Hessian
	factor   Buf // GPTQFactor's fp64 workspace
	factorN  int
	sqPart   Buf // AWQLoss's partial sums

	// Busy accumulates the seconds spent in each kind of work (names as
	// in Timing); the driver reads it for its report.
	Busy map[string]float64
}

type calibBlock struct {
	norms blockNorms
	lin   map[string]*calibLinear // by checkpoint name relative to the block
	attn  AttnOptions             // the layer's sliding window
}

type calibLinear struct {
	in, out int
	w, b    Buf // fp16: what the forward pass multiplies by
	w32     Buf // fp32: the weights as SetBlock had them (AWQ's searches start from them)
}

// NewCalibrator uploads the calibration activations X ([window]
// [seqLen·hidden] fp32, the embeddings of the windows) to the GPU of lib.
func NewCalibrator(lib *Lib, cfg *checkpoint.Config, X [][]float32, seqLen int) (*Calibrator, error) {
	if err := CalibratorSupports(cfg); err != nil {
		return nil, err
	}
	if len(X) == 0 || seqLen <= 0 {
		return nil, fmt.Errorf("no calibration windows")
	}
	x, err := lib.NewContext()
	if err != nil {
		return nil, err
	}
	c := &Calibrator{x: x, cfg: cfg, T: seqLen, N: len(X), Busy: map[string]float64{}}
	c.chunkW = max(1, min(len(X), 16384/seqLen))
	if err := c.alloc(X); err != nil {
		c.Close()
		return nil, fmt.Errorf("calibration buffers on the GPU: %w", err)
	}
	return c, nil
}

func (c *Calibrator) alloc(X [][]float32) error {
	cfg, T := c.cfg, c.T
	H, qd, kvd := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim
	rows := c.chunkW * T
	var err error
	if c.X, err = c.x.Alloc(c.N * T * H * 4); err != nil {
		return err
	}
	for w, xw := range X {
		if len(xw) != T*H {
			return fmt.Errorf("window %d holds %d values, want %d×%d", w, len(xw), T, H)
		}
		if err := Upload(c.x, c.X.Offset(w*T*H*4), xw); err != nil {
			return err
		}
	}
	cos, sin := llm.RopeTables(cfg, T)
	if c.cos, err = AllocFrom(c.x, cos); err != nil {
		return err
	}
	if c.sin, err = AllocFrom(c.x, sin); err != nil {
		return err
	}
	// The flash kernel (head dims it takes) reads k and v where the chunk
	// holds them: no cache and no workspace then.
	kvBytes, wsBytes := c.chunkW*2*T*kvd*2, c.x.Lib().AttentionWorkspaceBytes(rows, cfg.Heads, cfg.HeadDim, T)
	if CausalHeadDims(cfg.HeadDim) {
		kvBytes, wsBytes = 0, 0
	}
	for _, s := range []struct {
		b     *Buf
		bytes int
	}{
		{&c.attAll, c.N * T * qd * 2},
		{&c.h, rows * H * 2}, {&c.q, rows * qd * 2}, {&c.k, rows * kvd * 2}, {&c.v, rows * kvd * 2},
		{&c.att, rows * qd * 2}, {&c.delta, rows * H * 2}, {&c.g, rows * cfg.Intermediate * 2},
		{&c.u, rows * cfg.Intermediate * 2}, {&c.xtmp, rows * H * 4}, {&c.kv, kvBytes}, {&c.attnWS, wsBytes},
		{&c.meta.RowSeq, rows * 4}, {&c.meta.RowPos, rows * 4}, {&c.meta.KVBase, c.chunkW * 8}, {&c.meta.KVCap, c.chunkW * 4},
	} {
		if s.bytes == 0 {
			continue
		}
		if *s.b, err = c.x.Alloc(s.bytes); err != nil {
			return err
		}
	}
	// Rows of a chunk: window r/T at position r%T, each window its own
	// sequence with a cache of T positions.
	seq, pos := make([]int32, rows), make([]int32, rows)
	for r := range seq {
		seq[r], pos[r] = int32(r/T), int32(r%T)
	}
	base, capac := make([]uint64, c.chunkW), make([]int32, c.chunkW)
	for s := range base {
		base[s] = c.kv.Ptr() + uint64(s*2*T*kvd*2)
		capac[s] = int32(T)
	}
	for _, u := range []error{Upload(c.x, c.meta.RowSeq, seq), Upload(c.x, c.meta.RowPos, pos),
		Upload(c.x, c.meta.KVBase, base), Upload(c.x, c.meta.KVCap, capac)} {
		if u != nil {
			return u
		}
	}
	return nil
}

// Windows is the number of calibration windows the calibrator holds.
func (c *Calibrator) Windows() int { return c.N }

// Close frees everything the calibrator holds on the GPU.
func (c *Calibrator) Close() error {
	if c.x == nil {
		return nil
	}
	err := c.x.Close()
	c.x = nil
	return err
}

// PeakBytes is the most GPU memory the calibrator has held at once.
func (c *Calibrator) PeakBytes() (int64, error) {
	m, err := c.x.Memory()
	return int64(m.PeakBytes), err
}

// Download returns X, the activations entering the next block.
func (c *Calibrator) Download() ([][]float32, error) {
	H := c.cfg.Hidden
	out := make([][]float32, c.N)
	for w := range out {
		out[w] = make([]float32, c.T*H)
		if err := Download(c.x, out[w], c.X.Offset(w*c.T*H*4)); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// timed runs f and adds its duration (after the stream drains) to Busy[kind].
func (c *Calibrator) timed(kind string, f func() error) error {
	t0 := time.Now()
	err := f()
	if err == nil {
		err = c.x.Sync()
	}
	c.Busy[kind] += time.Since(t0).Seconds()
	return err
}

// SetBlock uploads a decoder block's norms and (dense) linear layers,
// replacing the previous block's. The weights go up in fp32 (kept for
// AWQ's searches) and are converted to fp16 on the device.
func (c *Calibrator) SetBlock(b *llm.Block) error {
	return c.timed("upload", func() error {
		c.freeBlock()
		if err := c.blk.norms.upload(b, func(w []float32) (Buf, error) { return AllocFrom(c.x, w) }); err != nil {
			return err
		}
		c.blk.attn = attnOptions(c.cfg, b.Layer)
		var err error
		c.blk.lin = map[string]*calibLinear{}
		for _, nl := range b.Linears() {
			d, ok := (*nl.L).(*llm.Dense)
			if !ok {
				return fmt.Errorf("%s: the calibrator takes dense layers, not %T", nl.Name, *nl.L)
			}
			l := &calibLinear{in: d.In(), out: d.Out()}
			c.blk.lin[nl.Name] = l
			if l.w32, err = AllocFrom(c.x, d.W); err != nil {
				return err
			}
			if l.w, err = c.x.Alloc(len(d.W) * 2); err != nil {
				return err
			}
			if err := c.x.F32ToF16(l.w32, l.w, len(d.W)); err != nil {
				return err
			}
			if d.B != nil {
				if l.b, err = AllocFrom(c.x, toF16(d.B)); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// SetLinear replaces one layer's weights [out][in] (after quantization,
// its dequantized weights).
func (c *Calibrator) SetLinear(name string, w []float32) error {
	l, ok := c.blk.lin[name]
	if !ok {
		return fmt.Errorf("the calibrator's block has no layer %s", name)
	}
	if len(w) != l.in*l.out {
		return fmt.Errorf("%s: %d weights, want %d×%d", name, len(w), l.out, l.in)
	}
	return c.timed("upload", func() error { return Upload(c.x, l.w, toF16(w)) })
}

func (c *Calibrator) freeBlock() {
	for _, b := range c.blk.norms.bufs() {
		c.x.Free(b)
	}
	for _, l := range c.blk.lin {
		c.x.Free(l.w)
		c.x.Free(l.w32)
		c.x.Free(l.b)
	}
	c.blk = calibBlock{}
}

// The steps of a block over one chunk of rows starting at row r0.

func (c *Calibrator) linear(name string, A, C Buf, rows int) error {
	l := c.blk.lin[name]
	if err := c.x.GemmNT(A, l.w, C, rows, l.out, l.in, false); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	if !l.b.Nil() {
		return c.x.AddBias(C, l.b, rows, l.out)
	}
	return nil
}

func (c *Calibrator) xrows(r0 int) Buf { return c.X.Offset(r0 * c.cfg.Hidden * 4) }

// attnNorm: h = RMSNorm(X rows)·attn_norm.
func (c *Calibrator) attnNorm(r0, rows int) error {
	return c.x.RMSNorm(c.xrows(r0), Buf{}, Buf{}, Buf{}, c.blk.norms.attn, c.h, rows, c.cfg.Hidden, float32(c.cfg.RMSNormEps))
}

// attention: from h, the attention output (before o_proj) into attAll's rows.
func (c *Calibrator) attention(r0, rows int) error { return c.attentionTo(c.attRows(r0), rows) }

// attentionTo: from h, the attention output of a chunk's rows into out.
func (c *Calibrator) attentionTo(out Buf, rows int) error {
	cfg, x := c.cfg, c.x
	hd := cfg.HeadDim
	flash := CausalHeadDims(hd) // the chunk is whole windows: the flash kernel, no cache
	steps := []func() error{
		func() error { return c.linear("self_attn.q_proj", c.h, c.q, rows) },
		func() error { return c.linear("self_attn.k_proj", c.h, c.k, rows) },
		func() error { return c.linear("self_attn.v_proj", c.h, c.v, rows) },
		func() error {
			return x.QKRoPEStore(c.q, c.k, c.v, Buf{}, c.blk.norms.q, c.blk.norms.k, float32(cfg.RMSNormEps), c.meta, c.cos, c.sin,
				0, 1, rows, cfg.Heads, cfg.KVHeads, hd, !flash)
		},
	}
	if flash {
		if rows%c.T != 0 {
			return fmt.Errorf("attention over %d rows: not whole windows of %d", rows, c.T)
		}
		steps = append(steps, func() error {
			return x.AttentionCausal(c.q, c.k, c.v, out, rows/c.T, c.T, cfg.Heads, cfg.KVHeads, hd, c.blk.attn)
		})
	} else {
		steps = append(steps, func() error {
			return x.Attention(c.q, out, c.attnWS, c.meta, 0, 1, rows, cfg.Heads, cfg.KVHeads, hd, c.T, c.blk.attn)
		})
	}
	for _, f := range steps {
		if err := f(); err != nil {
			return err
		}
	}
	return nil
}

func (c *Calibrator) attRows(r0 int) Buf {
	return c.attAll.Offset(r0 * c.cfg.Heads * c.cfg.HeadDim * 2)
}

// mlpNorm: xs += o_proj(att rows); h = RMSNorm(xs)·mlp_norm.
func (c *Calibrator) mlpNorm(xs Buf, r0, rows int) error {
	if err := c.linear("self_attn.o_proj", c.attRows(r0), c.delta, rows); err != nil {
		return err
	}
	return c.x.RMSNorm(xs, c.delta, Buf{}, Buf{}, c.blk.norms.mlp, c.h, rows, c.cfg.Hidden, float32(c.cfg.RMSNormEps))
}

// mlpAct: g = SiLU(gate_proj(h))·up_proj(h).
func (c *Calibrator) mlpAct(rows int) error {
	if err := c.linear("mlp.gate_proj", c.h, c.g, rows); err != nil {
		return err
	}
	if err := c.linear("mlp.up_proj", c.h, c.u, rows); err != nil {
		return err
	}
	return c.x.GatedAct(c.g, c.u, rows*c.cfg.Intermediate, c.cfg.Act)
}

// addDown: xs += down_proj(g).
func (c *Calibrator) addDown(xs Buf, rows int) error {
	if err := c.linear("mlp.down_proj", c.g, c.delta, rows); err != nil {
		return err
	}
	return c.x.Add(xs, c.delta, rows*c.cfg.Hidden)
}

// each runs f on every chunk of rows.
func (c *Calibrator) each(ctx context.Context, f func(r0, rows int) error) error {
	return c.eachOf(ctx, c.N*c.T, f)
}

func (c *Calibrator) add(h *Hessian, A Buf, rows int) error {
	if h == nil {
		return nil
	}
	h.Rows += rows
	return c.x.HessianAdd(A, h.Sum, rows, h.In)
}

// Stats holds the Hessians a pass accumulates: of q/k/v's input, o's,
// gate/up's and down's (nil ones are skipped).
type Stats struct{ QKV, O, Up, Down *Hessian }

// Statistics takes all four inputs' Hessians from the block as it is, in
// one pass, leaving X unchanged.
func (c *Calibrator) Statistics(ctx context.Context, s Stats) error {
	return c.timed("statistics", func() error {
		return c.each(ctx, func(r0, rows int) error {
			for _, f := range []func() error{
				func() error { return c.attnNorm(r0, rows) },
				func() error { return c.add(s.QKV, c.h, rows) },
				func() error { return c.attention(r0, rows) },
				func() error { return c.add(s.O, c.attRows(r0), rows) },
				func() error { return c.x.Copy(c.xtmp, c.xrows(r0), rows*c.cfg.Hidden*4) },
				func() error { return c.mlpNorm(c.xtmp, r0, rows) },
				func() error { return c.add(s.Up, c.h, rows) },
				func() error { return c.mlpAct(rows) },
				func() error { return c.add(s.Down, c.g, rows) },
			} {
				if err := f(); err != nil {
					return err
				}
			}
			return nil
		})
	})
}

// Propagate runs the block on X: X becomes the next block's input.
func (c *Calibrator) Propagate(ctx context.Context) error {
	return c.timed("forward", func() error {
		return c.each(ctx, func(r0, rows int) error {
			for _, f := range []func() error{
				func() error { return c.attnNorm(r0, rows) },
				func() error { return c.attention(r0, rows) },
				func() error { return c.mlpNorm(c.xrows(r0), r0, rows) },
				func() error { return c.mlpAct(rows) },
				func() error { return c.addDown(c.xrows(r0), rows) },
			} {
				if err := f(); err != nil {
					return err
				}
			}
			return nil
		})
	})
}

// The true-sequential stages, in order: each input's Hessian is taken
// with the layers before it already quantized (SetLinear), and X advances
// through the block as they go: after AttentionOutput and MLPInput X holds
// the attention residual, after Outputs the block's output.

// AttentionInput accumulates the Hessian of q/k/v's input.
func (c *Calibrator) AttentionInput(ctx context.Context, h *Hessian) error {
	return c.timed("statistics", func() error {
		return c.each(ctx, func(r0, rows int) error {
			if err := c.attnNorm(r0, rows); err != nil {
				return err
			}
			return c.add(h, c.h, rows)
		})
	})
}

// AttentionOutput runs attention (with the current q/k/v) and accumulates
// the Hessian of o's input; the output is kept for MLPInput.
func (c *Calibrator) AttentionOutput(ctx context.Context, h *Hessian) error {
	return c.timed("statistics", func() error {
		return c.each(ctx, func(r0, rows int) error {
			if err := c.attnNorm(r0, rows); err != nil {
				return err
			}
			if err := c.attention(r0, rows); err != nil {
				return err
			}
			return c.add(h, c.attRows(r0), rows)
		})
	})
}

// MLPInput adds o_proj of the kept attention output to X and accumulates
// the Hessian of gate/up's input.
func (c *Calibrator) MLPInput(ctx context.Context, h *Hessian) error {
	return c.timed("statistics", func() error {
		return c.each(ctx, func(r0, rows int) error {
			if err := c.mlpNorm(c.xrows(r0), r0, rows); err != nil {
				return err
			}
			return c.add(h, c.h, rows)
		})
	})
}

// mlpIn: h = RMSNorm(X rows)·mlp_norm (X holding the attention residual).
func (c *Calibrator) mlpIn(r0, rows int) error {
	return c.x.RMSNorm(c.xrows(r0), Buf{}, Buf{}, Buf{}, c.blk.norms.mlp, c.h, rows, c.cfg.Hidden, float32(c.cfg.RMSNormEps))
}

// MLPAct accumulates the Hessian of down's input.
func (c *Calibrator) MLPAct(ctx context.Context, h *Hessian) error {
	return c.timed("statistics", func() error {
		return c.each(ctx, func(r0, rows int) error {
			if err := c.mlpIn(r0, rows); err != nil {
				return err
			}
			if err := c.mlpAct(rows); err != nil {
				return err
			}
			return c.add(h, c.g, rows)
		})
	})
}

// Outputs adds the MLP's output to X: X becomes the next block's input.
func (c *Calibrator) Outputs(ctx context.Context) error {
	return c.timed("forward", func() error {
		return c.each(ctx, func(r0, rows int) error {
			if err := c.mlpIn(r0, rows); err != nil {
				return err
			}
			if err := c.mlpAct(rows); err != nil {
				return err
			}
			return c.addDown(c.xrows(r0), rows)
		})
	})
}

// Hessian is Σ x·xᵀ over the rows of one layer input, fp32 on the GPU.
type Hessian struct {
	In, Rows int
	Sum      Buf
}

// NewHessian starts an empty Hessian of in inputs.
func (c *Calibrator) NewHessian(in int) (*Hessian, error) {
	b, err := c.x.Alloc(in * in * 4)
	if err == nil {
		err = c.x.Memset(b, 0, b.Bytes)
	}
	if err != nil {
		return nil, fmt.Errorf("a %d×%d Hessian: %w", in, in, err)
	}
	return &Hessian{In: in, Sum: b}, nil
}

// Free releases h's GPU memory.
func (c *Calibrator) Free(h *Hessian) {
	if h == c.factored {
		c.factored = nil
	}
	if h != nil {
		c.x.Free(h.Sum)
		h.Sum = Buf{}
	}
}

// Diag returns diag(H) with H = 2/n·Σ x·xᵀ, as gptq.Hessian.Matrix scales it.
func (c *Calibrator) Diag(h *Hessian) ([]float64, error) {
	d, err := c.x.Alloc(h.In * 4)
	if err != nil {
		return nil, err
	}
	defer c.x.Free(d)
	if err := c.x.HessianDiag(h.Sum, d, h.In); err != nil {
		return nil, err
	}
	f := make([]float32, h.In)
	if err := Download(c.x, f, d); err != nil {
		return nil, err
	}
	out := make([]float64, h.In)
	s := 2 / float64(max(h.Rows, 1))
	for i, v := range f {
		out[i] = s * float64(v)
	}
	return out, nil
}

// GPTQFactor computes U, the upper Cholesky factor of (Hp + λI)⁻¹ with Hp
// = H in the column order perm (H = 2/n·Σ x·xᵀ, zero diagonal entries
// taken as 1), and keeps it for GPTQ; ok is false when Hp + λI is not
// positive definite.
func (c *Calibrator) GPTQFactor(h *Hessian, perm []int, lambda float64) (ok bool, err error) {
	n := h.In
	err = c.timed("factor", func() error {
		if c.hinvN != n {
			c.x.Free(c.hinv)
			c.x.Free(c.factor)
			c.hinvN, c.factorN = 0, 0
			if c.hinv, err = c.x.Alloc(n * n * 4); err != nil {
				return err
			}
			if c.factor, err = c.x.Alloc(c.x.Lib().FactorWorkspaceBytes(n)); err != nil {
				return err
			}
			c.hinvN, c.factorN = n, n
		}
		p := make([]int32, n)
		for i, v := range perm {
			p[i] = int32(v)
		}
		pb, err := AllocFrom(c.x, p)
		if err != nil {
			return err
		}
		defer c.x.Free(pb)
		c.factored = nil
		ok, err = c.x.GPTQFactor(h.Sum, 2/float64(max(h.Rows, 1)), pb, lambda, c.hinv, c.factor, n)
		if ok && err == nil {
			c.factored = h
		}
		return err
	})
	return ok, err
}

// GPTQ runs GPTQ's column updates with h's factor (the last GPTQFactor) on W
// [out][in] in its column order (as gptq.NewLayout arranges it): groupOf
// is each position's group; scale and zero [G][out] are read (fit false)
// or fitted at each group's first column and written back (fit true; on
// the weights as the 128-column block began when fromStart). It
// returns the codes [out][in] in column order and the GPTQ loss.
func (c *Calibrator) GPTQ(h *Hessian, W []float32, out, in int, groupOf []int32, scale []float32, zero []uint8, g pack.Grid, fit, fromStart bool) (q []uint8, loss float64, err error) {
	if h == nil || h != c.factored || in != h.In {
		return nil, 0, fmt.Errorf("GPTQ on %d inputs: the Hessian is not the one last factored", in)
	}
	if g.FP8 || g.MinMax {
		return nil, 0, fmt.Errorf("GPTQ on the GPU takes integer min-max grids (not FP8 or AWQ's)")
	}
	var bufs []Buf
	defer func() {
		for _, b := range bufs {
			c.x.Free(b)
		}
	}()
	// keep records a buffer for the deferred Free.
	keep := func(b Buf, err error) (Buf, error) {
		if err == nil {
			bufs = append(bufs, b)
		}
		return b, err
	}
	q = make([]uint8, out*in)
	losses := make([]float64, out)
	err = c.timed("solve", func() error {
		// W, the scales and zeros (read unless fitted) and the groups go
		// up; the codes, the block errors and the losses are only written
		// by the kernels, so they are allocated, not uploaded.
		var dW, dQ, dS, dZ, dG, dE, dL Buf
		var err error
		for _, f := range []func() error{
			func() error { dW, err = keep(AllocFrom(c.x, W)); return err },
			func() error { dS, err = keep(AllocFrom(c.x, scale)); return err },
			func() error { dZ, err = keep(AllocFrom(c.x, zero)); return err },
			func() error { dG, err = keep(AllocFrom(c.x, groupOf)); return err },
			func() error { dQ, err = keep(c.x.Alloc(out * in)); return err },
			func() error { dE, err = keep(c.x.Alloc(out * 128 * 4)); return err },
			func() error { dL, err = keep(c.x.Alloc(out * 8)); return err },
			func() error {
				return c.x.GPTQQuantize(dW, c.hinv, dQ, dS, dZ, dG, dE, dL, out, in, g.Group(in), g.Bits, g.Sym, fit, fromStart)
			},
			func() error { return Download(c.x, q, dQ) },
			func() error { return Download(c.x, scale, dS) },
			func() error { return Download(c.x, zero, dZ) },
			func() error { return Download(c.x, losses, dL) },
		} {
			if err := f(); err != nil {
				return err
			}
		}
		return nil
	})
	for _, v := range losses {
		loss += v
	}
	return q, loss, err
}

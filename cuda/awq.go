//go:build cgo

package cuda

import (
	"context"
	"fmt"

	"github.com/llmq/llmq/pack"
)

// AWQ's searches on the GPU (package awq has the algorithm and the CPU
// version; the quantize driver runs this one). For the block SetBlock
// uploaded, AWQCollect runs the block once over the first windows of X
// and keeps what the searches read: each linear input's x̄ (mean |x| per
// channel), the outputs the searches compare against (o_proj's and the
// MLP's) and down_proj's input, and, for the clip search, the Gram
// matrix Σ x·xᵀ of every stride-th row of each input. A scale candidate
// is then tried by writing its quantized weights over a layer's fp16
// weights (AWQQuantize), measuring the inspected output's error
// (AWQLoss) and restoring them (Restore); AWQClip searches one layer's
// clipping thresholds.

// searchKinds are the Busy names of each input's candidate losses, so
// that the report says which search the time went to.
var searchKinds = [4]string{"search q,k,v", "search o", "search gate,up", "search down"}

// AWQFeatures is what AWQCollect keeps on the GPU for one block.
type AWQFeatures struct {
	Windows int          // the windows collected: the first ones of X
	Mean    [4][]float64 // x̄ of each input over the windows' rows
	Gram    [4]*Hessian  // Σ x·xᵀ over every stride-th row (nil without the clip search)

	orgA, orgM, act Buf // fp16 rows: o_proj's output, the MLP's output, down's input
}

// inDims are the widths of the four inputs.
func (c *Calibrator) inDims() [4]int {
	cfg := c.cfg
	return [4]int{cfg.Hidden, cfg.Heads * cfg.HeadDim, cfg.Hidden, cfg.Intermediate}
}

// AWQCollect runs the block as SetBlock uploaded it over the first
// windows windows of X (leaving X unchanged) and keeps AWQ's features;
// with stride > 0 it also takes each input's Gram matrix over rows 0,
// stride, 2·stride, … of those windows (the rows package awq's clip
// search samples). FreeAWQ releases them.
func (c *Calibrator) AWQCollect(ctx context.Context, windows, stride int) (*AWQFeatures, error) {
	if windows <= 0 || windows > c.N {
		return nil, fmt.Errorf("AWQ features of %d windows: the calibrator holds %d", windows, c.N)
	}
	cfg, T := c.cfg, c.T
	H, I := cfg.Hidden, cfg.Intermediate
	dims := c.inDims()
	rows := windows * T
	f := &AWQFeatures{Windows: windows}
	ok := false
	defer func() {
		if !ok {
			c.FreeAWQ(f)
		}
	}()
	var err error
	if f.orgA, err = c.x.Alloc(rows * H * 2); err != nil {
		return nil, err
	}
	if f.orgM, err = c.x.Alloc(rows * H * 2); err != nil {
		return nil, err
	}
	if f.act, err = c.x.Alloc(rows * I * 2); err != nil {
		return nil, err
	}
	var parts [4]Buf
	defer func() {
		for _, p := range parts {
			c.x.Free(p)
		}
	}()
	for i, d := range dims {
		if parts[i], err = c.x.Alloc(ColSplits * d * 8); err != nil {
			return nil, err
		}
		if err := c.x.Memset(parts[i], 0, parts[i].Bytes); err != nil {
			return nil, err
		}
	}
	var sub Buf // a chunk's sampled rows of one input
	defer func() { c.x.Free(sub) }()
	if stride > 0 {
		for i, d := range dims {
			if f.Gram[i], err = c.NewHessian(d); err != nil {
				return nil, err
			}
		}
		if sub, err = c.x.Alloc((c.chunkW*T/stride + 1) * max(dims[0], dims[1], dims[2], dims[3]) * 2); err != nil {
			return nil, err
		}
	}
	// sample adds the rows of a chunk (starting at row r0) that the clip
	// search reads to input i's Gram matrix.
	sample := func(i int, A Buf, r0, n int) error {
		if stride <= 0 {
			return nil
		}
		first := (stride - r0%stride) % stride
		if first >= n {
			return nil
		}
		cnt := (n - first + stride - 1) / stride
		d := dims[i]
		if err := c.x.Copy2D(sub, d*2, A.Offset(first*d*2), stride*d*2, d*2, cnt); err != nil {
			return err
		}
		return c.add(f.Gram[i], sub, cnt)
	}
	// take accumulates input i's x̄ and Gram rows.
	take := func(i int, A Buf, r0, n int) error {
		if err := c.x.ColAbsSum(A, parts[i], n, dims[i]); err != nil {
			return err
		}
		return sample(i, A, r0, n)
	}
	err = c.timed("features", func() error {
		return c.eachOf(ctx, rows, func(r0, n int) error {
			act, orgA, orgM := f.act.Offset(r0*I*2), f.orgA.Offset(r0*H*2), f.orgM.Offset(r0*H*2)
			for _, step := range []func() error{
				func() error { return c.attnNorm(r0, n) },
				func() error { return take(InQKV, c.h, r0, n) },
				func() error { return c.attention(r0, n) },
				func() error { return take(InO, c.attRows(r0), r0, n) },
				func() error { return c.linear("self_attn.o_proj", c.attRows(r0), orgA, n) },
				func() error { return c.mlpInput(r0, n, orgA) },
				func() error { return take(InGateUp, c.h, r0, n) },
				func() error { return c.linear("mlp.gate_proj", c.h, act, n) },
				func() error { return c.linear("mlp.up_proj", c.h, c.u, n) },
				func() error { return c.x.GatedAct(act, c.u, n*I, c.cfg.Act) },
				func() error { return take(InDown, act, r0, n) },
				func() error { return c.linear("mlp.down_proj", act, orgM, n) },
			} {
				if err := step(); err != nil {
					return err
				}
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	for i, d := range dims {
		p := make([]float64, ColSplits*d)
		if err := Download(c.x, p, parts[i]); err != nil {
			return nil, err
		}
		m := make([]float64, d)
		for y := 0; y < ColSplits; y++ {
			for j := range m {
				m[j] += p[y*d+j]
			}
		}
		for j := range m {
			m[j] /= float64(rows)
		}
		f.Mean[i] = m
	}
	ok = true
	return f, nil
}

// eachOf runs fn on every chunk of the first rows rows of X.
func (c *Calibrator) eachOf(ctx context.Context, rows int, fn func(r0, n int) error) error {
	step := c.chunkW * c.T
	for r0 := 0; r0 < rows; r0 += step {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(r0, min(step, rows-r0)); err != nil {
			return err
		}
	}
	return nil
}

// mlpInput: h = RMSNorm(X rows + attn)·mlp_norm, leaving X unchanged (the
// residual goes through xtmp).
func (c *Calibrator) mlpInput(r0, n int, attn Buf) error {
	if err := c.x.Copy(c.xtmp, c.xrows(r0), n*c.cfg.Hidden*4); err != nil {
		return err
	}
	return c.x.RMSNorm(c.xtmp, attn, Buf{}, Buf{}, c.blk.norms.mlp, c.h, n, c.cfg.Hidden, float32(c.cfg.RMSNormEps))
}

// FreeAWQ releases what AWQCollect kept.
func (c *Calibrator) FreeAWQ(f *AWQFeatures) {
	if f == nil {
		return
	}
	for _, b := range []Buf{f.orgA, f.orgM, f.act} {
		c.x.Free(b)
	}
	for _, h := range f.Gram {
		c.Free(h)
	}
	*f = AWQFeatures{}
}

// AWQLoss is the mean squared error, over the rows of the features' first
// windows windows, of the output the search for input in inspects, computed with the block's
// current fp16 weights against the one AWQCollect kept: for q/k/v's input
// o_proj's output through attention, for o's o_proj's output, for
// gate/up's the MLP's output, for down's down_proj's output (the MSE of
// package awq's searches).
func (c *Calibrator) AWQLoss(ctx context.Context, f *AWQFeatures, in, windows int) (float64, error) {
	if windows <= 0 || windows > f.Windows {
		return 0, fmt.Errorf("AWQ loss on %d windows: the features hold %d", windows, f.Windows)
	}
	cfg := c.cfg
	H, I := cfg.Hidden, cfg.Intermediate
	if c.sqPart.Nil() {
		var err error
		if c.sqPart, err = c.x.Alloc(SqParts * 8); err != nil {
			return 0, err
		}
	}
	rows := windows * c.T
	err := c.timed(searchKinds[min(max(in, 0), 3)], func() error {
		if err := c.x.Memset(c.sqPart, 0, c.sqPart.Bytes); err != nil {
			return err
		}
		return c.eachOf(ctx, rows, func(r0, n int) error {
			orgA, orgM := f.orgA.Offset(r0*H*2), f.orgM.Offset(r0*H*2)
			var steps []func() error
			want := orgA
			switch in {
			case InQKV:
				steps = []func() error{
					func() error { return c.attnNorm(r0, n) },
					func() error { return c.attentionTo(c.att, n) },
					func() error { return c.linear("self_attn.o_proj", c.att, c.delta, n) },
				}
			case InO:
				steps = []func() error{func() error { return c.linear("self_attn.o_proj", c.attRows(r0), c.delta, n) }}
			case InGateUp:
				want = orgM
				steps = []func() error{
					func() error { return c.mlpInput(r0, n, orgA) },
					func() error { return c.mlpAct(n) },
					func() error { return c.linear("mlp.down_proj", c.g, c.delta, n) },
				}
			case InDown:
				want = orgM
				steps = []func() error{func() error { return c.linear("mlp.down_proj", f.act.Offset(r0*I*2), c.delta, n) }}
			default:
				return fmt.Errorf("AWQ input %d: want 0 to 3", in)
			}
			steps = append(steps, func() error { return c.x.SqDiffSum(c.delta, want, c.sqPart, n*H) })
			for _, step := range steps {
				if err := step(); err != nil {
					return err
				}
			}
			return nil
		})
	})
	if err != nil {
		return 0, err
	}
	p := make([]float64, SqParts)
	if err := Download(c.x, p, c.sqPart); err != nil {
		return 0, err
	}
	var sum float64
	for _, v := range p {
		sum += v
	}
	return sum / float64(rows*H), nil
}

// AWQAdvance makes X the block's output as SetBlock uploaded it (AWQ's
// rule: the next block reads the unquantized block's outputs): X += o's
// output + the MLP's, from the features when they cover every window.
// The layers' fp16 weights must be their SetBlock weights (Restore).
func (c *Calibrator) AWQAdvance(ctx context.Context, f *AWQFeatures) error {
	if f.Windows != c.N {
		return c.Propagate(ctx)
	}
	H := c.cfg.Hidden
	return c.timed("forward", func() error {
		return c.each(ctx, func(r0, n int) error {
			if err := c.x.Add(c.xrows(r0), f.orgA.Offset(r0*H*2), n*H); err != nil {
				return err
			}
			return c.x.Add(c.xrows(r0), f.orgM.Offset(r0*H*2), n*H)
		})
	})
}

// layer returns the named layer of the block SetBlock uploaded.
func (c *Calibrator) layer(name string) (*calibLinear, error) {
	l, ok := c.blk.lin[name]
	if !ok {
		return nil, fmt.Errorf("the calibrator's block has no layer %s", name)
	}
	return l, nil
}

// scales uploads AWQ scales s (nil: none) for a layer of in inputs; free
// the result with c.x.Free.
func (c *Calibrator) scales(s []float32, in int) (Buf, error) {
	if s == nil {
		return Buf{}, nil
	}
	if len(s) != in {
		return Buf{}, fmt.Errorf("%d AWQ scales for %d inputs", len(s), in)
	}
	return AllocFrom(c.x, s)
}

// AWQQuantize sets the named layers' fp16 weights to Q(W·diag(s))·diag(s)⁻¹
// on grid g, W their SetBlock weights (s nil: Q(W)): a scale candidate of
// a group of layers reading one input.
func (c *Calibrator) AWQQuantize(s []float32, g pack.Grid, names ...string) error {
	return c.timed("search", func() error {
		var sb Buf
		defer func() { c.x.Free(sb) }()
		for i, name := range names {
			l, err := c.layer(name)
			if err != nil {
				return err
			}
			if i == 0 {
				if sb, err = c.scales(s, l.in); err != nil {
					return err
				}
			}
			if err := c.x.AWQQuant(l.w32, sb, l.w, l.out, l.in, g); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
		return nil
	})
}

// Restore sets the named layers' fp16 weights back to their SetBlock weights.
func (c *Calibrator) Restore(names ...string) error {
	return c.timed("search", func() error {
		for _, name := range names {
			l, err := c.layer(name)
			if err != nil {
				return err
			}
			if err := c.x.F32ToF16(l.w32, l.w, l.in*l.out); err != nil {
				return err
			}
		}
		return nil
	})
}

// AWQClip runs AWQ's clip search on the named layer given its weights W
// [out][in] as they are to be quantized (the block's, with AWQ's scales
// folded in), whose input the folding divided by s (nil: not scaled). It
// returns the chosen threshold of each row and group, [out][in/group]:
// of max|w|·(1 − k/(2·nShrink)), k < nShrink, the one whose quantized
// weights best preserve the group's partial outputs on the sampled rows.
// W replaces the layer's SetBlock weights.
func (c *Calibrator) AWQClip(f *AWQFeatures, name string, W []float32, s []float32, in int, g pack.Grid, nShrink int) ([]float32, error) {
	l, err := c.layer(name)
	if err != nil {
		return nil, err
	}
	if in < 0 || in > 3 || f.Gram[in] == nil || f.Gram[in].In != l.in {
		return nil, fmt.Errorf("%s: no Gram matrix of its %d inputs (AWQCollect without a stride?)", name, l.in)
	}
	if len(W) != l.in*l.out {
		return nil, fmt.Errorf("%s: %d weights, want %d×%d", name, len(W), l.out, l.in)
	}
	G := l.in / g.Group(l.in)
	best := make([]float32, l.out*G)
	var bufs []Buf
	defer func() {
		for _, b := range bufs {
			c.x.Free(b)
		}
	}()
	err = c.timed("clip", func() error {
		if err := Upload(c.x, l.w32, W); err != nil {
			return err
		}
		sb, err := c.scales(s, l.in)
		if err != nil {
			return err
		}
		bufs = append(bufs, sb)
		var D, P, errs, bb Buf
		for _, a := range []struct {
			b     *Buf
			bytes int
		}{{&D, l.out * l.in * 4}, {&P, l.out * l.in * 4}, {&errs, l.out * G * 8}, {&bb, l.out * G * 4}} {
			if *a.b, err = c.x.Alloc(a.bytes); err != nil {
				return err
			}
			bufs = append(bufs, *a.b)
		}
		if err := c.x.AWQClip(l.w32, sb, f.Gram[in].Sum, D, P, errs, bb, l.out, l.in, g, nShrink); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		return Download(c.x, best, bb)
	})
	return best, err
}

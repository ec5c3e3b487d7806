package quantize

import (
	"context"
	"fmt"
	"math"

	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/mat"
)

// AWQ on the GPU: package awq's searches (awq.SearchBlock, awq.ClipBlock)
// with the calibration forward passes, the candidates' quantization and
// the error measurements on the device (cuda.Calibrator's AWQ methods);
// the choices are folded into the host's block by the CPU path's own
// code (awq.Apply, foldScales), and the layers are then rounded (AWQ) or
// handed to GPTQ on the GPU (AWQ+GPTQ) as on the CPU.

// gpuPrepare is Method.Prepare on the GPU path: AWQ's search for AWQ and
// AWQ+GPTQ (on the first 32 windows for the latter, as its Prepare), and
// nothing for GPTQ. After AWQ, X holds the unquantized block's outputs.
func (d *driver) gpuPrepare(ctx context.Context, bl *Block) error {
	switch m := d.m.(type) {
	case AWQ:
		return d.gpuAWQ(ctx, bl, m.Opt, 0, m.Opt.Clip, true, m.Record)
	case AWQGPTQ:
		return d.gpuAWQ(ctx, bl, m.Scales, 32, false, false, nil)
	}
	return nil
}

// calibrator returns the GPU calibrator, made on the first block: the
// calibration activations move to the GPU.
func (d *driver) calibrator() (*cuda.Calibrator, error) {
	if d.cal == nil {
		c, err := cuda.NewCalibrator(d.opt.GPU, d.ck.Config, d.X, d.opt.SeqLen)
		if err != nil {
			return nil, err
		}
		d.cal, d.X = c, nil
	}
	return d.cal, nil
}

// gpuAWQ searches block bl's AWQ scales on the GPU over the first windows
// calibration windows (0: all), folds them into the host's block, and
// with clip clamps the host's weights to the clip search's thresholds.
// With advance, X becomes the unquantized block's output. A non-nil
// record gets the block's input statistics (awq.MeanStats: no token
// outliers) with the search results, as AWQ.Record.
func (d *driver) gpuAWQ(ctx context.Context, bl *Block, opt awq.Options, windows int, clip, advance bool, record *[]awq.LinearStats) error {
	c, err := d.calibrator()
	if err != nil {
		return err
	}
	b := bl.Block
	if b.MoE != nil {
		return fmt.Errorf("AWQ on the GPU takes dense blocks; use --device cpu for mixtures of experts")
	}
	if err := c.SetBlock(b); err != nil {
		return err
	}
	if windows <= 0 || windows > c.Windows() {
		windows = c.Windows()
	}
	stride := 0
	if clip {
		stride = awq.ClipStride(windows * d.opt.SeqLen)
	}
	bl.Progress("features")
	f, err := c.AWQCollect(ctx, windows, stride)
	if err != nil {
		return err
	}
	defer c.FreeAWQ(f)

	searchWindows := opt.SearchWindows(windows, d.opt.SeqLen)
	bl.Progress("scales")
	dense := func(l llm.Linear) *llm.Dense { return l.(*llm.Dense) }
	q, k, v, o := dense(b.Q), dense(b.K), dense(b.V), dense(b.O)
	gate, up, down := dense(b.Gate), dense(b.Up), dense(b.Down)
	// search tries each candidate on the GPU: the group's layers are
	// quantized with it, the inspected output measured, the layers restored.
	search := func(what string, in int, names []string, ws []*llm.Dense) (awq.Choice, error) {
		var w [][]float32
		for _, l := range ws {
			w = append(w, l.W)
		}
		ch, err := awq.SearchScales(w, ws[0].In(), f.Mean[in], func(s []float32) (float64, error) {
			for _, name := range names {
				if err := c.AWQQuantize(name, s, opt.Grid); err != nil {
					return 0, err
				}
			}
			loss, err := c.AWQLoss(ctx, f, in, searchWindows)
			for _, name := range names {
				if rerr := c.Restore(name); err == nil {
					err = rerr
				}
			}
			return loss, err
		}, opt)
		if err != nil {
			return ch, fmt.Errorf("%s scales: %w", what, err)
		}
		return ch, nil
	}
	sc := &awq.Scales{}
	if sc.QKV, err = search("q/k/v", cuda.InQKV, qkvLayers, []*llm.Dense{q, k, v}); err != nil {
		return err
	}
	if v.Out() == o.In() && v.In() == o.Out() { // v_proj → o_proj without GQA, as awq.SearchBlock
		if sc.VO, err = search("v/o", cuda.InO, oLayers, []*llm.Dense{o}); err != nil {
			return err
		}
	}
	if sc.GateUp, err = search("gate/up", cuda.InGateUp, gateUpLayers, []*llm.Dense{gate, up}); err != nil {
		return err
	}
	if sc.Down, err = search("up/down", cuda.InDown, downLayers, []*llm.Dense{down}); err != nil {
		return err
	}
	if advance {
		bl.Progress("outputs")
		if err := c.AWQAdvance(ctx, f); err != nil {
			return err
		}
	}
	foldScales(bl, sc, nil, opt)
	var shrink [4]map[string]float64
	defer func() {
		if record == nil {
			return
		}
		var st []awq.LinearStats
		for i, name := range []string{"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"} {
			st = append(st, awq.MeanStats(bl.Prefix+name, f.Mean[i], windows*d.opt.SeqLen))
		}
		awq.AddSearchResults(st, sc, shrink)
		*record = append(*record, st...)
	}()
	if !clip {
		return nil
	}

	// The clip search of awq.ClipBlock: v, o, gate, up and down, each on
	// its input as the folding scaled it.
	bl.Progress("clip")
	nShrink := opt.NGrid / 2
	if nShrink <= 0 {
		nShrink = 10
	}
	for _, l := range []struct {
		name string
		d    *llm.Dense
		in   int
		s    []float32
	}{
		{"self_attn.v_proj", v, cuda.InQKV, sc.QKV.Scales},
		{"self_attn.o_proj", o, cuda.InO, sc.VO.Scales},
		{"mlp.gate_proj", gate, cuda.InGateUp, sc.GateUp.Scales},
		{"mlp.up_proj", up, cuda.InGateUp, sc.GateUp.Scales},
		{"mlp.down_proj", down, cuda.InDown, sc.Down.Scales},
	} {
		if err := ctx.Err(); err != nil {
			return err
		}
		best, err := c.AWQClip(f, l.name, l.d.W, l.s, l.in, opt.Grid, nShrink)
		if err != nil {
			return err
		}
		if shrink[l.in] == nil {
			shrink[l.in] = map[string]float64{}
		}
		shrink[l.in][l.name] = clampGroups(l.d.W, l.d.Out(), l.d.In(), opt.Grid.Group(l.d.In()), best)
	}
	return nil
}

// clampGroups clamps each row's groups of w [out][in] to ±their threshold
// (thr [out][in/group]), as awq.Clip does with the thresholds it chose,
// and returns the mean shrink (threshold / max|w|; 1 for a zero group).
func clampGroups(w []float32, out, in, group int, thr []float32) float64 {
	G := in / group
	rowShrink := make([]float64, out)
	mat.ParallelFor(out, 64, func(lo, hi int) {
		for o := lo; o < hi; o++ {
			for g := 0; g < G; g++ {
				m := thr[o*G+g]
				seg := w[o*in+g*group : o*in+(g+1)*group]
				var mx float32
				for i, v := range seg {
					mx = max(mx, float32(math.Abs(float64(v))))
					seg[i] = min(max(v, -m), m)
				}
				if mx > 0 {
					rowShrink[o] += float64(m / mx)
				} else {
					rowShrink[o]++
				}
			}
		}
	})
	var shrink float64
	for _, v := range rowShrink {
		shrink += v
	}
	return shrink / float64(out*G)
}

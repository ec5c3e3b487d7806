package quantize

import (
	"context"
	"fmt"

	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/llm"
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
	// search tries each candidate on the GPU: the group's layers are
	// quantized with it, the inspected output measured, the layers restored.
	search := func(what string, in int, names []string, ls ...llm.Linear) (awq.Choice, error) {
		var w [][]float32
		for _, l := range ls {
			w = append(w, l.(*llm.Dense).W)
		}
		ch, err := awq.SearchScales(w, ls[0].In(), f.Mean[in], func(s []float32) (float64, error) {
			if err := c.AWQQuantize(s, opt.Grid, names...); err != nil {
				return 0, err
			}
			loss, err := c.AWQLoss(ctx, f, in, searchWindows)
			if rerr := c.Restore(names...); err == nil {
				err = rerr
			}
			return loss, err
		}, opt)
		if err != nil {
			return ch, fmt.Errorf("%s scales: %w", what, err)
		}
		return ch, nil
	}
	sc := &awq.Scales{}
	if sc.QKV, err = search("q/k/v", cuda.InQKV, qkvLayers, b.Q, b.K, b.V); err != nil {
		return err
	}
	if b.V.Out() == b.O.In() && b.V.In() == b.O.Out() { // v_proj → o_proj without GQA, as awq.SearchBlock
		if sc.VO, err = search("v/o", cuda.InO, oLayers, b.O); err != nil {
			return err
		}
	}
	if sc.GateUp, err = search("gate/up", cuda.InGateUp, gateUpLayers, b.Gate, b.Up); err != nil {
		return err
	}
	if sc.Down, err = search("up/down", cuda.InDown, downLayers, b.Down); err != nil {
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
		if record != nil {
			st := awq.MeanBlockStats(bl.Prefix, f.Mean, windows*d.opt.SeqLen)
			awq.AddSearchResults(st, sc, shrink)
			*record = append(*record, st...)
		}
	}()
	if !clip {
		return nil
	}

	// The clip search of awq.ClipBlock, each layer on its input as the
	// folding scaled it.
	bl.Progress("clip")
	scales := sc.InputScales()
	for _, l := range awq.DenseClipLayers(b) {
		if err := ctx.Err(); err != nil {
			return err
		}
		thr, err := c.AWQClip(f, l.Name, l.L.W, scales[l.Input], l.Input, opt.Grid, opt.Shrinks())
		if err != nil {
			return err
		}
		if shrink[l.Input] == nil {
			shrink[l.Input] = map[string]float64{}
		}
		shrink[l.Input][l.Name] = awq.ClampGroups(l.L.W, l.L.Out(), l.L.In(), opt.Grid.Group(l.L.In()), thr)
	}
	return nil
}

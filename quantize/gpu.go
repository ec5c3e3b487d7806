package quantize

import (
	"context"
	"fmt"

	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// The GPU path (Options.GPU): the same pipeline, with the calibration
// activations resident on the GPU (cuda.Calibrator), each block's forward
// pass and Hessians computed there, and GPTQ's factorization and column
// updates run there; the host lays out each layer (column order, dead
// inputs, static groups: package gptq's own code) and packs the result.
// AWQ's searches run there too (gpuawq.go).

// RunsOnGPU says whether method m runs on the GPU path: every method but
// RTN, which reads no calibration data (with a GPU it rounds on the host).
func RunsOnGPU(m Method) bool {
	switch m.(type) {
	case GPTQ, AWQ, AWQGPTQ:
		return true
	}
	return false
}

// gpuStats is one layer input's Hessian on the GPU and, once factored,
// its column order.
type gpuStats struct {
	h    *cuda.Hessian
	prep *gptq.Prepared
}

// quantizeGPU is GPTQ.Quantize on the GPU.
func (m GPTQ) quantizeGPU(c *cuda.Calibrator, s *gpuStats, l Layer) (*pack.Linear, float64, error) {
	if s.prep == nil {
		diag, err := c.Diag(s.h)
		if err != nil {
			return nil, 0, err
		}
		p, mean := gptq.Order(diag, m.Opt.ActOrder)
		if p.Damp, err = gptq.Damp(mean, m.Opt, func(lambda float64) (bool, error) { return c.GPTQFactor(s.h, p.Perm, lambda) }); err != nil {
			return nil, 0, err
		}
		s.prep = p
	}
	opt := m.Opt
	opt.Grid = l.Grid
	lay, err := gptq.NewLayout(l.W, l.Out, l.In, s.prep, opt)
	if err != nil {
		return nil, 0, err
	}
	q, loss, err := c.GPTQ(s.h, lay.W, l.Out, l.In, lay.GroupOf, lay.Linear.Scale, lay.Linear.Zero, opt.Grid, lay.Fit, opt.GroupsFromBlockStart)
	if err != nil {
		return nil, 0, err
	}
	return lay.Finish(q), loss, nil
}

// gpuBlock quantizes a block whose Method has prepared it, on the GPU.
func (d *driver) gpuBlock(ctx context.Context, bl *Block) error {
	cfg := d.ck.Config
	c, err := d.calibrator()
	if err != nil {
		return err
	}
	var m GPTQ
	switch dm := d.m.(type) {
	case GPTQ:
		m = dm
	case AWQGPTQ:
		m = dm.GPTQ
	default:
		return fmt.Errorf("method %s has no GPU statistics", d.m.Name())
	}
	if err := c.SetBlock(bl.Block); err != nil {
		return err
	}
	linears := map[string]*llm.Dense{}
	for _, nl := range bl.Block.Linears() {
		linears[nl.Name] = (*nl.L).(*llm.Dense)
	}
	quantize := func(names []string, h *cuda.Hessian) error {
		defer c.Free(h)
		s := &gpuStats{h: h}
		for _, n := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			lin, err := d.layer(bl.tensors, bl.Prefix+n, linears[n], func(l Layer) (*pack.Linear, float64, error) { return m.quantizeGPU(c, s, l) })
			if err != nil {
				return err
			}
			if lin != nil {
				if err := c.SetLinear(n, lin.Dequantize()); err != nil {
					return err
				}
			}
		}
		return nil
	}
	ins := []int{cfg.Hidden, cfg.Heads * cfg.HeadDim, cfg.Hidden, cfg.Intermediate}
	groups := [][]string{qkvLayers, oLayers, gateUpLayers, downLayers}
	if d.opt.TrueSequential {
		stages := []struct {
			name string
			run  func(context.Context, *cuda.Hessian) error
		}{{"q,k,v", c.AttentionInput}, {"o", c.AttentionOutput}, {"gate,up", c.MLPInput}, {"down", c.MLPAct}}
		for i, st := range stages {
			bl.Progress(st.name)
			h, err := c.NewHessian(ins[i])
			if err != nil {
				return err
			}
			if err := st.run(ctx, h); err != nil {
				c.Free(h)
				return err
			}
			if err := quantize(groups[i], h); err != nil {
				return err
			}
		}
		bl.Progress("outputs")
		if err := c.Outputs(ctx); err != nil {
			return err
		}
	} else {
		var hs [4]*cuda.Hessian
		defer func() {
			for _, h := range hs {
				c.Free(h)
			}
		}()
		for i := range hs {
			var err error
			if hs[i], err = c.NewHessian(ins[i]); err != nil {
				return err
			}
		}
		bl.Progress("statistics")
		if err := c.Statistics(ctx, cuda.Stats{QKV: hs[0], O: hs[1], Up: hs[2], Down: hs[3]}); err != nil {
			return err
		}
		bl.Progress("quantize")
		for i, names := range groups {
			if err := quantize(names, hs[i]); err != nil {
				return err
			}
		}
		bl.Progress("outputs")
		if err := c.Propagate(ctx); err != nil {
			return err
		}
	}
	return d.writePart(bl.tensors)
}

package awq

import (
	"time"

	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/pack"
)

// Quantizer returns the per-block quantizer of --method awq: features from
// the unquantized block, scale search and folding, clip search, then
// round-to-nearest on AWQ's grid. The next block's input comes from the
// unquantized block, as in the reference. Input statistics of each block's
// q, o, gate and down layers are appended to stats when it is non-nil.
func Quantizer(opt Options, stats *[]LinearStats) gptq.BlockQuantizer {
	return func(bc *gptq.BlockContext) error {
		b, T := bc.Block, bc.SeqLen
		bc.Progress("features")
		f, err := Collect(bc.Ctx, bc.Stages, b, bc.X, T)
		if err != nil {
			return err
		}
		// Input statistics come from the unscaled features (Apply divides
		// them by the scales).
		var st []LinearStats
		if stats != nil {
			dims := [4]int{b.Q.In(), b.O.In(), b.Gate.In(), b.Down.In()}
			for i, name := range []string{"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"} {
				st = append(st, Stats(bc.Prefix+name, f.inputs()[i], dims[i]))
			}
		}
		sc, err := scaleBlock(bc, f, opt)
		if err != nil {
			return err
		}
		var shrink [4]map[string]float64
		if opt.Clip {
			bc.Progress("clip")
			shrink = ClipBlock(b, f, opt)
		}
		if stats != nil {
			for i, c := range []Choice{sc.QKV, sc.VO, sc.GateUp, sc.Down} {
				if c.Scales != nil {
					st[i].Alpha, st[i].AlphaLoss = &c.Alpha, c.Loss
				}
				st[i].ClipShrink = shrink[i]
			}
			*stats = append(*stats, st...)
		}
		bc.Progress("quantize")
		for _, nl := range b.Linears() {
			t0 := time.Now()
			d := dense(*nl.L)
			lin, err := pack.RTN(d.W, d.Out(), d.In(), opt.Grid)
			if err != nil {
				return err
			}
			if err := bc.Emit(nl.Name, nl.L, lin, 0, t0); err != nil {
				return err
			}
		}
		for w := range bc.X {
			bc.X[w] = f.Out[w]
		}
		return nil
	}
}

// Prepare returns the hook of --method awq+gptq: AWQ's scales (no clip) are
// searched on up to 32 calibration windows and folded into the block, then
// GPTQ quantizes the scaled weights.
func Prepare(opt Options) gptq.BlockQuantizer {
	return func(bc *gptq.BlockContext) error {
		bc.Progress("awq features")
		f, err := Collect(bc.Ctx, bc.Stages, bc.Block, bc.X[:min(32, len(bc.X))], bc.SeqLen)
		if err != nil {
			return err
		}
		_, err = scaleBlock(bc, f, opt)
		return err
	}
}

// scaleBlock searches and folds the block's scales and records the changed
// norms (and v bias) in the shard as F32.
func scaleBlock(bc *gptq.BlockContext, f *Features, opt Options) (*Scales, error) {
	b := bc.Block
	bc.Progress("scales")
	sc, err := SearchBlock(bc.Ctx, bc.Stages, b, f, opt)
	if err != nil {
		return nil, err
	}
	if n := Apply(b, sc, f); n > 0 && opt.Log != nil {
		opt.Log("%s: %d folded values clamped to the float16 range ±65504", bc.Prefix, n)
	}
	bc.SetFloat32("input_layernorm.weight", b.AttnNorm)
	bc.SetFloat32("post_attention_layernorm.weight", b.MLPNorm)
	if v := dense(b.V); v.B != nil && sc.VO.Scales != nil {
		bc.SetFloat32("self_attn.v_proj.bias", v.B)
	}
	return sc, nil
}

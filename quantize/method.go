package quantize

import (
	"context"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// A Method turns the linear layers of a decoder block into quantized ones.
// The driver calls it, for each block in turn:
//
//  1. Prepare, once, on the unquantized block and the calibration inputs
//     entering it (AWQ searches its scales and folds them in here);
//  2. NewStats for each distinct layer input, and Stats.Add with that
//     input's calibration rows (GPTQ's Hessian), in the order the driver
//     chooses (all at once, or true-sequential);
//  3. Quantize for each linear layer, with the statistics of its input.
//
// RTN, GPTQ, AWQ and AWQ+GPTQ are the Methods of this package.
type Method interface {
	// Name is the method as reports and the checkpoint's meta record it.
	Name() string
	// Grid is the quantization grid the layers are fitted to.
	Grid() pack.Grid
	// Calibrated says whether the method reads calibration activations.
	Calibrated() bool
	// Prepare may change the unquantized block (fold scales into norms
	// and weights, clip weights). It returns the block's outputs when the
	// next block is to read those (AWQ's rule), or nil: the driver then
	// runs the quantized block to compute them (GPTQ's rule).
	Prepare(b *Block) (next [][]float32, err error)
	// NewStats starts the statistics Quantize needs of an input with in
	// features, or returns nil when it needs none.
	NewStats(in int) Stats
	// Quantize quantizes one layer. s is the statistics of its input (nil
	// when NewStats returned nil); layers reading one input share it.
	Quantize(l Layer, s Stats) (lin *pack.Linear, loss float64, err error)
	// Describe records the method's settings in the checkpoint's
	// quantization_config.
	Describe(qc *pack.QuantConfig)
}

// Stats accumulate what a method needs to know of one layer input.
type Stats interface {
	// Add takes rows of the input, x [rows][in].
	Add(x []float32, rows int) error
}

// Layer is one linear layer handed to a Method: y = x·Wᵀ.
type Layer struct {
	Name    string    // checkpoint name, e.g. "model.layers.3.mlp.down_proj"
	W       []float32 // [Out][In]; Quantize must not modify it
	Out, In int
	// Grid is the layer's grid: the method's, or a mixed-precision plan's
	// for this layer (Options.Plan).
	Grid pack.Grid
}

// Block is the decoder block a Method prepares.
type Block struct {
	Ctx    context.Context
	Index  int
	Prefix string // "model.layers.N."
	Block  *llm.Block
	Stages *llm.Stages
	// X holds the calibration activations entering the block, [window]
	// [SeqLen·hidden] (nil for uncalibrated methods).
	X      [][]float32
	SeqLen int
	// Progress names the stage the block is in.
	Progress func(stage string)
	// Experts says how a sparse block's experts pick their calibration
	// rows (Options.MoECalib, MoEMinTokens).
	Experts llm.ExpertCalib
	// Rows, set by a Prepare that routed the calibration rows of a sparse
	// block, is reported unless the driver routes them again for its own
	// statistics.
	Rows    *llm.ExpertRows
	tensors map[string]checkpoint.Out
}

// SetFloat32 stores a changed tensor of the block (a norm weight AWQ has
// divided by its scales, a bias, a router whose columns it multiplied) in
// the output as F32, so that folded scales are kept exactly. name is
// relative to the block's prefix; shape defaults to v's length.
func (b *Block) SetFloat32(name string, v []float32, shape ...int) {
	if shape == nil {
		shape = []int{len(v)}
	}
	b.tensors[b.Prefix+name] = checkpoint.F32(v, shape...)
}

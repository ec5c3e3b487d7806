package pack

import (
	"fmt"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
)

// RTN quantizes w [out][in] to the nearest grid point, group by group: the
// round-to-nearest baseline every calibrated method is compared with.
func RTN(w []float32, out, in int, grid Grid) (*Linear, error) {
	if err := grid.Validate(in); err != nil {
		return nil, err
	}
	if err := CheckFinite(w); err != nil {
		return nil, err
	}
	group := grid.Group(in)
	G := in / group
	l := &Linear{In: in, Out: out, Grid: grid, Q: make([]uint8, out*in),
		Scale: make([]float32, G*out), Zero: make([]uint8, G*out), GIdx: SequentialGIdx(in, group)}
	mat.ParallelFor(out, 64, func(lo, hi int) {
		for o := lo; o < hi; o++ {
			for g := 0; g < G; g++ {
				seg := w[o*in+g*group : o*in+(g+1)*group]
				scale, zero := grid.Params(seg)
				for i, v := range seg {
					l.Q[o*in+g*group+i] = uint8(grid.Quantize(v, scale, zero))
				}
				// The codes come from the grid's scale; the layer holds it as
				// the checkpoint will (AWQ's grid does not round it itself).
				l.Scale[g*out+o], l.Zero[g*out+o] = RoundF16(scale), uint8(zero)
			}
		}
	})
	return l, nil
}

// CheckFinite reports the first NaN or ±Inf in x. (The largest finite
// float32, 3.4028235e38, is finite: a threshold below it would refuse it.)
func CheckFinite(x []float32) error {
	if i := checkpoint.NonFinite(x); i >= 0 {
		return fmt.Errorf("non-finite value %v at element %d", x[i], i)
	}
	return nil
}

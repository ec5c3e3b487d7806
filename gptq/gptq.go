// Package gptq implements GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022,
// "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
// Transformers"), following the IST-DASLab reference implementation.
//
// For a linear layer with weights W [out][in] and calibration inputs X,
// GPTQ minimises ‖W X − Ŵ X‖² over quantized Ŵ, one input column at a time.
// With the Hessian of that loss
//
//	H = 2/n · Σ x xᵀ        (n calibration tokens)
//
// quantizing column j to q_j leaves an error that the not-yet-quantized
// columns absorb optimally (Optimal Brain Surgeon):
//
//	err = (w_j − q_j) / [H⁻¹]_jj,    w_k −= err · [H⁻¹]_jk   for k > j.
//
// The reference implementation's tricks, all here:
//   - Hinv is the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU): row j of U
//     holds exactly the update coefficients after columns < j are gone;
//   - damping: H += damp·mean(diag H)·I (damp 0.01), retried ×10 when the
//     Cholesky factorization fails; dead inputs (H_jj = 0) get H_jj = 1, W_:j = 0;
//   - lazy batch updates: columns are processed in blocks of 128, and the
//     errors of a block update the rest of W in one matrix product;
//   - groups: a group's scale and zero are fitted when its first column is
//     reached, on the error-compensated weights (--static-groups fits all
//     groups up front on the original weights);
//   - act-order: columns in order of decreasing H_jj, recorded in g_idx.
//
// Rows (output channels) are independent given H, so they run in parallel.
package gptq

import (
	"fmt"
	"math"
	"sort"

	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
	gmat "gonum.org/v1/gonum/mat"
)

// Hessian accumulates H = 2/n Σ x xᵀ over the rows fed to a linear layer.
type Hessian struct {
	In  int
	n   int
	sum []float32 // Σ x xᵀ, [in][in]
}

// NewHessian starts an empty accumulator for in input features.
func NewHessian(in int) *Hessian { return &Hessian{In: in, sum: make([]float32, in*in)} }

// Add accumulates rows of inputs x [rows][in].
func (h *Hessian) Add(x []float32, rows int) error {
	if err := pack.CheckFinite(x[:rows*h.In]); err != nil {
		return fmt.Errorf("calibration activations: %w", err)
	}
	mat.Gemm(true, false, h.In, h.In, rows, 1, x, h.In, x, h.In, 1, h.sum, h.In)
	h.n += rows
	return nil
}

// Tokens is how many rows have been accumulated.
func (h *Hessian) Tokens() int { return h.n }

// Matrix returns H = 2/n Σ x xᵀ in float64.
func (h *Hessian) Matrix() []float64 {
	out := make([]float64, len(h.sum))
	s := 2 / float64(max(h.n, 1))
	for i, v := range h.sum {
		out[i] = s * float64(v)
	}
	return out
}

// Options configure GPTQ.
type Options struct {
	Grid         pack.Grid
	Damp         float64 // fraction of mean(diag H) added to the diagonal (0.01)
	BlockSize    int     // columns per lazy-update block (128)
	ActOrder     bool    // quantize columns by decreasing diag(H)
	StaticGroups bool    // fit every group's scale/zero before any update
	// GroupsFromBlockStart fits a group that starts inside a block on the
	// weights as they were when the block began (the reference's
	// find_params(W[:, j:j+group]) reads W, not the block's working copy
	// W1); otherwise on the weights already updated by the block's earlier
	// columns. The two differ for every group that does not start at a
	// block boundary (with blocks of 128: groups of 32 and 64, and e.g. the
	// second group of 192). Measured (WikiText-2 189×2048, calibration
	// 128×2048), updated fit (the default) vs block start:
	//	llama-tiny, CPU (evals/quality.sh gptq-wB-gG[-bs]):
	//	  w4 g32 258.964 vs 259.007, w4 g64 257.583 vs 259.251,
	//	  w3 g32 265.708 vs 272.379, w3 g64 265.414 vs 271.350;
	//	llama-small, GPU (cuda/device-model.sh quant; evals/results/
	//	quantize-gpu-llama-small-h200.txt):
	//	  w4 g32 130.995 vs 129.242, w4 g64 129.026 vs 129.755,
	//	  w3 g32 134.230 vs 135.272, w3 g64 137.787 vs 138.694.
	// The updated fit wins 7 of the 8 (by up to 2.5%; it loses w4 g32 on
	// llama-small by 1.4%), so it stays the default.
	GroupsFromBlockStart bool
	// Log, if set, receives notes such as increased damping.
	Log func(format string, args ...any)
}

// Prepared is the per-Hessian part of GPTQ: the column order and the
// damped inverse Cholesky factor. Layers that share inputs (q, k and v
// projections) share one.
type Prepared struct {
	In   int
	Perm []int     // column order (identity without act-order)
	Dead []bool    // inputs never active in calibration
	Hinv []float32 // upper Cholesky factor of (H + damp·I)⁻¹ in Perm order, [in][in]
	Damp float64   // damping actually used
}

// Prepare handles dead inputs, act-order and damping, and factors H.
func Prepare(H []float64, in int, opt Options) (*Prepared, error) {
	if len(H) != in*in {
		return nil, fmt.Errorf("Hessian has %d entries, want %d×%d", len(H), in, in)
	}
	diag := make([]float64, in)
	for i := range diag {
		diag[i] = H[i*in+i]
	}
	p, mean := Order(diag, opt.ActOrder)
	hp := gmat.NewSymDense(in, nil)
	for i := 0; i < in; i++ {
		for j := i; j < in; j++ {
			v := H[p.Perm[i]*in+p.Perm[j]]
			if i == j && p.Dead[p.Perm[i]] {
				v = 1
			}
			hp.SetSym(i, j, v)
		}
	}
	var err error
	p.Damp, err = Damp(mean, opt, func(lambda float64) (bool, error) {
		U, ok := inverseCholesky(hp, lambda)
		p.Hinv = U
		return ok, nil
	})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Order starts a Prepared from diag(H): dead inputs (H_jj = 0, taken as
// 1 from here on) and the column order (decreasing H_jj with act-order,
// else the identity). It returns the mean of the diagonal, the unit of
// damping.
func Order(diag []float64, actOrder bool) (p *Prepared, mean float64) {
	in := len(diag)
	p = &Prepared{In: in, Perm: make([]int, in), Dead: make([]bool, in)}
	d := append([]float64(nil), diag...)
	for i := range d {
		if d[i] == 0 {
			p.Dead[i] = true
			d[i] = 1
		}
		mean += d[i]
		p.Perm[i] = i
	}
	mean /= float64(max(in, 1))
	if actOrder {
		sort.SliceStable(p.Perm, func(a, b int) bool { return d[p.Perm[a]] > d[p.Perm[b]] })
	}
	return p, mean
}

// Damp runs factor(λ) with λ = damp·mean (damp from opt, 0.01 by default),
// and again with damp ×10 each time the factorization fails, up to four
// tries; it returns the damp that worked.
func Damp(mean float64, opt Options, factor func(lambda float64) (bool, error)) (float64, error) {
	damp := opt.Damp
	if damp <= 0 {
		damp = 0.01
	}
	for try := 0; ; try++ {
		ok, err := factor(damp * mean)
		if err != nil {
			return 0, err
		}
		if ok {
			return damp, nil
		}
		if try == 3 {
			return 0, fmt.Errorf("Hessian is not positive definite even with damping %g·mean(diag H): the calibration inputs are degenerate", damp)
		}
		if opt.Log != nil {
			opt.Log("Cholesky failed with damp %g; retrying with %g", damp, damp*10)
		}
		damp *= 10
	}
}

// inverseCholesky returns the upper factor U of (H + λI)⁻¹ = UᵀU as float32.
func inverseCholesky(h *gmat.SymDense, lambda float64) ([]float32, bool) {
	n := h.SymmetricDim()
	d := gmat.NewSymDense(n, nil)
	d.CopySym(h)
	for i := 0; i < n; i++ {
		d.SetSym(i, i, d.At(i, i)+lambda)
	}
	var c gmat.Cholesky
	if !c.Factorize(d) {
		return nil, false
	}
	var inv gmat.SymDense
	if err := c.InverseTo(&inv); err != nil {
		return nil, false
	}
	var c2 gmat.Cholesky
	if !c2.Factorize(&inv) {
		return nil, false
	}
	var u gmat.TriDense
	c2.UTo(&u)
	out := make([]float32, n*n)
	for i := 0; i < n; i++ {
		for j := i; j < n; j++ {
			v := u.At(i, j)
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return nil, false
			}
			out[i*n+j] = float32(v)
		}
	}
	return out, true
}

// Result is a quantized layer and its GPTQ loss Σ (w − q)² / (2·[H⁻¹]_jj²).
type Result struct {
	Linear *pack.Linear
	Loss   float64
}

// Layout is a layer arranged for GPTQ's column loop: W in the Hessian's
// column order with dead columns zeroed, the Linear to fill (its scales
// and zeros set already unless Fit), and the group of each position.
type Layout struct {
	W       []float32 // [out][in], Perm order
	Linear  *pack.Linear
	GroupOf []int32 // group of the column at each position of Perm order
	// Fit says that each group's scale and zero are fitted when the loop
	// reaches its first column (not static groups, and groups are on).
	Fit  bool
	perm []int
}

// NewLayout checks w [out][in] against p and lays it out. Without groups
// the single group is fitted first, on the original weights, as the
// reference does; with static groups every group is.
func NewLayout(w []float32, out, in int, p *Prepared, opt Options) (*Layout, error) {
	grid := opt.Grid
	if err := grid.Validate(in); err != nil {
		return nil, err
	}
	if p.In != in || len(w) != out*in {
		return nil, fmt.Errorf("weights %d×%d do not match the Hessian's %d inputs", out, len(w)/max(out, 1), p.In)
	}
	if err := pack.CheckFinite(w); err != nil {
		return nil, fmt.Errorf("weights: %w", err)
	}
	group := grid.Group(in)
	G := in / group
	perGroup := opt.Grid.GroupSize > 0
	W := make([]float32, out*in)
	l := &pack.Linear{In: in, Out: out, Grid: grid, Q: make([]uint8, out*in),
		Scale: make([]float32, G*out), Zero: make([]uint8, G*out), GIdx: make([]int32, in)}
	mat.ParallelFor(out, 8, func(lo, hi int) {
		seg := make([]float32, group)
		for o := lo; o < hi; o++ {
			if !perGroup {
				s, z := grid.Params(w[o*in : (o+1)*in])
				l.Scale[o], l.Zero[o] = s, uint8(z)
			}
			for j, src := range p.Perm {
				if !p.Dead[src] {
					W[o*in+j] = w[o*in+src]
				}
			}
			if !perGroup || !opt.StaticGroups {
				continue
			}
			for g := 0; g < G; g++ {
				for i := range seg {
					seg[i] = 0
					if src := g*group + i; !p.Dead[src] {
						seg[i] = w[o*in+src]
					}
				}
				s, z := grid.Params(seg)
				l.Scale[g*out+o], l.Zero[g*out+o] = s, uint8(z)
			}
		}
	})
	lay := &Layout{W: W, Linear: l, GroupOf: make([]int32, in), Fit: perGroup && !opt.StaticGroups, perm: p.Perm}
	for j, src := range p.Perm {
		switch {
		case !perGroup:
			lay.GroupOf[j] = 0
		case opt.StaticGroups:
			lay.GroupOf[j] = int32(src / group)
		default:
			lay.GroupOf[j] = int32(j / group)
		}
		l.GIdx[src] = lay.GroupOf[j]
	}
	return lay, nil
}

// Finish stores the codes q [out][in], found in Perm order, in the
// Linear's input order and returns it.
func (lay *Layout) Finish(q []uint8) *pack.Linear {
	l := lay.Linear
	in := l.In
	mat.ParallelFor(l.Out, 8, func(lo, hi int) {
		for o := lo; o < hi; o++ {
			for j, src := range lay.perm {
				l.Q[o*in+src] = q[o*in+j]
			}
		}
	})
	return l
}

// Quantize runs GPTQ on w [out][in] (not modified) with a prepared Hessian.
func Quantize(w []float32, out, in int, p *Prepared, opt Options) (*Result, error) {
	lay, err := NewLayout(w, out, in, p, opt)
	if err != nil {
		return nil, err
	}
	grid, l, W := opt.Grid, lay.Linear, lay.W
	bs := opt.BlockSize
	if bs <= 0 {
		bs = 128
	}
	group := grid.Group(in)
	perGroup := opt.Grid.GroupSize > 0
	groupOf := lay.GroupOf

	// The blocked column update of the reference's fasterquant: for each
	// block of bs columns [i1, i2), quantize its columns one by one, each
	// column's error Err1 spreading over the block's later columns with the
	// row Hinv1[j] of the inverse Cholesky factor; then the block's errors
	// update all later columns at once: W[:, i2:] −= Err1 · Hinv[i1:i2, i2:].
	Q := make([]uint8, out*in) // in Perm order
	Err1 := make([]float32, out*bs)
	losses := make([]float64, out)
	Hinv := p.Hinv
	for i1 := 0; i1 < in; i1 += bs {
		i2 := min(i1+bs, in)
		nb := i2 - i1
		mat.ParallelFor(out, 8, func(lo, hi int) {
			var start, seg []float32 // the block as it began; a group's weights
			if opt.GroupsFromBlockStart {
				start, seg = make([]float32, nb), make([]float32, group)
			}
			for o := lo; o < hi; o++ {
				W1 := W[o*in : (o+1)*in] // this row; the block is W1[i1:i2]
				copy(start, W1[i1:i2])
				for j := i1; j < i2; j++ {
					g := int(groupOf[j])
					if perGroup && !opt.StaticGroups && j%group == 0 {
						fit := W1[j : j+group]
						if start != nil && j > i1 {
							n := copy(seg, start[j-i1:])
							if j+group > i2 { // the group runs past the block
								copy(seg[n:], W1[i2:j+group])
							}
							fit = seg
						}
						s, z := grid.Params(fit)
						l.Scale[g*out+o], l.Zero[g*out+o] = s, uint8(z)
					}
					scale, zero := l.Scale[g*out+o], int(l.Zero[g*out+o])
					q := grid.Quantize(W1[j], scale, zero)
					Q[o*in+j] = uint8(q)
					d := Hinv[j*in+j]
					diff := W1[j] - pack.Dequantize(q, scale, zero)
					losses[o] += float64(diff) * float64(diff) / (2 * float64(d) * float64(d))
					err1 := diff / d
					Err1[o*bs+j-i1] = err1
					hrow := Hinv[j*in : j*in+i2]
					for k := j + 1; k < i2; k++ {
						W1[k] -= err1 * hrow[k]
					}
				}
			}
		})
		if i2 < in {
			mat.Gemm(false, false, out, in-i2, nb, -1, Err1, bs, Hinv[i1*in+i2:], in, 1, W[i2:], in)
		}
	}
	var loss float64
	for _, v := range losses {
		loss += v
	}
	return &Result{Linear: lay.Finish(Q), Loss: loss}, nil
}

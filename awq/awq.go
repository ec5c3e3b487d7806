// Package awq implements activation-aware weight quantization (Lin et al.
// 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
// Acceleration"), following the llm-awq reference code (auto_scale and
// auto_clip).
//
// A few input channels carry much larger activations than the rest, and
// the weights that multiply them matter most. AWQ protects them without
// mixed precision: for a group of linear layers sharing an input x, it
// scales weight columns up by s and the input down by 1/s,
//
//	y = W x = (W·diag(s)) (diag(s)⁻¹ x),
//
// so that quantizing W·diag(s) loses less on the salient channels. The
// division by s is folded exactly into whatever produces x (the previous
// RMSNorm's weight, or the previous linear layer's rows), so the network is
// unchanged before quantization. The scales are searched per group:
//
//	s = x̄^α / sqrt(max(x̄^α)·min(x̄^α)),   x̄ = mean over tokens of |x| per channel,
//
// for α on a 20-point grid in [0, 1), choosing the α whose quantized module
// output Q(W·diag(s))·diag(s)⁻¹ x is closest (MSE) to the original output.
// The "duo" variant uses x̄^α / w̄^(1−α) with w̄ the mean normalised |w|.
// Groups for the Llama family: input_layernorm → [q, k, v] (inspecting the
// whole attention output), v_proj → o_proj (only without GQA, when their
// shapes match), post_attention_layernorm → [gate, up] (inspecting the MLP
// output), up_proj → down_proj.
//
// Then clipping: per output channel and group, the weight range is shrunk
// to max|w|·(1 − i/20), i = 0 … 9, keeping the shrink whose quantized
// partial outputs on every (tokens/512)-th calibration token are closest;
// q and k are skipped.
//
// The searches make the same choices as llm-awq: evals/torchref/awq.py, an
// independent PyTorch version run on a GPU, reproduces the reference
// perplexities and agrees with this package's α in every group. That
// needs the reference's arithmetic where choices are near ties: the grid
// (pack.Grid with MinMax) computes its scale as PyTorch does on the GPU,
// and candidates are scored with float32 scales, not float16.
package awq

import (
	"fmt"
	"math"
	"sort"

	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
)

// Options configure the search.
type Options struct {
	Grid  pack.Grid // AWQ's grid: 4-bit, group 128, MinMax
	NGrid int       // α grid points (20)
	Duo   bool      // s = x̄^α / w̄^(1−α) (AutoAWQ's duo scaling)
	Clip  bool      // run the clip search
	// SearchTokens caps the calibration tokens each scale candidate's
	// loss is measured on (the first windows holding that many; 0: all).
	// x̄, the clip search and the next block's inputs still read every
	// window. The reference code calibrates on 128 × 512 tokens in all.
	SearchTokens int
	Log          func(format string, args ...any)
}

// Shrinks is how many max|w| shrinks the clip search tries: NGrid/2, or
// 10 when that is 0.
func (o Options) Shrinks() int {
	if n := o.NGrid / 2; n > 0 {
		return n
	}
	return 10
}

// SearchWindows is how many of n windows of T tokens the candidates'
// losses read.
func (o Options) SearchWindows(n, T int) int {
	if o.SearchTokens <= 0 || T <= 0 {
		return n
	}
	return min(n, max(1, (o.SearchTokens+T-1)/T))
}

// FakeQuant returns the grid's quantize-dequantize of w [out][in].
func FakeQuant(w []float32, out, in int, g pack.Grid) []float32 {
	group := g.Group(in)
	q := make([]float32, len(w))
	mat.ParallelFor(out, 16, func(lo, hi int) {
		for o := lo; o < hi; o++ {
			for s := 0; s < in; s += group {
				seg := w[o*in+s : o*in+s+group]
				scale, zero := g.Params(seg)
				for i, v := range seg {
					q[o*in+s+i] = pack.Dequantize(g.Quantize(v, scale, zero), scale, zero)
				}
			}
		}
	})
	return q
}

// ChannelMean is x̄: the mean over rows of |x| per channel, x [rows][d].
func ChannelMean(xs [][]float32, d int) []float64 {
	m := make([]float64, d)
	n := 0
	for _, x := range xs {
		for r := 0; r+d <= len(x); r += d {
			for c, v := range x[r : r+d] {
				m[c] += math.Abs(float64(v))
			}
			n++
		}
	}
	for c := range m {
		m[c] /= float64(max(n, 1))
	}
	return m
}

// weightMean is w̄ for the duo form: per input channel, the mean over
// output rows of |w| normalised by its group's max |w|.
func weightMean(ws [][]float32, in, group int) []float64 {
	m := make([]float64, in)
	rows := 0
	for _, w := range ws {
		out := len(w) / in
		for o := 0; o < out; o++ {
			for s := 0; s < in; s += group {
				seg := w[o*in+s : o*in+s+group]
				var mx float64
				for _, v := range seg {
					mx = math.Max(mx, math.Abs(float64(v)))
				}
				if mx == 0 {
					mx = 1
				}
				for i, v := range seg {
					m[s+i] += math.Abs(float64(v)) / mx
				}
			}
		}
		rows += out
	}
	for i := range m {
		m[i] /= float64(rows)
	}
	return m
}

// candidate builds the α candidate's scales, normalised by sqrt(max·min).
func candidate(xmean, wmean []float64, alpha float64) []float32 {
	s := make([]float64, len(xmean))
	lo, hi := math.Inf(1), 0.0
	for i, x := range xmean {
		v := math.Pow(x, alpha)
		if wmean != nil {
			v /= math.Pow(math.Max(wmean[i], 1e-4), 1-alpha)
		}
		v = math.Max(v, 1e-4)
		s[i] = v
		lo, hi = math.Min(lo, v), math.Max(hi, v)
	}
	norm := math.Sqrt(lo * hi)
	out := make([]float32, len(s))
	for i, v := range s {
		out[i] = float32(v / norm)
	}
	return out
}

// ScaledQuant returns Q(W·diag(s))·diag(s)⁻¹, the weights a candidate
// scale leaves after quantization, expressed on the unscaled input.
func ScaledQuant(w []float32, out, in int, s []float32, g pack.Grid) []float32 {
	ws := make([]float32, len(w))
	for o := 0; o < out; o++ {
		for i := 0; i < in; i++ {
			ws[o*in+i] = w[o*in+i] * s[i]
		}
	}
	q := FakeQuant(ws, out, in, g)
	for o := 0; o < out; o++ {
		for i := 0; i < in; i++ {
			q[o*in+i] /= s[i]
		}
	}
	return q
}

// Choice is the outcome of one group's scale search.
type Choice struct {
	Scales []float32 // per input channel; nil when the group does not apply
	Alpha  float64   // the chosen exponent
	Loss   []float64 // the inspected module's output MSE for each α on the grid
}

// Search finds the best scales for a group of linear layers (weights ws,
// all with in inputs). eval(qw) returns the squared error of the inspected
// module's output when the group's weights are replaced by qw (same order
// as ws).
func Search(ws [][]float32, in int, xmean []float64, eval func(qw [][]float32) (float64, error), opt Options) (Choice, error) {
	return SearchScales(ws, in, xmean, func(s []float32) (float64, error) {
		qw := make([][]float32, len(ws))
		for i, w := range ws {
			qw[i] = ScaledQuant(w, len(w)/in, in, s, opt.Grid)
		}
		return eval(qw)
	}, opt)
}

// SearchScales is Search with the quantization left to eval: eval(s)
// returns the inspected module's error when the group's weights W are
// replaced by Q(W·diag(s))·diag(s)⁻¹ (the GPU path quantizes on the
// device). ws are read only for the duo form's w̄.
func SearchScales(ws [][]float32, in int, xmean []float64, eval func(s []float32) (float64, error), opt Options) (Choice, error) {
	var wmean []float64
	if opt.Duo {
		wmean = weightMean(ws, in, opt.Grid.Group(in))
	}
	n := opt.NGrid
	if n <= 0 {
		n = 20
	}
	var c Choice
	bestErr := math.Inf(1)
	for r := 0; r < n; r++ {
		alpha := float64(r) / float64(n)
		s := candidate(xmean, wmean, alpha)
		e, err := eval(s)
		if err != nil {
			return Choice{}, err
		}
		c.Loss = append(c.Loss, e)
		if e < bestErr {
			c.Scales, c.Alpha, bestErr = s, alpha, e
		}
	}
	if c.Scales == nil {
		return Choice{}, fmt.Errorf("scale search found no finite error (non-finite activations?)")
	}
	return c, nil
}

// ScaleColumns multiplies the input columns of w [out][in] by s.
func ScaleColumns(w []float32, in int, s []float32) {
	for r := 0; r < len(w)/in; r++ {
		for i := 0; i < in; i++ {
			w[r*in+i] *= s[i]
		}
	}
}

// fp16Max is the largest finite float16: folded weights beyond it would
// overflow a checkpoint or a GPU runtime in half precision.
const fp16Max = 65504

// DivideRows divides w's output rows (and bias) by s: the fold into a
// previous linear layer. It clamps results to ±65504 and reports how many.
func DivideRows(w, b []float32, in int, s []float32) int {
	clamped := 0
	for r := range s {
		for i := 0; i < in; i++ {
			w[r*in+i] = clampF16(w[r*in+i]/s[r], &clamped)
		}
		if b != nil {
			b[r] = clampF16(b[r]/s[r], &clamped)
		}
	}
	return clamped
}

// DivideVector divides a norm weight by s (the fold into RMSNorm).
func DivideVector(v, s []float32) int {
	clamped := 0
	for i := range v {
		v[i] = clampF16(v[i]/s[i], &clamped)
	}
	return clamped
}

func clampF16(v float32, n *int) float32 {
	if v > fp16Max || v < -fp16Max {
		*n++
		return float32(math.Copysign(fp16Max, float64(v)))
	}
	return v
}

// ClipRows is about how many calibration rows the clip search reads.
const ClipRows = 512

// ClipStride is the clip search's row sampling for total rows: every
// ClipStride-th row, the first included.
func ClipStride(total int) int { return max(1, total/ClipRows) }

// Clip searches, per output channel and group, the max |w| shrink that
// best preserves the group's partial outputs on the input rows x
// [rows][in] subsampled with a stride of rows/512, as the reference does,
// and clamps w in place. For each group the partial outputs of all output
// channels are one matrix product, so each candidate shrink costs a GEMM.
// It returns the mean chosen shrink factor.
func Clip(w []float32, out, in int, xs [][]float32, opt Options) float64 {
	group := opt.Grid.Group(in)
	total := 0
	for _, x := range xs {
		total += len(x) / in
	}
	stride := ClipStride(total)
	var rows [][]float32
	idx := 0
	for _, x := range xs {
		for r := 0; r+in <= len(x); r += in {
			if idx%stride == 0 {
				rows = append(rows, x[r:r+in])
			}
			idx++
		}
	}
	R := len(rows)
	nShrink := opt.Shrinks()
	xg := make([]float32, R*group)     // this group's inputs [R][group]
	wg := make([]float32, out*group)   // this group's weights [out][group]
	cand := make([]float32, out*group) // clipped, fake-quantized candidate
	org := make([]float32, R*out)
	cur := make([]float32, R*out)
	bestErr := make([]float64, out)
	bestMax := make([]float32, out)
	mx := make([]float32, out)
	thr := make([]float32, out*(in/group)) // the chosen max |w| of each row and group
	for g := 0; g < in/group; g++ {
		for t, x := range rows {
			copy(xg[t*group:], x[g*group:(g+1)*group])
		}
		for o := 0; o < out; o++ {
			copy(wg[o*group:], w[o*in+g*group:o*in+(g+1)*group])
			mx[o] = 0
			for _, v := range wg[o*group : (o+1)*group] {
				mx[o] = max(mx[o], float32(math.Abs(float64(v))))
			}
			bestErr[o], bestMax[o] = math.Inf(1), mx[o]
		}
		mat.MatMulT(org, xg, wg, R, group, out)
		for k := 0; k < nShrink; k++ {
			f := 1 - float32(k)/float32(2*nShrink)
			mat.ParallelFor(out, 16, func(lo, hi int) {
				for o := lo; o < hi; o++ {
					m := mx[o] * f
					c := cand[o*group : (o+1)*group]
					for i, v := range wg[o*group : (o+1)*group] {
						c[i] = min(max(v, -m), m)
					}
					scale, zero := opt.Grid.Params(c)
					for i, v := range c {
						c[i] = pack.Dequantize(opt.Grid.Quantize(v, scale, zero), scale, zero)
					}
				}
			})
			mat.MatMulT(cur, xg, cand, R, group, out)
			for o := 0; o < out; o++ {
				var e float64
				for t := 0; t < R; t++ {
					d := float64(cur[t*out+o]) - float64(org[t*out+o])
					e += d * d
				}
				if e < bestErr[o] {
					bestErr[o], bestMax[o] = e, mx[o]*f
				}
			}
		}
		for o := 0; o < out; o++ {
			thr[o*(in/group)+g] = bestMax[o]
		}
	}
	return ClampGroups(w, out, in, group, thr)
}

// ClampGroups clamps each row's groups of w [out][in] to ±their threshold
// (thr [out][in/group], the clip search's choices) and returns the mean
// shrink: threshold / max|w| before clamping, 1 for an all-zero group.
func ClampGroups(w []float32, out, in, group int, thr []float32) float64 {
	G := in / group
	shrink := make([]float64, out*G)
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
				shrink[o*G+g] = 1
				if mx > 0 {
					shrink[o*G+g] = float64(m / mx)
				}
			}
		}
	})
	var sum float64 // group by group, then row by row: the order the search went in
	for g := 0; g < G; g++ {
		for o := 0; o < out; o++ {
			sum += shrink[o*G+g]
		}
	}
	return sum / float64(out*G)
}

// MSE is the mean squared difference of two equally long vectors.
func MSE(a, b []float32) float64 {
	var s float64
	for i := range a {
		d := float64(a[i]) - float64(b[i])
		s += d * d
	}
	return s / float64(len(a))
}

// LinearStats describes the inputs of one linear layer: channel saliency
// (mean |x| per channel) percentiles and the tokens with the largest |x|.
type LinearStats struct {
	Layer            string         `json:"layer"`
	Channels         int            `json:"channels"`
	Tokens           int            `json:"tokens"`
	SaliencyP50      float64        `json:"saliency_p50"`
	SaliencyP90      float64        `json:"saliency_p90"`
	SaliencyP99      float64        `json:"saliency_p99"`
	SaliencyMax      float64        `json:"saliency_max"`
	TopChannels      []int          `json:"top_channels"`
	TopTokenOutliers []TokenOutlier `json:"top_token_outliers"`
	// Set for the first layer of each scaling group: the chosen exponent
	// and the output MSE of every α on the grid (how flat the search was).
	Alpha     *float64  `json:"alpha,omitempty"`
	AlphaLoss []float64 `json:"alpha_loss,omitempty"`
	// ClipShrink is, for each layer reading this input that was clipped,
	// the mean chosen max|w| shrink factor (1 = not clipped).
	ClipShrink map[string]float64 `json:"clip_shrink,omitempty"`
}

// TokenOutlier is a token whose largest |x| is among the biggest.
type TokenOutlier struct {
	Window  int     `json:"window"`
	Token   int     `json:"token"`
	Channel int     `json:"channel"`
	AbsMax  float64 `json:"abs_max"`
}

// Stats summarises a layer's calibration inputs xs ([window][T·d]).
func Stats(layer string, xs [][]float32, d int) LinearStats {
	st := MeanStats(layer, ChannelMean(xs, d), 0)
	var outs []TokenOutlier
	for w, x := range xs {
		for t := 0; (t+1)*d <= len(x); t++ {
			best, ch := 0.0, 0
			for c, v := range x[t*d : (t+1)*d] {
				if a := math.Abs(float64(v)); a > best {
					best, ch = a, c
				}
			}
			outs = append(outs, TokenOutlier{Window: w, Token: t, Channel: ch, AbsMax: best})
			st.Tokens++
		}
	}
	sort.Slice(outs, func(a, b int) bool { return outs[a].AbsMax > outs[b].AbsMax })
	st.TopTokenOutliers = outs[:min(8, len(outs))]
	return st
}

// MeanStats is the part of Stats that x̄ (xmean) gives: the saliency
// percentiles and the top channels, over tokens rows (the GPU path keeps
// no per-token inputs, so no token outliers).
func MeanStats(layer string, xmean []float64, tokens int) LinearStats {
	d := len(xmean)
	st := LinearStats{Layer: layer, Channels: d, Tokens: tokens}
	sorted := append([]float64(nil), xmean...)
	sort.Float64s(sorted)
	pct := func(p float64) float64 { return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))] }
	st.SaliencyP50, st.SaliencyP90, st.SaliencyP99, st.SaliencyMax = pct(0.5), pct(0.9), pct(0.99), sorted[len(sorted)-1]
	order := make([]int, d)
	for i := range order {
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool { return xmean[order[a]] > xmean[order[b]] })
	st.TopChannels = order[:min(8, d)]
	return st
}

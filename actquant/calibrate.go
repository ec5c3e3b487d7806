package actquant

import (
	"fmt"
	"math"
)

// Bins is the resolution of the |x| histogram the calibration methods
// read (TensorRT's 2048).
const Bins = 2048

// Observer collects what calibration needs of one layer input: the largest
// |x| overall and per channel (SmoothQuant's statistic), and a histogram
// of |x|. Its bins keep the width the first batch sets (its max / Bins) and
// more are added as larger values come, so no value is clipped; Histogram
// merges them back to at most Bins.
type Observer struct {
	Cols       int
	Amax       float32   // max |x|
	ChannelMax []float32 // max |x| of each input channel
	Count      int64     // values seen
	width      float64
	hist       []int64
}

// NewObserver starts an observer of an input with cols channels.
func NewObserver(cols int) *Observer {
	return &Observer{Cols: cols, ChannelMax: make([]float32, cols)}
}

// Add observes rows of x [rows][cols].
func (o *Observer) Add(x []float32, rows int) {
	n := rows * o.Cols
	var amax float32
	for i, v := range x[:n] {
		a := float32(math.Abs(float64(v)))
		amax = max(amax, a)
		c := i % o.Cols
		o.ChannelMax[c] = max(o.ChannelMax[c], a)
	}
	o.Amax = max(o.Amax, amax)
	if o.width == 0 {
		if amax == 0 {
			o.Count += int64(n)
			o.hist = append(o.hist[:0], o.Count) // all zeros so far: one bin
			return
		}
		o.width = float64(amax) / Bins
		if len(o.hist) == 0 {
			o.hist = make([]int64, 1)
		}
	}
	need := int(math.Floor(float64(o.Amax)/o.width)) + 1
	for len(o.hist) < need {
		o.hist = append(o.hist, 0)
	}
	for _, v := range x[:n] {
		b := int(math.Abs(float64(v)) / o.width)
		o.hist[min(b, len(o.hist)-1)]++
	}
	o.Count += int64(n)
}

// Histogram returns the counts of |x| in at most Bins equal bins from 0,
// and the bins' width.
func (o *Observer) Histogram() ([]int64, float64) {
	if o.width == 0 {
		return []int64{o.Count}, 0
	}
	k := (len(o.hist) + Bins - 1) / Bins
	out := make([]int64, (len(o.hist)+k-1)/k)
	for i, c := range o.hist {
		out[i/k] += c
	}
	return out, o.width * float64(k)
}

// Methods of choosing a static threshold.
const (
	MinMax     = "minmax"
	Percentile = "percentile"
	KL         = "kl"
)

// Threshold is the clipping threshold T a calibration method chooses for
// the observed input (the scale is T/MaxQ): MinMax the largest |x|;
// Percentile the pct-th percentile of |x| (the upper edge of its bin);
// KL the T minimising KL(P‖Q) between the histogram clipped at T (the
// outliers folded into the last bin) and that histogram quantized to the
// scheme's 2^(bits−1) levels (Migacz 2017: every candidate edge from bin
// 128 on for 8 bits; T is the upper edge of the last kept bin).
func (o *Observer) Threshold(method string, pct float64, s Scheme) (float32, error) {
	switch method {
	case MinMax:
		return o.Amax, nil
	case Percentile:
		if !(pct > 0 && pct <= 100) {
			return 0, fmt.Errorf("percentile %v: want a value in (0, 100]", pct)
		}
		hist, w := o.Histogram()
		want := pct / 100 * float64(o.Count)
		var cum int64
		for i, c := range hist {
			cum += c
			if float64(cum) >= want {
				return min(float32(float64(i+1)*w), o.Amax), nil
			}
		}
		return o.Amax, nil
	case KL:
		hist, w := o.Histogram()
		levels := 1 << (s.Bits - 1)
		if len(hist) <= levels {
			return o.Amax, nil
		}
		return min(float32(float64(klEdge(hist, levels))*w), o.Amax), nil
	}
	return 0, fmt.Errorf("calibration method %q: want %s, %s or %s", method, MinMax, Percentile, KL)
}

// klEdge returns the number of bins i (levels ≤ i ≤ len(hist)) whose
// clipped distribution P is closest to its quantization Q.
func klEdge(hist []int64, levels int) int {
	best, bestKL := len(hist), math.Inf(1)
	for i := levels; i <= len(hist); i++ {
		p := make([]float64, i)
		for j := 0; j < i; j++ {
			p[j] = float64(hist[j])
		}
		for _, c := range hist[i:] {
			p[i-1] += float64(c) // outliers clip to the threshold
		}
		// Q: the i bins merged into levels groups; each group's mass spread
		// evenly over the group's non-empty bins (empty bins stay empty).
		q := make([]float64, i)
		for g := 0; g < levels; g++ {
			lo, hi := g*i/levels, (g+1)*i/levels
			var mass float64
			nonzero := 0
			for j := lo; j < hi; j++ {
				mass += float64(hist[j])
				if hist[j] != 0 {
					nonzero++
				}
			}
			for j := lo; j < hi; j++ {
				if hist[j] != 0 {
					q[j] = mass / float64(nonzero)
				}
			}
		}
		if d := klDivergence(p, q); d < bestKL {
			best, bestKL = i, d
		}
	}
	return best
}

// klDivergence is KL(P‖Q) of two unnormalised histograms; bins where P is
// non-zero and Q is zero get a small floor, as TensorRT's smoothing does.
func klDivergence(p, q []float64) float64 {
	var sp, sq float64
	for i := range p {
		sp += p[i]
		sq += q[i]
	}
	if sp == 0 || sq == 0 {
		return math.Inf(1)
	}
	var d float64
	for i := range p {
		if p[i] == 0 {
			continue
		}
		pi := p[i] / sp
		qi := max(q[i]/sq, 1e-12)
		d += pi * math.Log(pi/qi)
	}
	return d
}

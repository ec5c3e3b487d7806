package awq

import (
	"context"
	"fmt"

	"github.com/llmq/llmq/llm"
)

// Features are the inputs of a block's linear layers on the calibration
// windows, computed with the unquantized block, and the block's outputs.
type Features struct {
	T    int
	N    [][]float32 // RMSNorm(x): input of q, k, v
	Att  [][]float32 // attention output: input of o
	M    [][]float32 // RMSNorm(h): input of gate, up
	Act  [][]float32 // SiLU(gate)·up: input of down
	Out  [][]float32 // the block's output
	orgA [][]float32 // o(att): what the q/k/v search inspects
	orgM [][]float32 // down(act): what the gate/up search inspects
}

// Collect runs the block on the calibration windows X ([w][T·hidden]).
func Collect(ctx context.Context, st *llm.Stages, b *llm.Block, X [][]float32, T int) (*Features, error) {
	f := &Features{T: T}
	for _, x := range X {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n := st.Norm(b.AttnNorm, x, T)
		att := st.Attention(b, n, T)
		oa := make([]float32, T*b.O.Out())
		b.O.Forward(oa, att, T)
		h := append([]float32(nil), x...)
		add(h, oa)
		m := st.Norm(b.MLPNorm, h, T)
		act := st.MLPAct(b, m, T)
		dm := make([]float32, T*b.Down.Out())
		b.Down.Forward(dm, act, T)
		out := append([]float32(nil), h...)
		add(out, dm)
		f.N, f.Att, f.M, f.Act, f.Out = append(f.N, n), append(f.Att, att), append(f.M, m), append(f.Act, act), append(f.Out, out)
		f.orgA, f.orgM = append(f.orgA, oa), append(f.orgM, dm)
	}
	return f, nil
}

func add(x, y []float32) {
	for i := range x {
		x[i] += y[i]
	}
}

// Scales are the search results of a block's four AWQ groups (VO's Scales
// are nil when the group does not apply).
type Scales struct {
	QKV, VO, GateUp, Down Choice
}

func dense(l llm.Linear) *llm.Dense { return l.(*llm.Dense) }

// SearchBlock searches the scales of the block's groups.
func SearchBlock(ctx context.Context, st *llm.Stages, b *llm.Block, f *Features, opt Options) (*Scales, error) {
	T := f.T
	sc := &Scales{}
	q, k, v, o := dense(b.Q), dense(b.K), dense(b.V), dense(b.O)
	gate, up, down := dense(b.Gate), dense(b.Up), dense(b.Down)
	var err error

	// input_layernorm → q, k, v, inspecting o(attention(·)).
	sc.QKV, err = Search([][]float32{q.W, k.W, v.W}, q.In(), ChannelMean(f.N, q.In()), func(qw [][]float32) (float64, error) {
		tb := *b
		tb.Q, tb.K, tb.V = llm.NewDense(qw[0], q.B, q.In(), q.Out()), llm.NewDense(qw[1], k.B, k.In(), k.Out()), llm.NewDense(qw[2], v.B, v.In(), v.Out())
		outs := make([][]float32, len(f.N))
		for w, n := range f.N {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			outs[w] = make([]float32, T*o.Out())
			o.Forward(outs[w], st.Attention(&tb, n, T), T)
		}
		return meanMSE(outs, f.orgA), nil
	}, opt)
	if err != nil {
		return nil, fmt.Errorf("q/k/v scales: %w", err)
	}

	// v_proj → o_proj, only when their weights have the same shape (no GQA).
	if v.Out() == o.In() && v.In() == o.Out() {
		sc.VO, err = searchLinear(o, f.Att, f.orgA, T, opt)
		if err != nil {
			return nil, fmt.Errorf("v/o scales: %w", err)
		}
	}

	// post_attention_layernorm → gate, up, inspecting the MLP output.
	sc.GateUp, err = Search([][]float32{gate.W, up.W}, gate.In(), ChannelMean(f.M, gate.In()), func(qw [][]float32) (float64, error) {
		tb := *b
		tb.Gate, tb.Up = llm.NewDense(qw[0], nil, gate.In(), gate.Out()), llm.NewDense(qw[1], nil, up.In(), up.Out())
		outs := make([][]float32, len(f.M))
		for w, m := range f.M {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			outs[w] = make([]float32, T*down.Out())
			down.Forward(outs[w], st.MLPAct(&tb, m, T), T)
		}
		return meanMSE(outs, f.orgM), nil
	}, opt)
	if err != nil {
		return nil, fmt.Errorf("gate/up scales: %w", err)
	}

	// up_proj → down_proj.
	sc.Down, err = searchLinear(down, f.Act, f.orgM, T, opt)
	if err != nil {
		return nil, fmt.Errorf("up/down scales: %w", err)
	}
	return sc, nil
}

// searchLinear searches the scales of one linear layer whose own output is
// inspected (v_proj → o_proj and up_proj → down_proj).
func searchLinear(l *llm.Dense, inputs, org [][]float32, T int, opt Options) (Choice, error) {
	return Search([][]float32{l.W}, l.In(), ChannelMean(inputs, l.In()), func(qw [][]float32) (float64, error) {
		ql := llm.NewDense(qw[0], nil, l.In(), l.Out())
		outs := make([][]float32, len(inputs))
		for w, a := range inputs {
			outs[w] = make([]float32, T*l.Out())
			ql.Forward(outs[w], a, T)
		}
		return meanMSE(outs, org), nil
	}, opt)
}

// meanMSE averages the per-window MSE.
func meanMSE(got, want [][]float32) float64 {
	var s float64
	for i := range got {
		s += MSE(got[i], want[i])
	}
	return s / float64(len(got))
}

// Apply folds the scales into the block: each group's weight columns are
// multiplied by s and whatever produces their input (a norm's weight or a
// linear's rows) divided by s, leaving the block's function unchanged. The
// cached features are divided too, for the clip search. It returns how
// many folded values were clamped to the float16 range.
func Apply(b *llm.Block, sc *Scales, f *Features) int {
	clamped := 0
	divide := func(xs [][]float32, s []float32) {
		if xs == nil {
			return
		}
		d := len(s)
		for _, x := range xs {
			for i := range x {
				x[i] /= s[i%d]
			}
		}
	}
	q, k, v, o := dense(b.Q), dense(b.K), dense(b.V), dense(b.O)
	gate, up, down := dense(b.Gate), dense(b.Up), dense(b.Down)
	if s := sc.QKV.Scales; s != nil {
		clamped += DivideVector(b.AttnNorm, s)
		for _, l := range []*llm.Dense{q, k, v} {
			ScaleColumns(l.W, l.In(), s)
		}
		if f != nil {
			divide(f.N, s)
		}
	}
	if s := sc.VO.Scales; s != nil {
		clamped += DivideRows(v.W, v.B, v.In(), s)
		ScaleColumns(o.W, o.In(), s)
		if f != nil {
			divide(f.Att, s)
		}
	}
	if s := sc.GateUp.Scales; s != nil {
		clamped += DivideVector(b.MLPNorm, s)
		ScaleColumns(gate.W, gate.In(), s)
		ScaleColumns(up.W, up.In(), s)
		if f != nil {
			divide(f.M, s)
		}
	}
	if s := sc.Down.Scales; s != nil {
		clamped += DivideRows(up.W, nil, up.In(), s)
		ScaleColumns(down.W, down.In(), s)
		if f != nil {
			divide(f.Act, s)
		}
	}
	return clamped
}

// inputs are the block's four linear inputs, in the order of the AWQ
// groups that scale them: q/k/v, o, gate/up, down.
func (f *Features) inputs() [4][][]float32 { return [4][][]float32{f.N, f.Att, f.M, f.Act} }

// ClipBlock runs the clip search on v, o, gate, up and down (q and k are
// skipped: their errors are amplified by the softmax in ways the
// per-channel output error does not see). It returns the mean shrink of
// each layer, by the input it reads (the order of Features.inputs).
func ClipBlock(b *llm.Block, f *Features, opt Options) [4]map[string]float64 {
	var out [4]map[string]float64
	in := f.inputs()
	for _, c := range []struct {
		name  string
		l     llm.Linear
		input int
	}{{"self_attn.v_proj", b.V, 0}, {"self_attn.o_proj", b.O, 1}, {"mlp.gate_proj", b.Gate, 2}, {"mlp.up_proj", b.Up, 2}, {"mlp.down_proj", b.Down, 3}} {
		d := dense(c.l)
		if out[c.input] == nil {
			out[c.input] = map[string]float64{}
		}
		out[c.input][c.name] = Clip(d.W, d.Out(), d.In(), in[c.input], opt)
	}
	return out
}

// VBias is the block's v_proj bias (nil without one): folding v→o scales
// divides it too.
func VBias(b *llm.Block) []float32 { return dense(b.V).B }

// BlockStats are the input statistics of the block's q, o, gate and down
// layers (the four inputs AWQ scales), from unscaled features.
func BlockStats(prefix string, b *llm.Block, f *Features) []LinearStats {
	dims := [4]int{b.Q.In(), b.O.In(), b.Gate.In(), b.Down.In()}
	var st []LinearStats
	for i, name := range []string{"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"} {
		st = append(st, Stats(prefix+name, f.inputs()[i], dims[i]))
	}
	return st
}

// AddSearchResults records in a block's statistics (BlockStats) the α each
// group chose with the loss of every α, and the clip shrinks of ClipBlock.
func AddSearchResults(st []LinearStats, sc *Scales, shrink [4]map[string]float64) {
	for i, c := range []Choice{sc.QKV, sc.VO, sc.GateUp, sc.Down} {
		if c.Scales != nil {
			st[i].Alpha, st[i].AlphaLoss = &c.Alpha, c.Loss
		}
		st[i].ClipShrink = shrink[i]
	}
}

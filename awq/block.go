package awq

import (
	"context"
	"fmt"
	"strings"

	"github.com/llmq/llmq/llm"
)

// Features are the inputs of a block's linear layers on the calibration
// windows, computed with the unquantized block, and the block's outputs.
// In a sparse block M is the input of the router and of every expert's
// gate and up, Act is nil, and each expert's rows of M (Rows) and their
// gated activations are taken when needed (ExpertIn): holding every
// expert's would cost the experts' count times a dense block's.
type Features struct {
	T    int
	N    [][]float32 // RMSNorm(x): input of q, k, v
	Att  [][]float32 // attention output: input of o
	M    [][]float32 // RMSNorm(h): input of gate, up
	Act  [][]float32 // SiLU(gate)·up: input of down (dense blocks)
	Out  [][]float32 // the block's output
	orgA [][]float32 // o(att): what the q/k/v search inspects
	orgM [][]float32 // the MLP's (the mixture's) output before any post-norm: what the gate/up search inspects
	// Rows says which rows of M calibrate each expert of a sparse block.
	Rows *llm.ExpertRows
}

// Collect runs the block on the calibration windows X ([w][T·hidden]).
// experts picks each expert's calibration rows in a sparse block.
func Collect(ctx context.Context, st *llm.Stages, b *llm.Block, X [][]float32, T int, experts llm.ExpertCalib) (*Features, error) {
	f := &Features{T: T}
	var routes []*llm.Routing
	for _, x := range X {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n := st.Norm(b.AttnNorm, x, T)
		att := st.Attention(b, n, T)
		oa := make([]float32, T*b.O.Out())
		b.O.Forward(oa, att, T)
		h := append([]float32(nil), x...)
		add(h, postNorm(st, b.PostAttnNorm, oa, T))
		m := st.Norm(b.MLPNorm, h, T)
		var act, dm []float32
		if b.MoE != nil {
			routes = append(routes, b.MoE.Route(m, T))
			dm = make([]float32, len(h))
			b.MoE.Forward(dm, m, T)
		} else {
			act = st.MLPAct(b, m, T)
			dm = make([]float32, T*b.Down.Out())
			b.Down.Forward(dm, act, T)
			f.Act = append(f.Act, act)
		}
		out := append([]float32(nil), h...)
		add(out, postNorm(st, b.PostMLPNorm, dm, T))
		f.N, f.Att, f.M, f.Out = append(f.N, n), append(f.Att, att), append(f.M, m), append(f.Out, out)
		f.orgA, f.orgM = append(f.orgA, oa), append(f.orgM, dm)
	}
	if b.MoE != nil {
		f.Rows = llm.NewExpertRows(routes, len(b.MoE.Experts), experts)
	}
	return f, nil
}

// postNorm is RMSNorm(y)·w, or y when the block has no such norm.
func postNorm(st *llm.Stages, w, y []float32, T int) []float32 {
	if w == nil {
		return y
	}
	return st.Norm(w, y, T)
}

// ExpertIn returns the rows of M that calibrate expert e, pooled over the
// windows, and how many there are.
func (f *Features) ExpertIn(e int) ([]float32, int) {
	var in []float32
	rows := 0
	for w, m := range f.M {
		r := f.Rows.Rows(e, w)
		if r == nil {
			rows += f.T
		} else {
			rows += len(r)
		}
		in = append(in, llm.Gather(m, r, len(m)/f.T)...)
	}
	return in, rows
}

// expertAct returns an expert's gated activation (its down_proj's input)
// on its calibration rows, with its weights as they are now.
func expertAct(st *llm.Stages, x llm.Expert, f *Features, e int) []float32 {
	in, rows := f.ExpertIn(e)
	return st.GatedAct(x.Gate, x.Up, in, rows)
}

func add(x, y []float32) {
	for i := range x {
		x[i] += y[i]
	}
}

// Scales are the search results of a block's four AWQ groups (VO's Scales
// are nil when the group does not apply). In a sparse block GateUp is one
// scale shared by every expert's gate and up (they and the router read
// one norm's output), and ExpertDown replaces Down: each expert's up_proj
// → down_proj.
type Scales struct {
	QKV, VO, GateUp, Down Choice
	ExpertDown            []Choice
}

func dense(l llm.Linear) *llm.Dense { return l.(*llm.Dense) }

// SearchBlock searches the scales of the block's groups.
func SearchBlock(ctx context.Context, st *llm.Stages, b *llm.Block, f *Features, opt Options) (*Scales, error) {
	T := f.T
	sc := &Scales{}
	// The candidates' losses read the first SearchWindows windows (x̄
	// reads them all).
	nw := opt.SearchWindows(len(f.N), T)
	N, Att, M, Act, orgA, orgM := f.N[:nw], f.Att[:nw], f.M[:nw], f.Act, f.orgA[:nw], f.orgM[:nw]
	if Act != nil {
		Act = Act[:nw]
	}
	q, k, v, o := dense(b.Q), dense(b.K), dense(b.V), dense(b.O)
	var err error

	// input_layernorm → q, k, v, inspecting o(attention(·)).
	sc.QKV, err = Search([][]float32{q.W, k.W, v.W}, q.In(), ChannelMean(f.N, q.In()), func(qw [][]float32) (float64, error) {
		tb := *b
		tb.Q, tb.K, tb.V = llm.NewDense(qw[0], q.B, q.In(), q.Out()), llm.NewDense(qw[1], k.B, k.In(), k.Out()), llm.NewDense(qw[2], v.B, v.In(), v.Out())
		outs := make([][]float32, len(N))
		for w, n := range N {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			outs[w] = make([]float32, T*o.Out())
			o.Forward(outs[w], st.Attention(&tb, n, T), T)
		}
		return meanMSE(outs, orgA), nil
	}, opt)
	if err != nil {
		return nil, fmt.Errorf("q/k/v scales: %w", err)
	}

	// v_proj → o_proj, only when their weights have the same shape (no GQA).
	if v.Out() == o.In() && v.In() == o.Out() {
		sc.VO, err = searchLinear(o, Att, orgA, opt)
		if err != nil {
			return nil, fmt.Errorf("v/o scales: %w", err)
		}
	}
	if b.MoE != nil {
		return sc, searchMixture(ctx, st, b, f, sc, opt, M, orgM)
	}
	gate, up, down := dense(b.Gate), dense(b.Up), dense(b.Down)

	// post_attention_layernorm → gate, up, inspecting the MLP output.
	sc.GateUp, err = Search([][]float32{gate.W, up.W}, gate.In(), ChannelMean(f.M, gate.In()), func(qw [][]float32) (float64, error) {
		tb := *b
		tb.Gate, tb.Up = llm.NewDense(qw[0], nil, gate.In(), gate.Out()), llm.NewDense(qw[1], nil, up.In(), up.Out())
		outs := make([][]float32, len(M))
		for w, m := range M {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			outs[w] = make([]float32, T*down.Out())
			down.Forward(outs[w], st.MLPAct(&tb, m, T), T)
		}
		return meanMSE(outs, orgM), nil
	}, opt)
	if err != nil {
		return nil, fmt.Errorf("gate/up scales: %w", err)
	}

	// up_proj → down_proj.
	sc.Down, err = searchLinear(down, Act, orgM, opt)
	if err != nil {
		return nil, fmt.Errorf("up/down scales: %w", err)
	}
	return sc, nil
}

// searchMixture searches a sparse block's MLP scales as AutoAWQ does for
// Mixtral and Qwen3-MoE: one scale for the norm → every expert's gate and
// up, inspecting the whole mixture's output with the real routing (the
// router, kept unquantized, reads the unscaled input during the search;
// Apply compensates it when the scale is folded), then each expert's
// up_proj → down_proj on its calibration rows (Features.Rows).
func searchMixture(ctx context.Context, st *llm.Stages, b *llm.Block, f *Features, sc *Scales, opt Options, M, orgM [][]float32) error {
	T, moe := f.T, b.MoE
	var ws [][]float32
	for _, x := range moe.Experts {
		ws = append(ws, dense(x.Gate).W, dense(x.Up).W)
	}
	H := moe.Router.In()
	var err error
	sc.GateUp, err = Search(ws, H, ChannelMean(f.M, H), func(qw [][]float32) (float64, error) {
		tm := *moe
		tm.Experts = append([]llm.Expert(nil), moe.Experts...)
		for e := range tm.Experts {
			g, u := tm.Experts[e].Gate, tm.Experts[e].Up
			tm.Experts[e].Gate = llm.NewDense(qw[2*e], nil, g.In(), g.Out())
			tm.Experts[e].Up = llm.NewDense(qw[2*e+1], nil, u.In(), u.Out())
		}
		outs := make([][]float32, len(M))
		for w, m := range M {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			outs[w] = make([]float32, T*H)
			tm.Forward(outs[w], m, T)
		}
		return meanMSE(outs, orgM), nil
	}, opt)
	if err != nil {
		return fmt.Errorf("experts' gate/up scales: %w", err)
	}
	sc.ExpertDown = make([]Choice, len(moe.Experts))
	for e, x := range moe.Experts {
		if err := ctx.Err(); err != nil {
			return err
		}
		act := expertAct(st, x, f, e)
		down := dense(x.Down)
		org := make([]float32, len(act)/down.In()*down.Out())
		down.Forward(org, act, len(act)/down.In())
		if sc.ExpertDown[e], err = searchLinear(down, [][]float32{act}, [][]float32{org}, opt); err != nil {
			return fmt.Errorf("expert %d up/down scales: %w", e, err)
		}
	}
	return nil
}

// searchLinear searches the scales of one linear layer whose own output is
// inspected (v_proj → o_proj and up_proj → down_proj).
func searchLinear(l *llm.Dense, inputs, org [][]float32, opt Options) (Choice, error) {
	return Search([][]float32{l.W}, l.In(), ChannelMean(inputs, l.In()), func(qw [][]float32) (float64, error) {
		ql := llm.NewDense(qw[0], nil, l.In(), l.Out())
		outs := make([][]float32, len(inputs))
		for w, a := range inputs {
			rows := len(a) / l.In()
			outs[w] = make([]float32, rows*l.Out())
			ql.Forward(outs[w], a, rows)
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
// linear's rows) divided by s, leaving the block's function unchanged. In
// a sparse block the router's columns are multiplied by the gate/up scale
// too: it reads the same norm, and stays unquantized. The cached features
// are divided too, for the clip search. It returns how many folded values
// were clamped to the float16 range.
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
		for _, l := range gateUps(b) {
			ScaleColumns(l.W, l.In(), s)
		}
		if b.MoE != nil {
			ScaleColumns(b.MoE.Router.W, b.MoE.Router.In(), s)
		}
		if f != nil {
			divide(f.M, s)
		}
	}
	if b.MoE != nil { // the experts' activations are computed when needed
		for e, c := range sc.ExpertDown {
			if s := c.Scales; s != nil {
				x := b.MoE.Experts[e]
				up, down := dense(x.Up), dense(x.Down)
				clamped += DivideRows(up.W, nil, up.In(), s)
				ScaleColumns(down.W, down.In(), s)
			}
		}
		return clamped
	}
	up, down := dense(b.Up), dense(b.Down)
	if s := sc.Down.Scales; s != nil {
		clamped += DivideRows(up.W, nil, up.In(), s)
		ScaleColumns(down.W, down.In(), s)
		if f != nil {
			divide(f.Act, s)
		}
	}
	return clamped
}

// gateUps are the layers reading the MLP's normed input: gate and up, or
// every expert's.
func gateUps(b *llm.Block) []*llm.Dense {
	if b.MoE == nil {
		return []*llm.Dense{dense(b.Gate), dense(b.Up)}
	}
	var ls []*llm.Dense
	for _, x := range b.MoE.Experts {
		ls = append(ls, dense(x.Gate), dense(x.Up))
	}
	return ls
}

// inputs are the block's four linear inputs, in the order of the AWQ
// groups that scale them: q/k/v, o, gate/up, down.
func (f *Features) inputs() [4][][]float32 { return [4][][]float32{f.N, f.Att, f.M, f.Act} }

// ClipBlock runs the clip search on v, o, gate, up and down (q and k are
// skipped: their errors are amplified by the softmax in ways the
// per-channel output error does not see), each expert's gate, up and down
// on the expert's calibration rows in a sparse block. It returns the mean
// shrink of each layer, by the input it reads (the order of
// Features.inputs: every expert's gate and up under the third, their
// downs under the fourth).
func ClipBlock(st *llm.Stages, b *llm.Block, f *Features, opt Options) [4]map[string]float64 {
	out := [4]map[string]float64{{}, {}, {}, {}}
	in := f.inputs()
	clip := func(name string, l llm.Linear, input int, xs [][]float32) {
		d := dense(l)
		out[input][name] = Clip(d.W, d.Out(), d.In(), xs, opt)
	}
	if b.MoE == nil {
		for _, l := range DenseClipLayers(b) {
			clip(l.Name, l.L, l.Input, in[l.Input])
		}
		return out
	}
	clip("self_attn.v_proj", b.V, 0, in[0])
	clip("self_attn.o_proj", b.O, 1, in[1])
	names := expertNames(b)
	for e, x := range b.MoE.Experts {
		act := expertAct(st, x, f, e) // before its gate and up are clipped, as the cached features of a dense block
		xin, _ := f.ExpertIn(e)
		clip(names[e][0], x.Gate, 2, [][]float32{xin})
		clip(names[e][1], x.Up, 2, [][]float32{xin})
		clip(names[e][2], x.Down, 3, [][]float32{act})
	}
	return out
}

// ClipLayer is a layer the clip search runs on (name relative to the
// block's prefix) and which of the four inputs it reads, in the order of
// the AWQ groups (q/k/v's, o's, gate/up's, down's).
type ClipLayer struct {
	Name  string
	L     *llm.Dense
	Input int
}

// DenseClipLayers are the layers of a dense block the clip search runs
// on, in order: v, o, gate, up, down.
func DenseClipLayers(b *llm.Block) []ClipLayer {
	return []ClipLayer{
		{"self_attn.v_proj", dense(b.V), 0},
		{"self_attn.o_proj", dense(b.O), 1},
		{"mlp.gate_proj", dense(b.Gate), 2},
		{"mlp.up_proj", dense(b.Up), 2},
		{"mlp.down_proj", dense(b.Down), 3},
	}
}

// InputScales are the scales each of the four inputs was divided by when
// the groups were folded (nil where a group did not apply): what a clip
// search on the unscaled inputs needs.
func (sc *Scales) InputScales() [4][]float32 {
	return [4][]float32{sc.QKV.Scales, sc.VO.Scales, sc.GateUp.Scales, sc.Down.Scales}
}

// expertNames are each expert's gate, up and down names (relative to the
// block's prefix).
func expertNames(b *llm.Block) [][3]string {
	ls := b.Linears()[4:] // after q, k, v, o: the experts' gate, up, down
	names := make([][3]string, len(ls)/3)
	for i, l := range ls {
		names[i/3][i%3] = l.Name
	}
	return names
}

// VBias is the block's v_proj bias (nil without one): folding v→o scales
// divides it too.
func VBias(b *llm.Block) []float32 { return dense(b.V).B }

// statLayers name the statistics of a dense block's four inputs: by the
// first layer reading each.
var statLayers = [4]string{"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"}

// MeanBlockStats are BlockStats of a dense block from x̄ of its four
// inputs over tokens rows (awq.MeanStats: no token outliers), as the GPU
// path keeps them.
func MeanBlockStats(prefix string, xmean [4][]float64, tokens int) []LinearStats {
	var ls []LinearStats
	for i, name := range statLayers {
		ls = append(ls, MeanStats(prefix+name, xmean[i], tokens))
	}
	return ls
}

// BlockStats are the input statistics of the block's q, o, gate and down
// layers (the four inputs AWQ scales), from unscaled features; in a
// sparse block, of q, o, the mixture's input (named after expert 0's
// gate: every expert's gate and up and the router read it) and each
// expert's down on its calibration rows.
func BlockStats(st *llm.Stages, prefix string, b *llm.Block, f *Features) []LinearStats {
	if b.MoE == nil {
		dims := [4]int{b.Q.In(), b.O.In(), b.Gate.In(), b.Down.In()}
		var ls []LinearStats
		for i, name := range statLayers {
			ls = append(ls, Stats(prefix+name, f.inputs()[i], dims[i]))
		}
		return ls
	}
	names := expertNames(b)
	ls := []LinearStats{Stats(prefix+"self_attn.q_proj", f.N, b.Q.In()), Stats(prefix+"self_attn.o_proj", f.Att, b.O.In()),
		Stats(prefix+names[0][0], f.M, b.MoE.Router.In())}
	for e, x := range b.MoE.Experts {
		ls = append(ls, Stats(prefix+names[e][2], [][]float32{expertAct(st, x, f, e)}, x.Down.In()))
	}
	return ls
}

// AddSearchResults records in a block's statistics (BlockStats) the α each
// group chose with the loss of every α, and the clip shrinks of ClipBlock.
func AddSearchResults(st []LinearStats, sc *Scales, shrink [4]map[string]float64) {
	choices := []Choice{sc.QKV, sc.VO, sc.GateUp, sc.Down}
	if sc.ExpertDown != nil {
		choices = append(choices[:3], sc.ExpertDown...)
	}
	for i, c := range choices {
		if c.Scales != nil {
			st[i].Alpha, st[i].AlphaLoss = &c.Alpha, c.Loss
		}
		switch {
		case i < 3 || sc.ExpertDown == nil:
			st[i].ClipShrink = shrink[i]
		case len(shrink[3]) > 0: // one expert's down
			for name, v := range shrink[3] {
				if strings.HasSuffix(st[i].Layer, "."+name) {
					st[i].ClipShrink = map[string]float64{name: v}
				}
			}
		}
	}
}

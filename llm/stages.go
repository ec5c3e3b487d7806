package llm

import "github.com/llmq/llmq/llm/checkpoint"

// Stages runs one decoder block in pieces over a single sequence starting
// at position 0, for calibration: quantizers need the inputs of each linear
// layer and must re-run parts of a block after quantizing others. It shares
// the forward pass's code, so calibration sees exactly what inference does.
type Stages struct {
	m *Model // configuration and rotary tables only; no weights
}

// NewStages prepares stages for an architecture.
func NewStages(cfg *checkpoint.Config) *Stages {
	return &Stages{m: &Model{Cfg: cfg, ropes: newRopes(cfg)}}
}

// Config is the architecture the stages run.
func (s *Stages) Config() *checkpoint.Config { return s.m.Cfg }

// Norm returns RMSNorm(x)·w for T rows.
func (s *Stages) Norm(w, x []float32, T int) []float32 {
	out := make([]float32, len(x))
	RMSNorm(out, x, w, T, s.m.Cfg.RMSNormEps)
	return out
}

// Attention returns the attention output before o_proj for the normed rows
// n (the input of q/k/v_proj), positions 0..T−1 with a causal mask.
func (s *Stages) Attention(b *Block, n []float32, T int) []float32 {
	c := s.m.Cfg
	hd := c.HeadDim
	pool := NewBlockPool(&checkpoint.Config{Layers: 1}, T, 0, int64(2*c.KVHeads*T*hd)*4)
	kc := newKVCache(pool, []int{0}, T, c.KVHeads, hd)
	defer kc.Close()
	if err := kc.Reserve(T); err != nil {
		panic(err) // an unbounded pool
	}
	cos, sin := s.m.ropes[b.Layer].table(0, T)
	att := make([]float32, T*c.Heads*hd)
	q := make([]float32, T*c.Heads*hd)
	k := make([]float32, T*c.KVHeads*hd)
	v := make([]float32, T*c.KVHeads*hd)
	s.m.selfAttention(att, b, n, 0, []int{T}, []*KVCache{kc}, cos, sin, q, k, v, &kvScratch{})
	return att
}

// MLPAct returns act(gate·m) ⊙ up·m, the input of down_proj, for the
// normed rows m (the input of gate/up_proj) of a block with a dense MLP.
func (s *Stages) MLPAct(b *Block, m []float32, T int) []float32 {
	return s.GatedAct(b.Gate, b.Up, m, T)
}

// GatedAct returns act(gate·m) ⊙ up·m for rows of m: the input of a gated
// MLP's down projection (a dense MLP's, or one expert's).
func (s *Stages) GatedAct(gate, up Linear, m []float32, rows int) []float32 {
	I := gate.Out()
	g, u := make([]float32, rows*I), make([]float32, rows*I)
	gate.Forward(g, m, rows)
	up.Forward(u, m, rows)
	GatedAct(s.m.Cfg.Act, g, u)
	return g
}

// AddLinear sets x += L(in) for T rows.
func (s *Stages) AddLinear(x []float32, l Linear, in []float32, T int) {
	add(x, s.linear(l, in, T))
}

func (s *Stages) linear(l Linear, in []float32, T int) []float32 {
	out := make([]float32, T*l.Out())
	l.Forward(out, in, T)
	return out
}

// AddAttention sets x += o(att), normed by the block's post-attention
// norm where it has one (Gemma 3): the attention residual.
func (s *Stages) AddAttention(b *Block, x, att []float32, T int) {
	add(x, s.postNorm(b.PostAttnNorm, s.linear(b.O, att, T), T))
}

// AddMLP sets x += MLP(m) for the normed rows m (the MLP's input), the
// mixture of experts in a sparse block, normed by the post-feed-forward
// norm where the block has one (Gemma 3).
func (s *Stages) AddMLP(b *Block, x, m []float32, T int) {
	var y []float32
	if b.MoE != nil {
		y = make([]float32, len(x))
		b.MoE.Forward(y, m, T)
	} else {
		y = s.linear(b.Down, s.MLPAct(b, m, T), T)
	}
	add(x, s.postNorm(b.PostMLPNorm, y, T))
}

// postNorm returns RMSNorm(y)·w, or y when w is nil.
func (s *Stages) postNorm(w, y []float32, T int) []float32 {
	if w == nil {
		return y
	}
	return s.Norm(w, y, T)
}

// Block runs the whole block on x (T rows) and returns the new x: the
// forward pass's computation, Gemma's output norms and mixtures of
// experts included.
func (s *Stages) Block(b *Block, x []float32, T int) []float32 {
	h := append([]float32(nil), x...)
	s.AddAttention(b, h, s.Attention(b, s.Norm(b.AttnNorm, x, T), T), T)
	s.AddMLP(b, h, s.Norm(b.MLPNorm, h, T), T)
	return h
}

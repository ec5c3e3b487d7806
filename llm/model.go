package llm

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
)

// Linear is a fully connected layer y = x·Wᵀ + b over rows of activations.
type Linear interface {
	In() int
	Out() int
	// Forward writes rows×Out() outputs for rows×In() inputs.
	Forward(y, x []float32, rows int)
}

// Dense is a float32 Linear with W stored out×in (PyTorch's layout).
type Dense struct {
	W       []float32 // [out][in]
	B       []float32 // [out], or nil
	in, out int
}

// NewDense wraps a weight matrix (and optional bias).
func NewDense(w, b []float32, in, out int) *Dense { return &Dense{W: w, B: b, in: in, out: out} }

func (d *Dense) In() int  { return d.in }
func (d *Dense) Out() int { return d.out }

func (d *Dense) Forward(y, x []float32, rows int) {
	mat.MatMulT(y[:rows*d.out], x[:rows*d.in], d.W, rows, d.in, d.out)
	if d.B != nil {
		for r := 0; r < rows; r++ {
			row := y[r*d.out : (r+1)*d.out]
			for i, b := range d.B {
				row[i] += b
			}
		}
	}
}

// Block is one decoder layer.
type Block struct {
	AttnNorm, MLPNorm []float32
	Q, K, V, O        Linear
	Gate, Up, Down    Linear
}

// Linears lists the block's layers with their checkpoint names
// (relative to model.layers.N.), in execution order.
func (b *Block) Linears() []NamedLinear {
	return []NamedLinear{
		{"self_attn.q_proj", &b.Q}, {"self_attn.k_proj", &b.K}, {"self_attn.v_proj", &b.V},
		{"self_attn.o_proj", &b.O}, {"mlp.gate_proj", &b.Gate}, {"mlp.up_proj", &b.Up},
		{"mlp.down_proj", &b.Down},
	}
}

// NamedLinear points at one of a block's layers.
type NamedLinear struct {
	Name string
	L    *Linear
}

// Model is a loaded network; it is also the CPU Backend.
type Model struct {
	Cfg    *checkpoint.Config
	Embed  []float32 // [vocab][hidden]
	Blocks []*Block
	Norm   []float32
	LMHead Linear
	// TiedHead says LMHead reuses Embed (its weights are not counted twice).
	TiedHead bool
	rope     *rope
	caches   atomic.Int64 // bytes of open caches
}

// LinearByName returns the layer a checkpoint calls name
// ("model.layers.3.mlp.down_proj", "lm_head" when it is not tied), for
// reading or replacing it.
func (m *Model) LinearByName(name string) (*Linear, bool) {
	if name == "lm_head" && !m.TiedHead {
		return &m.LMHead, true
	}
	num, rest, ok := strings.Cut(strings.TrimPrefix(name, "model.layers."), ".")
	i, err := strconv.Atoi(num)
	if !ok || err != nil || !strings.HasPrefix(name, "model.layers.") || i < 0 || i >= len(m.Blocks) {
		return nil, false
	}
	for _, nl := range m.Blocks[i].Linears() {
		if nl.Name == rest {
			return nl.L, true
		}
	}
	return nil, false
}

// Config implements Backend.
func (m *Model) Config() *checkpoint.Config { return m.Cfg }

// Name implements Backend.
func (m *Model) Name() string { return "cpu (" + mat.Backend + ")" }

// LinearLoader builds the Linear called name (e.g. "model.layers.0.mlp.up_proj")
// with the given shape. Quantized checkpoints supply one that reads packed
// weights; the default reads name+".weight" (and ".bias" when bias is set).
type LinearLoader func(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (Linear, error)

// DenseLoader reads an unquantized linear layer.
func DenseLoader(ck *checkpoint.Checkpoint, name string, in, out int, bias bool) (Linear, error) {
	w, err := ck.Float32(name+".weight", out, in)
	if err != nil {
		return nil, err
	}
	b, err := ReadBias(ck, name, out, bias)
	if err != nil {
		return nil, err
	}
	return NewDense(w, b, in, out), nil
}

// ReadBias reads name+".bias" when bias is set (nil otherwise).
func ReadBias(ck *checkpoint.Checkpoint, name string, out int, bias bool) ([]float32, error) {
	if !bias {
		return nil, nil
	}
	return ck.Float32(name+".bias", out)
}

// LinearSpec names one linear layer of the network and gives its shape:
// the table every backend loads its layers from.
type LinearSpec struct {
	Name    string // checkpoint prefix, e.g. "model.layers.0.mlp.up_proj"
	In, Out int
	Bias    bool
}

// BlockLinears lists decoder layer i's linear layers in execution order:
// q, k, v, o, gate, up, down (the order of Block.Linears).
func BlockLinears(c *checkpoint.Config, i int) []LinearSpec {
	p := fmt.Sprintf("model.layers.%d.", i)
	q, kv := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	return []LinearSpec{
		{p + "self_attn.q_proj", c.Hidden, q, c.QKVBias},
		{p + "self_attn.k_proj", c.Hidden, kv, c.QKVBias},
		{p + "self_attn.v_proj", c.Hidden, kv, c.QKVBias},
		{p + "self_attn.o_proj", q, c.Hidden, false},
		{p + "mlp.gate_proj", c.Hidden, c.Intermediate, false},
		{p + "mlp.up_proj", c.Hidden, c.Intermediate, false},
		{p + "mlp.down_proj", c.Intermediate, c.Hidden, false},
	}
}

// ReadBlockNorms reads decoder layer i's two RMSNorm weights.
func ReadBlockNorms(ck *checkpoint.Checkpoint, i int) (attn, mlp []float32, err error) {
	c := ck.Config
	p := fmt.Sprintf("model.layers.%d.", i)
	if attn, err = ck.Float32(p+"input_layernorm.weight", c.Hidden); err != nil {
		return nil, nil, err
	}
	if mlp, err = ck.Float32(p+"post_attention_layernorm.weight", c.Hidden); err != nil {
		return nil, nil, err
	}
	return attn, mlp, nil
}

// LoadBlock reads decoder layer i. Quantization tools use it to stream a
// model one block at a time.
func LoadBlock(ck *checkpoint.Checkpoint, i int, load LinearLoader) (*Block, error) {
	b := &Block{}
	var err error
	if b.AttnNorm, b.MLPNorm, err = ReadBlockNorms(ck, i); err != nil {
		return nil, err
	}
	specs := BlockLinears(ck.Config, i)
	for j, nl := range b.Linears() {
		s := specs[j]
		if *nl.L, err = load(ck, s.Name, s.In, s.Out, s.Bias); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// ReadEmbeddings reads the token embeddings [vocab][hidden] and the final
// norm.
func ReadEmbeddings(ck *checkpoint.Checkpoint) (embed, norm []float32, err error) {
	c := ck.Config
	if embed, err = ck.Float32("model.embed_tokens.weight", c.Vocab, c.Hidden); err != nil {
		return nil, nil, err
	}
	if norm, err = ck.Float32("model.norm.weight", c.Hidden); err != nil {
		return nil, nil, err
	}
	return embed, norm, nil
}

// HeadLinear is the LM head's spec, or tied when the head reuses the
// embeddings (tie_word_embeddings and no lm_head in the checkpoint).
func HeadLinear(ck *checkpoint.Checkpoint) (s LinearSpec, tied bool, err error) {
	c := ck.Config
	switch {
	case ck.Has("lm_head.weight") || ck.Has("lm_head.qweight"):
		return LinearSpec{Name: "lm_head", In: c.Hidden, Out: c.Vocab}, false, nil
	case c.TieEmbeddings:
		return LinearSpec{}, true, nil
	}
	return LinearSpec{}, false, fmt.Errorf("%s: no lm_head.weight and tie_word_embeddings is false", ck.Dir)
}

// LoadEmbeddings reads the token embeddings, the final norm and the LM head
// (which reuses the embeddings when they are tied).
func LoadEmbeddings(ck *checkpoint.Checkpoint, load LinearLoader) (embed, norm []float32, head Linear, err error) {
	if embed, norm, err = ReadEmbeddings(ck); err != nil {
		return nil, nil, nil, err
	}
	s, tied, err := HeadLinear(ck)
	switch {
	case err != nil:
		return nil, nil, nil, err
	case tied:
		head = NewDense(embed, nil, ck.Config.Hidden, ck.Config.Vocab)
	default:
		if head, err = load(ck, s.Name, s.In, s.Out, s.Bias); err != nil {
			return nil, nil, nil, err
		}
	}
	return embed, norm, head, nil
}

// Load reads a whole model for the CPU backend. load may be nil for
// unquantized checkpoints.
func Load(ck *checkpoint.Checkpoint, load LinearLoader) (*Model, error) {
	if load == nil {
		load = DenseLoader
	}
	m := &Model{Cfg: ck.Config, rope: newRope(ck.Config)}
	var err error
	if m.Embed, m.Norm, m.LMHead, err = LoadEmbeddings(ck, load); err != nil {
		return nil, err
	}
	if _, m.TiedHead, err = HeadLinear(ck); err != nil {
		return nil, err
	}
	for i := 0; i < ck.Config.Layers; i++ {
		b, err := LoadBlock(ck, i, load)
		if err != nil {
			return nil, err
		}
		m.Blocks = append(m.Blocks, b)
	}
	return m, nil
}

// rope holds the rotary inverse frequencies, computed in float32 as
// transformers does, with Llama-3.1's or linear scaling applied.
type rope struct {
	invFreq []float32 // [head_dim/2]
}

func newRope(c *checkpoint.Config) *rope {
	half := c.HeadDim / 2
	inv := make([]float32, half)
	for i := range inv {
		e := float32(2*i) / float32(c.HeadDim)
		inv[i] = 1 / float32(math.Pow(c.Rope.Theta, float64(e)))
	}
	switch c.Rope.Type {
	case "linear":
		for i := range inv {
			inv[i] /= float32(c.Rope.Factor)
		}
	case "llama3":
		// Wavelengths shorter than the original context/high_freq_factor
		// are kept, longer than context/low_freq_factor divided by factor,
		// and those between interpolated smoothly.
		r := c.Rope
		old := float64(r.OriginalMaxPositions)
		lowWave, highWave := old/r.LowFreqFactor, old/r.HighFreqFactor
		for i, f := range inv {
			wave := 2 * math.Pi / float64(f)
			switch {
			case wave < highWave:
			case wave > lowWave:
				inv[i] = float32(float64(f) / r.Factor)
			default:
				smooth := (old/wave - r.LowFreqFactor) / (r.HighFreqFactor - r.LowFreqFactor)
				inv[i] = float32((1-smooth)*float64(f)/r.Factor + smooth*float64(f))
			}
		}
	}
	return &rope{invFreq: inv}
}

// RopeTables returns the rotary tables cos and sin [n][head_dim/2] for
// positions 0..n-1, as the CPU backend computes them, for backends that
// rotate on their own.
func RopeTables(c *checkpoint.Config, n int) (cos, sin []float32) { return newRope(c).table(0, n) }

// table fills cos and sin [n][half] for positions pos0..pos0+n-1.
func (r *rope) table(pos0, n int) (cos, sin []float32) {
	half := len(r.invFreq)
	cos, sin = make([]float32, n*half), make([]float32, n*half)
	for t := 0; t < n; t++ {
		p := float32(pos0 + t)
		for i, f := range r.invFreq {
			a := float64(p * f)
			cos[t*half+i], sin[t*half+i] = float32(math.Cos(a)), float32(math.Sin(a))
		}
	}
	return
}

// apply rotates each head of x [rows][heads×hd] in place, "rotate_half"
// style: (x₁, x₂) → (x₁cos − x₂sin, x₂cos + x₁sin) on the two halves.
func (r *rope) apply(x []float32, rows, heads, hd int, cos, sin []float32) {
	half := hd / 2
	mat.ParallelFor(rows, 16, func(lo, hi int) {
		for t := lo; t < hi; t++ {
			c, s := cos[t*half:(t+1)*half], sin[t*half:(t+1)*half]
			for h := 0; h < heads; h++ {
				v := x[(t*heads+h)*hd : (t*heads+h+1)*hd]
				for i := 0; i < half; i++ {
					a, b := v[i], v[i+half]
					v[i] = a*c[i] - b*s[i]
					v[i+half] = b*c[i] + a*s[i]
				}
			}
		}
	})
}

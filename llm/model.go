package llm

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"

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

// Block is one decoder layer. Gate, Up and Down are its MLP, or nil when
// MoE replaces it; QNorm and KNorm, PostAttnNorm and PostMLPNorm are nil
// in the families without them.
type Block struct {
	AttnNorm, MLPNorm []float32
	Q, K, V, O        Linear
	Gate, Up, Down    Linear
	// QNorm and KNorm [head_dim] norm each head of the queries and keys
	// before RoPE (Qwen3, Gemma 3).
	QNorm, KNorm []float32
	// PostAttnNorm and PostMLPNorm norm the attention and MLP outputs
	// before they are added to the residual stream (Gemma 3); MLPNorm is
	// then Gemma's pre_feedforward_layernorm.
	PostAttnNorm, PostMLPNorm []float32
	// MoE is the mixture of experts of a sparse layer (Mixtral, Qwen3-MoE).
	MoE *MoE
	// Layer is the block's index in the model: it selects the layer's
	// sliding window and rotary embedding (Config.Window, LayerRope).
	Layer int
}

// Linears lists the block's layers with their checkpoint names
// (relative to model.layers.N.), in execution order: q, k, v, o, then
// gate, up, down, or each expert's gate, up and down in expert order. A
// mixture's router is not among them: it stays in float32 (MoE.Router).
func (b *Block) Linears() []NamedLinear {
	ls := []NamedLinear{
		{"self_attn.q_proj", &b.Q}, {"self_attn.k_proj", &b.K}, {"self_attn.v_proj", &b.V},
		{"self_attn.o_proj", &b.O},
	}
	if b.MoE == nil {
		return append(ls, NamedLinear{"mlp.gate_proj", &b.Gate}, NamedLinear{"mlp.up_proj", &b.Up}, NamedLinear{"mlp.down_proj", &b.Down})
	}
	for e := range b.MoE.Experts {
		x := &b.MoE.Experts[e]
		n := b.MoE.names.expert(e)
		ls = append(ls, NamedLinear{n[0], &x.Gate}, NamedLinear{n[1], &x.Up}, NamedLinear{n[2], &x.Down})
	}
	return ls
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
	ropes    []*rope // per layer (Gemma's sliding layers have their own)
	kvOnce   sync.Once
	kv       *BlockPool // the caches' blocks (KVPool)
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
	Input   Input // which of its block's inputs it reads
}

// Input names the four inputs a decoder block's linear layers read.
type Input int

const (
	InputAttnNorm Input = iota // q, k, v: the attention norm's output
	InputAttn                  // o: the attention output
	InputMLPNorm               // gate and up, every expert's: the MLP norm's output
	InputAct                   // down, every expert's: the gated activation
)

// BlockLinears lists decoder layer i's linear layers in execution order:
// q, k, v, o, gate, up, down, with the experts' gate, up, down in place of
// the MLP's in a sparse layer (the order of Block.Linears).
func BlockLinears(c *checkpoint.Config, i int) []LinearSpec {
	p := fmt.Sprintf("model.layers.%d.", i)
	q, kv := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	specs := []LinearSpec{
		{p + "self_attn.q_proj", c.Hidden, q, c.QKVBias, InputAttnNorm},
		{p + "self_attn.k_proj", c.Hidden, kv, c.QKVBias, InputAttnNorm},
		{p + "self_attn.v_proj", c.Hidden, kv, c.QKVBias, InputAttnNorm},
		{p + "self_attn.o_proj", q, c.Hidden, c.OBias, InputAttn},
	}
	if !c.Sparse(i) {
		return append(specs,
			LinearSpec{p + "mlp.gate_proj", c.Hidden, c.Intermediate, false, InputMLPNorm},
			LinearSpec{p + "mlp.up_proj", c.Hidden, c.Intermediate, false, InputMLPNorm},
			LinearSpec{p + "mlp.down_proj", c.Intermediate, c.Hidden, false, InputAct})
	}
	names, I := moeNamesFor(c), c.MoE.Intermediate
	for e := 0; e < c.MoE.Experts; e++ {
		n := names.expert(e)
		specs = append(specs,
			LinearSpec{p + n[0], c.Hidden, I, false, InputMLPNorm},
			LinearSpec{p + n[1], c.Hidden, I, false, InputMLPNorm},
			LinearSpec{p + n[2], I, c.Hidden, false, InputAct})
	}
	return specs
}

// NamedNorm points at one of a block's RMSNorm weights.
type NamedNorm struct {
	Name string // relative to model.layers.N., e.g. "input_layernorm.weight"
	W    *[]float32
	N    int // its length
}

// Norms lists the block's RMSNorm weights with their checkpoint names:
// the two of Llama (AttnNorm is input_layernorm, MLPNorm
// post_attention_layernorm), or Gemma 3's four (MLPNorm is then
// pre_feedforward_layernorm, PostAttnNorm post_attention_layernorm), and
// q_norm and k_norm where the family has them.
func (b *Block) Norms(c *checkpoint.Config) []NamedNorm {
	var ns []NamedNorm
	if c.SandwichNorm {
		ns = []NamedNorm{{"input_layernorm.weight", &b.AttnNorm, c.Hidden}, {"post_attention_layernorm.weight", &b.PostAttnNorm, c.Hidden},
			{"pre_feedforward_layernorm.weight", &b.MLPNorm, c.Hidden}, {"post_feedforward_layernorm.weight", &b.PostMLPNorm, c.Hidden}}
	} else {
		ns = []NamedNorm{{"input_layernorm.weight", &b.AttnNorm, c.Hidden}, {"post_attention_layernorm.weight", &b.MLPNorm, c.Hidden}}
	}
	if c.QKNorm {
		ns = append(ns, NamedNorm{"self_attn.q_norm.weight", &b.QNorm, c.HeadDim}, NamedNorm{"self_attn.k_norm.weight", &b.KNorm, c.HeadDim})
	}
	return ns
}

// ReadNorms reads every norm of decoder layer i into b. Gemma 3's
// weights are stored as w and applied as (1+w): b holds 1+w, computed in
// float32 as transformers does, so RMSNorm is the same function for all.
func ReadNorms(ck *checkpoint.Checkpoint, i int, b *Block) error {
	p := fmt.Sprintf("model.layers.%d.", i)
	for _, n := range b.Norms(ck.Config) {
		w, err := ReadNorm(ck, p+n.Name, n.N)
		if err != nil {
			return err
		}
		*n.W = w
	}
	return nil
}

// StoredNorm is the checkpoint's spelling of a norm weight as a block
// holds it: w itself, or w−1 where the config stores (1+w)'s w.
func StoredNorm(c *checkpoint.Config, w []float32) []float32 {
	if !c.NormPlusOne {
		return w
	}
	out := make([]float32, len(w))
	for i, v := range w {
		out[i] = v - 1
	}
	return out
}

// ReadNorm reads one RMSNorm weight, as 1+w where the config says so.
func ReadNorm(ck *checkpoint.Checkpoint, name string, n int) ([]float32, error) {
	w, err := ck.Float32(name, n)
	if err != nil {
		return nil, err
	}
	if ck.Config.NormPlusOne {
		for i := range w {
			w[i] += 1
		}
	}
	return w, nil
}

// LoadBlock reads decoder layer i. Quantization tools use it to stream a
// model one block at a time. A mixture's router is read in float32
// whatever load does.
func LoadBlock(ck *checkpoint.Checkpoint, i int, load LinearLoader) (*Block, error) {
	c := ck.Config
	b := &Block{Layer: i}
	if err := ReadNorms(ck, i, b); err != nil {
		return nil, err
	}
	if c.Sparse(i) {
		names := moeNamesFor(c)
		name := fmt.Sprintf("model.layers.%d.%s", i, names.router)
		w, err := ck.Float32(name+".weight", c.MoE.Experts, c.Hidden)
		if err != nil {
			return nil, err
		}
		b.MoE = &MoE{Router: NewDense(w, nil, c.Hidden, c.MoE.Experts), Experts: make([]Expert, c.MoE.Experts),
			TopK: c.MoE.TopK, NormTopK: c.MoE.NormTopK, Act: c.Act, names: names}
	}
	specs := BlockLinears(c, i)
	var err error
	for j, nl := range b.Linears() {
		s := specs[j]
		if *nl.L, err = load(ck, s.Name, s.In, s.Out, s.Bias); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// ReadEmbeddings reads the token embeddings [vocab][hidden] and the final
// norm (as 1+w for Gemma 3).
func ReadEmbeddings(ck *checkpoint.Checkpoint) (embed, norm []float32, err error) {
	c := ck.Config
	if embed, err = ck.Float32("model.embed_tokens.weight", c.Vocab, c.Hidden); err != nil {
		return nil, nil, err
	}
	if norm, err = ReadNorm(ck, "model.norm.weight", c.Hidden); err != nil {
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
	m := &Model{Cfg: ck.Config, ropes: newRopes(ck.Config)}
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

// newRopes gives each layer its rotary embedding: one shared by all, or
// (Gemma 3) one for the full-attention layers and one for the sliding.
func newRopes(c *checkpoint.Config) []*rope {
	byParams := map[checkpoint.Rope]*rope{}
	out := make([]*rope, c.Layers)
	for l := range out {
		p := c.LayerRope(l)
		if byParams[p] == nil {
			byParams[p] = newRope(p, c.HeadDim)
		}
		out[l] = byParams[p]
	}
	return out
}

func newRope(r checkpoint.Rope, hd int) *rope {
	half := hd / 2
	inv := make([]float32, half)
	for i := range inv {
		e := float32(2*i) / float32(hd)
		inv[i] = 1 / float32(math.Pow(r.Theta, float64(e)))
	}
	switch r.Type {
	case "linear":
		for i := range inv {
			inv[i] /= float32(r.Factor)
		}
	case "llama3":
		// Wavelengths shorter than the original context/high_freq_factor
		// are kept, longer than context/low_freq_factor divided by factor,
		// and those between interpolated smoothly.
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
func RopeTables(c *checkpoint.Config, n int) (cos, sin []float32) {
	return RopeTablesOf(c.Rope, c.HeadDim, n)
}

// RopeTablesOf is RopeTables for the rotary embedding r (a layer's own,
// Config.LayerRope).
func RopeTablesOf(r checkpoint.Rope, hd, n int) (cos, sin []float32) {
	return newRope(r, hd).table(0, n)
}

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

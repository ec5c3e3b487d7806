package llm

import (
	"fmt"
	"math"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
)

// MoE is a sparse mixture-of-experts MLP (Shazeer et al. 2017) as Mixtral
// (Jiang et al. 2024) and Qwen3-MoE have it. For each row x of normed
// activations the router scores the experts and the TopK most probable
// run on the row:
//
//	p   = softmax(Wr·x)                          (float32, all experts)
//	S   = the TopK largest pₑ                     (ties: the lower index)
//	wₑ  = pₑ / Σ_{e'∈S} pₑ' if NormTopK, else pₑ  (e ∈ S)
//	y   = Σ_{e∈S} wₑ · Downₑ(act(Gateₑ·x) ⊙ Upₑ·x)
//
// which is transformers' order of operations: softmax over every expert,
// top-k, then the renormalisation (Mixtral always renormalises, which
// equals a softmax over the top-k logits; Qwen3-MoE when norm_topk_prob
// is set), and the weighted expert outputs added in ascending expert
// order. The router is kept in float32 (quantizing it would change which
// experts run); the experts are ordinary Linears a quantizer can replace.
type MoE struct {
	Router   *Dense // [experts][hidden]
	Experts  []Expert
	TopK     int
	NormTopK bool
	Act      string // the experts' activation (Config.Act)
	names    moeNames
}

// Expert is one expert's gated MLP.
type Expert struct{ Gate, Up, Down Linear }

// moeNames are a family's checkpoint names for the router and experts,
// relative to model.layers.N.
type moeNames struct {
	router  string    // e.g. "mlp.gate"
	expert0 string    // e.g. "mlp.experts." (the expert's number follows)
	proj    [3]string // gate, up, down: "gate_proj", "up_proj", "down_proj" or Mixtral's "w1", "w3", "w2"
}

func moeNamesFor(c *checkpoint.Config) moeNames {
	if c.Architecture == "MixtralForCausalLM" {
		return moeNames{"block_sparse_moe.gate", "block_sparse_moe.experts.", [3]string{"w1", "w3", "w2"}}
	}
	return moeNames{"mlp.gate", "mlp.experts.", [3]string{"gate_proj", "up_proj", "down_proj"}}
}

// expert is expert e's gate, up and down names.
func (n moeNames) expert(e int) [3]string {
	p := fmt.Sprintf("%s%d.", n.expert0, e)
	return [3]string{p + n.proj[0], p + n.proj[1], p + n.proj[2]}
}

// RouterName is the checkpoint name of a sparse layer's router (without
// ".weight"), e.g. "model.layers.0.mlp.gate".
func RouterName(c *checkpoint.Config, layer int) string {
	return fmt.Sprintf("model.layers.%d.%s", layer, moeNamesFor(c).router)
}

// Routing is the router's decision for a batch of rows: row r goes to the
// experts Expert[r·TopK …] with weights Weight[r·TopK …], most probable
// first.
type Routing struct {
	TopK    int
	Experts int
	Expert  []int
	Weight  []float32
}

// Route runs the router on rows of normed activations h [rows][hidden].
func (m *MoE) Route(h []float32, rows int) *Routing {
	E := len(m.Experts)
	logits := make([]float32, rows*E)
	m.Router.Forward(logits, h, rows)
	return RouteLogits(logits, rows, E, m.TopK, m.NormTopK)
}

// RouteLogits is the routing of rows of router logits [rows][E]: the
// softmax, the top k (ties: the lower expert) and, when norm is set, their
// renormalisation (the GPU's route kernel is tested against it).
func RouteLogits(logits []float32, rows, E, k int, norm bool) *Routing {
	r := &Routing{TopK: k, Experts: E, Expert: make([]int, rows*k), Weight: make([]float32, rows*k)}
	p := make([]float32, E)
	for row := 0; row < rows; row++ {
		lg := logits[row*E : (row+1)*E]
		mx := lg[0]
		for _, v := range lg {
			mx = max(mx, v)
		}
		var sum float64
		for e, v := range lg {
			ex := math.Exp(float64(v - mx))
			p[e] = float32(ex)
			sum += ex
		}
		for e := range p {
			p[e] = float32(float64(p[e]) / sum)
		}
		idx, w := r.Expert[row*k:(row+1)*k], r.Weight[row*k:(row+1)*k]
		for j := range idx {
			best := -1
			for e, v := range p {
				if !taken(idx[:j], e) && (best < 0 || v > p[best]) {
					best = e
				}
			}
			idx[j], w[j] = best, p[best]
		}
		if norm {
			var s float32
			for _, v := range w {
				s += v
			}
			for j := range w {
				w[j] /= s
			}
		}
	}
	return r
}

func taken(chosen []int, e int) bool {
	for _, c := range chosen {
		if c == e {
			return true
		}
	}
	return false
}

// Assigned lists the rows routed to expert e, ascending, and the weight
// of each: the tokens a quantizer calibrating expert e must see.
func (r *Routing) Assigned(e int) (rows []int, weights []float32) {
	for i, x := range r.Expert {
		if x == e {
			rows = append(rows, i/r.TopK)
			weights = append(weights, r.Weight[i])
		}
	}
	return rows, weights
}

// Forward writes the mixture's output for rows of normed activations h
// into out ([rows][hidden]).
func (m *MoE) Forward(out, h []float32, rows int) {
	H := m.Router.In()
	r := m.Route(h, rows)
	clear(out[:rows*H])
	for e, x := range m.Experts {
		idx, w := r.Assigned(e)
		n := len(idx)
		if n == 0 {
			continue
		}
		in := make([]float32, n*H)
		for j, row := range idx {
			copy(in[j*H:(j+1)*H], h[row*H:(row+1)*H])
		}
		I := x.Gate.Out()
		g, u, y := make([]float32, n*I), make([]float32, n*I), make([]float32, n*H)
		x.Gate.Forward(g, in, n)
		x.Up.Forward(u, in, n)
		GatedAct(m.Act, g, u)
		x.Down.Forward(y, g, n)
		for j, row := range idx {
			o, yr := out[row*H:(row+1)*H], y[j*H:(j+1)*H]
			for i := range o {
				o[i] += yr[i] * w[j]
			}
		}
	}
}

// GatedAct sets g = act(g) ⊙ u: SwiGLU for "silu", GeGLU with the tanh
// approximation of GELU for "gelu_pytorch_tanh".
func GatedAct(act string, g, u []float32) {
	if act == "gelu_pytorch_tanh" {
		GeGLU(g, u)
		return
	}
	SwiGLU(g, u)
}

// GeGLU sets g = GELU(g) ⊙ u with GELU(z) ≈ ½z(1 + tanh(√(2/π)(z + 0.044715z³)))
// (PyTorch's approximate="tanh"), computed in float64.
func GeGLU(g, u []float32) {
	c := math.Sqrt(2 / math.Pi)
	mat.ParallelFor(len(g), 4096, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			z := float64(g[i])
			g[i] = float32(0.5*z*(1+math.Tanh(c*(z+0.044715*z*z*z)))) * u[i]
		}
	})
}

// ExpertRows says which calibration rows calibrate each expert of a
// mixture: those the router sends it (Routing.Assigned) or, for an expert
// calibrated on all rows, every row. Statistics only: the mixture's
// outputs always follow the real routing.
type ExpertRows struct {
	// Routed is how many rows the router sent to each expert over all
	// windows.
	Routed []int
	// All marks the experts calibrated on every row of every window.
	All    []bool
	routes []*Routing
}

// ExpertCalib is how a quantizer picks the calibration rows of each
// expert: All sends every row through every expert (for statistics only);
// otherwise each expert sees the rows routed to it, but an expert routed
// fewer than MinTokens rows over the calibration set is calibrated on all
// rows (too few rows make a poor estimate: fewer than its input width
// leave a Hessian singular, none leave nothing to fit).
type ExpertCalib struct {
	All       bool
	MinTokens int
}

// NewExpertRows decides from each window's routing which rows calibrate
// each of the experts.
func NewExpertRows(routes []*Routing, experts int, c ExpertCalib) *ExpertRows {
	r := &ExpertRows{Routed: make([]int, experts), All: make([]bool, experts), routes: routes}
	for _, rt := range routes {
		for _, e := range rt.Expert {
			r.Routed[e]++
		}
	}
	for e := range r.All {
		r.All[e] = c.All || r.Routed[e] < c.MinTokens
	}
	return r
}

// Rows lists the rows of window w that calibrate expert e, or returns nil
// when the expert is calibrated on all rows.
func (r *ExpertRows) Rows(e, w int) []int {
	if r.All[e] {
		return nil
	}
	rows, _ := r.routes[w].Assigned(e)
	if rows == nil {
		rows = []int{}
	}
	return rows
}

// Gather returns the rows of x ([rows][width]) listed, in order; nil rows
// means all of x.
func Gather(x []float32, rows []int, width int) []float32 {
	if rows == nil {
		return x
	}
	out := make([]float32, len(rows)*width)
	for j, r := range rows {
		copy(out[j*width:(j+1)*width], x[r*width:(r+1)*width])
	}
	return out
}

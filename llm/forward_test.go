package llm_test

import (
	"context"
	"math"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
)

func loadModel(tb testing.TB, rel string) *llm.Model {
	tb.Helper()
	ck, err := checkpoint.Open(shared.Path(tb, rel))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ck.Close() })
	m, err := llm.Load(ck, nil)
	if err != nil {
		tb.Fatal(err)
	}
	return m
}

// Tolerances of the logits (magnitudes up to ~15, where a float32 ulp is
// 9.5e-7). Against transformers' fp32 logits the worst measured |diff| was
// 1.47e-5 (OpenBLAS) and 1.24e-5 (gonum) over the first six models; the
// Qwen3, Qwen3-MoE, Mixtral and Gemma 3 zoo models measure at most 1.91e-5
// (OpenBLAS, Mixtral's position 113; 8.8e-6 with gonum): summation order
// differs, nothing else. The bound leaves 1.6× above that for other BLAS
// kernels and CPUs, while a real error (RoPE, a norm's eps, a dtype
// conversion, a routing choice) shows up at 1e-3 or more.
const refTol = 3e-5

// Between two runs of llmq's own forward pass that differ only in how
// tokens are batched (prefill vs one at a time, batched vs alone) the
// GEMMs see other shapes and sum in another order: worst measured 1.05e-5
// (OpenBLAS), 4.1e-6 (gonum); bound 2×.
const batchTol = 2e-5

// TestLogitsMatchTransformers compares full-sequence logits with the fp32
// logits transformers computed for the same ids, on the trained models and
// on the architecture zoo (Qwen2 biases, Mistral head_dim and sliding
// window, Llama-3.1 RoPE, Qwen3 q/k norm, the Qwen3-MoE and Mixtral
// mixtures of experts, Gemma 3).
func TestLogitsMatchTransformers(t *testing.T) {
	for _, name := range []string{"llama-tiny", "llama-small", "archzoo/qwen2-rand", "archzoo/mistral-rand", "archzoo/mistral-swa-rand", "archzoo/llama31-rand",
		"archzoo/qwen3-rand", "archzoo/qwen3moe-rand", "archzoo/mixtral-rand", "archzoo/gemma3-rand"} {
		t.Run(name, func(t *testing.T) {
			base := name
			if i := len("archzoo/"); len(name) > i && name[:i] == "archzoo/" {
				base = name[i:]
			}
			m := loadModel(t, "models/"+name)
			ids := shared.Int32s(t, "reference/"+base+".logits.input.i32")
			want := shared.Float32s(t, "reference/"+base+".logits.f32")
			V := m.Cfg.Vocab
			if len(want) != len(ids)*V {
				t.Fatalf("reference has %d logits, want %d×%d", len(want), len(ids), V)
			}
			cache, _ := m.NewCache(len(ids))
			got := make([]float32, len(ids)*V)
			if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: got}}); err != nil {
				t.Fatal(err)
			}
			worst, at := 0.0, 0
			for i := range got {
				if d := math.Abs(float64(got[i] - want[i])); d > worst || math.IsNaN(d) {
					worst, at = d, i
				}
			}
			t.Logf("%s: max |diff| = %.2e at position %d", name, worst, at/V)
			if !(worst <= refTol) {
				t.Fatalf("max |logit diff| %.3e at position %d token %d exceeds %.0e", worst, at/V, at%V, refTol)
			}
		})
	}
}

// TestIncrementalDecodingMatchesPrefill checks the KV cache: feeding tokens
// one at a time gives the logits of the full-prefix pass.
func TestIncrementalDecodingMatchesPrefill(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	ids := shared.Int32s(t, "reference/llama-tiny.logits.input.i32")[:24]
	V := m.Cfg.Vocab
	full := make([]float32, len(ids)*V)
	c1, _ := m.NewCache(64)
	if err := m.Forward(context.Background(), []llm.Step{{Cache: c1, Tokens: ids, Logits: full}}); err != nil {
		t.Fatal(err)
	}
	c2, _ := m.NewCache(64)
	step := make([]float32, V)
	// a prefix of 10 in one go, then one token at a time
	pre := make([]float32, V)
	if err := m.Forward(context.Background(), []llm.Step{{Cache: c2, Tokens: ids[:10], Logits: pre, LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	assertClose(t, pre, full[9*V:10*V], batchTol, "prefix of 10")
	for i := 10; i < len(ids); i++ {
		if err := m.Forward(context.Background(), []llm.Step{{Cache: c2, Tokens: ids[i : i+1], Logits: step}}); err != nil {
			t.Fatal(err)
		}
		assertClose(t, step, full[i*V:(i+1)*V], batchTol, "position")
	}
}

// TestBatchEqualsSingle: sequences of different lengths in one batch give
// the logits they give alone.
func TestBatchEqualsSingle(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	ids := shared.Int32s(t, "reference/llama-tiny.logits.input.i32")
	V := m.Cfg.Vocab
	a, b := ids[:40], ids[10:17]
	la, lb := make([]float32, len(a)*V), make([]float32, V)
	ca, _ := m.NewCache(64)
	cb, _ := m.NewCache(64)
	if err := m.Forward(context.Background(), []llm.Step{{Cache: ca, Tokens: a, Logits: la}, {Cache: cb, Tokens: b, Logits: lb, LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	sa := make([]float32, len(a)*V)
	c, _ := m.NewCache(64)
	m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: a, Logits: sa}})
	assertClose(t, la, sa, batchTol, "batched sequence a")
	sb := make([]float32, V)
	c, _ = m.NewCache(64)
	m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: b, Logits: sb, LastOnly: true}})
	assertClose(t, lb, sb, batchTol, "batched sequence b")
}

func TestForwardRejectsBadInput(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	c, _ := m.NewCache(4)
	out := make([]float32, 8*m.Cfg.Vocab)
	if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: []int{1, 2, 3, 4, 5}, Logits: out}}); err == nil {
		t.Error("5 tokens into a cache of 4 was accepted")
	}
	if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: []int{m.Cfg.Vocab}, Logits: out}}); err == nil {
		t.Error("out-of-vocabulary token was accepted")
	}
}

func assertClose(t *testing.T, got, want []float32, tol float64, what string) {
	t.Helper()
	worst, at := 0.0, 0
	for i := range want {
		if d := math.Abs(float64(got[i] - want[i])); d > worst || math.IsNaN(d) {
			worst, at = d, i
		}
	}
	t.Logf("%s: max |diff| %.2e", what, worst)
	if !(worst <= tol) {
		t.Fatalf("%s: element %d differs by %.3e > %.0e (got %v want %v)", what, at, worst, tol, got[at], want[at])
	}
}

// TestStagesEqualForward: running the blocks piecewise through Stages (as
// the quantizers do) gives the forward pass's logits, to the bit: the same
// kernels on the same shapes in the same order (measured 0 with both BLAS
// builds). The zoo's later families are included: q/k norm, Gemma's four
// norms and sliding layers (a prefill from an empty cache gathers the
// sliding layers' keys in Stages' order), experts.
func TestStagesEqualForward(t *testing.T) {
	for _, name := range []string{"qwen2-rand", "qwen3-rand", "qwen3moe-rand", "mixtral-rand", "gemma3-rand"} {
		m := loadModel(t, "models/archzoo/"+name)
		ids := shared.Int32s(t, "reference/"+name+".logits.input.i32")[:100]
		c := m.Cfg
		T := len(ids)
		x := make([]float32, T*c.Hidden)
		for i, id := range ids {
			copy(x[i*c.Hidden:], m.Embed[id*c.Hidden:(id+1)*c.Hidden])
			if c.EmbedScale != 0 {
				for j := 0; j < c.Hidden; j++ {
					x[i*c.Hidden+j] *= float32(c.EmbedScale)
				}
			}
		}
		st := llm.NewStages(c)
		for _, b := range m.Blocks {
			x = st.Block(b, x, T)
		}
		got := make([]float32, T*c.Vocab)
		m.LMHead.Forward(got, st.Norm(m.Norm, x, T), T)
		want := make([]float32, T*c.Vocab)
		cache, _ := m.NewCache(T)
		if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: want}}); err != nil {
			t.Fatal(err)
		}
		assertClose(t, got, want, 0, name+" stages vs forward")
	}
}

// TestSlidingWindowDecoding: with Mistral's sliding window (64), decoding
// one token at a time past the window through the KV cache gives
// transformers' full-sequence logits (which differ from full attention by
// up to 4 there).
func TestSlidingWindowDecoding(t *testing.T) {
	m := loadModel(t, "models/archzoo/mistral-swa-rand")
	if m.Cfg.SlidingWindow != 64 {
		t.Fatalf("sliding window %d, want 64", m.Cfg.SlidingWindow)
	}
	ids := shared.Int32s(t, "reference/mistral-swa-rand.logits.input.i32")[:100]
	want := shared.Float32s(t, "reference/mistral-swa-rand.logits.f32")
	V := m.Cfg.Vocab
	c, _ := m.NewCache(len(ids))
	step := make([]float32, V)
	if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: ids[:50], Logits: step, LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	for i := 50; i < len(ids); i++ {
		if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: ids[i : i+1], Logits: step}}); err != nil {
			t.Fatal(err)
		}
		assertClose(t, step, want[i*V:(i+1)*V], refTol, "position")
	}
}

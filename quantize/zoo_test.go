package quantize

import (
	"context"
	"math"
	"path/filepath"
	"testing"

	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// zooQuantized are the architecture zoo's models the driver writes
// beyond Llama's block: q/k norms, Gemma's four norms, mixtures of
// experts, and Mistral's sliding window.
var zooQuantized = []string{"qwen3-rand", "qwen3moe-rand", "mixtral-rand", "gemma3-rand", "mistral-swa-rand"}

// zooLogits runs a model directory on the zoo's reference input.
func zooLogits(t *testing.T, dir, name string) []float32 {
	t.Helper()
	m, err := pack.OpenModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ids := shared.Int32s(t, "reference/"+name+".logits.input.i32")
	out := make([]float32, len(ids)*m.Cfg.Vocab)
	c, _ := m.NewCache(len(ids))
	if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: ids, Logits: out}}); err != nil {
		t.Fatal(err)
	}
	return out
}

// relRMS is ‖got − want‖ / ‖want‖.
func relRMS(got, want []float32) float64 {
	var num, den float64
	for i := range want {
		d := float64(got[i] - want[i])
		num += d * d
		den += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(num / den)
}

func TestZooQuantizeSmoke(t *testing.T) {
	g := pack.Grid{Bits: 4, GroupSize: 32}
	methods := map[string]Method{
		"rtn":  RTN{G: g},
		"gptq": GPTQ{Opt: gptq.Options{Grid: g, Damp: 0.01}},
		"awq":  AWQ{Opt: awq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 32, MinMax: true}, Clip: true}},
	}
	for _, name := range zooQuantized {
		src := shared.Path(t, "models/archzoo/"+name)
		want := zooLogits(t, src, name)
		for _, mn := range []string{"rtn", "gptq", "awq"} {
			for _, format := range []string{"gptq", "awq"} {
				out := filepath.Join(t.TempDir(), "out")
				rep, err := Run(context.Background(), Options{Src: src, Out: out, Method: methods[mn], Format: format, TrueSequential: true,
					Calib: shared.Path(t, "data/calib.txt"), NSamples: 8, SeqLen: 64, MoEMinTokens: 32})
				if err != nil {
					t.Fatalf("%s %s %s: %v", name, mn, format, err)
				}
				got := zooLogits(t, out, name)
				t.Logf("%s %s %s: logits rel RMS %.4f, %d layers, %d experts reported", name, mn, format, relRMS(got, want), len(rep.Layers), len(rep.Experts))
				for _, e := range rep.Experts {
					t.Logf("  %s routed %d stats %d all %v fallback %v", e.Name, e.Routed, e.Tokens, e.AllTokens, e.Fallback)
				}
				_ = checkpoint.Open
			}
		}
	}
}

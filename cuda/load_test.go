package cuda

import (
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
)

// TestReadLinearsMatchesOneByOne: the load's parallel read of a layer's
// linears (readLinears; qwen3moe-rand's first layer: q, k, v, o and
// three linears of each of 8 experts) gives what readLinearAs gives one
// at a time, in order; with two specs broken, the error names the first.
// No GPU: the host side of the load only (run it with -race).
func TestReadLinearsMatchesOneByOne(t *testing.T) {
	ck, err := checkpoint.Open(shared.Path(t, "models/archzoo/qwen3moe-rand"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	m := &Model{cfg: ck.Config}
	specs := llm.BlockLinears(ck.Config, 0)
	if len(specs) != 4+3*ck.Config.MoE.Experts {
		t.Fatalf("%d linears in layer 0, want 4 and 3 for each of %d experts", len(specs), ck.Config.MoE.Experts)
	}
	got, err := m.readLinears(ck, nil, specs, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range specs {
		want, err := m.readLinearAs(ck, nil, s, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got[i], want) {
			t.Fatalf("spec %d (%s): the parallel read differs from the one-by-one read", i, s.Name)
		}
	}
	bad := append([]llm.LinearSpec(nil), specs...)
	bad[9].Name, bad[17].Name = "model.layers.0.no_such_9", "model.layers.0.no_such_17"
	if _, err := m.readLinears(ck, nil, bad, nil); err == nil || !strings.Contains(err.Error(), "no_such_9") {
		t.Errorf("two specs broken: %v; want the first's error (naming no_such_9)", err)
	}
}

// BenchmarkReadLinears times the host side of loading one layer:
// readLinears against readLinearAs one linear at a time, on the packed
// checkpoint in LLMQ_BENCH_CHECKPOINT (e.g. llmq synth --preset
// qwen3-30b-a3b --layers 2), layer 0, as the load reads it (a
// mixture's experts as the grouped kernel takes them).
func BenchmarkReadLinears(b *testing.B) {
	dir := os.Getenv("LLMQ_BENCH_CHECKPOINT")
	if dir == "" {
		b.Skip("LLMQ_BENCH_CHECKPOINT is not set: no packed checkpoint to read")
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer ck.Close()
	q, err := pack.ParseQuantConfig(ck.Config.Quantization)
	if err != nil {
		b.Fatal(err)
	}
	m := &Model{cfg: ck.Config}
	specs := llm.BlockLinears(ck.Config, 0)
	b.Logf("%s: %d linears in layer 0, %d cores", dir, len(specs), mat.Workers())
	b.Run("parallel", func(b *testing.B) {
		for range b.N {
			if _, err := m.readLinears(ck, q, specs, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("one-by-one", func(b *testing.B) {
		for range b.N {
			for _, s := range specs {
				if _, err := m.readLinearAs(ck, q, s, nil); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}

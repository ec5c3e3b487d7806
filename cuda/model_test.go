//go:build cgo

package cuda

import (
	"context"
	"math"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// loadBoth opens a shared model on the CPU and on the GPU.
func loadBoth(t *testing.T, name string) (*pack.Model, *Model) {
	t.Helper()
	lib := openLib(t)
	dir := shared.Path(t, "models/"+name)
	cpu, err := pack.OpenModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cpu.Close() })
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	gpu, err := Load(lib, ck)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gpu.Close() })
	return cpu, gpu
}

// The GPU's logits on the reference input, against transformers' fp32
// logits: fp16 activations move them by a few hundredths at most, and
// the argmax of every position is kept.
func TestModelLogits(t *testing.T) {
	for _, name := range []string{"llama-tiny", "llama-small"} {
		t.Run(name, func(t *testing.T) {
			_, gpu := loadBoth(t, name)
			ids := shared.Int32s(t, "reference/"+name+".logits.input.i32")
			ref := shared.Float32s(t, "reference/"+name+".logits.f32")
			V := gpu.Config().Vocab
			cache, err := gpu.NewCache(len(ids))
			if err != nil {
				t.Fatal(err)
			}
			defer cache.(*Cache).Close()
			got := make([]float32, len(ids)*V)
			if err := gpu.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: got}}); err != nil {
				t.Fatal(err)
			}
			var maxd, sumd float64
			argmax := 0
			for r := 0; r < len(ids); r++ {
				g, w := got[r*V:(r+1)*V], ref[r*V:(r+1)*V]
				for i := range g {
					d := math.Abs(float64(g[i] - w[i]))
					maxd = max(maxd, d)
					sumd += d
				}
				if llm.Argmax(g) == llm.Argmax(w) {
					argmax++
				}
			}
			t.Logf("%s on %s: max |Δlogit| %.4f, mean %.5f, argmax equal at %d/%d positions", name, gpu.Name(), maxd, sumd/float64(len(got)), argmax, len(ids))
			if maxd > 0.25 || sumd/float64(len(got)) > 0.02 || argmax < len(ids)-1 {
				t.Errorf("GPU logits too far from the reference")
			}
		})
	}
}

// Greedy decoding on the GPU (decode steps through CUDA graphs) gives
// transformers' 32 reference tokens for every reference prompt.
func TestGreedyMatchesReference(t *testing.T) {
	for _, name := range []string{"llama-tiny", "llama-small"} {
		t.Run(name, func(t *testing.T) {
			_, gpu := loadBoth(t, name)
			for prompt, r := range shared.GreedyRefs(t, name) {
				out, err := llm.Generate(context.Background(), gpu, r.PromptIDs, llm.GenerateOptions{MaxTokens: len(r.GreedyIDs)}, nil)
				if err != nil {
					t.Fatal(err)
				}
				for i := range r.GreedyIDs {
					if i >= len(out) || out[i] != r.GreedyIDs[i] {
						t.Errorf("%q: first difference at token %d:\n got %v\nwant %v", prompt, i, out, r.GreedyIDs)
						break
					}
				}
			}
		})
	}
}

// A batch mixing a prefill with decodes, then batched decode steps (a
// graph for batch 3), gives each sequence the tokens it gets alone.
func TestBatchedSteps(t *testing.T) {
	_, gpu := loadBoth(t, "llama-small")
	prompts := [][]int{{0, 462, 2347, 286, 265}, {0, 6810, 815, 263, 630}, {0, 5, 6, 7, 8, 9, 10, 11, 12}}
	const n = 12
	alone := make([][]int, len(prompts))
	for i, p := range prompts {
		out, err := llm.Generate(context.Background(), gpu, p, llm.GenerateOptions{MaxTokens: n}, nil)
		if err != nil {
			t.Fatal(err)
		}
		alone[i] = out
	}
	V := gpu.Config().Vocab
	caches := make([]llm.Cache, len(prompts))
	logits := make([][]float32, len(prompts))
	next := make([][]int, len(prompts))
	got := make([][]int, len(prompts))
	for i := range prompts {
		c, err := gpu.NewCache(64)
		if err != nil {
			t.Fatal(err)
		}
		defer c.(*Cache).Close()
		caches[i], logits[i] = c, make([]float32, V)
	}
	// Sequence 0 prefills alone first, so the next pass mixes its decode
	// step with the others' prefills.
	next[0] = prompts[0]
	if err := gpu.Forward(context.Background(), []llm.Step{{Cache: caches[0], Tokens: next[0], Logits: logits[0], LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	got[0] = append(got[0], llm.Argmax(logits[0]))
	next[0], next[1], next[2] = []int{got[0][0]}, prompts[1], prompts[2]
	for step := 0; len(got[2]) < n; step++ {
		steps := make([]llm.Step, 0, 3)
		for i := range prompts {
			if len(got[i]) < n {
				steps = append(steps, llm.Step{Cache: caches[i], Tokens: next[i], Logits: logits[i], LastOnly: true})
			}
		}
		if err := gpu.Forward(context.Background(), steps); err != nil {
			t.Fatal(err)
		}
		for i := range prompts {
			if len(got[i]) < n {
				id := llm.Argmax(logits[i])
				got[i] = append(got[i], id)
				next[i] = []int{id}
			}
		}
	}
	for i := range prompts {
		for j := range alone[i] {
			if got[i][j] != alone[i][j] {
				t.Errorf("sequence %d in a batch: %v, alone: %v", i, got[i], alone[i])
				break
			}
		}
	}
	if len(gpu.graphs) == 0 {
		t.Error("no decode step went through a CUDA graph")
	}
}

// The GPU's window NLL (log-softmax on the device) against the CPU's.
func TestWindowNLL(t *testing.T) {
	cpu, gpu := loadBoth(t, "llama-tiny")
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	for w := 0; w < 3; w++ {
		win := ids[w*2048 : (w+1)*2048]
		g, n, err := gpu.WindowNLL(context.Background(), win)
		if err != nil {
			t.Fatal(err)
		}
		V := cpu.Config().Vocab
		cache, _ := cpu.NewCache(len(win))
		logits := make([]float32, len(win)*V)
		if err := cpu.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: win, Logits: logits}}); err != nil {
			t.Fatal(err)
		}
		var c float64
		for i := 0; i+1 < len(win); i++ {
			c += llm.NLL(logits[i*V:(i+1)*V], win[i+1])
		}
		rel := math.Abs(g-c) / c
		t.Logf("window %d: GPU mean NLL %.5f, CPU %.5f (relative difference %.2e)", w, g/float64(n), c/float64(n), rel)
		if n != len(win)-1 || rel > 1e-3 {
			t.Errorf("window %d: GPU NLL %.4f over %d tokens, CPU %.4f", w, g, n, c)
		}
	}
}

// A failing kernel comes back as an error naming it, and the model keeps
// working afterwards.
func TestKernelErrorIsRecoverable(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	err := gpu.lib.Embed(Buf{}, gpu.embed, Buf{}, 0, gpu.cfg.Hidden) // a grid of 0 blocks
	if err == nil || !strings.Contains(err.Error(), "embed_kernel") {
		t.Fatalf("launch with 0 blocks: %v, want an error naming embed_kernel", err)
	}
	if _, err := llm.Generate(context.Background(), gpu, []int{0, 462, 2347}, llm.GenerateOptions{MaxTokens: 4}, nil); err != nil {
		t.Fatalf("after a failed launch: %v", err)
	}
	if _, err := gpu.NewCache(1 << 30); err == nil || !strings.Contains(err.Error(), "max_position_embeddings") {
		t.Errorf("oversized cache: %v", err)
	}
}

func TestCheckFits(t *testing.T) {
	dev := Device{Name: "H200", FreeBytes: 10 << 30, TotalBytes: 140 << 30}
	if err := checkFits("m", 9<<30, dev); err != nil {
		t.Error(err)
	}
	err := checkFits("llama3-70b", 141<<30, dev)
	if err == nil || !strings.Contains(err.Error(), "needs about 141.0 GiB") || !strings.Contains(err.Error(), "has 10.0 GiB free") {
		t.Errorf("too large: %v", err)
	}
}

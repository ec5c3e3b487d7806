//go:build cgo

package cuda

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
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
			defer cache.Close()
			got := make([]float32, len(ids)*V)
			if err := gpu.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: got}}); err != nil {
				t.Fatal(err)
			}
			maxd, mean, argmax := logitDiff(got, ref, V)
			t.Logf("%s on %s: max |Δlogit| %.4f, mean %.5f, argmax equal at %d/%d positions", name, gpu.Name(), maxd, mean, argmax, len(ids))
			if maxd > 0.25 || mean > 0.02 || argmax < len(ids)-1 {
				t.Errorf("GPU logits too far from the reference")
			}
		})
	}
}

// The architecture zoo's families the GPU runs (Qwen2's biases, Mistral's
// head_dim 48 and its sliding window of 64 over 126 positions, Llama-3.1's
// RoPE scaling, Qwen3's q/k norms, Gemma 3's sandwich norms, GeGLU,
// embedding and score scales, and its sliding layer with its own RoPE,
// Qwen3-MoE's and Mixtral's mixtures of experts in fp16) against
// transformers' fp32 logits, as TestModelLogits; then the last 8 positions
// again as decode steps after a prefill of the rest (the cache attention
// and the decode graphs), against the full pass.
func TestZooLogitsOnGPU(t *testing.T) {
	for _, name := range []string{"qwen2-rand", "mistral-rand", "mistral-swa-rand", "llama31-rand", "qwen3-rand", "gemma3-rand", "qwen3moe-rand", "mixtral-rand"} {
		t.Run(name, func(t *testing.T) {
			_, gpu := loadBoth(t, "archzoo/"+name)
			ids := shared.Int32s(t, "reference/"+name+".logits.input.i32")
			ref := shared.Float32s(t, "reference/"+name+".logits.f32")
			V, n := gpu.Config().Vocab, len(ids)
			if len(ref) != n*V {
				t.Fatalf("reference has %d logits, want %d×%d", len(ref), n, V)
			}
			cache, err := gpu.NewCache(n)
			if err != nil {
				t.Fatal(err)
			}
			defer cache.Close()
			got := make([]float32, n*V)
			if err := gpu.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: got}}); err != nil {
				t.Fatal(err)
			}
			maxd, mean, argmax := logitDiff(got, ref, V)
			t.Logf("%s on %s: max |Δlogit| %.4f, mean %.5f, argmax equal at %d/%d positions", name, gpu.Name(), maxd, mean, argmax, n)
			if tie, ok := routerNearTie[name]; ok {
				// A router's near-tie flips with fp16 noise and moves that
				// position's logits by units (and, through attention, the
				// positions after it a little). Up to n/50 positions past
				// tol, none before the known near-tie, may be left out;
				// the rest must be as close as a dense model's.
				var out []int
				maxd, out = logitDiffOver(got, ref, V, 0.25)
				t.Logf("%s: positions %v left out (router near-tie at %d); max |Δlogit| over the rest %.4f", name, out, tie, maxd)
				if len(out) > n/50 || len(out) > 0 && slices.Min(out) < tie {
					t.Errorf("%s: positions %v are off by more than 0.25: more than %d, or before the near-tie at %d", name, out, n/50, tie)
				}
			}
			if maxd > 0.25 || mean > 0.02 || argmax < n-n/20 {
				t.Errorf("GPU logits too far from the reference")
			}

			const steps = 8
			dec, err := gpu.NewCache(n)
			if err != nil {
				t.Fatal(err)
			}
			defer dec.Close()
			last := make([]float32, V)
			if err := gpu.Forward(context.Background(), []llm.Step{{Cache: dec, Tokens: ids[:n-steps], Logits: last, LastOnly: true}}); err != nil {
				t.Fatal(err)
			}
			for p := n - steps; p < n; p++ {
				if err := gpu.Forward(context.Background(), []llm.Step{{Cache: dec, Tokens: ids[p : p+1], Logits: last, LastOnly: true}}); err != nil {
					t.Fatal(err)
				}
				if d, _, _ := logitDiff(last, got[p*V:(p+1)*V], V); d > 0.1 {
					t.Errorf("decode step at position %d: max |Δlogit| %.4f against the full pass", p, d)
				}
			}
		})
	}
}

// TestJoinedLinearsMatchSeparate: a packed checkpoint (LLMQ_TEST_W4_MODELS,
// colon-separated directories; cuda/device-model.sh check makes RTN w4
// copies of llama-tiny, one with its lm_head quantized too, and of
// qwen2-rand, whose q/k/v have biases, and two mixtures; and a synthetic
// qwen3-30b-a3b of three layers whose middle one is dense) loaded
// with q/k/v and gate/up joined into one GEMM each gives the logits of the
// same model run layer by layer, and both stay within TestModelLogits'
// bounds of the CPU backend's — over a prefill (the fused kernel) and
// then decode steps one token at a time (the GEMV kernel).
func TestJoinedLinearsMatchSeparate(t *testing.T) {
	dirs := os.Getenv("LLMQ_TEST_W4_MODELS")
	if dirs == "" {
		t.Skip("LLMQ_TEST_W4_MODELS is not set: no packed checkpoints to load (cuda/device-model.sh check makes them)")
	}
	lib := openLib(t)
	for _, dir := range strings.Split(dirs, ":") {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			ck, err := checkpoint.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			cpu, err := pack.OpenModel(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer cpu.Close()
			V, n, steps := ck.Config.Vocab, 96, 4
			ids := make([]int, n)
			for i := range ids {
				ids[i] = (i*7919 + 13) % V
			}
			run := func(m llm.Backend) []float32 {
				t.Helper()
				cache, err := m.NewCache(n)
				if err != nil {
					t.Fatal(err)
				}
				defer cache.Close()
				out := make([]float32, n*V)
				if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids[:n-steps], Logits: out[:(n-steps)*V]}}); err != nil {
					t.Fatal(err)
				}
				for p := n - steps; p < n; p++ {
					if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids[p : p+1], Logits: out[p*V : (p+1)*V]}}); err != nil {
						t.Fatal(err)
					}
				}
				return out
			}
			var logits [2][]float32
			for i, join := range []bool{true, false} {
				gpu, err := LoadWith(lib, ck, LoadOptions{Separate: !join})
				if err != nil {
					t.Fatal(err)
				}
				// A quantized lm_head with power-of-two groups stays packed
				// (Load) and runs headRows rows at a time: the prefill's 92
				// rows are two calls.
				if strings.HasSuffix(dir, "-head") && (gpu.lmHead.w4 == nil || !gpu.lmHead.w.Nil()) {
					t.Fatalf("the quantized lm_head is not held packed")
				}
				b := gpu.blocks[0]
				if joined := b.qkv != nil && (b.gateUp != nil || b.moe != nil); joined != join {
					t.Fatalf("join %v: block 0 joined %v", join, joined)
				}
				// A dense block's joined gate/up applies the activation in the
				// GEMM's epilogue (interleaved halves, W4.Gated).
				if join && b.gateUp != nil && b.gateUp.w4.Gated != GatingFor(gpu.cfg.Act) {
					t.Fatalf("block 0's gate/up runs gating %d, want %d", b.gateUp.w4.Gated, GatingFor(gpu.cfg.Act))
				}
				// A mixture's 4-bit experts run on the grouped W4 GEMV
				// (mixtral-rand), or dequantized in fp16 where its layout
				// cannot hold them (qwen3moe-rand: 96 outputs, not a
				// multiple of the 64-column tiles).
				if wantFP16 := strings.Contains(dir, "qwen3moe"); b.moe != nil && (b.moe.gateUp == nil) != wantFP16 {
					t.Fatalf("experts: grouped 4-bit %v, want fp16 %v", b.moe.gateUp != nil, wantFP16)
				}
				// Joined, 4-bit experts a multiple of 64 wide write act(gate)·up
				// in the grouped GEMV (interleaved, W4.Gated); separate, they
				// run the activation after it.
				if b.moe != nil && b.moe.gateUp != nil {
					want := NotGated
					if join && gpu.cfg.MoE.Intermediate%64 == 0 {
						want = GatingFor(gpu.cfg.Act)
					}
					if b.moe.gateUp.Gated != want {
						t.Fatalf("join %v: the experts' gate/up runs gating %d, want %d", join, b.moe.gateUp.Gated, want)
					}
				}
				// A mixture's packed o leaves its sums through the experts at
				// decode (moeSums), as the dense blocks' o and down do.
				if b.moe != nil && b.o != nil && b.o.w4 != nil && os.Getenv("LLMQ_SPLIT_SUMS") == "" && !gpu.moeSums(b, 1) {
					t.Fatalf("block 0, a mixture with a packed o: o writes fp16 at decode, want its sums left to the combine")
				}
				logits[i] = run(gpu)
				gpu.Close()
			}
			// o and down writing fp16 outputs (LoadOptions.HalfDeltas) against
			// their fp32 sums finished by the next norm (the default): the
			// deltas differ by their fp16 rounding.
			half, err := LoadWith(lib, ck, LoadOptions{HalfDeltas: true})
			if err != nil {
				t.Fatal(err)
			}
			halfLogits := run(half)
			half.Close()
			if d, _, argmax := logitDiff(logits[0], halfLogits, V); d > 0.05 || argmax < n-1 {
				t.Errorf("fp16 deltas against split sums finished by the norm: max |Δlogit| %.4f, argmax equal at %d/%d", d, argmax, n)
			} else {
				t.Logf("fp16 deltas against split sums: max |Δlogit| %.4f", d)
			}
			want := run(cpu)
			d, mean, argmax := logitDiff(logits[0], logits[1], V)
			t.Logf("joined against separate: max |Δlogit| %.4f, mean %.5f, argmax equal at %d/%d positions", d, mean, argmax, n)
			if d > 0.05 || argmax < n-1 {
				t.Errorf("joined GEMMs moved the logits")
			}
			d, mean, argmax = logitDiff(logits[0], want, V)
			t.Logf("joined against the CPU: max |Δlogit| %.4f, mean %.5f, argmax equal at %d/%d positions", d, mean, argmax, n)
			if d > 0.25 || mean > 0.02 || argmax < n-n/20 {
				t.Errorf("GPU logits too far from the CPU's")
			}
		})
	}
}

// logitDiff compares rows of V logits: the largest and the mean absolute
// difference, and at how many rows the argmax is the same.
func logitDiff(got, want []float32, V int) (maxd, mean float64, argmax int) {
	for r := 0; r < len(got)/V; r++ {
		g, w := got[r*V:(r+1)*V], want[r*V:(r+1)*V]
		for i := range g {
			d := math.Abs(float64(g[i] - w[i]))
			maxd, mean = max(maxd, d), mean+d
		}
		if llm.Argmax(g) == llm.Argmax(w) {
			argmax++
		}
	}
	return maxd, mean / float64(len(got)), argmax
}

// routerNearTie is, for a mixture of the zoo, the first position where
// its routing is a near-tie on the CPU: qwen3moe-rand's layer 0 at
// position 107 has its 2nd and 3rd experts' logits 1.1e-4 apart
// (measured with the CPU model), so fp16 noise may pick either.
var routerNearTie = map[string]int{"qwen3moe-rand": 107}

// logitDiffOver is logitDiff's max |Δlogit| over the positions within tol,
// and the positions past it.
func logitDiffOver(got, want []float32, V int, tol float64) (float64, []int) {
	var maxd float64
	var out []int
	for r := range len(got) / V {
		d, _, _ := logitDiff(got[r*V:(r+1)*V], want[r*V:(r+1)*V], V)
		if d > tol {
			out = append(out, r)
		} else {
			maxd = max(maxd, d)
		}
	}
	return maxd, out
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

// TestPagedCache: a GPU cache takes blocks of 16 positions per layer from
// the model's pool as it grows (none when opened), gives back those past a
// truncation and all of them when closed; a pass the pool cannot hold
// fails whole (no block taken, the length unchanged) and the cache goes on
// once there is room; Trim returns the segments once no block is in use.
// (Logits through the blocks are every other GPU test's; the attention
// test also runs its cases on shuffled blocks, and TestLongContextMatchesCPU
// decodes in blocks another sequence held before.)
func TestPagedCache(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	ctx := context.Background()
	L, V := gpu.Config().Layers, gpu.Config().Vocab
	pool := gpu.KVPool()
	c, err := gpu.NewCache(512)
	if err != nil {
		t.Fatal(err)
	}
	pc := c.(llm.PagedCache)
	if pc.Blocks() != 0 || pool.Used() != 0 {
		t.Fatalf("a new cache holds %d blocks (pool: %d in use), want none", pc.Blocks(), pool.Used())
	}
	step := func(n int) error {
		ids := make([]int, n)
		for i := range ids {
			ids[i] = (c.Len()*7 + i*13 + 5) % V
		}
		return gpu.Forward(ctx, []llm.Step{{Cache: c, Tokens: ids, Logits: make([]float32, V), LastOnly: true}})
	}
	if err := step(40); err != nil {
		t.Fatal(err)
	}
	if pc.Blocks() != 3*L || pool.Used() != 3*L || c.Len() != 40 {
		t.Errorf("40 tokens: %d blocks held (pool %d), length %d; want %d, 40", pc.Blocks(), pool.Used(), c.Len(), 3*L)
	}
	if mem, err := gpu.Memory(); err != nil || mem.Caches < int64(3*L)*pool.BlockBytes() {
		t.Errorf("40 tokens: memory %+v, %v; want the context's count to agree and at least the blocks held", mem, err)
	}
	c.Truncate(20)
	if pc.Blocks() != 2*L {
		t.Errorf("truncated to 20: %d blocks held, want %d", pc.Blocks(), 2*L)
	}
	// A pool of the blocks held plus one layer's block: the next 20 tokens
	// (to 40, block 2 in every layer) do not fit.
	if err := gpu.SetKVCacheBytes(int64(2*L+1) * pool.BlockBytes()); err != nil {
		t.Fatal(err)
	}
	if err := step(20); err == nil || !strings.Contains(err.Error(), "exhausted") {
		t.Errorf("a pass past the pool: %v, want the pool exhausted", err)
	}
	if pc.Blocks() != 2*L || c.Len() != 20 {
		t.Errorf("after the refused pass: %d blocks, length %d; want %d, 20", pc.Blocks(), c.Len(), 2*L)
	}
	if err := gpu.SetKVCacheBytes(0); err != nil {
		t.Fatal(err)
	}
	if err := step(20); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if pool.Used() != 0 {
		t.Errorf("closed: the pool has %d blocks in use, want 0", pool.Used())
	}
	gpu.Trim()
	mem, err := gpu.Memory()
	if err != nil {
		t.Fatal(err)
	}
	if mem.Caches != 0 {
		t.Errorf("after Trim with no cache open: %d bytes of caches, want 0", mem.Caches)
	}
}

// TestGreedyStepsOnDevice: decode steps that ask only for their argmax
// (llm.Step.Greedy, no logits buffer) get the id the host picks from the
// logits of the same sequence in a batch of the same make-up, whether
// every step of the batch asks (the argmax kernel, ids copied back) or
// only some do (the logits copied back, the argmax taken on the host).
// Two sequences with different prompts, each run twice: once greedy, once
// with logits; a swapped or repeated row picks the other sequence's token.
func TestGreedyStepsOnDevice(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	if !llm.IsGreedier(gpu) {
		t.Fatal("the GPU model does not answer greedy steps")
	}
	ctx := context.Background()
	prompts := [][]int{{1, 450, 4955, 310, 278}, {1, 3118, 263, 931, 727, 471}}
	V := gpu.Config().Vocab
	// caches[0], [1]: the two sequences, greedy; [2], [3]: the same, with logits.
	caches := make([]llm.Cache, 4)
	next := make([]int, 2)
	for i := range caches {
		c, err := gpu.NewCache(32)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		caches[i] = c
		logits := make([]float32, V)
		if err := gpu.Forward(ctx, []llm.Step{{Cache: c, Tokens: prompts[i%2], Logits: logits, LastOnly: true}}); err != nil {
			t.Fatal(err)
		}
		next[i%2] = llm.Argmax(logits)
	}
	if next[0] == next[1] {
		t.Logf("both prompts continue with %d: the first step cannot tell the rows apart", next[0])
	}
	logits := [][]float32{make([]float32, V), make([]float32, V)}
	for step := range 4 {
		greedy := []llm.Step{
			{Cache: caches[0], Tokens: []int{next[0]}, LastOnly: true, Greedy: true},
			{Cache: caches[1], Tokens: []int{next[1]}, LastOnly: true, Greedy: true},
		}
		plain := []llm.Step{
			{Cache: caches[2], Tokens: []int{next[0]}, Logits: logits[0], LastOnly: true},
			{Cache: caches[3], Tokens: []int{next[1]}, Logits: logits[1], LastOnly: true},
		}
		if step == 3 { // a batch mixing a greedy step with one that wants its logits, both ways round
			greedy[1], plain[1] = plain[1], greedy[1]
		}
		for _, b := range [][]llm.Step{greedy, plain} {
			if err := gpu.Forward(ctx, b); err != nil {
				t.Fatal(err)
			}
		}
		for i := range 2 {
			want := llm.Argmax(logits[i])
			var got int
			if step == 3 && i == 1 {
				got = plain[1].Argmax
			} else {
				got = greedy[i].Argmax
			}
			if got != want {
				t.Fatalf("step %d, sequence %d: the greedy step picked %d, the host picks %d from the same sequence's logits", step, i, got, want)
			}
			next[i] = want
		}
	}
}

// TestDecodeGreedyMatchesSteps: a chain of greedy steps on the device
// (llm.Chainer) picks what single steps pick from their logits, for two
// sequences at once — a short one, and one whose chain crosses
// 16-position blocks and the graphs' 256-key bound — and leaves the caches
// as single steps leave them: the step after gives the same logits. The
// single steps are fed the chain's picks (teacher forcing), so every step
// is compared on the same inputs. The chain runs the 512-key graph
// throughout and single steps switch to it midway, so the attention may
// sum in another order: a pick may differ only where the reference's top
// two logits are within twice the logits' tolerance. Bad chains fail
// whole: no cache advanced, no block taken.
func TestDecodeGreedyMatchesSteps(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	ch, ok := llm.Backend(gpu).(llm.Chainer)
	if !ok {
		t.Fatal("the GPU model does not chain greedy steps")
	}
	ctx := context.Background()
	V := gpu.Config().Vocab
	long := make([]int, 250)
	for i := range long {
		long[i] = (i*7919 + 11) % V
	}
	prompts := [][]int{{1, 450, 4955, 310, 278}, long}
	const n, tol = 12, 1e-2 // steps a chain; the largest |Δlogit| allowed between the two ways
	prefill := func() ([]llm.Cache, []int) {
		caches, next := make([]llm.Cache, 2), make([]int, 2)
		for i := range caches {
			c, err := gpu.NewCache(300)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			logits := make([]float32, V)
			if err := gpu.Forward(ctx, []llm.Step{{Cache: c, Tokens: prompts[i], Logits: logits, LastOnly: true}}); err != nil {
				t.Fatal(err)
			}
			caches[i], next[i] = c, llm.Argmax(logits)
		}
		return caches, next
	}

	chained, first := prefill()
	steps := []llm.Step{{Cache: chained[0], Tokens: []int{first[0]}}, {Cache: chained[1], Tokens: []int{first[1]}}}
	pool := gpu.KVPool()
	used := pool.Used()
	for _, bad := range []struct {
		steps []llm.Step
		n     int
		want  string
	}{
		{[]llm.Step{steps[0], {Cache: chained[1], Tokens: []int{first[1], first[1]}}}, n, "2 tokens"},
		{steps, 0, "at least 1"},
		{steps, 300, "capacity"},
		{[]llm.Step{steps[0], {Cache: chained[1], Tokens: []int{V}}}, n, "vocabulary"},
	} {
		if _, err := ch.DecodeGreedy(ctx, bad.steps, bad.n); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("chain of %d (%v): %v, want an error saying %q", bad.n, bad.steps[1].Tokens, err, bad.want)
		}
		for i, c := range chained {
			if c.Len() != len(prompts[i]) || pool.Used() != used {
				t.Fatalf("after a failed chain, cache %d holds %d tokens (want its prompt's %d), the pool %d blocks (want %d)",
					i, c.Len(), len(prompts[i]), pool.Used(), used)
			}
		}
	}
	got, err := ch.DecodeGreedy(ctx, steps, n)
	if err != nil {
		t.Fatal(err)
	}

	// The reference: single steps fed the chain's picks, each step's
	// argmax and its margin over the runner-up.
	one, next := prefill()
	for i := range 2 {
		if next[i] != first[i] {
			t.Fatalf("sequence %d: the two prefills pick %d and %d", i, first[i], next[i])
		}
	}
	logits := [][]float32{make([]float32, V), make([]float32, V)}
	for k := range n {
		in := next
		st := []llm.Step{{Cache: one[0], Tokens: []int{in[0]}, Logits: logits[0], LastOnly: true},
			{Cache: one[1], Tokens: []int{in[1]}, Logits: logits[1], LastOnly: true}}
		if err := gpu.Forward(ctx, st); err != nil {
			t.Fatal(err)
		}
		for i := range 2 {
			top := llm.Argmax(logits[i])
			second := float32(math.Inf(-1))
			for j, v := range logits[i] {
				if j != top && v > second {
					second = v
				}
			}
			if got[i][k] != top && logits[i][top]-second >= 2*tol {
				t.Errorf("sequence %d, step %d: the chain picked %d, single steps %d (ahead of the runner-up by %.4g)",
					i, k, got[i][k], top, logits[i][top]-second)
			} else if got[i][k] != top {
				t.Logf("sequence %d, step %d: a near-tie (margin %.2g) picked both ways", i, k, logits[i][top]-second)
			}
		}
		next = []int{got[0][k], got[1][k]} // teacher forcing: the chain's picks
	}
	// The step after: the caches hold the same keys and values.
	after := [][]float32{make([]float32, V), make([]float32, V)}
	for i := range 2 {
		if chained[i].Len() != one[i].Len() {
			t.Fatalf("sequence %d: the chain left %d tokens in the cache, single steps %d", i, chained[i].Len(), one[i].Len())
		}
		for _, st := range []llm.Step{{Cache: one[i], Tokens: []int{got[i][n-1]}, Logits: logits[i], LastOnly: true},
			{Cache: chained[i], Tokens: []int{got[i][n-1]}, Logits: after[i], LastOnly: true}} {
			if err := gpu.Forward(ctx, []llm.Step{st}); err != nil {
				t.Fatal(err)
			}
		}
		worst, _, _ := logitDiff(after[i], logits[i], V)
		if worst > tol {
			t.Errorf("sequence %d: the step after the chain's logits differ from single steps' by up to %.3g", i, worst)
		}
		t.Logf("sequence %d: the step after's logits within %.2g of single steps'", i, worst)
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
		defer c.Close()
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

// A prefill into empty caches goes through the flash kernel (one window,
// or several of one length); a prefill after cached tokens reads the cache.
// The two agree on every position's logits.
func TestPrefillFlashMatchesCacheAttention(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")[:300]
	V := gpu.Config().Vocab
	// forward runs the steps (token slices, each into a new cache after
	// the cached prefix) and returns every row's logits, step by step.
	forward := func(prefix []int, steps ...[]int) [][]float32 {
		t.Helper()
		var ss []llm.Step
		for _, toks := range steps {
			c, err := gpu.NewCache(len(prefix) + len(toks))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			if len(prefix) > 0 {
				if err := gpu.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: prefix, Logits: make([]float32, V), LastOnly: true}}); err != nil {
					t.Fatal(err)
				}
			}
			ss = append(ss, llm.Step{Cache: c, Tokens: toks, Logits: make([]float32, len(toks)*V)})
		}
		before := gpu.flashPasses
		if err := gpu.Forward(context.Background(), ss); err != nil {
			t.Fatal(err)
		}
		if flash := gpu.flashPasses > before; flash != (len(prefix) == 0) {
			t.Fatalf("%d steps after %d cached tokens: flash kernel used %v", len(steps), len(prefix), flash)
		}
		out := make([][]float32, len(ss))
		for i, s := range ss {
			out[i] = s.Logits
		}
		return out
	}
	compare := func(what string, got, want []float32) {
		t.Helper()
		n := len(got) / V
		maxd, mean, argmax := logitDiff(got, want, V)
		t.Logf("%s: max |Δlogit| %.4f, mean %.5f, argmax equal at %d/%d positions", what, maxd, mean, argmax, n)
		if maxd > 0.1 || mean > 0.01 || argmax < n-1 {
			t.Errorf("%s: the flash kernel's logits and the cache attention's disagree", what)
		}
	}
	whole := forward(nil, ids)[0]
	cached := forward(ids[:1], ids[1:])[0]
	compare("300 tokens: one flash window against 1 + 299 through the cache", whole[V:], cached)
	two := forward(nil, ids[:150], ids[150:])
	compare("two windows of 150 in one pass, the first", two[0][V:], forward(ids[:1], ids[1:150])[0])
	compare("two windows of 150 in one pass, the second", two[1][V:], forward(ids[150:151], ids[151:])[0])
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
	err := gpu.x.Embed(Buf{}, gpu.embed, Buf{}, 0, gpu.cfg.Hidden, 0) // a grid of 0 blocks
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

// TestEstimateCountsCodesAsTheGPUHoldsThem: a GPTQ qweight of K×N weights
// takes K·N/2 bytes on the GPU at 2 to 4 bits (nibbles) and K·N at 8 bits
// (bytes), whatever its size on disk, a quantized lm_head likewise unless
// its groups are not a power of two (then K·N·2: it runs dequantized);
// other tensors count as stored.
func TestEstimateCountsCodesAsTheGPUHoldsThem(t *testing.T) {
	const K, N = 4096, 1024
	for _, c := range []struct{ bits, want int64 }{{2, K * N / 2}, {3, K * N / 2}, {4, K * N / 2}, {8, K * N}} {
		q := &pack.QuantConfig{QuantMethod: "gptq", Bits: int(c.bits), GroupSize: 128}
		qweight := checkpoint.Tensor{Name: "model.layers.0.mlp.down_proj.qweight", DType: safetensors.I32, Shape: []int{K * int(c.bits) / 32, N}}
		if got := tensorGPUBytes(qweight, q); got != c.want {
			t.Errorf("%d-bit qweight: %d bytes, want %d", c.bits, got, c.want)
		}
		scales := checkpoint.Tensor{Name: "model.layers.0.mlp.down_proj.scales", DType: safetensors.F16, Shape: []int{K / 128, N}}
		if got, want := tensorGPUBytes(scales, q), int64(K/128*N*2); got != want {
			t.Errorf("%d-bit scales: %d bytes, want %d", c.bits, got, want)
		}
	}
	// A quantized lm_head stays packed (K·N/2 bytes at 4 bits), but one
	// with groups of 96 rows, or 1040 outputs (not whole 64-column tiles),
	// runs dequantized, in fp16: K·N·2 bytes.
	for _, c := range []struct{ group, n, want int64 }{{128, N, K * N / 2}, {-1, N, K * N / 2}, {96, N, K * N * 2}, {128, 1040, K * 1040 * 2}} {
		head := checkpoint.Tensor{Name: "lm_head.qweight", DType: safetensors.I32, Shape: []int{K * 4 / 32, int(c.n)}}
		q := &pack.QuantConfig{QuantMethod: "gptq", Bits: 4, GroupSize: int(c.group)}
		if got := tensorGPUBytes(head, q); got != c.want {
			t.Errorf("4-bit lm_head, %d outputs in groups of %d: %d bytes, want %d", c.n, c.group, got, c.want)
		}
	}
	bf16 := checkpoint.Tensor{Name: "model.layers.0.mlp.down_proj.weight", DType: safetensors.BF16, Shape: []int{N, K}}
	if got := tensorGPUBytes(bf16, nil); got != K*N*2 {
		t.Errorf("bf16 weight: %d bytes, want %d", got, K*N*2)
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

// use runs what a server does with a model: a prefill, batched decode
// steps (graphs for batch 1 and 2), a perplexity window, and a memory
// report that must account for every byte of the context.
func use(t *testing.T, gpu *Model) llm.Memory {
	t.Helper()
	ctx := context.Background()
	if _, err := llm.Generate(ctx, gpu, []int{0, 462, 2347, 286}, llm.GenerateOptions{MaxTokens: 6}, nil); err != nil {
		t.Fatal(err)
	}
	V := gpu.Config().Vocab
	var steps []llm.Step
	for i := 0; i < 2; i++ {
		c, err := gpu.NewCache(32)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		steps = append(steps, llm.Step{Cache: c, Tokens: []int{0, 5 + i}, Logits: make([]float32, V), LastOnly: true})
	}
	for s := 0; s < 3; s++ {
		if err := gpu.Forward(ctx, steps); err != nil {
			t.Fatal(err)
		}
		for i := range steps {
			steps[i].Tokens = []int{llm.Argmax(steps[i].Logits)}
		}
	}
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")[:256]
	if _, _, err := gpu.WindowNLL(ctx, ids); err != nil {
		t.Fatal(err)
	}
	mem, err := gpu.Memory() // fails when the categories miss a byte of the context
	if err != nil {
		t.Fatal(err)
	}
	// The two open caches hold 5 positions, one block a layer each, from
	// the one segment of blocks the pool has needed, and a table each of
	// two rows (capacity 32) of a block address a layer.
	kv, L := &gpu.kv, gpu.cfg.Layers
	if kv.pool.Used() != 2*L {
		t.Errorf("%d blocks in use, want %d (one a layer for each open cache)", kv.pool.Used(), 2*L)
	}
	want := int64(kv.segBlocks)*kv.blockBytes + int64(2*2*L*8)
	if mem.Caches != want || mem.Graphs < 2 || mem.Weights != gpu.WeightBytes() || mem.Activations == 0 {
		t.Errorf("memory while in use: %+v; want %d bytes of caches (a segment of blocks, two tables) and ≥ 2 graphs", mem, want)
	}
	return mem
}

// Loading, using and closing llama-tiny again and again leaves the GPU's
// free memory where it was: Close releases the weights, the caches left
// open, the activations, the decode graphs, the cuBLAS handle and its
// workspace, and the stream. The baseline is taken after one round, once
// the CUDA context exists and the kernels' modules are loaded (both stay
// for the life of the process).
func TestLoadUnloadReleasesMemory(t *testing.T) {
	lib := openLib(t)
	dir := shared.Path(t, "models/llama-tiny")
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	free := func() int64 {
		d, err := lib.Device()
		if err != nil {
			t.Fatal(err)
		}
		return int64(d.FreeBytes)
	}
	var base int64
	for round := 0; round < 6; round++ {
		gpu, err := Load(lib, ck)
		if err != nil {
			t.Fatal(err)
		}
		mem := use(t, gpu)
		leak, err := gpu.NewCache(64) // left open: Close must free it
		if err != nil {
			t.Fatal(err)
		}
		held := base - free()
		if err := gpu.Close(); err != nil {
			t.Fatal(err)
		}
		if err := leak.Close(); err != nil { // after the model: harmless
			t.Fatal(err)
		}
		after := free()
		if round == 0 {
			base = after
			t.Logf("round 0: the model held %.1f MiB (weights %.1f, caches %.1f, activations %.1f, workspace %.1f, %d graphs); baseline free %.1f MiB",
				mib(mem.Total()), mib(mem.Weights), mib(mem.Caches), mib(mem.Activations), mib(mem.Workspace), mem.Graphs, mib(base))
			continue
		}
		t.Logf("round %d: %.1f MiB in use while loaded, free memory after Close %+d bytes from the baseline", round, mib(held), after-base)
		// cudaMemGetInfo moves in 2 MiB pages; anything left behind by a
		// round would show as a whole page at least.
		if after != base {
			t.Errorf("round %d: free memory %d bytes after Close, %d at the start", round, after, base)
		}
	}
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// Several goroutines generating at once on one model (as a server without
// the engine's scheduler would) each get transformers' greedy tokens: the
// model's mutex keeps their passes apart on its one stream.
func TestConcurrentGenerate(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	refs := shared.GreedyRefs(t, "llama-tiny")
	var wg sync.WaitGroup
	errs := make(chan error, 4*len(refs))
	for g := 0; g < 4; g++ {
		for prompt, r := range refs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				out, err := llm.Generate(context.Background(), gpu, r.PromptIDs, llm.GenerateOptions{MaxTokens: len(r.GreedyIDs)}, nil)
				if err != nil {
					errs <- err
					return
				}
				for i := range r.GreedyIDs {
					if i >= len(out) || out[i] != r.GreedyIDs[i] {
						errs <- fmt.Errorf("%q: first difference at token %d: got %v, want %v", prompt, i, out, r.GreedyIDs)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// A closed model answers every call with an error, and closing it again,
// or closing its caches afterwards, is harmless.
func TestClosedModel(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	c, err := gpu.NewCache(8)
	if err != nil {
		t.Fatal(err)
	}
	if err := gpu.Close(); err != nil {
		t.Fatal(err)
	}
	if err := gpu.Close(); err != nil {
		t.Error(err)
	}
	if err := c.Close(); err != nil {
		t.Error(err)
	}
	V := gpu.Config().Vocab
	if err := gpu.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: []int{1}, Logits: make([]float32, V)}}); err == nil {
		t.Error("Forward on a closed model succeeded")
	}
	if _, err := gpu.NewCache(8); err == nil {
		t.Error("NewCache on a closed model succeeded")
	}
	if _, _, err := gpu.WindowNLL(context.Background(), []int{1, 2, 3}); err == nil {
		t.Error("WindowNLL on a closed model succeeded")
	}
	if _, err := gpu.Memory(); err == nil {
		t.Error("Memory on a closed model succeeded")
	}
}

// TestLongContextMatchesCPU (issue 16, long context): llama31-rand
// (Llama-3.1's RoPE scaling, factor 8 over 1024 original positions) with
// its positions raised to 6144, on the GPU and on the CPU: a prefill of
// 4200 random tokens (the flash kernel), then 16 decode steps at positions
// 4200–4215, past 4096 (the decode attention over 66 chunks), each step's
// logits against the CPU's. Before it, another sequence filled a cache of
// the same size and closed it, so the long sequence's cache may sit in
// memory that held other keys and values.
func TestLongContextMatchesCPU(t *testing.T) {
	lib := openLib(t)
	dir := shared.Path(t, "models/archzoo/llama31-rand")
	const positions, prompt, steps = 6144, 4200, 16
	open := func() *checkpoint.Checkpoint {
		ck, err := checkpoint.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ck.Close() })
		ck.Config.MaxPositions = positions
		return ck
	}
	ck := open()
	load, err := pack.Loader(ck.Config)
	if err != nil {
		t.Fatal(err)
	}
	cpu, err := llm.Load(ck, load)
	if err != nil {
		t.Fatal(err)
	}
	gpu, err := Load(lib, open())
	if err != nil {
		t.Fatal(err)
	}
	defer gpu.Close()
	V := gpu.Config().Vocab
	r := rand.New(rand.NewPCG(3, 4))
	ids := make([]int, prompt+steps)
	for i := range ids {
		ids[i] = r.IntN(V)
	}
	ctx := context.Background()
	other, err := gpu.NewCache(prompt + steps)
	if err != nil {
		t.Fatal(err)
	}
	if err := gpu.Forward(ctx, []llm.Step{{Cache: other, Tokens: ids[steps:], Logits: make([]float32, V), LastOnly: true}}); err != nil {
		t.Fatal(err)
	}
	other.Close() // its blocks go back to the pool: the runs below reuse them
	// run returns the logits after the prefill and after each decode step.
	run := func(b llm.Backend) [][]float32 {
		c, err := b.NewCache(prompt + steps)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var out [][]float32
		for p := prompt; p <= prompt+steps; p++ {
			from := p - 1
			if p == prompt {
				from = 0
			}
			last := make([]float32, V)
			if err := b.Forward(ctx, []llm.Step{{Cache: c, Tokens: ids[from:p], Logits: last, LastOnly: true}}); err != nil {
				t.Fatal(err)
			}
			out = append(out, last)
		}
		return out
	}
	g, c := run(gpu), run(cpu)
	worst, same := 0.0, 0
	for i := range g {
		d, _, a := logitDiff(g[i], c[i], V)
		worst, same = max(worst, d), same+a
	}
	t.Logf("positions %d–%d: max |Δlogit| %.4f against the CPU, argmax equal at %d/%d", prompt-1, prompt+steps-1, worst, same, len(g))
	if worst > 0.05 || same < len(g)-1 {
		t.Errorf("GPU logits past 4096 positions too far from the CPU's")
	}
}

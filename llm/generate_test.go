package llm_test

import (
	"context"
	"reflect"
	"slices"
	"testing"

	"github.com/llmq/llmq/internal/hostchain"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// TestGreedyMatchesTransformers: 32 greedy tokens for each reference prompt
// equal transformers' generate() output.
func TestGreedyMatchesTransformers(t *testing.T) {
	for _, name := range []string{"llama-tiny", "llama-small"} {
		m := loadModel(t, "models/"+name)
		for prompt, ref := range shared.GreedyRefs(t, name) {
			got, err := llm.Generate(context.Background(), m, ref.PromptIDs, llm.GenerateOptions{MaxTokens: len(ref.GreedyIDs)}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, ref.GreedyIDs) {
				t.Errorf("%s %q:\n got  %v\n want %v", name, prompt, got, ref.GreedyIDs)
			}
		}
	}
}

// TestCachedDecodingEqualsFullPrefix: each greedy token chosen through the
// KV cache is the argmax of a fresh full-prefix forward pass.
func TestCachedDecodingEqualsFullPrefix(t *testing.T) {
	assertCachedEqualsFullPrefix(t, "llama-tiny", loadModel(t, "models/llama-tiny"), []int{0, 6810, 815, 263, 630}, 20)
}

// assertCachedEqualsFullPrefix generates n greedy tokens after prompt
// through the KV cache and checks each against the argmax of a fresh
// full-prefix pass.
func assertCachedEqualsFullPrefix(t *testing.T, name string, m *llm.Model, prompt []int, n int) {
	t.Helper()
	got, err := llm.Generate(context.Background(), m, prompt, llm.GenerateOptions{MaxTokens: n}, nil)
	if err != nil {
		t.Fatal(err)
	}
	seq := append([]int(nil), prompt...)
	logits := make([]float32, m.Cfg.Vocab)
	for i, id := range got {
		c, _ := m.NewCache(len(seq))
		if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: seq, Logits: logits, LastOnly: true}}); err != nil {
			t.Fatal(err)
		}
		if want := llm.Argmax(logits); want != id {
			t.Fatalf("%s token %d: cached decoding chose %d, full prefix %d", name, i, id, want)
		}
		seq = append(seq, id)
	}
}

// drawer answers Step.Draw on the host, as cuda.Model does on the GPU:
// the logits, then Draw.Pick; it counts the draws it answered.
type drawer struct {
	llm.Backend
	draws int
}

func (*drawer) AnswersDraw() {}

func (d *drawer) Forward(ctx context.Context, steps []llm.Step) error {
	if err := d.Backend.Forward(ctx, steps); err != nil {
		return err
	}
	for i, s := range steps {
		if s.Draw != nil && s.LastOnly {
			steps[i].Argmax = s.Draw.Pick(s.Logits)
			d.draws++
		}
	}
	return nil
}

// TestSamplingIsSeeded: the same seed gives the same tokens, another seed
// (almost surely) different ones, and top-k 1 is greedy.
func TestSamplingIsSeeded(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	prompt := []int{0, 462, 2347, 286, 265}
	run := func(o llm.SampleOptions) []int {
		out, err := llm.Generate(context.Background(), m, prompt, llm.GenerateOptions{MaxTokens: 24, Sample: o}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	a := run(llm.SampleOptions{Temperature: 1, TopP: 0.95, Seed: 7})
	b := run(llm.SampleOptions{Temperature: 1, TopP: 0.95, Seed: 7})
	c := run(llm.SampleOptions{Temperature: 1, TopP: 0.95, Seed: 8})
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("same seed, different tokens:\n%v\n%v", a, b)
	}
	if reflect.DeepEqual(a, c) {
		t.Errorf("seeds 7 and 8 gave identical samples %v", a)
	}
	// A backend that picks sampled tokens itself (a Drawer, as the GPU)
	// gets each token's draw and gives the same text.
	d := &drawer{Backend: m}
	drawn, err := llm.Generate(context.Background(), d, prompt, llm.GenerateOptions{MaxTokens: 24, Sample: llm.SampleOptions{Temperature: 1, TopP: 0.95, Seed: 7}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(drawn, a) || d.draws != len(a) {
		t.Fatalf("picked by the backend from %d draws:\n%v\npicked by the sampler:\n%v", d.draws, drawn, a)
	}
	greedy := run(llm.SampleOptions{})
	if k1 := run(llm.SampleOptions{Temperature: 1.3, TopK: 1, Seed: 3}); !reflect.DeepEqual(k1, greedy) {
		t.Errorf("top-k 1 differs from greedy")
	}
	if err := (llm.SampleOptions{TopP: 1.5}).Validate(); err == nil {
		t.Error("top-p 1.5 accepted")
	}
}

// TestGenerateStopsAtEOS: a stop token ends generation and is not emitted.
func TestGenerateStopsAtEOS(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	prompt := []int{0, 462, 2347, 286, 265}
	full, _ := llm.Generate(context.Background(), m, prompt, llm.GenerateOptions{MaxTokens: 10}, nil)
	// stop at the first token that has not appeared before it
	i := 1
	for ; i < len(full); i++ {
		seen := false
		for _, id := range full[:i] {
			seen = seen || id == full[i]
		}
		if !seen {
			break
		}
	}
	if i == len(full) {
		t.Fatal("no new token in the reference output")
	}
	out, _ := llm.Generate(context.Background(), m, prompt, llm.GenerateOptions{MaxTokens: 10, Stop: []int{full[i]}}, nil)
	if !reflect.DeepEqual(out, full[:i]) {
		t.Fatalf("stopping at %d: got %v from %v", full[i], out, full)
	}
	if _, err := llm.Generate(context.Background(), m, prompt, llm.GenerateOptions{MaxTokens: 5000}, nil); err == nil {
		t.Error("generation past the context accepted")
	}
}

// TestGenerateInChains: greedy generation through a Chainer (one on the
// host) in chains of 4 gives the tokens one step at a time gives, emitted
// in order, stops at a stop token inside a chain, and asks for no token
// past MaxTokens.
func TestGenerateInChains(t *testing.T) {
	m := loadModel(t, "models/llama-tiny")
	prompt := []int{0, 462, 2347, 286, 265}
	full, err := llm.Generate(context.Background(), m, prompt, llm.GenerateOptions{MaxTokens: 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := hostchain.New(m)
	var emitted []int
	got, err := llm.Generate(context.Background(), c, prompt, llm.GenerateOptions{MaxTokens: 10, Chain: 4}, func(id int) error {
		emitted = append(emitted, id)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The prefill picks the first token; then chains of 4, 4 and the 1 left.
	if !reflect.DeepEqual(got, full) || !reflect.DeepEqual(emitted, full) || !reflect.DeepEqual(c.Chains(), []int{4, 4, 1}) {
		t.Fatalf("in chains %v: got %v, emitted %v, want %v", c.Chains(), got, emitted, full)
	}
	// A stop token inside a chain (the first token not seen before it,
	// past the first chain's first) ends generation there.
	i := 2
	for i < len(full) && slices.Contains(full[:i], full[i]) {
		i++
	}
	if i >= len(full) {
		t.Fatalf("no new token after position 2 in the reference output %v", full)
	}
	if (i-1)%4 == 3 || i == len(full)-1 { // positions 1–4, 5–8 and 9 are a chain each
		t.Fatalf("the stop token %d at position %d ends its chain: no token after it is dropped", full[i], i)
	}
	emitted = nil
	got, err = llm.Generate(context.Background(), c, prompt, llm.GenerateOptions{MaxTokens: 10, Chain: 4, Stop: []int{full[i]}}, func(id int) error {
		emitted = append(emitted, id)
		return nil
	})
	if err != nil || !reflect.DeepEqual(got, full[:i]) || !reflect.DeepEqual(emitted, full[:i]) {
		t.Fatalf("stopping at %d (position %d; chains %v): got %v, emitted %v, %v; want %v", full[i], i, c.Chains(), got, emitted, err, full[:i])
	}
	if _, err := llm.Generate(context.Background(), c, prompt, llm.GenerateOptions{MaxTokens: 10, Chain: -1}, nil); err == nil {
		t.Error("a chain of -1 tokens accepted")
	}
}

package evals_test

import (
	"context"
	"math"
	"strings"
	"testing"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
)

func load(t *testing.T, rel string) *llm.Model {
	t.Helper()
	ck, err := checkpoint.Open(shared.Path(t, rel))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	m, err := llm.Load(ck, nil)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestPerplexityLlamaTiny runs the whole shared protocol (189 windows of
// 2048 wikitext-2 tokens) and compares with REFERENCE.md's fp32 figure.
// About 3 minutes with OpenBLAS on two cores; skipped with -short.
func TestPerplexityLlamaTiny(t *testing.T) {
	if testing.Short() {
		t.Skip("full wikitext-2 evaluation skipped in -short mode")
	}
	m := load(t, "models/llama-tiny")
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	res, err := evals.Perplexity(context.Background(), m, ids, evals.PPLOptions{SeqLen: 2048})
	if err != nil {
		t.Fatal(err)
	}
	const want = 257.668
	t.Logf("llama-tiny wikitext-2 ppl %.4f (reference %.3f), %d windows, %.0f tokens/s", res.Perplexity, want, res.Windows, res.TokensPerSec)
	if res.Windows != 189 || res.Predicted != 189*2047 {
		t.Errorf("windows %d predicted %d, want 189 and %d", res.Windows, res.Predicted, 189*2047)
	}
	if rel := math.Abs(res.Perplexity-want) / want; rel > 0.001 {
		t.Fatalf("perplexity %.4f differs from the reference %.3f by %.3f%% (> 0.1%%)", res.Perplexity, want, 100*rel)
	}
}

// TestNLLByHand: −log softmax on a case computed by hand.
func TestNLLByHand(t *testing.T) {
	// logits (0, ln 2, ln 5): softmax = (1/8, 2/8, 5/8)
	l := []float32{0, float32(math.Log(2)), float32(math.Log(5))}
	for target, p := range []float64{1.0 / 8, 2.0 / 8, 5.0 / 8} {
		if got, want := llm.NLL(l, target), -math.Log(p); math.Abs(got-want) > 1e-6 {
			t.Errorf("NLL(target %d) = %v, want %v", target, got, want)
		}
	}
}

// TestWindowsAreIndependent: perplexity over two windows is the exp of the
// mean of the windows' NLLs, each window starting from an empty context.
func TestWindowsAreIndependent(t *testing.T) {
	m := load(t, "models/llama-tiny")
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")[:300]
	ctx := context.Background()
	res, err := evals.Perplexity(ctx, m, ids, evals.PPLOptions{SeqLen: 128})
	if err != nil {
		t.Fatal(err)
	}
	if res.Windows != 2 || res.Predicted != 254 {
		t.Fatalf("300 tokens / 128: %d windows, %d predicted; want 2 and 254 (tail dropped)", res.Windows, res.Predicted)
	}
	s1, _, _ := evals.WindowNLL(ctx, m, ids[:128])
	s2, _, _ := evals.WindowNLL(ctx, m, ids[128:256])
	if want := math.Exp((s1 + s2) / 254); math.Abs(res.Perplexity-want) > 1e-9*want {
		t.Errorf("ppl %v, want %v", res.Perplexity, want)
	}
}

func TestTextShorterThanAWindow(t *testing.T) {
	m := load(t, "models/llama-tiny")
	_, err := evals.Perplexity(context.Background(), m, make([]int, 100), evals.PPLOptions{SeqLen: 2048})
	if err == nil || !strings.Contains(err.Error(), "100 tokens, fewer than one window of seqlen 2048") {
		t.Errorf("error = %v", err)
	}
	_, err = evals.Perplexity(context.Background(), m, make([]int, 5000), evals.PPLOptions{SeqLen: 4096})
	if err == nil || !strings.Contains(err.Error(), "max_position_embeddings") {
		t.Errorf("seqlen past the context: %v", err)
	}
}

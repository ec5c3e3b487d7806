// Package evals measures models: perplexity under the shared protocol and
// throughput benchmarks, with results written as JSON records that carry the
// command, commit and device that produced them.
//
// Perplexity (the protocol of the GPTQ and AWQ papers' WikiText-2 figures):
// the whole text is tokenized without BOS and cut into non-overlapping
// windows of seqlen tokens, the tail dropped; each window runs with a fresh
// context, and
//
//	ppl = exp( Σ_windows Σ_{i=1}^{seqlen-1} −log p(x_i | x_<i) / (windows·(seqlen−1)) ).
package evals

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/llmq/llmq/llm"
)

// PPLOptions configure a perplexity run.
type PPLOptions struct {
	SeqLen  int // window length (default 2048)
	Windows int // evaluate only the first N windows (0: all)
	// Progress, if set, is called after each window.
	Progress func(done, total int)
}

// PPLResult is the outcome of a perplexity run.
type PPLResult struct {
	Perplexity   float64 `json:"perplexity"`
	MeanNLL      float64 `json:"mean_nll"`
	Windows      int     `json:"windows"`
	SeqLen       int     `json:"seqlen"`
	Predicted    int     `json:"predicted_tokens"`
	Tokens       int     `json:"tokens"` // tokens run through the model
	Seconds      float64 `json:"seconds"`
	TokensPerSec float64 `json:"tokens_per_second"`
}

// Perplexity evaluates b on the token ids.
func Perplexity(ctx context.Context, b llm.Backend, ids []int, opt PPLOptions) (PPLResult, error) {
	if opt.SeqLen == 0 {
		opt.SeqLen = 2048
	}
	if opt.SeqLen < 2 {
		return PPLResult{}, fmt.Errorf("seqlen must be at least 2, got %d", opt.SeqLen)
	}
	if max := b.Config().MaxPositions; opt.SeqLen > max {
		return PPLResult{}, fmt.Errorf("seqlen %d exceeds the model's max_position_embeddings %d", opt.SeqLen, max)
	}
	n := len(ids) / opt.SeqLen
	if n == 0 {
		return PPLResult{}, fmt.Errorf("the text has %d tokens, fewer than one window of seqlen %d", len(ids), opt.SeqLen)
	}
	if opt.Windows > 0 && opt.Windows < n {
		n = opt.Windows
	}
	start := time.Now()
	var sum float64
	count := 0
	for w := 0; w < n; w++ {
		win := ids[w*opt.SeqLen : (w+1)*opt.SeqLen]
		s, c, err := WindowNLL(ctx, b, win)
		if err != nil {
			return PPLResult{}, fmt.Errorf("window %d: %w", w, err)
		}
		sum += s
		count += c
		if opt.Progress != nil {
			opt.Progress(w+1, n)
		}
	}
	secs := time.Since(start).Seconds()
	return PPLResult{
		Perplexity: math.Exp(sum / float64(count)), MeanNLL: sum / float64(count),
		Windows: n, SeqLen: opt.SeqLen, Predicted: count, Tokens: n * opt.SeqLen,
		Seconds: secs, TokensPerSec: float64(n*opt.SeqLen) / secs,
	}, nil
}

// WindowNLL runs one window from an empty context and returns the summed
// −log p of tokens 1..len−1 and how many there are (the backend's
// WindowNLL: on the GPU the logits never leave the device).
func WindowNLL(ctx context.Context, b llm.Backend, win []int) (float64, int, error) {
	return b.WindowNLL(ctx, win)
}

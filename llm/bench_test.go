package llm_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
)

// BenchmarkPrefill reports prompt-processing throughput on llama-small:
// one 2048-token window (or 512) per iteration.
func BenchmarkPrefill(b *testing.B) {
	for _, n := range []int{512, 2048} {
		b.Run(itoa(n), func(b *testing.B) {
			m := loadModel(b, "models/llama-small")
			ids := shared.Int32s(b, "reference/wikitext2-test.tokens.i32")[:n]
			logits := make([]float32, n*m.Cfg.Vocab)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				c, _ := m.NewCache(n)
				if err := m.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: ids, Logits: logits}}); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}

// BenchmarkDecode reports batch-1 decoding throughput on llama-small after
// a 128-token prompt: one new token per iteration through the KV cache.
func BenchmarkDecode(b *testing.B) {
	m := loadModel(b, "models/llama-small")
	ids := shared.Int32s(b, "reference/wikitext2-test.tokens.i32")[:128]
	logits := make([]float32, m.Cfg.Vocab)
	c, _ := m.NewCache(m.Cfg.MaxPositions)
	ctx := context.Background()
	if err := m.Forward(ctx, []llm.Step{{Cache: c, Tokens: ids, Logits: logits, LastOnly: true}}); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if c.Len() == c.Cap() {
			c.Truncate(128)
		}
		if err := m.Forward(ctx, []llm.Step{{Cache: c, Tokens: []int{llm.Argmax(logits)}, Logits: logits, LastOnly: true}}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}

func itoa(n int) string {
	if n == 2048 {
		return "2048"
	}
	return "512"
}

// BenchmarkArgmax: greedy sampling of one row of llama3's 128,256 logits
// on the host, what the engine does for every sequence of a decode step.
func BenchmarkArgmax(b *testing.B) {
	row := make([]float32, 128256)
	for i := range row {
		row[i] = float32((i*7919)%10007) / 10007
	}
	b.SetBytes(int64(4 * len(row)))
	for i := 0; i < b.N; i++ {
		llm.Argmax(row)
	}
}

// BenchmarkLogprobs: one token's log-probability and its top 5 over
// llama3's 128,256 logits, what the engine does per token when a request
// asks for logprobs: on one goroutine, and cut across every core
// (LogprobsIn, what the engine does when a batch has fewer such rows than
// cores).
func BenchmarkLogprobs(b *testing.B) {
	row := make([]float32, 128256)
	for i := range row {
		row[i] = float32((i*7919)%10007)/1000 - 5
	}
	for _, parts := range slices.Compact([]int{1, runtime.GOMAXPROCS(0)}) {
		b.Run(fmt.Sprintf("pieces%d", parts), func(b *testing.B) {
			b.SetBytes(int64(4 * len(row)))
			for i := 0; i < b.N; i++ {
				llm.LogprobsIn(row, 17, 5, parts)
			}
		})
	}
}

// BenchmarkSample: one sampled token (temperature 0.8, top-p 0.95) from
// llama3's 128,256 logits on the host, what the engine does for every
// sequence of a decode step that samples: on flat logits (uniform over
// 10 units: a nucleus of most of the vocabulary) and on peaked ones (a
// few tokens 10 above a normal spread of 2.5, as a language model's).
func BenchmarkSample(b *testing.B) {
	for _, peaked := range []bool{false, true} {
		row := make([]float32, 128256)
		r := rand.New(rand.NewPCG(1, 2))
		for i := range row {
			row[i] = float32((i*7919)%10007)/1000 - 5
			if peaked {
				row[i] = float32(r.NormFloat64() * 2.5)
				if i%5000 == 0 {
					row[i] += 10
				}
			}
		}
		name := map[bool]string{false: "flat", true: "peaked"}[peaked]
		b.Run(name, func(b *testing.B) {
			s := llm.NewSampler(llm.SampleOptions{Temperature: 0.8, TopP: 0.95, Seed: 1})
			for i := 0; i < b.N; i++ {
				s.Sample(row)
			}
		})
	}
}

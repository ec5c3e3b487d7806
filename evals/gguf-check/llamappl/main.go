// Command llamappl computes a checkpoint's perplexity with llmq's CPU
// backend under llama.cpp's llama-perplexity protocol (its default mode),
// so that the two can be compared on the same text and windows:
//
//   - the whole file is tokenized with BOS in front (when the tokenizer's
//     post-processor adds one), then cut into chunks of --ctx tokens;
//
//   - each chunk runs from an empty context with its first token replaced
//     by BOS;
//
//   - only the second half is scored: the predictions of tokens
//     ctx/2+1 … ctx−1 from the logits at positions ctx/2 … ctx−2.
//
//     go run ./evals/gguf-check/llamappl MODEL_DIR --data wiki.test.raw --ctx 512 --chunks 8
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "llamappl:", err)
		os.Exit(1)
	}
}

func run() error {
	fs := flag.NewFlagSet("llamappl", flag.ContinueOnError)
	data := fs.String("data", "", "text file")
	nctx := fs.Int("ctx", 512, "chunk length (llama-perplexity -c)")
	chunks := fs.Int("chunks", 0, "first N chunks (llama-perplexity --chunks); 0: all")
	if len(os.Args) < 2 {
		return fmt.Errorf("usage: llamappl MODEL_DIR --data FILE [--ctx 512] [--chunks N]")
	}
	dir := os.Args[1]
	if err := fs.Parse(os.Args[2:]); err != nil {
		return err
	}
	text, err := os.ReadFile(*data)
	if err != nil {
		return err
	}
	m, err := pack.OpenModel(dir)
	if err != nil {
		return err
	}
	defer m.Close()
	ids := m.Tokenizer.Encode(string(text), true)
	bos := m.Checkpoint.Config.BOS
	n := len(ids) / *nctx
	if *chunks > 0 && *chunks < n {
		n = *chunks
	}
	V := m.Model.Cfg.Vocab
	first := *nctx / 2
	var sum float64
	count := 0
	for c := 0; c < n; c++ {
		win := append([]int(nil), ids[c**nctx:(c+1)**nctx]...)
		if bos >= 0 {
			win[0] = bos
		}
		cache, err := m.Model.NewCache(len(win))
		if err != nil {
			return err
		}
		logits := make([]float32, len(win)*V)
		if err := m.Model.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: win, Logits: logits}}); err != nil {
			return err
		}
		for i := first; i+1 < len(win); i++ {
			sum += llm.NLL(logits[i*V:(i+1)*V], win[i+1])
			count++
		}
		fmt.Printf("[%d]%.4f\n", c+1, math.Exp(sum/float64(count)))
	}
	fmt.Printf("tokens %d, chunks %d of %d, predictions %d\n", len(ids), n, len(ids) / *nctx, count)
	fmt.Printf("Final estimate: PPL = %.4f\n", math.Exp(sum/float64(count)))
	return nil
}

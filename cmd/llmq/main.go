// Command llmq quantizes LLM weights to INT4 (GPTQ, AWQ, RTN), packs them,
// and runs them: perplexity, generation, serving and benchmarks, on the CPU
// everywhere and on an NVIDIA GPU when the CUDA library is present.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	if err := newRoot().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "llmq:", err)
		os.Exit(1)
	}
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "llmq",
		Short: "Quantize LLM weights to INT4 (GPTQ, AWQ) and run them on CPU or GPU",
		Long: `llmq quantizes Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2)
to INT4 with GPTQ, AWQ or round-to-nearest, writes packed checkpoints that
transformers and vLLM load, and runs models: perplexity, generation and
benchmarks.`,
		Example: `  llmq inspect ../shared/models/llama-tiny
  llmq eval ppl ../shared/models/llama-tiny --data ../shared/data/wikitext2/wiki.test.raw
  llmq generate ../shared/models/llama-tiny --prompt "Once upon a time"`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newInspect(), newTokenize(), newQuantize(), newEval(), newGenerate(), newBench())
	return root
}

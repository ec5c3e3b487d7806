// Command llmq quantizes LLM weights to INT4 (GPTQ, AWQ, RTN), packs them,
// and runs them: perplexity, generation, serving and benchmarks, on the CPU
// everywhere and on an NVIDIA GPU when the CUDA library is present.
package main

import (
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"

	"github.com/llmq/llmq/evals"
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
		Long: `llmq quantizes Hugging Face checkpoints (Llama, Mistral, Qwen2 and Qwen3,
Gemma 3, and the mixtures of experts Qwen3-MoE and Mixtral) with GPTQ, AWQ or
round-to-nearest at 2 to 8 bits, or to FP8, writes checkpoints that
transformers, vLLM and llama.cpp (GGUF export) load, and runs models on the CPU
or an NVIDIA GPU: perplexity, generation, an OpenAI-compatible server and
benchmarks.`,
		Example: `  llmq inspect ../shared/models/llama-tiny
  llmq eval ppl ../shared/models/llama-tiny --data ../shared/data/wikitext2/wiki.test.raw
  llmq generate ../shared/models/llama-tiny --prompt "Once upon a time"`,
		SilenceUsage:  true,
		SilenceErrors: true,
		// --version: the commit the binary was built from, as results record it.
		Version: fmt.Sprintf("%s (%s)", evals.Commit(), runtime.Version()),
	}
	var profile string
	var stopProfile func()
	root.PersistentFlags().StringVar(&profile, "cpuprofile", "", "write a CPU profile (go tool pprof) of the command to this file")
	root.PersistentPreRunE = func(cmd *cobra.Command, args []string) error {
		if profile == "" {
			return nil
		}
		f, err := os.Create(profile)
		if err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		stopProfile = func() { pprof.StopCPUProfile(); f.Close() }
		return nil
	}
	root.PersistentPostRun = func(cmd *cobra.Command, args []string) {
		if stopProfile != nil {
			stopProfile()
		}
	}
	root.AddCommand(newInspect(), newTokenize(), withFlagErrors(newQuantize(), flagNames{"bits": "--bits", "group size": "--group"}), newEval(), newGenerate(), newServe(), newCalibrate(), newSensitivity(),
		withFlagErrors(newSynth(), flagNames{"Preset": "--preset", "Bits": "--bits", "Group": "--group", "Tokenizer": "--tokenizer", "MLPOnly": "--mlp-only-layers", "QuantizeLMHead": "--quantize-lm-head"}), newBench(), newExport())
	return root
}

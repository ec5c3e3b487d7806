package main

import (
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/llmq/llmq/pack/gguf"
	"github.com/spf13/cobra"
)

func newExport() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "export",
		Short:   "Export a checkpoint to another engine's format (GGUF for llama.cpp and ollama)",
		Example: `  llmq export gguf out/llama-small-gptq -o llama-small-q4_0.gguf`,
	}
	cmd.AddCommand(newExportGGUF())
	return cmd
}

func newExportGGUF() *cobra.Command {
	var out string
	var force bool
	var opt gguf.Options
	cmd := &cobra.Command{
		Use:   "gguf MODEL_DIR -o OUT.gguf",
		Short: "Write a GGUF file that llama.cpp and ollama load",
		Long: `gguf writes a Llama, Mistral or Qwen2 checkpoint (unquantized, or packed by
GPTQ/AWQ) as one GGUF file. Packed 4-bit layers whose groups cover whole
blocks of 32 inputs (group 32, 64, 128, …, or per channel, without
act-order) keep their codes and scales: symmetric → Q4_0 (bit for bit),
asymmetric → Q4_1 (exact up to float16 rounding of m = −scale·zero);
symmetric 8-bit → Q8_0. Other layers are re-quantized from their weights
(Q4_0, or Q8_0 for 8 bits) with a warning giving the relative weight
error. Unquantized weights are written F16, norms F32.`,
		Example: `  llmq export gguf out/llama-small-gptq -o llama-small-q4_0.gguf
  llmq export gguf ../shared/models/llama-tiny -o llama-tiny-f16.gguf`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return fmt.Errorf("-o OUT.gguf is required")
			}
			if st, err := os.Stat(out); err == nil {
				if st.IsDir() {
					return fmt.Errorf("-o %s is a directory", out)
				}
				if !force {
					return fmt.Errorf("-o %s exists (--force replaces it)", out)
				}
			}
			opt.Warnf = func(format string, a ...any) {
				fmt.Fprintf(os.Stderr, "llmq: warning: "+format+"\n", a...)
			}
			start := time.Now()
			rep, err := gguf.Export(args[0], out, opt)
			if err != nil {
				return err
			}
			count := map[string]int{}
			exact, requant := 0, 0
			maxQ41 := 0.0
			for _, t := range rep.Tensors {
				count[t.Type.String()]++
				if t.Type == gguf.Q4_0 || t.Type == gguf.Q4_1 || t.Type == gguf.Q8_0 {
					if t.Exact {
						exact++
					} else {
						requant++
					}
				}
				if t.Type == gguf.Q4_1 && t.Exact {
					maxQ41 = max(maxQ41, t.MaxErr)
				}
			}
			var types []string
			for k, n := range count {
				types = append(types, fmt.Sprintf("%s×%d", k, n))
			}
			sort.Strings(types)
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "wrote %s (%s, %s, %d tensors: %v) in %.1f s\n", out, rep.Arch, human(float64(rep.Bytes), "B"), len(rep.Tensors), types, time.Since(start).Seconds())
			if exact+requant > 0 {
				fmt.Fprintf(w, "packed layers: %d mapped exactly, %d re-quantized\n", exact, requant)
			}
			if maxQ41 > 0 {
				fmt.Fprintf(w, "Q4_1: largest |w_gguf − w| from rounding m to float16: %.3g\n", maxQ41)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&out, "output", "o", "", "the GGUF file to write")
	f.BoolVar(&force, "force", false, "replace OUT if it exists")
	f.StringVar(&opt.Name, "name", "", "general.name (default: the model directory's name)")
	f.StringVar(&opt.Pre, "tokenizer-pre", "", "tokenizer.ggml.pre, llama.cpp's name for the pre-tokenizer regex (default: detected: gpt-2, llama-bpe, qwen2)")
	return cmd
}

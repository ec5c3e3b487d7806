package main

import (
	"fmt"
	"os"
	"time"

	"github.com/llmq/llmq/llm"
	"github.com/spf13/cobra"
)

func newGenerate() *cobra.Command {
	var prompt string
	var opt llm.GenerateOptions
	var noBOS bool
	var device string
	cmd := &cobra.Command{
		Use:   "generate MODEL_DIR",
		Short: "Continue a prompt, streaming the text as it is produced",
		Example: `  llmq generate ../shared/models/llama-tiny --prompt "Once upon a time"
  llmq generate out/llama-small-gptq --prompt "The history of" --temperature 0.8 --top-p 0.9 --seed 7`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if prompt == "" {
				return fmt.Errorf("--prompt is required")
			}
			if opt.MaxTokens <= 0 {
				return fmt.Errorf("--max-tokens must be positive, got %d", opt.MaxTokens)
			}
			if err := checkChain(opt.Chain); err != nil {
				return err
			}
			if err := opt.Sample.Validate(); err != nil {
				return fmt.Errorf("--%w", err) // its messages name the option: temperature, top-k, top-p
			}
			m, err := openModel(args[0], device)
			if err != nil {
				return err
			}
			defer m.Close()
			ids := m.Tokenizer.Encode(prompt, !noBOS)
			opt.Stop = m.Config.EOS
			w := cmd.OutOrStdout()
			fmt.Fprint(w, prompt)
			stream := m.Tokenizer.NewStream()
			start := time.Now()
			var first time.Duration
			out, err := llm.Generate(cmd.Context(), m.Backend, ids, opt, func(id int) error {
				if first == 0 {
					first = time.Since(start)
				}
				fmt.Fprint(w, stream.Add(id))
				return nil
			})
			fmt.Fprintln(w, stream.Flush())
			if err != nil {
				return err
			}
			el := time.Since(start)
			rate := 0.0
			if len(out) > 1 {
				rate = float64(len(out)-1) / (el - first).Seconds()
			}
			fmt.Fprintf(os.Stderr, "[%d prompt tokens, %d generated; first token %v, then %.1f tokens/s on %s]\n",
				len(ids), len(out), first.Round(time.Millisecond), rate, m.Backend.Name())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&prompt, "prompt", "", "text to continue (required)")
	f.IntVar(&opt.MaxTokens, "max-tokens", 64, "new tokens at most")
	f.Float64Var(&opt.Sample.Temperature, "temperature", 0, "sampling temperature (0: greedy)")
	f.Float64Var(&opt.Sample.TopP, "top-p", 1, "nucleus sampling: keep the most likely tokens up to this probability")
	f.IntVar(&opt.Sample.TopK, "top-k", 0, "keep only the K most likely tokens (0: all)")
	f.Uint64Var(&opt.Sample.Seed, "seed", 0, "random seed for sampling")
	f.IntVar(&opt.Chain, "chain", llm.DefaultChain, "greedy tokens the GPU decodes a call, with no round trip to the host between them (1: one a call)")
	f.BoolVar(&noBOS, "no-bos", false, "do not prepend the BOS token")
	f.StringVar(&device, "device", "auto", "auto (the GPU when there is one, else the CPU), cpu, or cuda (decode steps replay a CUDA graph)")
	return cmd
}

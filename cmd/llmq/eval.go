package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/progress"
	"github.com/spf13/cobra"
)

func newEval() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "eval",
		Short: "Evaluate a model",
	}
	cmd.AddCommand(newEvalPPL())
	return cmd
}

func newEvalPPL() *cobra.Command {
	var data, jsonOut, device string
	var opt evals.PPLOptions
	cmd := &cobra.Command{
		Use:   "ppl MODEL_DIR",
		Short: "Perplexity on a text file (non-overlapping windows, no BOS)",
		Example: `  llmq eval ppl ../shared/models/llama-tiny --data ../shared/data/wikitext2/wiki.test.raw
  llmq eval ppl out/llama-small-gptq --data wiki.test.raw --seqlen 2048 --windows 10 --json ppl.json
  llmq eval ppl out/llama-small-gptq --data wiki.test.raw --device cuda`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if data == "" {
				return fmt.Errorf("--data FILE is required (the text to evaluate on)")
			}
			text, err := os.ReadFile(data)
			if err != nil {
				return fmt.Errorf("--data: %w", err)
			}
			m, err := openModel(args[0], device)
			if err != nil {
				return err
			}
			defer m.Close()
			ids := m.Tokenizer.Encode(string(text), false)
			seq := opt.SeqLen
			if seq == 0 {
				seq = 2048
			}
			if len(ids) < seq {
				return fmt.Errorf("--data %s has %d tokens, fewer than one window of --seqlen %d", data, len(ids), seq)
			}
			bar := progress.New("ppl", 0)
			opt.Progress = func(done, total int) {
				if done == 1 {
					bar = progress.New("ppl", total)
				}
				bar.Set(done, "")
			}
			res, err := evals.Perplexity(cmd.Context(), m.Backend, ids, opt)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "perplexity  %.4f\n", res.Perplexity)
			fmt.Fprintf(w, "tokens      %d in %d windows of %d (%d predicted)\n", res.Tokens, res.Windows, res.SeqLen, res.Predicted)
			fmt.Fprintf(w, "speed       %.0f tokens/s on %s (%.1f s)\n", res.TokensPerSec, m.Backend.Name(), res.Seconds)
			if jsonOut != "" {
				rec := evals.NewRecord("ppl", map[string]any{"model": args[0], "data": data, "backend": m.Backend.Name(), "load_s": m.LoadTime.Seconds(), "result": res})
				return writeJSON(jsonOut, rec)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&data, "data", "", "text file to evaluate on (required)")
	cmd.Flags().IntVar(&opt.SeqLen, "seqlen", 2048, "window length in tokens")
	cmd.Flags().IntVar(&opt.Windows, "windows", 0, "evaluate only the first N windows (0: all)")
	cmd.Flags().StringVar(&jsonOut, "json", "", "also write the result as JSON to this file")
	cmd.Flags().StringVar(&device, "device", "auto", "auto (the GPU when there is one, else the CPU), cpu, or cuda (the GPU backend: logits stay on the GPU)")
	return cmd
}

// writeJSON writes v indented, atomically (temp file, then rename).
func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(data, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/progress"
	"github.com/llmq/llmq/llm/calib"
	"github.com/spf13/cobra"
)

func newEval() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "eval",
		Short: "Evaluate a model",
		Example: `  llmq eval ppl ../shared/models/llama-tiny --data ../shared/data/wikitext2/wiki.test.raw --windows 8
  llmq eval tasks ../shared/models/llama-tiny --tasks evals/tasks/llmq-facts.jsonl`,
	}
	cmd.AddCommand(newEvalPPL(), newEvalTasks())
	return cmd
}

func newEvalPPL() *cobra.Command {
	var data, format, jsonOut, device string
	var opt evals.PPLOptions
	var act actFlags
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
			if _, err := os.Stat(data); err != nil {
				return fmt.Errorf("--data: %w", err)
			}
			fmt.Fprintf(os.Stderr, "llmq: loading %s\n", args[0])
			bopt, err := act.backendOptions(cmd)
			if err != nil {
				return err
			}
			m, err := openModelWith(args[0], device, bopt)
			if err != nil {
				return err
			}
			defer m.Close()
			ids, err := calib.ReadTokens(data, format, m.Tokenizer)
			if err != nil {
				if errors.Is(err, calib.ErrNotText) {
					return fmt.Errorf("--data: %w; for little-endian int32 token ids use --format ids (or a .i32 name)", err)
				}
				return fmt.Errorf("--data/--format: %w", err)
			}
			vocab := m.Backend.Config().Vocab
			for i, id := range ids {
				if id < 0 || id >= vocab {
					return fmt.Errorf("--data %s: token id %d at position %d is outside the model's vocabulary [0, %d)", data, id, i, vocab)
				}
			}
			seq := opt.SeqLen
			if seq == 0 {
				seq = 2048
			}
			if len(ids) < seq {
				return fmt.Errorf("--data %s has %d tokens, fewer than one window of --seqlen %d", data, len(ids), seq)
			}
			// The bar starts before the first window, so its rate and ETA
			// count that window too.
			windows := len(ids) / seq
			if opt.Windows > 0 {
				windows = min(windows, opt.Windows)
			}
			bar := progress.New("ppl", windows)
			bar.Set(0, "")
			opt.Progress = func(done, total int) { bar.Set(done, "") }
			res, err := evals.Perplexity(cmd.Context(), m.Backend, ids, opt)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "perplexity  %.4f\n", res.Perplexity)
			fmt.Fprintf(w, "tokens      %d in %d windows of %d (%d predicted)\n", res.Tokens, res.Windows, res.SeqLen, res.Predicted)
			fmt.Fprintf(w, "speed       %.0f tokens/s on %s (%.1f s)\n", res.TokensPerSec, m.Backend.Name(), res.Seconds)
			if jsonOut != "" {
				info := map[string]any{"model": args[0], "data": data, "backend": m.Backend.Name(), "load_s": m.LoadTime.Seconds(), "result": res}
				if act.bits > 0 {
					info["activations"] = act.describe()
				}
				rec := evals.NewRecordOn("ppl", info, evals.GPUName(m.Backend))
				return writeJSON(jsonOut, rec)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&data, "data", "", "text (or token id) file to evaluate on (required)")
	cmd.Flags().StringVar(&format, "format", "auto", "what --data holds: auto (ids when the name ends in .i32, else text), text, or ids (little-endian int32 token ids)")
	cmd.Flags().IntVar(&opt.SeqLen, "seqlen", 2048, "window length in tokens")
	cmd.Flags().IntVar(&opt.Windows, "windows", 0, "evaluate only the first N windows (0: all)")
	cmd.Flags().StringVar(&jsonOut, "json", "", "also write the result as JSON to this file")
	act.register(cmd)
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

func newEvalTasks() *cobra.Command {
	var tasks, jsonOut, device string
	cmd := &cobra.Command{
		Use:   "tasks MODEL_DIR --tasks FILE.jsonl",
		Short: "Multiple-choice accuracy (acc and lm-eval's length-normalised acc_norm)",
		Long: `Scores multiple-choice items the way lm-evaluation-harness scores its
loglikelihood tasks. Each line of --tasks is one item:

  {"context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}

For each choice, the log-likelihood of its tokens after the context (the
context and context+choice are encoded, with BOS, and the choice's tokens
are the extra ones; whitespace ending the context moves to the choice).
acc: the answer is the choice of highest log-likelihood; acc_norm: of
highest log-likelihood per byte of the choice. Both with standard errors.
Run it on a model and its quantized versions to compare them item by item
(--json keeps every item's scores).`,
		Example: `  llmq eval tasks ../shared/models/llama-small --tasks evals/tasks/llmq-facts.jsonl
  llmq eval tasks out/llama-small-gptq --tasks evals/tasks/llmq-facts.jsonl --device cuda --json tasks.json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if tasks == "" {
				return fmt.Errorf("--tasks FILE.jsonl is required (one {\"context\", \"choices\", \"answer\"} item a line)")
			}
			items, err := evals.ReadTasks(tasks)
			if err != nil {
				return fmt.Errorf("--tasks: %w", err)
			}
			fmt.Fprintf(os.Stderr, "llmq: loading %s\n", args[0])
			m, err := openModel(args[0], device)
			if err != nil {
				return err
			}
			defer m.Close()
			bar := progress.New("tasks", len(items))
			bar.Set(0, "")
			res, err := evals.ScoreTasks(cmd.Context(), m.Backend, m.Tokenizer, items, evals.TaskOptions{
				Progress: func(done, total int) { bar.Set(done, "") }})
			if err != nil {
				return fmt.Errorf("--tasks %s: %w", tasks, err)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "acc         %.4f ± %.4f\n", res.Acc, res.AccStderr)
			fmt.Fprintf(w, "acc_norm    %.4f ± %.4f\n", res.AccNorm, res.AccNormStderr)
			fmt.Fprintf(w, "items       %d (%d choices, %d tokens run)\n", res.Items, res.Choices, res.Tokens)
			fmt.Fprintf(w, "time        %.1f s on %s\n", res.Seconds, m.Backend.Name())
			if jsonOut != "" {
				rec := evals.NewRecordOn("tasks", map[string]any{"model": args[0], "tasks": tasks, "backend": m.Backend.Name(),
					"load_s": m.LoadTime.Seconds(), "result": res}, evals.GPUName(m.Backend))
				return writeJSON(jsonOut, rec)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&tasks, "tasks", "", "JSON Lines file of multiple-choice items (required)")
	cmd.Flags().StringVar(&jsonOut, "json", "", "also write the result, with every item's scores, as JSON to this file")
	cmd.Flags().StringVar(&device, "device", "auto", "auto (the GPU when there is one, else the CPU), cpu, or cuda")
	return cmd
}

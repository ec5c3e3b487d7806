package main

import (
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/calib"
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
	var out, evalData string
	var force bool
	var opt gguf.Options
	var ppl evals.PPLOptions
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
error, and a warning with what that costs, measured on the spot: the
perplexity of the checkpoint as llmq runs it and with the re-quantized
layers read back from the file, on the first --eval-windows windows of
--eval-seqlen tokens of --eval-data (default: a few KB of English prose
built into llmq), on the CPU. Unquantized weights are written F16, norms
F32.`,
		Example: `  llmq export gguf out/llama-small-gptq -o llama-small-q4_0.gguf
  llmq export gguf ../shared/models/llama-tiny -o llama-tiny-f16.gguf
  llmq export gguf out/llama-small-gptq-w3 -o small.gguf --eval-data wiki.test.raw --eval-windows 8 --eval-seqlen 2048`,
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
			if ppl.Windows < 1 || ppl.SeqLen < 2 {
				return fmt.Errorf("--eval-windows %d --eval-seqlen %d: want at least 1 window of at least 2 tokens", ppl.Windows, ppl.SeqLen)
			}
			if evalData != "" {
				if _, err := os.Stat(evalData); err != nil {
					return fmt.Errorf("--eval-data: %w", err)
				}
			}
			warnf := func(format string, a ...any) {
				fmt.Fprintf(cmd.ErrOrStderr(), "llmq: warning: "+format+"\n", a...)
			}
			opt.Warnf = warnf
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
				if t.Requantized() {
					requant++
				} else if t.Exact {
					exact++
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
			if requant == 0 {
				return nil
			}
			c, err := requantizationCost(cmd, args[0], out, rep, evalData, ppl)
			if err != nil {
				return fmt.Errorf("measuring the re-quantization's cost: %w (%s was written)", err, out)
			}
			warnf("%d of %d packed layers were re-quantized: perplexity %.4f as llmq runs the checkpoint, %.4f with the GGUF file's weights (%+.2f%%), on %s (%d windows of %d tokens)",
				requant, exact+requant, c.source.Perplexity, c.exported.Perplexity, 100*(c.exported.Perplexity/c.source.Perplexity-1),
				c.text, c.source.Windows, c.source.SeqLen)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&out, "output", "o", "", "the GGUF file to write")
	f.BoolVar(&force, "force", false, "replace OUT if it exists")
	f.StringVar(&opt.Name, "name", "", "general.name (default: the model directory's name)")
	f.StringVar(&evalData, "eval-data", "", "text (or .i32 ids) to measure the perplexity cost of re-quantized layers on (default: prose built into llmq)")
	f.IntVar(&ppl.Windows, "eval-windows", 4, "windows of --eval-data for the cost of re-quantized layers")
	f.IntVar(&ppl.SeqLen, "eval-seqlen", 512, "tokens per window for the cost of re-quantized layers")
	f.StringVar(&opt.Pre, "tokenizer-pre", "", "tokenizer.ggml.pre, llama.cpp's name for the pre-tokenizer regex (default: detected: gpt-2, llama-bpe, qwen2)")
	return cmd
}

// cost is the perplexity of a checkpoint as llmq runs it and with its
// re-quantized layers as an exported GGUF file holds them.
type cost struct {
	source, exported evals.PPLResult
	text             string
}

// requantizationCost measures, on the CPU, what re-quantizing the layers
// rep lists costs: the perplexity of the checkpoint in dir, then of the
// same model with those layers replaced by the weights read back from
// the GGUF file at path. The text is data (Prose when empty).
func requantizationCost(cmd *cobra.Command, dir, path string, rep *gguf.Report, data string, opt evals.PPLOptions) (*cost, error) {
	f, err := gguf.Read(path)
	if err != nil {
		return nil, err
	}
	var model *llm.Model
	m, err := loadModelWith(dir, "cpu", backend.Options{CPU: func(cm *llm.Model) error { model = cm; return nil }})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	c := &cost{text: evals.ProseName}
	var ids []int
	if data != "" {
		c.text = data
		if ids, err = calib.ReadTokens(data, calib.FormatAuto, m.Tokenizer); err != nil {
			return nil, fmt.Errorf("--eval-data: %w", err)
		}
	} else {
		ids = m.Tokenizer.Encode(evals.Prose, false)
	}
	if len(ids) < opt.SeqLen {
		return nil, fmt.Errorf("%s has %d tokens, fewer than one window of --eval-seqlen %d", c.text, len(ids), opt.SeqLen)
	}
	if c.source, err = evals.Perplexity(cmd.Context(), model, ids, opt); err != nil {
		return nil, err
	}
	for _, t := range rep.Tensors {
		if !t.Requantized() {
			continue
		}
		l, ok := model.LinearByName(t.Source)
		if !ok {
			return nil, fmt.Errorf("the model has no layer %s", t.Source)
		}
		d, ok := (*l).(*llm.Dense)
		if !ok {
			return nil, fmt.Errorf("%s is not a float32 layer", t.Source)
		}
		w, err := f.Weights(t)
		if err != nil {
			return nil, err
		}
		if len(w) != len(d.W) {
			return nil, fmt.Errorf("%s: %d weights in the GGUF file, %d in the model", t.Source, len(w), len(d.W))
		}
		*l = llm.NewDense(w, d.B, d.In(), d.Out())
	}
	if c.exported, err = evals.Perplexity(cmd.Context(), model, ids, opt); err != nil {
		return nil, err
	}
	return c, nil
}

package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/progress"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/calib"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/llmq/llmq/pack"
	"github.com/llmq/llmq/quantize"
	"github.com/spf13/cobra"
)

func newSensitivity() *cobra.Command {
	var data, out, plotPath, jsonOut, by string
	var windows, seqlen, bits, group, high int
	var target float64
	cmd := &cobra.Command{
		Use:   "sensitivity MODEL_DIR --data FILE",
		Short: "Profile before you quantize: each layer's perplexity cost, and a mixed-precision plan",
		Long: `Rounds each linear layer (--by layer) or each module type across all
blocks (--by type) alone to --bits on --group, measures the mean NLL on the
first --windows windows of --seqlen tokens of --data, and reports each one's
cost. -o writes a plan that raises the costliest layers per weight to
--high-bits while the average stays within --target-bits; llmq quantize
--plan applies it. Round-to-nearest is the probe: a layer that costs much
under RTN is one a calibrated method also has to work hardest on.`,
		Example: `  llmq sensitivity ../shared/models/llama-small --data ../shared/data/calib.txt --target-bits 4.5 -o plan.json --plot cost.png
  llmq quantize ../shared/models/llama-small --method gptq --calib ../shared/data/calib.txt --plan plan.json -o out/mixed`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if data == "" {
				return fmt.Errorf("--data FILE is required (text to measure the cost on)")
			}
			if by != "layer" && by != "type" {
				return fmt.Errorf("--by %q: want layer or type", by)
			}
			grid := pack.Grid{Bits: bits, GroupSize: group}
			if err := grid.Validate(0); err != nil {
				return err
			}
			tok, err := tokenizer.Load(filepath.Join(args[0], "tokenizer.json"))
			if err != nil {
				return err
			}
			ids, err := calib.ReadTokens(data, calib.FormatAuto, tok)
			if err != nil {
				return fmt.Errorf("--data: %w", err)
			}
			wins, err := calib.Windows(ids, windows, seqlen)
			if err != nil {
				return fmt.Errorf("--data %s with --windows %d --seqlen %d: %w", data, windows, seqlen, err)
			}
			var costs []quantize.LayerCost
			var base float64
			bar := progress.New("sensitivity", 0)
			profile := func(m *llm.Model) error {
				costs, base, err = quantize.Sensitivity(cmd.Context(), m, wins, grid, by == "type", func(done, total int) {
					if done == 1 {
						bar = progress.New("sensitivity", total)
					}
					bar.Set(done, fmt.Sprintf("layer %d/%d", done, total))
				})
				return err
			}
			m, err := loadModelWith(args[0], "cpu", backend.Options{CPU: profile})
			if err != nil {
				return err
			}
			m.Close()
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "unquantized mean NLL %.4f (perplexity %.3f) on %d windows of %d\n", base, math.Exp(base), windows, seqlen)
			ranked := append([]quantize.LayerCost(nil), costs...)
			sort.SliceStable(ranked, func(a, b int) bool { return ranked[a].Delta > ranked[b].Delta })
			fmt.Fprintf(w, "%-36s %10s %12s %10s\n", "quantized alone at "+fmt.Sprint(bits)+" bits", "weights", "Δ NLL", "ppl")
			for _, c := range ranked {
				fmt.Fprintf(w, "%-36s %10d %+12.5f %10.3f\n", c.Name, c.Params, c.Delta, c.PPL)
			}
			var plan *quantize.Plan
			if out != "" {
				if plan, err = quantize.ProposePlan(costs, bits, high, target); err != nil {
					return fmt.Errorf("--bits/--high-bits/--target-bits: %w", err)
				}
				fmt.Fprintf(w, "plan: %d of %d raised to %d bits, %.3f bits per weight on average (target %.2f) → %s\n",
					len(plan.Raised), len(costs), high, plan.AverageBits, target, out)
				if err := writeJSON(out, plan); err != nil {
					return err
				}
			}
			if plotPath != "" {
				labels, values := make([]string, len(costs)), make([]float64, len(costs))
				for i, c := range costs {
					labels[i], values[i] = strings.TrimPrefix(c.Name, "model.layers."), c.Delta
				}
				title := fmt.Sprintf("%s: mean NLL cost of each %s alone at %d bits", filepath.Base(args[0]), by, bits)
				if err := evals.Bars(plotPath, title, "Δ mean NLL (nats)", labels, values); err != nil {
					return fmt.Errorf("--plot: %w", err)
				}
			}
			if jsonOut != "" {
				rec := evals.NewRecord("sensitivity", map[string]any{"model": args[0], "data": data, "windows": windows, "seqlen": seqlen,
					"bits": bits, "group": group, "by": by, "base_nll": base, "costs": costs, "plan": plan})
				return writeJSON(jsonOut, rec)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&data, "data", "", "text (or .i32 ids) to measure the cost on (required)")
	f.IntVar(&windows, "windows", 4, "windows of --data")
	f.IntVar(&seqlen, "seqlen", 512, "tokens per window")
	f.IntVar(&bits, "bits", 4, "bits each layer is probed at: 2, 3, 4 or 8")
	f.IntVar(&group, "group", 128, "group size of the probe")
	f.StringVar(&by, "by", "layer", "layer (each layer of each block) or type (each module type across the blocks)")
	f.IntVar(&high, "high-bits", 8, "bits of the layers a plan raises")
	f.Float64Var(&target, "target-bits", 4.5, "average bits per weight a plan may reach")
	f.StringVarP(&out, "output", "o", "", "write a mixed-precision plan (JSON) for llmq quantize --plan")
	f.StringVar(&plotPath, "plot", "", "draw each layer's cost as a bar chart (.png or .svg)")
	f.StringVar(&jsonOut, "json", "", "write the costs as a JSON record")
	return cmd
}

// readPlan reads the dynamic rules of a plan written by llmq sensitivity.
func readPlan(path string) (pack.Dynamic, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var p struct {
		Dynamic pack.Dynamic `json:"dynamic"`
	}
	if err := json.Unmarshal(data, &p); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return p.Dynamic, nil
}

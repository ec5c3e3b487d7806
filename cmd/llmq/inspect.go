package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
	"github.com/spf13/cobra"
)

func newInspect() *cobra.Command {
	return &cobra.Command{
		Use:     "inspect MODEL_DIR",
		Short:   "Show a checkpoint's architecture, size, dtypes and quantization",
		Example: "  llmq inspect ../shared/models/llama-small",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if st, err := os.Stat(args[0]); err == nil && !st.IsDir() && strings.EqualFold(filepath.Ext(args[0]), ".gguf") {
				return fmt.Errorf("%s is a GGUF file: inspect reads a Hugging Face checkpoint directory (llmq export gguf writes GGUF files, llama.cpp's gguf-dump lists them)", args[0])
			}
			ck, err := checkpoint.Open(args[0])
			if err != nil {
				return err
			}
			defer ck.Close()
			c := ck.Config
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "model          %s\n", args[0])
			fmt.Fprintf(w, "architecture   %s (%s)\n", c.Architecture, c.ModelType)
			fmt.Fprintf(w, "layers         %d\n", c.Layers)
			fmt.Fprintf(w, "hidden         %d (intermediate %d)\n", c.Hidden, c.Intermediate)
			fmt.Fprintf(w, "heads          %d query, %d key/value, head_dim %d\n", c.Heads, c.KVHeads, c.HeadDim)
			fmt.Fprintf(w, "vocab          %d (embeddings tied: %v)\n", c.Vocab, c.TieEmbeddings)
			fmt.Fprintf(w, "context        %d, rope %s θ=%g\n", c.MaxPositions, c.Rope.Type, c.Rope.Theta)
			fmt.Fprintf(w, "parameters     %s\n", human(float64(c.Params()), ""))
			if c.MoE != nil {
				fmt.Fprintf(w, "experts        %d per sparse layer, top %d, intermediate %d\n", c.MoE.Experts, c.MoE.TopK, c.MoE.Intermediate)
			}
			var dts []string
			for d, n := range ck.DTypes() {
				dts = append(dts, fmt.Sprintf("%s×%d", d, n))
			}
			sort.Strings(dts)
			fmt.Fprintf(w, "tensors        %d (%s), config dtype %s\n", len(ck.Names()), strings.Join(dts, ", "), c.DType)
			fmt.Fprintf(w, "size on disk   %s\n", human(float64(ck.SizeOnDisk()), "B"))
			if c.Quantization == nil {
				fmt.Fprintf(w, "quantization   none\n")
			} else {
				var q map[string]any
				_ = json.Unmarshal(c.Quantization, &q)
				if meta, ok := q["meta"].(map[string]any); ok {
					delete(meta, "moe") // listed below
				}
				keys := make([]string, 0, len(q))
				for k := range q {
					keys = append(keys, k)
				}
				sort.Strings(keys)
				var parts []string
				for _, k := range keys {
					v := fmt.Sprint(q[k])
					switch q[k].(type) {
					case map[string]any, []any: // as JSON, not Go's map[...] syntax
						b, _ := json.Marshal(q[k])
						v = string(b)
					}
					parts = append(parts, k+"="+v)
				}
				fmt.Fprintf(w, "quantization   %s\n", strings.Join(parts, " "))
				if qc, err := pack.ParseQuantConfig(c.Quantization); err == nil && qc.Meta != nil && qc.Meta.MoE != nil {
					printMoEMeta(w, qc.Meta.MoE)
				}
			}
			return nil
		},
	}
}

// human prints 29368832 as "29.37M".
func human(v float64, unit string) string {
	for _, s := range []string{"", "K", "M", "G", "T"} {
		if v < 1000 {
			return fmt.Sprintf("%.2f%s%s", v, s, unit)
		}
		v /= 1000
	}
	return fmt.Sprintf("%.2fP%s", v, unit)
}

// printMoEMeta lists the calibration tokens each expert received.
func printMoEMeta(w io.Writer, m *pack.MoEMeta) {
	fmt.Fprintf(w, "expert calibration  %s (experts routed fewer than %d tokens calibrated on all, marked *)\n", m.Calib, m.MinTokens)
	for _, l := range m.Layers {
		all := map[int]bool{}
		for _, e := range l.AllTokens {
			all[e] = true
		}
		var parts []string
		for e, n := range l.Routed {
			mark := ""
			if all[e] {
				mark = "*"
			}
			parts = append(parts, fmt.Sprintf("%d:%d%s", e, n, mark))
		}
		fmt.Fprintf(w, "  layer %-3d routed tokens per expert  %s\n", l.Layer, strings.Join(parts, " "))
	}
}

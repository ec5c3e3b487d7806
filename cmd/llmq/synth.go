package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/assets"
	"github.com/llmq/llmq/internal/progress"
	"github.com/spf13/cobra"
)

func newSynth() *cobra.Command {
	opt := evals.SynthOptions{}
	var shardSize string
	cmd := &cobra.Command{
		Use:   "synth --preset NAME -o DIR",
		Short: "Write a random-weight checkpoint of a real model's size (for speed measurements)",
		Long: `synth writes a checkpoint with the architecture of a published model and
random weights, in the layout real checkpoints use: bf16 (--bits 16), or
GPTQ with fp16 scales at 3, 4 or 8 bits (--bits 3, 4, 8). Its perplexity
means nothing; its load time, memory and speed are those of the real model.
Quantized, a mixture of experts has every expert packed and its routers in
bf16, as quantize leaves them.
Presets: ` + strings.Join(evals.PresetNames(), ", "),
		Example: `  llmq synth --preset llama3-8b --bits 4 --group 128 -o /tmp/llama3-8b-w4
  llmq synth --preset llama3-8b --bits 16 -o /tmp/llama3-8b-bf16
  llmq synth --preset llama3-70b --bits 3 --layers 2 -o /tmp/llama3-70b-w3-2layers
  llmq synth --preset qwen3-30b-a3b --bits 8 --layers 4 -o /tmp/qwen3-30b-a3b-w8-4layers`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if opt.Out == "" {
				return fmt.Errorf("-o DIR is required")
			}
			var err error
			if opt.MaxShardBytes, err = parseSize(shardSize); err != nil {
				return fmt.Errorf("--max-shard-size: %w", err)
			}
			bar := progress.New("synth", 0)
			opt.Progress = func(done, total int) {
				if done == 1 {
					bar = progress.New("synth "+opt.Preset, total)
				}
				bar.Set(done, "")
			}
			start := time.Now()
			if err := evals.Synth(opt); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s (%s, %d-bit) in %.1f s\n", opt.Out, opt.Preset, opt.Bits, time.Since(start).Seconds())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&opt.Preset, "preset", "llama3-8b", "architecture: "+strings.Join(evals.PresetNames(), ", "))
	f.IntVar(&opt.Bits, "bits", 4, "3, 4 or 8 (GPTQ, symmetric, fp16 scales) or 16 (bf16)")
	f.IntVar(&opt.Group, "group", 128, "quantization group size")
	f.StringVar(&shardSize, "max-shard-size", "5GB", "largest shard of the output: bytes, or with kB/MB/GB or KiB/MiB/GiB")
	f.IntVar(&opt.Layers, "layers", 0, "override the number of layers (0: the preset's)")
	f.BoolVar(&opt.QuantizeLMHead, "quantize-lm-head", false, "pack lm_head too, as quantize --quantize-lm-head does (not with --bits 16 or tied embeddings)")
	f.IntSliceVar(&opt.MLPOnly, "mlp-only-layers", nil, "layers of a Qwen3-MoE preset that keep a dense MLP (mlp_only_layers), e.g. 1,3")
	f.StringVar(&opt.Tokenizer, "tokenizer", filepath.Join(assets.Root(), "models", "llama-small"), "directory whose tokenizer.json (and tokenizer_config.json) to copy")
	f.StringVarP(&opt.Out, "output", "o", "", "output directory")
	f.BoolVar(&opt.Force, "force", false, "replace OUT if it exists and is empty or an earlier llmq output")
	return cmd
}

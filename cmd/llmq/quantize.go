package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/progress"
	"github.com/llmq/llmq/llm/calib"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
	"github.com/llmq/llmq/quantize"
	"github.com/spf13/cobra"
)

func newQuantize() *cobra.Command {
	var opt quantize.Options
	var method string
	var gopt gptq.Options
	var bits, group int
	var sym, duo, noClip bool
	var awqSearchTokens int
	var reportPath, statsPath, shardSize, fp8Scale, fp8Act string
	var plan planFlags
	var planPath, evalData, evalDevice, device, smoothPath string
	var evalWindows, evalSeqLen int
	cmd := &cobra.Command{
		Use:   "quantize MODEL_DIR -o OUT",
		Short: "Quantize a checkpoint to INT4 (GPTQ, AWQ, RTN) and write a packed checkpoint",
		Long: `Quantize the linear layers of every decoder block, streaming one block at a
time, and write safetensors shards in the GPTQ layout that transformers, vLLM
and GPTQModel load. Embeddings, norms and lm_head keep their dtype unless
--quantize-lm-head. Calibration takes the first --nsamples non-overlapping
windows of --seqlen tokens of --calib (deterministic).`,
		Example: `  llmq quantize ../shared/models/llama-small --method gptq --bits 4 --group 128 \
      --calib ../shared/data/calib.txt -o out/llama-small-gptq-w4g128
  llmq quantize ../shared/models/llama-small --method awq --calib ../shared/data/calib.txt \
      --stats out/awq-stats.json -o out/llama-small-awq
  llmq quantize ../shared/models/llama-small --method rtn --bits 4 --group 128 -o out/llama-small-rtn
  llmq quantize ../shared/models/llama-small --method gptq --calib ../shared/data/calib.txt \
      --format compressed-tensors -o out/llama-small-gptq-ct
  llmq quantize ../shared/models/llama-small --method fp8 -o out/llama-small-fp8
  llmq quantize ../shared/models/llama-small --method fp8 --fp8-scale per-tensor --fp8-act static \
      --calib ../shared/data/calib.txt -o out/llama-small-fp8-static`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			opt.Src = args[0]
			if opt.Out == "" {
				return fmt.Errorf("-o/--output is required")
			}
			var err error
			if opt.MaxShardBytes, err = parseSize(shardSize); err != nil {
				return fmt.Errorf("--max-shard-size: %w", err)
			}
			if opt.Format != "gptq" && opt.Format != "awq" && opt.Format != pack.MethodCT {
				return fmt.Errorf("--format must be gptq, awq or %s, got %q", pack.MethodCT, opt.Format)
			}
			if fp8Scale != "per-channel" && fp8Scale != "per-tensor" {
				return fmt.Errorf("--fp8-scale must be per-channel or per-tensor, got %q", fp8Scale)
			}
			if fp8Act != "dynamic" && fp8Act != "static" {
				return fmt.Errorf("--fp8-act must be dynamic or static, got %q", fp8Act)
			}
			if method == "fp8" {
				if cmd.Flags().Changed("format") && opt.Format != pack.MethodCT {
					return fmt.Errorf("--method fp8 writes --format %s, got %q", pack.MethodCT, opt.Format)
				}
				opt.Format = pack.MethodCT
				for _, fl := range []string{"bits", "group", "sym", "override", "plan"} {
					if cmd.Flags().Changed(fl) {
						return fmt.Errorf("--%s does not apply to --method fp8 (FP8 E4M3, symmetric, --fp8-scale per-channel or per-tensor)", fl)
					}
				}
			} else if cmd.Flags().Changed("fp8-scale") || cmd.Flags().Changed("fp8-act") {
				return fmt.Errorf("--fp8-scale and --fp8-act apply to --method fp8")
			}
			grid := pack.Grid{Bits: bits, GroupSize: group, Sym: sym}
			if err := grid.Validate(0); err != nil {
				return err // withFlagErrors names the flag
			}
			if gopt.Damp <= 0 || gopt.Damp >= 1 {
				return fmt.Errorf("--damp must be in (0, 1), got %v", gopt.Damp)
			}
			note := func(format string, a ...any) { fmt.Fprintf(os.Stderr, "\nnote: "+format+"\n", a...) }
			gopt.Grid, gopt.Log = grid, note
			if awqSearchTokens < 0 {
				return fmt.Errorf("--awq-search-tokens must be 0 (every calibration token) or a positive count, got %d", awqSearchTokens)
			}
			awqOpt := awq.Options{Grid: grid, Duo: duo, Clip: !noClip, SearchTokens: awqSearchTokens, Log: note}
			awqOpt.Grid.MinMax = true // AWQ's own grid
			var stats []awq.LinearStats
			switch method {
			case "rtn":
				opt.Method = quantize.RTN{G: grid}
			case "gptq":
				opt.Method = quantize.GPTQ{Opt: gopt}
			case "awq":
				m := quantize.AWQ{Opt: awqOpt}
				if statsPath != "" {
					m.Record = &stats
				}
				opt.Method = m
				// AWQ's default calibration: 128 windows of 512 tokens.
				if !cmd.Flags().Changed("seqlen") {
					opt.SeqLen = 512
				}
			case "awq+gptq":
				opt.Method = quantize.AWQGPTQ{GPTQ: quantize.GPTQ{Opt: gopt}, Scales: awqOpt}
			case "fp8":
				opt.Method = quantize.FP8{PerTensor: fp8Scale == "per-tensor", StaticActivations: fp8Act == "static"}
			default:
				return fmt.Errorf("--method must be gptq, awq, awq+gptq, rtn or fp8, got %q", method)
			}
			if opt.Method.Calibrated() && opt.Calib == "" {
				return fmt.Errorf("--method %s needs --calib FILE (calibration text or .i32 tokens)", method)
			}
			if opt.Calib != "" { // checked before any model is opened
				if _, err := os.Stat(opt.Calib); err != nil {
					return fmt.Errorf("--calib: %w", err)
				}
			}
			if statsPath != "" && method != "awq" {
				return fmt.Errorf("--stats is written by --method awq")
			}
			if smoothPath != "" {
				if opt.Smooth, err = actquant.ReadScales(smoothPath); err != nil {
					return fmt.Errorf("--smooth-scales: %w", err)
				}
				if len(opt.Smooth.Smooth) == 0 {
					return fmt.Errorf("--smooth-scales %s holds no SmoothQuant factors (llmq calibrate --smooth α writes them)", smoothPath)
				}
			}
			if planPath != "" {
				rules, err := readPlan(planPath)
				if err != nil {
					return fmt.Errorf("--plan: %w", err)
				}
				opt.Plan = append(opt.Plan, rules...)
			}
			if len(plan.rules) > 0 {
				cfg, err := checkpoint.LoadConfig(opt.Src)
				if err != nil {
					return err
				}
				rules, head, err := plan.build(cfg)
				if err != nil {
					return err
				}
				opt.Plan = append(rules, opt.Plan...) // flags before --plan: they win
				opt.QuantizeLMHead = opt.QuantizeLMHead || head
			}
			switch opt.MoECalib {
			case quantize.MoECalibRouted, quantize.MoECalibAll:
			default:
				return fmt.Errorf("--moe-calib must be %s or %s, got %q", quantize.MoECalibRouted, quantize.MoECalibAll, opt.MoECalib)
			}
			if opt.MoEMinTokens < 0 {
				return fmt.Errorf("--moe-min-tokens must be 0 (the hidden size) or a positive number of tokens, got %d", opt.MoEMinTokens)
			}
			if opt.GPU, err = quantizeDevice(device, opt.Method, opt.Src); err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			go func() { <-ctx.Done(); stop() }() // a second Ctrl-C kills at once
			var bar *progress.Bar
			blocks := 0
			opt.Progress = func(block, n int, stage string) {
				if bar == nil {
					bar, blocks = progress.New(method, n), n
				}
				bar.Set(block, fmt.Sprintf("block %d %s", block, stage))
			}
			opt.CommandLine = commandLine(cmd)
			if v := evals.Commit(); v != "unknown" {
				opt.Version = v
			}
			rep, err := quantize.Run(ctx, opt)
			if err != nil {
				if errors.Is(err, quantize.ErrInterrupted) {
					return fmt.Errorf("%w; nothing was written to %s; the same command with --resume continues", err, opt.Out)
				}
				return quantizeFlagError(err, opt)
			}
			if rep.ResumedAt > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "resumed: blocks 0–%d were kept from the interrupted run\n", rep.ResumedAt-1)
			}
			if bar != nil {
				bar.Set(blocks, "done")
			}
			printReport(cmd, rep)
			var ppl *evals.PPLResult
			if evalData != "" {
				if ppl, err = evalOutput(cmd, opt.Out, evalData, evalDevice, evals.PPLOptions{SeqLen: evalSeqLen, Windows: evalWindows}); err != nil {
					return fmt.Errorf("--eval: %w (the checkpoint was written to %s)", err, opt.Out)
				}
			}
			if statsPath != "" {
				if err := writeJSON(statsPath, map[string]any{"model": opt.Src, "layers": stats}); err != nil {
					return err
				}
			}
			if reportPath != "" {
				info := map[string]any{"model": opt.Src, "out": opt.Out, "report": rep}
				if ppl != nil {
					info["eval"] = map[string]any{"data": evalData, "result": ppl}
				}
				return writeJSON(reportPath, evals.NewRecord("quantize", info))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&opt.Out, "output", "o", "", "output directory (required; written atomically)")
	f.StringVar(&method, "method", "gptq", "gptq, awq, awq+gptq (AWQ scales folded, then GPTQ), rtn, or fp8 (FP8 E4M3 weights, scale max|W|/448; written as compressed-tensors)")
	f.StringVar(&opt.Format, "format", "gptq", "checkpoint layout: gptq, awq (AutoAWQ GEMM; 4-bit, no act-order) or compressed-tensors (llm-compressor's, that vLLM loads: pack-quantized; FP8: float-quantized)")
	f.StringVar(&fp8Act, "fp8-act", "dynamic", "--method fp8: the activation scheme recorded: dynamic (FP8 per token) or static (one FP8 scale per layer input, max|x|/448 over --calib; written as input_scale)")
	f.StringVar(&fp8Scale, "fp8-scale", "per-channel", "--method fp8: per-channel (a scale per output channel, llm-compressor's FP8_DYNAMIC) or per-tensor (one scale per layer)")
	f.StringVar(&statsPath, "stats", "", "AWQ: write per-layer activation statistics (channel saliency; outlier tokens on the CPU) and search results (α and its loss curve, clip shrinks) as JSON")
	f.BoolVar(&duo, "duo", false, "AWQ: duo scaling x̄^α / w̄^(1−α) (AutoAWQ) instead of x̄^α (llm-awq)")
	f.BoolVar(&noClip, "no-clip", false, "AWQ: skip the clip search")
	f.IntVar(&awqSearchTokens, "awq-search-tokens", 0, "AWQ: measure each scale candidate on the first windows holding this many calibration tokens (0: all; x̄, the clip search and the propagation read all)")
	f.IntVar(&bits, "bits", 4, "bits per weight: 2, 3, 4 or 8")
	f.IntVar(&group, "group", 128, "group size along the input dimension: a size dividing every layer's input (32, 64, 128, 256, …) or -1 (per channel)")
	f.BoolVar(&sym, "sym", false, "symmetric grid (zero fixed at 2^(bits-1))")
	f.BoolVar(&gopt.ActOrder, "act-order", false, "GPTQ: quantize columns by decreasing Hessian diagonal (desc_act)")
	f.BoolVar(&gopt.StaticGroups, "static-groups", false, "GPTQ: fit all group scales before quantizing")
	f.BoolVar(&gopt.GroupsFromBlockStart, "groups-from-block-start", false, "GPTQ: fit a group that starts inside a 128-column block on the weights as the block began (the reference code's W), not as already updated (matters for groups of 32, 64, …)")
	f.Float64Var(&gopt.Damp, "damp", 0.01, "GPTQ: dampening as a fraction of mean(diag H)")
	f.BoolVar(&opt.TrueSequential, "true-sequential", true, "GPTQ: quantize [q,k,v]→[o]→[gate,up]→[down] sequentially")
	f.StringVar(&opt.Calib, "calib", "", "calibration data: a text file, JSON Lines with a \"text\" field per line (.jsonl), or int32 token ids (.i32)")
	f.IntVar(&opt.NSamples, "nsamples", 128, "calibration windows")
	f.Uint64Var(&opt.Seed, "seed", 0, "sample the windows at random offsets with this seed (0: the first --nsamples non-overlapping windows)")
	f.IntVar(&opt.SeqLen, "seqlen", 2048, "tokens per calibration window (AWQ default 512)")
	f.BoolVar(&opt.QuantizeLMHead, "quantize-lm-head", false, "also quantize lm_head")
	f.BoolVar(&opt.Resume, "resume", false, "continue an interrupted run (same command and settings) from its last finished block")
	f.BoolVar(&opt.Force, "force", false, "replace OUT if it exists and is empty or an earlier llmq output")
	f.Var(ruleFlag{p: &plan}, "override", "mixed precision: quantize modules matching a glob (* any characters; re:EXPR for a regular expression) with other bits and group, e.g. 'layers.0.*=8', '*.down_proj=8:64', 'lm_head=8'; repeatable, the first match wins")
	f.StringVar(&evalData, "eval", "", "after writing, measure the checkpoint's perplexity on this text (as eval ppl does) and add it to its model card")
	f.IntVar(&evalWindows, "eval-windows", 0, "--eval: only the first N windows (0: all)")
	f.IntVar(&evalSeqLen, "eval-seqlen", 2048, "--eval: window length in tokens")
	f.StringVar(&evalDevice, "eval-device", "auto", "--eval: auto, cpu or cuda")
	f.StringVar(&smoothPath, "smooth-scales", "", "fold the SmoothQuant factors of this file (llmq calibrate --smooth α) into the norms and weights before quantizing: W8A8 with smoothing, the weights rounded after smoothing (evaluate with --act-bits 8, without the file again)")
	f.StringVar(&planPath, "plan", "", "mixed-precision plan from llmq sensitivity -o (its rules come after --override/--skip)")
	f.Var(ruleFlag{p: &plan, skip: true}, "skip", "mixed precision: keep modules matching a glob (or re:EXPR) unquantized, e.g. 'layers.31.mlp.down_proj'; repeatable")
	f.StringVar(&shardSize, "max-shard-size", "5GB", "largest shard of the output (a block is never split): bytes, or with kB/MB/GB or KiB/MiB/GiB")
	f.StringVar(&device, "device", "auto", "where GPTQ and AWQ calibrate, search and solve: auto (the GPU when its library and a device are there), cpu, or cuda (RTN needs no calibration and rounds on the CPU)")
	f.StringVar(&reportPath, "report", "", "write the run's report (per-layer loss, timings, each expert's calibration tokens) as JSON here")
	f.StringVar(&opt.MoECalib, "moe-calib", quantize.MoECalibRouted, "mixtures of experts: each expert's statistics from the calibration tokens the router sends it (routed), or from every token sent through every expert (all; statistics only, outputs follow the real routing)")
	f.IntVar(&opt.MoEMinTokens, "moe-min-tokens", 0, "mixtures of experts: an expert routed fewer calibration tokens is calibrated on all tokens instead, and reported (0: the model's hidden size)")
	return cmd
}

// quantizeDevice opens the GPU for --device cuda, and for auto when the
// method and the model's architecture run there and a GPU is available
// (saying once why not, if not).
func quantizeDevice(device string, m quantize.Method, src string) (*cuda.Lib, error) {
	switch device {
	case "cpu":
		return nil, nil
	case "auto", "cuda":
	default:
		return nil, fmt.Errorf("--device must be auto, cpu or cuda, got %q", device)
	}
	if !m.Calibrated() {
		return nil, nil // RTN reads no calibration data: it rounds on the CPU wherever it runs
	}
	if !quantize.RunsOnGPU(m) {
		if device == "cuda" {
			return nil, fmt.Errorf("--device cuda: --method %s runs on the CPU only", m.Name())
		}
		return nil, nil
	}
	if cfg, err := checkpoint.LoadConfig(src); err == nil {
		if err := cuda.CalibratorSupports(cfg); err != nil {
			if device == "cuda" {
				return nil, fmt.Errorf("--device cuda: %w", err)
			}
			fmt.Fprintf(os.Stderr, "llmq: quantizing on the CPU (%v)\n", err)
			return nil, nil
		}
	}
	lib, err := cuda.Open("")
	if err == nil {
		_, err = lib.Device()
	}
	if err != nil {
		if device == "cuda" {
			return nil, fmt.Errorf("--device cuda: %w", err)
		}
		fmt.Fprintf(os.Stderr, "llmq: quantizing on the CPU (%v)\n", err)
		return nil, nil
	}
	return lib, nil
}

// quantizeFlagError names the flags behind a library error where there
// are some.
func quantizeFlagError(err error, opt quantize.Options) error {
	if errors.Is(err, pack.ErrPartial) {
		return fmt.Errorf("%w: --resume continues it, --force starts over", err)
	}
	var short *calib.ShortError
	if errors.As(err, &short) {
		fit := short.Tokens / short.SeqLen
		hint := fmt.Sprintf("use --nsamples %d", fit)
		if fit == 0 {
			hint = "use more calibration text"
		}
		if s := short.Tokens / short.N; s >= 16 {
			hint += fmt.Sprintf(", or --seqlen %d for %d windows", s, short.N)
		}
		return fmt.Errorf("--calib %s with --nsamples %d --seqlen %d: %w; %s", opt.Calib, opt.NSamples, opt.SeqLen, short, hint)
	}
	if errors.Is(err, quantize.ErrCalibration) {
		return fmt.Errorf("--calib/--nsamples/--seqlen: %w", err)
	}
	return err
}

func printReport(cmd *cobra.Command, rep *quantize.Report) {
	w := cmd.OutOrStdout()
	if rep.Method == "gptq" || rep.Method == "awq+gptq" {
		fmt.Fprintf(w, "%-36s %12s %8s\n", "layer", "gptq loss", "seconds")
		for _, l := range rep.Layers {
			fmt.Fprintf(w, "%-36s %12.4f %8.2f\n", l.Name, l.Loss, l.Seconds)
		}
	}
	printExperts(w, rep.Experts)
	fmt.Fprintf(w, "method %s, format %s", rep.Method, rep.Format)
	if rep.CalibTokens > 0 {
		fmt.Fprintf(w, ", %d calibration tokens (of the %d in the file)", rep.CalibTokens, rep.CalibSourceTokens)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "size %s → %s, wall time %.1f s on %s", human(float64(rep.BytesIn), "B"), human(float64(rep.BytesOut), "B"), rep.Seconds, rep.Device)
	if rep.PeakGPUBytes > 0 {
		fmt.Fprintf(w, " (peak GPU memory %s)", human(float64(rep.PeakGPUBytes), "B"))
	}
	fmt.Fprintln(w)
	var kinds []string
	for k := range rep.Timing {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for i, k := range kinds {
		kinds[i] = fmt.Sprintf("%s %.1f s", k, rep.Timing[k])
	}
	if len(kinds) > 0 {
		fmt.Fprintf(w, "time: %s\n", strings.Join(kinds, ", "))
	}
	if rep.CalibTokensPerSecond > 0 {
		fmt.Fprintf(w, "calibration forward: %s tokens/s (tokens × blocks over the passes' seconds)\n", human(rep.CalibTokensPerSecond, ""))
	}
}

// commandLine is the command as a shell would take it back.
func commandLine(cmd *cobra.Command) string {
	parts := []string{cmd.CommandPath()}
	for _, a := range os.Args[1:] {
		if a == "" || strings.ContainsAny(a, " \t\n'\"$\\") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		parts = append(parts, a)
	}
	if len(os.Args) > 1 && os.Args[1] == cmd.Name() {
		parts = append(parts[:1], parts[2:]...) // CommandPath already holds it
	}
	return strings.Join(parts, " ")
}

// evalOutput measures a written checkpoint's perplexity on data and adds
// it to the checkpoint's model card.
func evalOutput(cmd *cobra.Command, dir, data, device string, opt evals.PPLOptions) (*evals.PPLResult, error) {
	m, err := openModel(dir, device)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	ids, err := calib.ReadTokens(data, calib.FormatAuto, m.Tokenizer)
	if err != nil {
		return nil, err
	}
	res, err := evals.Perplexity(cmd.Context(), m.Backend, ids, opt)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "perplexity %.4f on %d windows of %d tokens of %s\n", res.Perplexity, res.Windows, res.SeqLen, data)
	section := fmt.Sprintf("\n## Evaluation\n\nPerplexity %.4f on %s: %d windows of %d tokens (%d predicted), without BOS, each from an empty context, as `llmq eval ppl` measures it (%s).\n",
		res.Perplexity, filepath.Base(data), res.Windows, res.SeqLen, res.Predicted, m.Backend.Name())
	card := filepath.Join(dir, "README.md")
	old, err := os.ReadFile(card)
	if err != nil {
		return nil, err
	}
	tmp := card + ".tmp"
	if err := os.WriteFile(tmp, append(old, section...), 0o644); err != nil {
		return nil, err
	}
	return &res, os.Rename(tmp, card)
}

// printExperts lists each sparse layer's experts with the calibration
// tokens the router sent them; * marks an expert calibrated on all tokens
// (--moe-calib all, or fewer routed tokens than --moe-min-tokens).
func printExperts(w io.Writer, experts []quantize.ExpertReport) {
	if len(experts) == 0 {
		return
	}
	fallback, all := 0, 0
	for i, e := range experts {
		if i == 0 || experts[i-1].Layer != e.Layer {
			if i > 0 {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "layer %d experts, routed calibration tokens:", e.Layer)
		}
		mark := ""
		if e.AllTokens {
			mark, all = "*", e.Tokens
		}
		if e.Fallback {
			fallback++
		}
		fmt.Fprintf(w, " %d:%d%s", e.Expert, e.Routed, mark)
	}
	fmt.Fprintln(w)
	if all > 0 {
		fmt.Fprintf(w, "* calibrated on all %d tokens", all)
		if fallback > 0 {
			fmt.Fprintf(w, " (%d experts routed fewer than --moe-min-tokens)", fallback)
		}
		fmt.Fprintln(w)
	}
}

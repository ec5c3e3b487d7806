package main

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/calib"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/spf13/cobra"
)

func newCalibrate() *cobra.Command {
	var act actFlags
	var opt actquant.CalibrateOptions
	var calibPath, out, plotPath, channelsPath, plotLayer string
	var nsamples, seqlen int
	cmd := &cobra.Command{
		Use:   "calibrate MODEL_DIR --calib FILE -o scales.json",
		Short: "Calibrate static activation thresholds (min-max, percentile, KL) and SmoothQuant factors",
		Long: `Runs the model on the first --nsamples windows of --seqlen tokens of --calib,
observes the input of every linear layer of every block, and writes each
input's clipping threshold as chosen by --method: minmax (the largest |x|),
percentile (--percentile of |x|), or kl (TensorRT's entropy calibration: the
threshold whose clipped, quantized histogram is closest in KL divergence);
several methods, comma-separated, write a file each from one pass (-o
with {method} in its name). With --smooth α, SmoothQuant's per-channel factors are calibrated first and
recorded too. llmq eval ppl --act-scales reads the file.`,
		Example: `  llmq calibrate ../shared/models/llama-small --calib ../shared/data/calib.txt --method kl -o kl.json
  llmq eval ppl ../shared/models/llama-small --data wiki.test.raw --act-bits 8 --act-scheme per-tensor --act-scales kl.json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return fmt.Errorf("-o FILE is required")
			}
			if calibPath == "" {
				return fmt.Errorf("--calib FILE is required (calibration text or .i32 tokens)")
			}
			methods := strings.Split(opt.Method, ",")
			for _, m := range methods {
				switch m {
				case actquant.MinMax, actquant.Percentile, actquant.KL:
				default:
					return fmt.Errorf("--method %q: want minmax, percentile or kl (or several, comma-separated)", m)
				}
			}
			if len(methods) > 1 && !strings.Contains(out, "{method}") {
				return fmt.Errorf("--method %s writes a file per method: -o needs {method} in its name (e.g. scales-{method}.json)", opt.Method)
			}
			opt.Method = methods[0]
			if !(opt.Percentile > 0 && opt.Percentile <= 100) {
				return fmt.Errorf("--percentile %v: want a value in (0, 100]", opt.Percentile)
			}
			if !(opt.Alpha >= 0 && opt.Alpha < 1) {
				return fmt.Errorf("--smooth %v: want α in (0, 1), or 0 for none", opt.Alpha)
			}
			var err error
			act.scheme = "per-tensor"
			if opt.Scheme, err = act.parse(); err != nil {
				return err
			}
			tok, err := tokenizer.Load(filepath.Join(args[0], "tokenizer.json"))
			if err != nil {
				return err
			}
			ids, err := calib.ReadTokens(calibPath, calib.FormatAuto, tok)
			if err != nil {
				return fmt.Errorf("--calib: %w", err)
			}
			windows, err := calib.Windows(ids, nsamples, seqlen)
			if err != nil {
				return fmt.Errorf("--calib %s with --nsamples %d --seqlen %d: %w", calibPath, nsamples, seqlen, err)
			}
			var sc *actquant.Scales
			observers := map[string]*actquant.Observer{}
			opt.Observed = func(name string, o *actquant.Observer) { observers[name] = o }
			calibrate := func(m *llm.Model) error {
				sc, err = actquant.Calibrate(cmd.Context(), m, windows, opt)
				return err
			}
			m, err := loadModelWith(args[0], "cpu", backend.Options{CPU: calibrate})
			if err != nil {
				return err
			}
			m.Close()
			names := make([]string, 0, len(sc.Layers))
			for n := range sc.Layers {
				names = append(names, n)
			}
			sort.Strings(names)
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "%-40s %10s %10s\n", "layer input", "threshold", "max |x|")
			for _, n := range names {
				fmt.Fprintf(w, "%-40s %10.4f %10.4f\n", n, sc.Layers[n].Threshold, sc.Layers[n].Amax)
			}
			for i, m := range methods {
				msc := sc
				if i > 0 { // the same observations, another method's thresholds
					c := *sc
					if c.Layers, err = actquant.Thresholds(observers, m, opt.Percentile, opt.Scheme); err != nil {
						return err
					}
					c.Method, msc = m, &c
				}
				if err := writeJSON(strings.ReplaceAll(out, "{method}", m), msc); err != nil {
					return err
				}
			}
			if plotPath == "" && channelsPath == "" {
				return nil
			}
			layer := plotLayer
			if layer == "" { // the input with the largest |x|: where outliers are
				for n, o := range observers {
					if layer == "" || o.Amax > observers[layer].Amax || o.Amax == observers[layer].Amax && n < layer {
						layer = n
					}
				}
			}
			o, ok := observers[layer]
			if !ok {
				return fmt.Errorf("--plot-layer %q: no such layer input (names as printed above)", plotLayer)
			}
			if plotPath != "" {
				th := map[string]float64{}
				for _, m := range []string{actquant.MinMax, actquant.Percentile, actquant.KL} {
					t, err := o.Threshold(m, opt.Percentile, opt.Scheme)
					if err != nil {
						return err
					}
					th[m] = float64(t)
				}
				counts, width := o.Histogram()
				if err := evals.Histogram(plotPath, "|x| entering "+layer, "|x|", counts, width, th); err != nil {
					return fmt.Errorf("--plot: %w", err)
				}
			}
			if channelsPath != "" {
				labels, values := make([]string, len(o.ChannelMax)), make([]float64, len(o.ChannelMax))
				for i, v := range o.ChannelMax {
					labels[i], values[i] = fmt.Sprint(i), float64(v)
				}
				if err := evals.Bars(channelsPath, "max |x| per input channel of "+layer, "max |x|", labels, values); err != nil {
					return fmt.Errorf("--plot-channels: %w", err)
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&calibPath, "calib", "", "calibration text file (or .i32 token file)")
	f.IntVar(&nsamples, "nsamples", 32, "calibration windows")
	f.IntVar(&seqlen, "seqlen", 512, "tokens per calibration window")
	f.StringVar(&opt.Method, "method", "minmax", "minmax, percentile or kl, or several comma-separated (one pass; -o names a file per method with {method})")
	f.Float64Var(&opt.Percentile, "percentile", 99.99, "for --method percentile: the percentile of |x| (0, 100]")
	f.Float64Var(&opt.Alpha, "smooth", 0, "SmoothQuant migration strength α in (0, 1) (0: no smoothing)")
	f.IntVar(&act.bits, "bits", 8, "activation bits the thresholds are for (KL's number of levels)")
	f.StringVar(&act.format, "format", "int", "int or fp8")
	f.StringVarP(&out, "output", "o", "", "write the thresholds here (JSON)")
	f.StringVar(&plotPath, "plot", "", "draw one layer input's |x| histogram with the min-max, percentile and KL thresholds (.png or .svg)")
	f.StringVar(&channelsPath, "plot-channels", "", "draw one layer input's max |x| per channel: its outlier channels (.png or .svg)")
	f.StringVar(&plotLayer, "plot-layer", "", "the layer input the plots show (default: the one with the largest |x|)")
	return cmd
}

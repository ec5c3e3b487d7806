package main

import (
	"context"
	"fmt"
	"time"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/llm"
	"github.com/spf13/cobra"
)

// newBenchDecode is `llmq bench decode` (prefill too): end-to-end speed of
// a backend's forward passes, logits copied back to the host included.
func newBenchDecode() *cobra.Command {
	var device, contexts, batches, prefills, jsonOut string
	var steps, reps, chain int
	var allLogits bool
	cmd := &cobra.Command{
		Use:   "decode MODEL_DIR",
		Short: "Decode and prefill speed: tokens/s at given context lengths and batch sizes",
		Long: `For each context length C and batch size B, decode prefills B sequences with
C tokens, then times --steps decode steps of B tokens (one per sequence,
greedy, as a server decodes a request at temperature 0: where the backend
picks greedy tokens itself (the GPU), only the ids come back; --logits
copies every step's logits to the host instead, as a sampled or logprobs
request needs). It also times the
prefill of each --prefill length (batch 1). On the GPU, decode steps replay
CUDA graphs; the memory in use on the GPU is reported.`,
		Example: `  llmq bench decode /tmp/llama3-8b-w4 --device cuda --context 128,2048 --batch 1,8,32 --json evals/results/decode-h200-llama3-8b-w4.json
  llmq bench decode /tmp/llama3-8b-w4 --device cuda --prefill 512,2048,8192 --context 128,2048,8158 --batch 1,8,32,64`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctxs, err := parseInts(contexts)
			if err != nil {
				return fmt.Errorf("--context: %w", err)
			}
			bs, err := parseInts(batches)
			if err != nil {
				return fmt.Errorf("--batch: %w", err)
			}
			var pre []int
			if prefills != "0" {
				if pre, err = parseInts(prefills); err != nil {
					return fmt.Errorf("--prefill: %w", err)
				}
			}
			if err := checkChain(chain); err != nil {
				return err
			}
			if chain > 1 && allLogits {
				return fmt.Errorf("--chain %d with --logits: a chain reads only the picked ids, once at its end", chain)
			}
			m, err := openModel(args[0], device)
			if err != nil {
				return err
			}
			defer m.Close()
			b := m.Backend
			// A measurement past the model's positions would fail midway,
			// after minutes of others: refuse the flags first.
			if _, ok := b.(llm.Chainer); chain > 1 && !ok {
				return fmt.Errorf("--chain %d: the %s backend does not chain greedy steps on a device (the GPU's does)", chain, b.Name())
			}
			if P := b.Config().MaxPositions; P > 0 {
				d := decoded(steps, chain)
				for _, c := range ctxs {
					if c+d > P {
						fix := fmt.Sprintf("use --context %d or less", P-d)
						if P-d < 1 {
							fix = "use fewer --steps (or a shorter --chain)"
						}
						return fmt.Errorf("--context %d with --steps %d (--chain %d) needs %d positions (the warm-up's included); the model has %d (max_position_embeddings): %s", c, steps, chain, c+d, P, fix)
					}
				}
				for _, n := range pre {
					if n > P {
						return fmt.Errorf("--prefill %d: the model has %d positions (max_position_embeddings)", n, P)
					}
				}
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "%s on %s (loaded in %.1f s)\n", args[0], b.Name(), m.LoadTime.Seconds())
			var results []map[string]any
			peak := int64(0)
			var most llm.Memory // the backend's report when the device was fullest
			gpuUsed := func() {
				if u, err := b.Memory(); err == nil && u.DeviceUsed >= peak {
					peak, most = u.DeviceUsed, u
				}
			}
			for _, prefill := range pre {
				var times []float64
				for r := 0; r < reps; r++ {
					t, err := timePrefill(cmd.Context(), b, prefill)
					if err != nil {
						return err
					}
					times = append(times, t)
				}
				t := evals.Median(times)
				fmt.Fprintf(w, "prefill %5d tokens            %8.1f ms  %9.0f tokens/s\n", prefill, t*1e3, float64(prefill)/t)
				results = append(results, map[string]any{"kind": "prefill", "tokens": prefill, "ms": t * 1e3, "tokens_per_s": float64(prefill) / t})
			}
			greedy := !allLogits && llm.IsGreedier(b)
			if greedy {
				fmt.Fprintln(w, "decode steps pick their tokens on the device (--logits: copy the logits to the host)")
			}
			if chain > 1 {
				fmt.Fprintf(w, "greedy steps in chains of %d on the device, the host reading the ids once a chain (times are a chain's over %d)\n", chain, chain)
			}
			for _, c := range ctxs {
				for _, B := range bs {
					per, err := timeDecode(cmd.Context(), b, c, B, steps, chain, greedy, gpuUsed)
					if err != nil {
						return fmt.Errorf("context %d, batch %d: %w", c, B, err)
					}
					fmt.Fprintf(w, "decode  context %5d batch %3d %8.2f ms/step %9.1f tokens/s\n", c, B, per*1e3, float64(B)/per)
					results = append(results, map[string]any{"kind": "decode", "context": c, "batch": B, "ms_per_step": per * 1e3, "tokens_per_s": float64(B) / per})
				}
			}
			data := map[string]any{"model": args[0], "backend": b.Name(), "load_s": m.LoadTime.Seconds(), "steps": steps,
				"greedy_on_device": greedy, "chain": chain, "timed_steps": decoded(steps, chain) - decoded(0, chain), "results": results}
			if peak > 0 { // a device with its own memory
				data["weight_bytes"] = most.Weights
				data["gpu_memory_used_bytes"] = peak
				data["memory"] = most
				fmt.Fprintf(w, "GPU memory: weights %.2f GiB; at most %.2f GiB held by the model (caches %.2f, activations and %d graphs %.2f, workspace %.2f), %.2f GiB in use on the device (CUDA context and other processes included)\n",
					gibf(most.Weights), gibf(most.Total()), gibf(most.Caches), most.Graphs, gibf(most.Activations), gibf(most.Workspace), gibf(peak))
			}
			if jsonOut != "" {
				return writeJSON(jsonOut, evals.NewRecordOn("bench-decode", data, evals.GPUName(b)))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&device, "device", "cpu", "auto, cpu or cuda")
	f.StringVar(&contexts, "context", "128,2048", "comma-separated context lengths before decoding")
	f.StringVar(&batches, "batch", "1,8,32", "comma-separated batch sizes")
	f.IntVar(&steps, "steps", 64, "decode steps timed per measurement")
	f.StringVar(&prefills, "prefill", "2048", "comma-separated token counts of the timed prefills (0: skip)")
	f.IntVar(&reps, "reps", 3, "prefill repetitions (median reported)")
	f.StringVar(&jsonOut, "json", "", "write the results as JSON here")
	f.IntVar(&chain, "chain", 1, "greedy steps queued on the device back to back, the ids read once a chain (a backend that chains them: the GPU)")
	f.BoolVar(&allLogits, "logits", false, "copy every decode step's logits to the host, even where the backend picks greedy tokens itself")
	return cmd
}

// tokens returns n token ids for benchmarking (a fixed pattern below the
// vocabulary size).
func tokens(n, vocab int, salt int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = (i*7919 + salt*104729 + 11) % min(vocab, 8000)
	}
	return ids
}

func gibf(b int64) float64 { return float64(b) / (1 << 30) }

// timePrefill times one prefill of n tokens from an empty cache.
func timePrefill(ctx context.Context, b llm.Backend, n int) (float64, error) {
	c, err := b.NewCache(n)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	logits := make([]float32, b.Config().Vocab)
	start := time.Now()
	if err := b.Forward(ctx, []llm.Step{{Cache: c, Tokens: tokens(n, b.Config().Vocab, 0), Logits: logits, LastOnly: true}}); err != nil {
		return 0, err
	}
	return time.Since(start).Seconds(), nil
}

// timeDecode prefills B sequences of n tokens, then returns the seconds
// per decode step of B tokens (median of steps steps after two warm-ups;
// with chain > 1, of ⌈steps/chain⌉ chains after one, each chain's time
// over its steps).
func timeDecode(ctx context.Context, b llm.Backend, n, B, steps, chain int, greedy bool, sample func()) (float64, error) {
	V := b.Config().Vocab
	caches := make([]llm.Cache, B)
	logits := make([][]float32, B)
	for i := range caches {
		c, err := b.NewCache(n + decoded(steps, chain))
		if err != nil {
			return 0, err
		}
		defer c.Close()
		caches[i], logits[i] = c, make([]float32, V)
		if err := b.Forward(ctx, []llm.Step{{Cache: c, Tokens: tokens(n, V, i), Logits: logits[i], LastOnly: true}}); err != nil {
			return 0, err
		}
	}
	var times []float64
	st := make([]llm.Step, B)
	next := make([]int, B)
	for i := range next {
		next[i] = llm.Argmax(logits[i])
	}
	if chain > 1 {
		return timeChains(ctx, b.(llm.Chainer), caches, next, (steps+chain-1)/chain, chain, sample)
	}
	for s := 0; s < steps+2; s++ {
		for i := range st {
			st[i] = llm.Step{Cache: caches[i], Tokens: []int{next[i]}, Logits: logits[i], LastOnly: true, Greedy: greedy}
		}
		start := time.Now()
		if err := b.Forward(ctx, st); err != nil {
			return 0, err
		}
		if s >= 2 {
			times = append(times, time.Since(start).Seconds())
		}
		for i := range next {
			if greedy {
				next[i] = st[i].Argmax
			} else {
				next[i] = llm.Argmax(logits[i])
			}
		}
	}
	sample()
	return evals.Median(times), nil
}

// decoded is how many tokens timeDecode adds to each sequence: steps and
// two warm-up steps, or ⌈steps/chain⌉ chains and one warm-up chain (so
// the steps timed are decoded(steps, chain) − decoded(0, chain)).
func decoded(steps, chain int) int {
	if chain <= 1 {
		return steps + 2
	}
	return ((steps+chain-1)/chain + 1) * chain
}

// timeChains times chains+1 greedy chains of n steps from the sequences'
// caches and next tokens, and returns the median chain's seconds over n
// (the first chain a warm-up: it captures the graph).
func timeChains(ctx context.Context, b llm.Chainer, caches []llm.Cache, next []int, chains, n int, sample func()) (float64, error) {
	st := make([]llm.Step, len(caches))
	var times []float64
	for c := 0; c < chains+1; c++ {
		for i := range st {
			st[i] = llm.Step{Cache: caches[i], Tokens: []int{next[i]}}
		}
		start := time.Now()
		out, err := b.DecodeGreedy(ctx, st, n)
		if err != nil {
			return 0, err
		}
		if c > 0 {
			times = append(times, time.Since(start).Seconds()/float64(n))
		}
		for i := range next {
			next[i] = out[i][n-1]
		}
	}
	sample()
	return evals.Median(times), nil
}

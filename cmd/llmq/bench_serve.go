package main

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"time"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/server"
	"github.com/spf13/cobra"
)

func newBenchServe() *cobra.Command {
	var load evals.LoadOptions
	var opt engine.Options
	var device, clients, jsonOut string
	var perClient int
	cmd := &cobra.Command{
		Use:   "serve MODEL_DIR",
		Short: "Load-test llmq serve in-process: concurrent streaming chat clients on loopback",
		Long: `Starts the OpenAI-compatible server on a loopback port and, for each
--clients level, drives it with that many concurrent streaming chat clients
until --requests requests have been answered; then shuts it down. Each
level reports time to first token, inter-token latency (a request's mean
gap between tokens after the first) and request latency percentiles,
tokens/s, and the GPU memory in use. It fails when a request is lost or
goroutines are left behind after shutdown.`,
		Example: `  llmq bench serve ../shared/models/llama-tiny --clients 32 --requests 256 --json evals/results/serve-load-llama-tiny.json
  llmq bench serve /tmp/llama3-8b-w4 --device cuda --clients 1,8,32,64 --max-batch 64 --requests-per-client 8 --max-tokens 128`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			levels, err := parseInts(clients)
			if err != nil {
				return fmt.Errorf("--clients: %w", err)
			}
			if err := checkChain(opt.Chain); err != nil {
				return err
			}
			base := runtime.NumGoroutine()
			m, err := loadModel(args[0], device)
			if err != nil {
				return err
			}
			e, err := engine.New(m, opt)
			if err != nil {
				m.Close()
				return err
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				e.Close()
				m.Close()
				return err
			}
			load.URL, load.Model = "http://"+ln.Addr().String(), modelName(args[0])
			ctx, stop := context.WithCancel(cmd.Context())
			served := make(chan error, 1)
			go func() {
				served <- server.Serve(ctx, ln, server.New(e, server.Options{Model: load.Model}), server.ServeOptions{Grace: 10 * time.Second})
			}()
			w := cmd.OutOrStdout()
			var rows []map[string]any
			var failed []string
			var lerr error
			for _, c := range levels {
				load.Clients = c
				if perClient > 0 {
					load.Requests = perClient * c
				}
				res, err := evals.RunLoad(cmd.Context(), load)
				if err != nil {
					lerr = err
					break
				}
				row := map[string]any{"clients": c, "result": res}
				fmt.Fprintf(w, "%d clients: %d/%d requests answered by %s (batch ≤ %d), %d tokens in %.1f s: %.1f tokens/s\n",
					c, res.Succeeded, res.Requests, e.Backend.Name(), opt.MaxBatch, res.CompletionTokens, res.WallSeconds, res.TokensPerSecond)
				if res.TTFT == nil {
					fmt.Fprintf(w, "  time to first token: no request streamed text (--logprobs times tokens a tokenizer cannot spell)\n")
				} else {
					fmt.Fprintf(w, "  time to first token ms: p50 %.0f  p99 %.0f  max %.0f\n", res.TTFT["p50"], res.TTFT["p99"], res.TTFT["max"])
					fmt.Fprintf(w, "  inter-token latency ms: p50 %.2f  p99 %.2f\n", res.ITL["p50"], res.ITL["p99"])
				}
				fmt.Fprintf(w, "  request latency ms:     p50 %.0f  p99 %.0f  max %.0f\n", res.Total["p50"], res.Total["p99"], res.Total["max"])
				if u, err := e.Backend.Memory(); err == nil && u.DeviceUsed > 0 {
					row["gpu_memory_used_bytes"], row["memory"] = u.DeviceUsed, u
					fmt.Fprintf(w, "  GPU memory in use: %.2f GiB (model: weights %.2f, caches %.2f, activations and graphs %.2f)\n",
						gibf(u.DeviceUsed), gibf(u.Weights), gibf(u.Caches), gibf(u.Activations))
				}
				rows = append(rows, row)
				for _, msg := range res.Errors {
					failed = append(failed, fmt.Sprintf("%d clients: %s", c, msg))
				}
			}
			stop()
			serr := <-served
			e.Close()
			m.Close()
			leaked := leakedGoroutines(base)
			fmt.Fprintf(w, "goroutines left after shutdown: %d\n", leaked)
			if jsonOut != "" && len(rows) > 0 { // the levels that finished, also when a later one failed
				rec := evals.NewRecordOn("bench-serve", map[string]any{"model": args[0], "backend": e.Backend.Name(), "max_batch": opt.MaxBatch,
					"chain": opt.Chain, "max_tokens": load.MaxTokens, "levels": rows, "goroutines_leaked": leaked}, evals.GPUName(e.Backend))
				if err := writeJSON(jsonOut, rec); err != nil {
					return err
				}
			}
			if lerr != nil {
				return lerr
			}
			if serr != nil {
				return serr
			}
			if len(failed) > 0 {
				return fmt.Errorf("%d requests failed; first: %s", len(failed), failed[0])
			}
			if leaked > 0 {
				return fmt.Errorf("%d goroutines still running after shutdown", leaked)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&clients, "clients", "32", "concurrent streaming clients: a count, or a comma-separated list of levels run one after another")
	f.IntVar(&load.Requests, "requests", 128, "requests in all, at each level")
	f.BoolVar(&load.Logprobs, "logprobs", false, "ask for each token's logprob (the engine then copies every row's logits to the host and takes its log-softmax there); it also makes every token an event where a tokenizer cannot spell the model's ids")
	f.IntVar(&perClient, "requests-per-client", 0, "requests at each level per client, in place of --requests (a level of 64 clients then runs as long as one of 1)")
	f.IntVar(&load.MaxTokens, "max-tokens", 32, "max_tokens of each request")
	f.StringVar(&load.Prompt, "prompt", "Tell me about the history of Rome", "user message")
	f.IntVar(&opt.MaxBatch, "max-batch", 16, "most sequences in one forward pass")
	f.StringVar(&device, "device", "cpu", "auto, cpu or cuda")
	f.IntVar(&opt.MaxQueue, "max-queue", 64, "most requests waiting for a batch slot")
	chainFlag(f, &opt.Chain)
	f.StringVar(&jsonOut, "json", "", "write the results as JSON here")
	return cmd
}

// leakedGoroutines waits up to two seconds for the goroutine count to fall
// back to base (connections close asynchronously) and returns the excess.
func leakedGoroutines(base int) int {
	deadline := time.Now().Add(2 * time.Second)
	for {
		n := runtime.NumGoroutine() - base
		if n <= 0 || time.Now().After(deadline) {
			return max(n, 0)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

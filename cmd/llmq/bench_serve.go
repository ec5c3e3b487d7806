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
	var device, jsonOut string
	cmd := &cobra.Command{
		Use:   "serve MODEL_DIR",
		Short: "Load-test llmq serve in-process: concurrent streaming chat clients on loopback",
		Long: `Starts the OpenAI-compatible server on a loopback port, drives it with
--clients concurrent streaming chat clients until --requests requests have
been answered, shuts it down, and reports time to first token, request
latency percentiles and tokens/s. It fails when a request is lost or
goroutines are left behind after shutdown.`,
		Example: `  llmq bench serve ../shared/models/llama-tiny --clients 32 --requests 256 --json evals/results/serve-load-llama-tiny.json`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
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
			res, lerr := evals.RunLoad(cmd.Context(), load)
			stop()
			serr := <-served
			e.Close()
			m.Close()
			if lerr != nil {
				return lerr
			}
			if serr != nil {
				return serr
			}
			leaked := leakedGoroutines(base)
			fmt.Fprintf(cmd.OutOrStdout(), "%d/%d requests answered by %s (batch ≤ %d) with %d clients, %d tokens in %.1f s: %.1f tokens/s\n",
				res.Succeeded, res.Requests, e.Backend.Name(), opt.MaxBatch, load.Clients, res.CompletionTokens, res.WallSeconds, res.TokensPerSecond)
			fmt.Fprintf(cmd.OutOrStdout(), "time to first token ms: p50 %.0f  p90 %.0f  p99 %.0f  max %.0f\n", res.TTFT["p50"], res.TTFT["p90"], res.TTFT["p99"], res.TTFT["max"])
			fmt.Fprintf(cmd.OutOrStdout(), "request latency ms:     p50 %.0f  p90 %.0f  p99 %.0f  max %.0f\n", res.Total["p50"], res.Total["p90"], res.Total["p99"], res.Total["max"])
			fmt.Fprintf(cmd.OutOrStdout(), "goroutines left after shutdown: %d\n", leaked)
			if jsonOut != "" {
				rec := evals.NewRecord("bench-serve", map[string]any{"model": args[0], "backend": e.Backend.Name(), "max_batch": opt.MaxBatch,
					"clients": load.Clients, "max_tokens": load.MaxTokens, "result": res, "goroutines_leaked": leaked})
				if err := writeJSON(jsonOut, rec); err != nil {
					return err
				}
			}
			if len(res.Errors) > 0 {
				return fmt.Errorf("%d of %d requests failed; first: %s", len(res.Errors), res.Requests, res.Errors[0])
			}
			if leaked > 0 {
				return fmt.Errorf("%d goroutines still running after shutdown", leaked)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&load.Clients, "clients", 32, "concurrent streaming clients")
	f.IntVar(&load.Requests, "requests", 128, "requests in all")
	f.IntVar(&load.MaxTokens, "max-tokens", 32, "max_tokens of each request")
	f.StringVar(&load.Prompt, "prompt", "Tell me about the history of Rome", "user message")
	f.IntVar(&opt.MaxBatch, "max-batch", 16, "most sequences in one forward pass")
	f.StringVar(&device, "device", "cpu", "auto, cpu or cuda")
	f.IntVar(&opt.MaxQueue, "max-queue", 64, "most requests waiting for a batch slot")
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

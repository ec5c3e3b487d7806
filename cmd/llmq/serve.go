package main

import (
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/server"
	"github.com/spf13/cobra"
)

func newServe() *cobra.Command {
	var addr, name, device string
	var opt engine.Options
	var grace time.Duration
	var maxBody int64
	cmd := &cobra.Command{
		Use:   "serve MODEL_DIR",
		Short: "Serve a model with an OpenAI-compatible HTTP API (chat and completions, streaming)",
		Long: `serve answers POST /v1/chat/completions and /v1/completions (streamed with
server-sent events or whole), GET /v1/models and GET /health. Concurrent
requests share forward passes (continuous batching); when --max-queue
requests are already waiting, new ones get 503 with Retry-After. SIGTERM or
Ctrl-C stops accepting connections and lets running requests finish for up
to --grace.`,
		Example: `  llmq serve ../shared/models/llama-tiny --addr 127.0.0.1:8080
  curl -N localhost:8080/v1/chat/completions -d '{"model":"llama-tiny","stream":true,"max_tokens":32,"messages":[{"role":"user","content":"Hi"}]}'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := loadModel(args[0], device)
			if err != nil {
				return err
			}
			defer m.Close()
			if m.Fallback != "" {
				fmt.Fprintln(os.Stderr, "llmq:", m.Fallback)
			}
			e, err := engine.New(m, opt)
			if err != nil {
				return err
			}
			defer e.Close()
			if name == "" {
				name = modelName(args[0])
			}
			ln, err := net.Listen("tcp", addr)
			if err != nil {
				return fmt.Errorf("--addr: %w", err)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			chatNote := "chat template from tokenizer_config.json"
			if e.Template == nil {
				chatNote = "no chat template: /v1/chat/completions answers 400, use /v1/completions"
			}
			fmt.Fprintf(os.Stderr, "llmq: serving %q on http://%s (%s, batch ≤ %d, queue ≤ %d; %s)\n",
				name, ln.Addr(), e.Backend.Name(), opt.MaxBatch, opt.MaxQueue, chatNote)
			err = server.Serve(ctx, ln, server.New(e, server.Options{Model: name, MaxBodyBytes: maxBody}), grace)
			fmt.Fprintln(os.Stderr, "llmq: server stopped")
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "addr", "127.0.0.1:8080", "address to listen on")
	f.StringVar(&name, "model-name", "", "model name clients send (default: the directory's name)")
	f.StringVar(&device, "device", "auto", "auto (the GPU when there is one, else the CPU), cpu or cuda")
	f.IntVar(&opt.MaxBatch, "max-batch", 16, "most sequences in one forward pass")
	f.IntVar(&opt.MaxQueue, "max-queue", 64, "most requests waiting for a batch slot before 503")
	f.DurationVar(&grace, "grace", 30*time.Second, "on SIGTERM, how long running requests may take to finish")
	f.Int64Var(&maxBody, "max-body", 1<<20, "request body limit in bytes")
	return cmd
}

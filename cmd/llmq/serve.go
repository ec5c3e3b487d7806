package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/server"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

func newServe() *cobra.Command {
	var addr, name, device, logFormat string
	var kvGB float64
	var opt engine.Options
	var sopt server.Options
	var tout server.ServeOptions
	cmd := &cobra.Command{
		Use:   "serve MODEL_DIR",
		Short: "Serve a model with an OpenAI-compatible HTTP API (chat and completions, streaming)",
		Long: `serve answers POST /v1/chat/completions and /v1/completions (streamed with
server-sent events or whole), GET /v1/models, GET /health and GET /metrics
(Prometheus). The port is bound first and the model loaded after: until it
is ready /health answers 503 {"status": "loading"} and the API 503 with
Retry-After. Concurrent requests share forward passes (continuous
batching); when --max-queue requests are already waiting, new ones get 503
with Retry-After.

Every error is answered in OpenAI's {"error": {...}} shape. With --api-key
(or LLMQ_API_KEY, which keeps the key out of the process list) every route
but /health needs "Authorization: Bearer KEY" (401 otherwise). POSTs
that a browser marks as cross-origin get 403 (CSRF).
--max-concurrent and --rate-limit answer 429 with Retry-After beyond them;
bodies over --max-body get 413, prompts over --max-prompt-bytes 400 before
they are tokenized; a client that stops reading its answer for
--write-timeout is disconnected. One log line per request (--log-format text|json, on
stderr) carries its id, also sent back as X-Request-Id. SIGTERM or Ctrl-C
stops accepting connections and lets running requests finish for up to
--grace.

Memory: the key/value caches are paged — blocks of 16 positions of one
layer, taken as a sequence grows and given back when it ends — from a pool
of --kv-cache-gb (default 4 GiB on the CPU, three quarters of the device
memory free after loading on the GPU). A request joins the batch when the
pool has room for it and otherwise waits; when running sequences fill the
pool, the latest to arrive is preempted (its blocks freed) and prefilled
again later, so its text is unchanged. A request whose prompt + max_tokens
could never fit the pool, or exceed the model's context, gets 400
context_length_exceeded; one that sets no max_tokens gets
--default-max-tokens, bounded by what the context and the pool can hold.
(The GPU keeps every position of a sliding-window layer, where the CPU
keeps its window.)`,
		Example: `  llmq serve ../shared/models/llama-tiny --addr 127.0.0.1:8080
  curl -N localhost:8080/v1/chat/completions -d '{"model":"llama-tiny","stream":true,"max_tokens":32,"messages":[{"role":"user","content":"Hi"}]}'
  LLMQ_API_KEY=secret llmq serve ../shared/models/llama-tiny --addr 0.0.0.0:8080 --rate-limit 20 --max-concurrent 64
  curl localhost:8080/metrics`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var h slog.Handler
			switch logFormat {
			case "text":
				h = slog.NewTextHandler(cmd.ErrOrStderr(), nil)
			case "json":
				h = slog.NewJSONHandler(cmd.ErrOrStderr(), nil)
			default:
				return fmt.Errorf("--log-format %q: want text or json", logFormat)
			}
			logger := slog.New(h)
			if kvGB < 0 {
				return fmt.Errorf("--kv-cache-gb %g: want a size in GiB (0: unbounded)", kvGB)
			}
			opt.KVCacheBytes = int64(kvGB * (1 << 30))
			if err := checkChain(opt.Chain); err != nil {
				return err
			}
			if !cmd.Flags().Changed("api-key") {
				sopt.APIKey = os.Getenv("LLMQ_API_KEY")
			}
			if name == "" {
				name = modelName(args[0])
			}
			sopt.Model, sopt.Logger, tout.Logger = name, logger, logger

			// Bind first, so that clients see "loading" rather than a
			// refused connection while the model loads.
			ln, err := net.Listen("tcp", addr)
			if err != nil {
				return fmt.Errorf("--addr: %w", err)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			srv := server.New(nil, sopt)
			served := make(chan error, 1)
			go func() { served <- server.Serve(ctx, ln, srv, tout) }()
			auth := "no API key"
			if sopt.APIKey != "" {
				auth = "API key required"
			}
			fmt.Fprintf(os.Stderr, "llmq: listening on http://%s (%s); loading %s\n", ln.Addr(), auth, args[0])

			m, e, err := loadForServe(ctx, args[0], device, opt, !cmd.Flags().Changed("kv-cache-gb"))
			if err != nil {
				stop()
				<-served
				return err
			}
			if m == nil { // interrupted while loading
				return <-served
			}
			defer m.Close()
			defer e.Close() // after Serve: in-flight requests finish first
			srv.SetEngine(e)
			chatNote := "chat template from tokenizer_config.json"
			if e.Template == nil {
				chatNote = "no chat template: /v1/chat/completions answers 400, use /v1/completions"
			}
			kvNote := "KV cache: prompt + max_tokens reserved per request"
			if st := e.Stats(); st.KVPaged {
				kvNote = "KV cache unbounded, paged"
				if st.KVBlocksTotal > 0 {
					kvNote = fmt.Sprintf("KV cache %.3g GiB, paged: %d tokens at most per request", float64(e.KVPoolBytes())/(1<<30), e.MaxSequence())
				}
			} else if cmd.Flags().Changed("kv-cache-gb") {
				fmt.Fprintf(os.Stderr, "llmq: --kv-cache-gb applies to a backend that pages its caches; %s reserves each request's cache up front\n", e.Backend.Name())
			}
			fmt.Fprintf(os.Stderr, "llmq: serving %q on http://%s (%s, batch ≤ %d, queue ≤ %d; %s; %s)\n",
				name, ln.Addr(), e.Backend.Name(), opt.MaxBatch, opt.MaxQueue, kvNote, chatNote)
			err = <-served
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
	chainFlag(f, &opt.Chain)
	f.Float64Var(&kvGB, "kv-cache-gb", 4, "memory for the key/value caches of all requests together, in GiB (paged in blocks of 16 positions; 0: unbounded; unset on the GPU: three quarters of the device memory free after loading)")
	f.DurationVar(&tout.Grace, "grace", 30*time.Second, "on SIGTERM, how long running requests may take to finish")
	f.Int64Var(&sopt.MaxBodyBytes, "max-body", 1<<20, "request body limit in bytes (413 beyond)")
	f.IntVar(&sopt.DefaultMaxTokens, "default-max-tokens", server.DefaultMaxTokensValue, "max_tokens of a request that sets none (bounded by the room left in the context and the KV cache)")
	f.IntVar(&sopt.MaxPromptBytes, "max-prompt-bytes", 0, "prompt text limit in bytes, checked before tokenizing (400 beyond; 0: context × longest token, the most that could fit)")
	f.StringVar(&sopt.APIKey, "api-key", "", "require \"Authorization: Bearer KEY\" on every route but /health (default: $LLMQ_API_KEY; empty: no key)")
	f.IntVar(&sopt.MaxConcurrent, "max-concurrent", 256, "most generation requests handled at once, queued ones included (429 beyond; 0: no limit)")
	f.Float64Var(&sopt.RateLimit, "rate-limit", 0, "generation requests admitted per second, in bursts of as many (429 with Retry-After beyond; 0: no limit)")
	f.DurationVar(&sopt.RequestTimeout, "request-timeout", 10*time.Minute, "longest a generation may take, queueing included (504 beyond; 0: no limit)")
	f.DurationVar(&sopt.WriteTimeout, "write-timeout", server.DefaultWriteTimeout, "longest one write of an answer may wait for a client that stopped reading (the connection is closed and its generation stopped beyond)")
	f.DurationVar(&tout.ReadTimeout, "read-timeout", 60*time.Second, "longest the server waits for a request's headers and body")
	f.DurationVar(&tout.IdleTimeout, "idle-timeout", 120*time.Second, "how long a kept-alive connection may wait for its next request")
	f.StringVar(&logFormat, "log-format", "text", "request log on stderr: text or json")
	return cmd
}

// loadForServe opens the model and starts its engine, giving up (nil, nil,
// nil) when ctx ends first: a SIGTERM during a long load exits at once.
// With kvAuto (--kv-cache-gb not given) a GPU's key/value pool is three
// quarters of the device memory free once the weights are loaded.
func loadForServe(ctx context.Context, dir, device string, opt engine.Options, kvAuto bool) (*backend.Model, *engine.Engine, error) {
	type loaded struct {
		m   *backend.Model
		e   *engine.Engine
		err error
	}
	done := make(chan loaded, 1)
	go func() {
		m, err := loadModel(dir, device)
		if err != nil {
			done <- loaded{err: err}
			return
		}
		if m.Fallback != "" {
			fmt.Fprintln(os.Stderr, "llmq:", m.Fallback)
		}
		if mem, err := m.Backend.Memory(); kvAuto && err == nil && mem.DeviceTotal > 0 {
			opt.KVCacheBytes = (mem.DeviceTotal - mem.DeviceUsed) / 4 * 3
		}
		e, err := engine.New(m, opt)
		if err != nil {
			m.Close()
			done <- loaded{err: fmt.Errorf("starting the engine: %w", err)}
			return
		}
		done <- loaded{m: m, e: e}
	}()
	select {
	case l := <-done:
		return l.m, l.e, l.err
	case <-ctx.Done():
		return nil, nil, nil
	}
}

// chainFlag adds --chain, the engine's Options.Chain, to a command that
// serves (serve, bench serve).
func chainFlag(f *pflag.FlagSet, chain *int) {
	f.IntVar(chain, "chain", llm.DefaultChain, "greedy steps the GPU runs back to back while every running request decodes greedily and no request has arrived since the scheduler last looked (1: a step at a time)")
}

// checkChain refuses a --chain below 1.
func checkChain(chain int) error {
	if chain < 1 {
		return fmt.Errorf("--chain %d: want at least 1", chain)
	}
	return nil
}

// Command chatserver is a Go program that embeds llmq: it loads a model
// (packed GPTQ/AWQ or unquantized) on the GPU when it can, else the CPU,
// and serves OpenAI-compatible chat on an address, shutting down gracefully
// on Ctrl-C or SIGTERM.
//
//	go run ./examples/chatserver -model ../shared/models/llama-tiny -addr 127.0.0.1:8080
//	curl -s 127.0.0.1:8080/v1/chat/completions -d '{"model": "llama-tiny",
//	    "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/llmq/llmq/backend"
	"github.com/llmq/llmq/engine"
	"github.com/llmq/llmq/server"
)

func main() {
	dir := flag.String("model", "", "model directory (Hugging Face layout, packed or not)")
	addr := flag.String("addr", "127.0.0.1:8080", "address to listen on")
	flag.Parse()

	m, err := backend.Open(*dir, "auto") // the GPU when it can; m.Fallback says why not
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	if m.Fallback != "" {
		log.Print(m.Fallback)
	}
	e, err := engine.New(m, engine.Options{MaxBatch: 16}) // continuous batching
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close() // before m.Close: the engine does not own the model

	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	name := filepath.Base(filepath.Clean(*dir))
	log.Printf("serving %s on http://%s (%s)", name, ln.Addr(), m.Backend.Name())
	if err := server.Serve(ctx, ln, server.New(e, server.Options{Model: name}), server.ServeOptions{}); err != nil {
		log.Fatal(err)
	}
}

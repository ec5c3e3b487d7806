package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/llmq/llmq/internal/shared"
)

// TestServeBindsBeforeLoading (issue 18, point 10): llmq serve listens
// before it loads the model. The model's config.json is a named pipe that
// the test holds shut, so loading blocks until the test releases it: all
// that time /health answers 503 "loading" (not a refused connection) and
// the API 503; once released, /health turns 200 "ok" and requests are
// served. The API key comes from LLMQ_API_KEY (point 11).
func TestServeBindsBeforeLoading(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	dir := filepath.Join(t.TempDir(), "llama-tiny")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() != "config.json" {
			if err := os.Symlink(filepath.Join(src, e.Name()), filepath.Join(dir, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
	}
	config, err := os.ReadFile(filepath.Join(src, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "config.json")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Skipf("no named pipes here: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()

	t.Setenv("LLMQ_API_KEY", "sk-test")
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() {
		root := newRoot()
		root.SetArgs([]string{"serve", dir, "--addr", addr, "--device", "cpu"})
		served <- root.ExecuteContext(ctx)
	}()
	defer func() {
		cancel()
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("serve did not stop")
		}
	}()

	get := func(path string, auth bool) (int, string, error) {
		req, _ := http.NewRequest("GET", "http://"+addr+path, nil)
		if auth {
			req.Header.Set("Authorization", "Bearer sk-test")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), nil
	}
	var status int
	var body string
	for i := 0; ; i++ {
		if status, body, err = get("/health", false); err == nil {
			break
		}
		if i > 500 {
			t.Fatalf("nothing listening on %s: %v", addr, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var h struct{ Status string }
	json.Unmarshal([]byte(body), &h)
	if status != 503 || h.Status != "loading" {
		t.Fatalf("/health while the model loads: %d %s", status, body)
	}
	time.Sleep(200 * time.Millisecond) // still loading: the pipe is shut
	if status, body, _ := get("/v1/models", true); status != 200 {
		t.Errorf("/v1/models while loading: %d %s", status, body)
	}
	req, _ := http.NewRequest("POST", "http://"+addr+"/v1/completions", strings.NewReader(`{"model": "llama-tiny", "prompt": "x"}`))
	req.Header.Set("Authorization", "Bearer sk-test")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 503 {
		t.Errorf("completion while loading: %v %v", resp, err)
	}

	// Release the model: feed config.json to each reader of the pipe
	// (once: a second write before the reader saw the end would append to
	// what it reads) until the server is ready.
	feeding, stopFeeding := context.WithCancel(context.Background())
	defer stopFeeding()
	go func() {
		for feeding.Err() == nil {
			f, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0)
			if err != nil { // no reader yet
				time.Sleep(5 * time.Millisecond)
				continue
			}
			f.Write(config)
			f.Close()
			time.Sleep(300 * time.Millisecond) // this reader has read it all
		}
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		status, body, err = get("/health", false)
		if err == nil && status == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("never ready: %d %s %v", status, body, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopFeeding()
	json.Unmarshal([]byte(body), &h)
	if h.Status != "ok" {
		t.Errorf("/health when ready: %s", body)
	}
	if status, body, _ := get("/v1/models", false); status != 401 || !strings.Contains(body, "invalid_api_key") {
		t.Errorf("without the key from LLMQ_API_KEY: %d %s", status, body)
	}
	req, _ = http.NewRequest("POST", "http://"+addr+"/v1/completions", strings.NewReader(`{"model": "llama-tiny", "prompt": "Once upon a time", "max_tokens": 2}`))
	req.Header.Set("Authorization", "Bearer sk-test")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Request-Id") == "" {
		t.Errorf("completion when ready: %d %s", resp.StatusCode, b)
	}
}

// TestServeFlagErrors: bad serve flags are refused, naming the flag,
// before anything is bound or loaded.
func TestServeFlagErrors(t *testing.T) {
	model := shared.Path(t, "models/llama-tiny")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", model, "--log-format", "xml"}, `--log-format "xml": want text or json`},
		{[]string{"serve", model, "--addr", "127.0.0.1:99999"}, "--addr"},
		{[]string{"serve", model, "--kv-cache-gb", "-1"}, "--kv-cache-gb -1"},
	} {
		if _, err := llmq(t, c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want it to say %q", c.args, err, c.want)
		}
	}
}

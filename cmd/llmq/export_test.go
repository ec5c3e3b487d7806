package main

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

// TestExportGGUF: llmq export gguf writes the file and says what it did;
// an existing file needs --force; a missing -o, a directory and a model
// without a tokenizer are errors that say so.
func TestExportGGUF(t *testing.T) {
	model := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	out := filepath.Join(dir, "tiny.gguf")
	got := mustLLMQ(t, "export", "gguf", model, "-o", out)
	if !strings.Contains(got, "wrote "+out) || !strings.Contains(got, "F16×30") {
		t.Errorf("output: %q", got)
	}
	if _, err := llmq(t, "export", "gguf", model, "-o", out); err == nil || !strings.Contains(err.Error(), "--force") {
		t.Errorf("existing output without --force: %v", err)
	}
	mustLLMQ(t, "export", "gguf", model, "-o", out, "--force")
	if _, err := llmq(t, "export", "gguf", model); err == nil || !strings.Contains(err.Error(), "-o") {
		t.Errorf("no -o: %v", err)
	}
	if _, err := llmq(t, "export", "gguf", model, "-o", dir); err == nil || !strings.Contains(err.Error(), "directory") {
		t.Errorf("-o a directory: %v", err)
	}
	bare := filepath.Join(dir, "bare")
	os.Mkdir(bare, 0o755)
	for _, f := range []string{"config.json", "model.safetensors"} {
		if err := os.Symlink(filepath.Join(model, f), filepath.Join(bare, f)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := llmq(t, "export", "gguf", bare, "-o", filepath.Join(dir, "bare.gguf")); err == nil || !strings.Contains(err.Error(), "tokenizer") {
		t.Errorf("no tokenizer.json: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("temporary file left behind: %s", e.Name())
		}
	}
}

// llmqBoth runs one command line and returns what it printed on stdout
// and on stderr.
func llmqBoth(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	root := newRoot()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), errOut.String(), err
}

// TestExportGGUFRequantizationCost: exporting 3-bit layers (re-quantized
// to Q4_0) warns with the perplexity measured on the spot, of the
// checkpoint as llmq runs it and with the GGUF file's weights, on the
// built-in prose or on --eval-data; 4-bit symmetric groups of 32 (Q4_0
// exactly) warn about nothing.
func TestExportGGUFRequantizationCost(t *testing.T) {
	model := shared.Path(t, "models/llama-tiny")
	wiki := shared.Path(t, "data/wikitext2/wiki.test.raw")
	dir := t.TempDir()
	w3, g32 := filepath.Join(dir, "w3"), filepath.Join(dir, "g32")
	mustLLMQ(t, "quantize", model, "--method", "rtn", "--bits", "3", "--group", "128", "-o", w3)
	mustLLMQ(t, "quantize", model, "--method", "rtn", "--bits", "4", "--group", "32", "--sym", "-o", g32)
	cost := regexp.MustCompile(`warning: 28 of 28 packed layers were re-quantized: perplexity ([0-9.]+) as llmq runs the checkpoint, ([0-9.]+) with the GGUF file's weights \(([-+][0-9.]+)%\), on (.+) \((\d+) windows of (\d+) tokens\)`)
	for _, c := range []struct {
		args          []string
		text          string
		windows, tlen string
	}{
		{nil, "llmq's built-in prose", "4", "512"},
		{[]string{"--eval-data", wiki, "--eval-windows", "2", "--eval-seqlen", "256"}, wiki, "2", "256"},
	} {
		stdout, stderr, err := llmqBoth(t, append([]string{"export", "gguf", w3, "-o", filepath.Join(dir, "w3.gguf"), "--force"}, c.args...)...)
		if err != nil {
			t.Fatalf("export: %v\n%s", err, stderr)
		}
		if !strings.Contains(stdout, "0 mapped exactly, 28 re-quantized") {
			t.Errorf("stdout: %q", stdout)
		}
		m := cost.FindStringSubmatch(stderr)
		if m == nil {
			t.Fatalf("no perplexity cost in the warnings:\n%s", stderr)
		}
		src, exp := mustFloat(t, m[1]), mustFloat(t, m[2])
		// Real perplexities of a 3-bit llama-tiny (the unquantized model
		// is at 90.2 on the prose's 4 windows of 512, 257.7 on WikiText-2;
		// the vocabulary has 8192 tokens); Q4_0 of the 3-bit weights is
		// close to them and not much better.
		for _, p := range []float64{src, exp} {
			if math.IsNaN(p) || math.IsInf(p, 0) || p < 10 || p > 8192 {
				t.Errorf("perplexity %v out of range", p)
			}
		}
		if exp < src*0.995 || exp > src*1.5 {
			t.Errorf("perplexity %v with the GGUF weights against %v as llmq runs it", exp, src)
		}
		if rel := 100 * (exp/src - 1); math.Abs(rel-mustFloat(t, m[3])) > 0.01 {
			t.Errorf("stated cost %s%%, perplexities give %.3f%%", m[3], rel)
		}
		if m[4] != c.text || m[5] != c.windows || m[6] != c.tlen {
			t.Errorf("measured on %q (%s windows of %s), want %q (%s of %s)", m[4], m[5], m[6], c.text, c.windows, c.tlen)
		}
		t.Logf("%s: %s", c.text, m[0])
	}
	stdout, stderr, err := llmqBoth(t, "export", "gguf", g32, "-o", filepath.Join(dir, "g32.gguf"))
	if err != nil || !strings.Contains(stdout, "28 mapped exactly, 0 re-quantized") || strings.Contains(stderr, "warning") {
		t.Errorf("exact export: %v\nstdout %q\nstderr %q", err, stdout, stderr)
	}
	if _, err := llmq(t, "export", "gguf", w3, "-o", filepath.Join(dir, "x.gguf"), "--eval-windows", "0"); err == nil || !strings.Contains(err.Error(), "--eval-windows") {
		t.Errorf("--eval-windows 0: %v", err)
	}
}

func mustFloat(t *testing.T, s string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

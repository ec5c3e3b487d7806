package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/shared"
)

// TestTable: rows read from eval records and checkpoints become the JSON
// record (perplexity, change against the first row, bytes) and the
// markdown table, which names the backends that evaluated the rows; rows
// measured on other windows are refused.
func TestTable(t *testing.T) {
	model := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	ppl := func(name string, p float64, windows int) string {
		path := filepath.Join(dir, name+".json")
		backend := "cpu (gonum)"
		if name == "w4" {
			backend = "cuda (NVIDIA H200, W4A16)"
		}
		rec := evals.Record{Kind: "ppl", Command: "llmq eval ppl " + name, Commit: "abc", Device: "cpu",
			Data: map[string]any{"result": evals.PPLResult{Perplexity: p, Windows: windows, SeqLen: 2048}, "backend": backend}}
		b, _ := json.Marshal(rec)
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	manifest := filepath.Join(dir, "rows.tsv")
	rows := fmt.Sprintf("base\tW16A16\tbf16\tfp32\t%s\t%s\t-\t-\nw4\tW4A16\tINT4\tfp32\t%s\t%s\t-\ta note\n",
		model, ppl("base", 200, 3), model, ppl("w4", 210, 3))
	os.WriteFile(manifest, []byte(rows), 0o644)
	out := filepath.Join(dir, "table")
	if err := run(manifest, "evals/schemes.sh x", "", out, "Title"); err != nil {
		t.Fatal(err)
	}
	var rec struct {
		Commit string
		Data   struct{ Rows []Row }
	}
	b, _ := os.ReadFile(out + ".json")
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatal(err)
	}
	r := rec.Data.Rows
	// llama-tiny: 7,342,336 bf16 parameters, 3,145,728 of them in the blocks' linear layers.
	if rec.Commit != "abc" || len(r) != 2 || math.Abs(r[1].VsBaseline-0.05) > 1e-12 || r[0].LinearBytes != 2*3145728 ||
		r[0].WeightBytes < 2*7342336 || r[0].WeightBytes > 2*7342336+4096 || r[1].Note != "a note" {
		t.Errorf("record: %+v", rec)
	}
	md, _ := os.ReadFile(out + ".md")
	if !strings.Contains(string(md), "| W4A16 | INT4 | fp32 | 210.000 | +5.00% | 14.68 MB | 6.29 MB |") || !strings.Contains(string(md), "- W4A16: a note") ||
		!strings.Contains(string(md), "evaluated by cpu (gonum) + cuda (NVIDIA H200, W4A16).") {
		t.Errorf("markdown:\n%s", md)
	}
	os.WriteFile(manifest, []byte(rows+fmt.Sprintf("w3\tW3A16\tINT3\tfp32\t%s\t%s\t-\t-\n", model, ppl("w3", 230, 2))), 0o644)
	if err := run(manifest, "", "", out, ""); err == nil || !strings.Contains(err.Error(), "2 windows") {
		t.Errorf("rows on other windows: %v", err)
	}
}

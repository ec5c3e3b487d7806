package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

// llmq eval tasks on the shipped items: it prints acc and acc_norm with
// their standard errors, writes a record with every item, and names the
// line of a bad item.
func TestEvalTasks(t *testing.T) {
	model := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	rec := filepath.Join(dir, "tasks.json")
	out := mustLLMQ(t, "eval", "tasks", model, "--tasks", "../../evals/tasks/llmq-facts.jsonl", "--device", "cpu", "--json", rec)
	for _, want := range []string{"acc         0.", "acc_norm    0.", " ± 0.0", "items       50 (200 choices"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var r struct {
		Kind string
		Data struct {
			Result struct {
				Items   int
				Acc     float64
				PerItem []struct{ Loglik []float64 } `json:"per_item"`
			}
		}
	}
	b, err := os.ReadFile(rec)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &r); err != nil || r.Kind != "tasks" || r.Data.Result.Items != 50 || len(r.Data.Result.PerItem) != 50 || len(r.Data.Result.PerItem[0].Loglik) != 4 {
		t.Errorf("record %s: %v", b[:min(len(b), 300)], err)
	}

	bad := filepath.Join(dir, "bad.jsonl")
	os.WriteFile(bad, []byte(`{"context": "a", "choices": ["b", "c"], "answer": 0}`+"\n"+`{"context": "a", "choices": ["b", "c"], "answer": 3}`+"\n"), 0o644)
	if _, err := llmq(t, "eval", "tasks", model, "--tasks", bad); err == nil || !strings.Contains(err.Error(), "bad.jsonl:2: answer 3") {
		t.Errorf("bad item: %v", err)
	}
	if _, err := llmq(t, "eval", "tasks", model); err == nil || !strings.Contains(err.Error(), "--tasks FILE.jsonl is required") {
		t.Errorf("no --tasks: %v", err)
	}
}

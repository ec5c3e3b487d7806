// Package shared gives tests and benchmarks the project's read-only
// reference assets (models, data and reference outputs in ../shared beside
// the repository, located by internal/assets). It imports testing: only
// tests may import it. When they are absent a test is skipped with a clear
// message, unless LLMQ_REQUIRE_SHARED=1 (set by CI), where it fails.
package shared

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/llmq/llmq/internal/assets"
)

// Root returns the shared directory (see assets.Root).
func Root() string { return assets.Root() }

// Path returns Root()/rel, skipping (or, in CI, failing) tb when it is absent.
func Path(tb testing.TB, rel string) string {
	tb.Helper()
	p := filepath.Join(Root(), rel)
	if _, err := os.Stat(p); err != nil {
		msg := "shared asset " + p + " is absent (the project's ../shared folder): " + err.Error()
		if os.Getenv("LLMQ_REQUIRE_SHARED") == "1" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	return p
}

// Int32s reads a little-endian int32 file.
func Int32s(tb testing.TB, rel string) []int {
	tb.Helper()
	b, err := os.ReadFile(Path(tb, rel))
	if err != nil {
		tb.Fatal(err)
	}
	out := make([]int, len(b)/4)
	for i := range out {
		out[i] = int(int32(binary.LittleEndian.Uint32(b[4*i:])))
	}
	return out
}

// Float32s reads a little-endian float32 file.
func Float32s(tb testing.TB, rel string) []float32 {
	tb.Helper()
	b, err := os.ReadFile(Path(tb, rel))
	if err != nil {
		tb.Fatal(err)
	}
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// Greedy is one prompt of reference/<model>.greedy.json: transformers'
// prompt ids and its greedy continuation.
type Greedy struct {
	PromptIDs []int  `json:"prompt_ids"`
	GreedyIDs []int  `json:"greedy_ids"`
	Text      string `json:"text"`
}

// GreedyRefs reads reference/<model>.greedy.json, keyed by prompt text.
func GreedyRefs(tb testing.TB, model string) map[string]Greedy {
	tb.Helper()
	data, err := os.ReadFile(Path(tb, "reference/"+model+".greedy.json"))
	if err != nil {
		tb.Fatal(err)
	}
	var g map[string]Greedy
	if err := json.Unmarshal(data, &g); err != nil {
		tb.Fatalf("reference/%s.greedy.json: %v", model, err)
	}
	return g
}

// LogSoftmax is log-softmax of one row of reference logits in float64,
// computed here independently of package llm (tests compare llmq's
// logprobs against it).
func LogSoftmax(row []float32) []float64 {
	mx := math.Inf(-1)
	for _, v := range row {
		mx = math.Max(mx, float64(v))
	}
	var s float64
	for _, v := range row {
		s += math.Exp(float64(v) - mx)
	}
	out := make([]float64, len(row))
	for i, v := range row {
		out[i] = float64(v) - mx - math.Log(s)
	}
	return out
}

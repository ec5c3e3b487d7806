package quantize

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/pack"
)

// TestRefusesNewFamilies: the driver writes Llama's block only, so the
// families whose blocks hold more (q/k norms, Gemma's norms, experts) are
// refused by name rather than written without those tensors.
func TestRefusesNewFamilies(t *testing.T) {
	for _, name := range []string{"qwen3-rand", "qwen3moe-rand", "mixtral-rand", "gemma3-rand"} {
		_, err := Run(context.Background(), Options{Src: shared.Path(t, "models/archzoo/"+name),
			Out: filepath.Join(t.TempDir(), "out"), Method: RTN{G: pack.Grid{Bits: 4, GroupSize: 32}}})
		if err == nil || !strings.Contains(err.Error(), "not supported yet") {
			t.Errorf("%s: %v, want a refusal", name, err)
		}
	}
}

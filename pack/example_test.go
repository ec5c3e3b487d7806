package pack_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// Load a checkpoint (packed by llmq quantize, or unquantized) and continue
// a prompt greedily.
func ExampleOpenModel() {
	m, err := pack.OpenModel("../shared/models/llama-tiny")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()
	prompt := m.Tokenizer.Encode("The history of the", true)
	out, err := llm.Generate(context.Background(), m.Model, prompt, llm.GenerateOptions{MaxTokens: 9}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(m.Tokenizer.Decode(out, true))
}

func TestOpenModelGenerates(t *testing.T) {
	m, err := pack.OpenModel(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	prompt := m.Tokenizer.Encode("The history of the", true)
	out, err := llm.Generate(context.Background(), m.Model, prompt, llm.GenerateOptions{MaxTokens: 9}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Tokenizer.Decode(out, true); got != " history of the history of the history of the" {
		t.Fatalf("generated %q", got)
	}
	if _, err := pack.OpenModel(t.TempDir()); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("empty directory: %v", err)
	}
}

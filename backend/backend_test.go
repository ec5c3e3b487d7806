package backend

import (
	"errors"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

// Device "auto" uses the GPU when it can and otherwise says why it runs on
// the CPU.
func TestOpenAuto(t *testing.T) {
	m, err := Open(shared.Path(t, "models/llama-tiny"), "auto")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	name := m.Backend.Name()
	switch {
	case m.Fallback == "" && !strings.HasPrefix(name, "cuda"):
		t.Errorf("no fallback reason, but running on %s", name)
	case m.Fallback != "" && (!strings.HasPrefix(name, "cpu") || !strings.Contains(m.Fallback, "GPU unavailable")):
		t.Errorf("fallback %q, running on %s", m.Fallback, name)
	}
	if _, err := Open(t.TempDir(), "auto"); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("auto on an empty directory: %v (want the checkpoint's error)", err)
	}
}

// The CPU model carries what an engine needs: the tokenizer, the chat
// template of tokenizer_config.json, the config's EOS.
func TestOpenCPU(t *testing.T) {
	m, err := Open(shared.Path(t, "models/llama-tiny"), "cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	b, tok, tmpl := m.Parts()
	if b == nil || tok == nil || tmpl == nil {
		t.Fatalf("parts %v %v %v", b, tok, tmpl)
	}
	if !strings.HasPrefix(b.Name(), "cpu") || m.Fallback != "" {
		t.Errorf("running on %q, fallback %q", b.Name(), m.Fallback)
	}
	// llama-tiny's config.json: eos_token_id 1 (<|end_of_text|>).
	if eos := b.Config().EOS; len(eos) != 1 || eos[0] != 1 || m.Config != b.Config() {
		t.Errorf("EOS %v, config %p vs the backend's %p", eos, m.Config, b.Config())
	}
}

func TestOpenUnknownDevice(t *testing.T) {
	_, err := Open(shared.Path(t, "models/llama-tiny"), "tpu")
	if !errors.Is(err, ErrUnknownDevice) || !strings.Contains(err.Error(), `"tpu": want auto, cpu or cuda`) {
		t.Errorf("unknown device: %v", err)
	}
}

package evals_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// Synthetic checkpoints load like real ones (4-bit GPTQ and bf16), run with
// finite logits of a sane size, and are reproducible byte for byte.
func TestSynth(t *testing.T) {
	arch := &evals.Preset{Hidden: 256, Intermediate: 512, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 8192,
		MaxPositions: 256, RopeTheta: 10000, QKVBias: true, Arch: "Qwen2ForCausalLM", ModelType: "qwen2"}
	tok := filepath.Dir(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	dir := t.TempDir()
	for _, bits := range []int{4, 16} {
		out := filepath.Join(dir, fmt.Sprintf("bits%d", bits))
		opt := evals.SynthOptions{Arch: arch, Bits: bits, Group: 128, Tokenizer: tok, Out: out}
		if err := evals.Synth(opt); err != nil {
			t.Fatal(err)
		}
		m, err := pack.OpenModel(out)
		if err != nil {
			t.Fatalf("%d bits: %v", bits, err)
		}
		q, _ := pack.ParseQuantConfig(m.Checkpoint.Config.Quantization)
		if (bits == 4) != (q != nil) || m.Checkpoint.Config.Layers != 2 || !m.Checkpoint.Config.QKVBias {
			t.Errorf("%d bits: quantization %+v, config %+v", bits, q, m.Checkpoint.Config)
		}
		ids := m.Tokenizer.Encode("The history of the", true)
		cache, _ := m.NewCache(len(ids))
		V := m.Config().Vocab
		logits := make([]float32, len(ids)*V)
		if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: logits}}); err != nil {
			t.Fatal(err)
		}
		var ss float64
		for _, v := range logits {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				t.Fatalf("%d bits: non-finite logit", bits)
			}
			ss += float64(v) * float64(v)
		}
		// The final RMSNorm (weights 1) leaves each position's hidden state
		// with RMS 1, so a logit is a sum of 256 such values times
		// independent weights of standard deviation 0.02: RMS 0.02·√256 =
		// 0.32 (measured 0.3204 at 4 bits, 0.3199 at 16). Over 5×8192
		// logits the estimate is within 1%; the bound is 5%.
		rms := math.Sqrt(ss / float64(len(logits)))
		t.Logf("%d bits: logits RMS %.4f", bits, rms)
		if want := 0.02 * math.Sqrt(float64(arch.Hidden)); math.Abs(rms-want) > 0.05*want {
			t.Errorf("%d bits: logits RMS %.4f, want %.4f ± 5%%", bits, rms, want)
		}
		m.Close()

		again := filepath.Join(dir, "again")
		opt.Out, opt.Force = again, true
		if err := evals.Synth(opt); err != nil {
			t.Fatal(err)
		}
		a, _ := os.ReadFile(filepath.Join(out, "model.safetensors"))
		b, _ := os.ReadFile(filepath.Join(again, "model.safetensors"))
		if len(a) == 0 || !bytes.Equal(a, b) {
			t.Errorf("%d bits: two runs wrote different shards (%d and %d bytes)", bits, len(a), len(b))
		}
	}
	err := evals.Synth(evals.SynthOptions{Preset: "gpt-5", Bits: 4, Group: 128, Tokenizer: tok, Out: filepath.Join(dir, "x")})
	if err == nil || !strings.Contains(err.Error(), "llama3-8b") {
		t.Errorf("unknown preset: %v", err)
	}
	err = evals.Synth(evals.SynthOptions{Arch: arch, Bits: 3, Group: 128, Tokenizer: tok, Out: filepath.Join(dir, "x")})
	var oe *evals.SynthOptionError
	if !errors.As(err, &oe) || oe.Field != "Bits" || err.Error() != "bits 3: want 4 (GPTQ) or 16 (bf16)" {
		t.Errorf("3 bits: %v", err)
	}
}

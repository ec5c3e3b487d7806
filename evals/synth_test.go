package evals_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// Synthetic checkpoints load like real ones (GPTQ at 3, 4 and 8 bits, and
// bf16), run with finite logits of a sane size, and are reproducible byte
// for byte.
func TestSynth(t *testing.T) {
	arch := &evals.Preset{Hidden: 256, Intermediate: 512, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 8192,
		MaxPositions: 256, RopeTheta: 10000, QKVBias: true, Arch: "Qwen2ForCausalLM", ModelType: "qwen2"}
	tok := filepath.Dir(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	dir := t.TempDir()
	for _, bits := range []int{3, 4, 8, 16} {
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
		if (bits != 16) != (q != nil) || q != nil && q.Bits != bits || m.Checkpoint.Config.Layers != 2 || !m.Checkpoint.Config.QKVBias {
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
		// 0.32 (measured 0.3235, 0.3225, 0.3220 at 3, 4, 8 bits, 0.3199 at
		// 16). Over 5×8192 logits the estimate is within 1%; the bound is
		// 5%.
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
	err = evals.Synth(evals.SynthOptions{Arch: arch, Bits: 5, Group: 128, Tokenizer: tok, Out: filepath.Join(dir, "x")})
	var oe *evals.SynthOptionError
	if !errors.As(err, &oe) || oe.Field != "Bits" || err.Error() != "bits 5: want 3, 4 or 8 (GPTQ) or 16 (bf16)" {
		t.Errorf("5 bits: %v", err)
	}
}

// At 3, 4 and 8 bits every linear layer is stored in the GPTQ layout of
// its width: read back with the checkpoint's grid it has the bits of
// quantization_config, the symmetric zero 2^(b−1), codes over the whole
// range, and dequantized weights of standard deviation 0.02; the normal
// loader's weights are exactly those.
func TestSynthGPTQWidths(t *testing.T) {
	arch := &evals.Preset{Hidden: 128, Intermediate: 256, Layers: 1, Heads: 4, KVHeads: 2, Vocab: 8192,
		MaxPositions: 256, RopeTheta: 10000, Arch: "LlamaForCausalLM", ModelType: "llama"}
	tok := filepath.Dir(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	for _, bits := range []int{3, 4, 8} {
		out := filepath.Join(t.TempDir(), "m")
		if err := evals.Synth(evals.SynthOptions{Arch: arch, Bits: bits, Group: 32, Tokenizer: tok, Out: out}); err != nil {
			t.Fatalf("%d bits: %v", bits, err)
		}
		m, err := pack.OpenModel(out)
		if err != nil {
			t.Fatalf("%d bits: %v", bits, err)
		}
		defer m.Close()
		ck := m.Checkpoint
		q, err := pack.ParseQuantConfig(ck.Config.Quantization)
		if err != nil || q == nil || q.Bits != bits || q.GroupSize != 32 || q.Grid().Bits != bits || !q.Grid().Sym {
			t.Fatalf("%d bits: quantization_config %+v, %v", bits, q, err)
		}
		specs := llm.BlockLinears(ck.Config, 0)
		if len(specs) != 7 {
			t.Fatalf("%d bits: %d linear layers, want 7", bits, len(specs))
		}
		for _, s := range specs {
			l, err := q.Read(ck, s.Name, s.In, s.Out)
			if err != nil {
				t.Fatalf("%d bits: %v", bits, err)
			}
			lo, hi := l.Q[0], l.Q[0]
			for _, c := range l.Q {
				lo, hi = min(lo, c), max(hi, c)
			}
			zeros := true
			for _, z := range l.Zero {
				zeros = zeros && int(z) == 1<<(bits-1)
			}
			if l.Grid.Bits != bits || !zeros || lo != 0 || int(hi) != 1<<bits-1 {
				t.Errorf("%d bits: %s read back with %d bits, codes %d … %d, symmetric zeros %v", bits, s.Name, l.Grid.Bits, lo, hi, zeros)
			}
			w := l.Dequantize()
			var ss float64
			for _, v := range w {
				ss += float64(v) * float64(v)
			}
			// 8192 to 32768 weights: the estimate is within 2%; the bound is 5%.
			if rms := math.Sqrt(ss / float64(len(w))); math.Abs(rms-0.02) > 0.05*0.02 {
				t.Errorf("%d bits: %s weights have RMS %.5f, want 0.02 ± 5%%", bits, s.Name, rms)
			}
			loaded, ok := m.LinearByName(s.Name)
			if d, isDense := (*loaded).(*llm.Dense); !ok || !isDense || !slices.Equal(d.W, w) {
				t.Errorf("%d bits: the loader's %s is not the layer read back", bits, s.Name)
			}
		}
	}
}

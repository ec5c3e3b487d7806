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
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
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

// A preset whose vocabulary is larger than the copied tokenizer's gets a
// tokenizer that spells every id: the copied ids decode and encode as
// before, and each id past them decodes to its filler text ("synth<id>").
// With llama-tiny's 8,192 tokens under a
// 40,000-token model, ids 8,192 and up would otherwise decode to "" (and
// a streaming server would send nothing for them).
func TestSynthSpellsEveryID(t *testing.T) {
	arch := &evals.Preset{Hidden: 64, Intermediate: 128, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 40000,
		MaxPositions: 64, RopeTheta: 10000, Arch: "LlamaForCausalLM", ModelType: "llama"}
	dir := filepath.Dir(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	out := filepath.Join(t.TempDir(), "m")
	if err := evals.Synth(evals.SynthOptions{Arch: arch, Bits: 16, Group: 64, Tokenizer: dir, Out: out}); err != nil {
		t.Fatal(err)
	}
	m, err := pack.OpenModel(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	orig, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	tok := m.Tokenizer
	n := orig.VocabSize()
	if tok.VocabSize() != 40000 || n >= 40000 {
		t.Fatalf("vocabulary %d (copied from %d), want 40000", tok.VocabSize(), n)
	}
	text := "The history of the Roman Empire, in 3 volumes: déjà vu!"
	if a, b := tok.Encode(text, true), orig.Encode(text, true); !slices.Equal(a, b) {
		t.Errorf("encoding changed: %v, was %v", a, b)
	}
	for _, id := range []int{5, 1000, n - 1} {
		if a, b := tok.Decode([]int{id}, false), orig.Decode([]int{id}, false); a != b {
			t.Errorf("id %d decodes to %q, was %q", id, a, b)
		}
	}
	for id := n; id < 40000; id++ {
		if got, want := tok.Decode([]int{id}, true), fmt.Sprintf("synth%d", id); got != want {
			t.Fatalf("id %d decodes to %q, want %q", id, got, want)
		}
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

// QuantizeLMHead packs lm_head as the decoder's layers are, and says so
// in quantization_config (lm_head: true) as quantize --quantize-lm-head
// does; the loader's head is the layer read back. A bf16 checkpoint or a
// tied head refuses it, naming the option.
func TestSynthQuantizedLMHead(t *testing.T) {
	arch := &evals.Preset{Hidden: 128, Intermediate: 256, Layers: 1, Heads: 4, KVHeads: 2, Vocab: 8192,
		MaxPositions: 256, RopeTheta: 10000, Arch: "LlamaForCausalLM", ModelType: "llama"}
	tok := filepath.Dir(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	out := filepath.Join(t.TempDir(), "m")
	if err := evals.Synth(evals.SynthOptions{Arch: arch, Bits: 4, Group: 32, QuantizeLMHead: true, Tokenizer: tok, Out: out}); err != nil {
		t.Fatal(err)
	}
	m, err := pack.OpenModel(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ck := m.Checkpoint
	q, err := pack.ParseQuantConfig(ck.Config.Quantization)
	if err != nil || q == nil || !q.LMHead {
		t.Fatalf("quantization_config %+v (%v): want lm_head true", q, err)
	}
	if ck.Has("lm_head.weight") || !ck.Has("lm_head.qweight") {
		t.Fatalf("lm_head is stored as %v, want only lm_head.qweight and its groups", ck.Names())
	}
	l, err := q.Read(ck, "lm_head", arch.Hidden, arch.Vocab)
	if err != nil {
		t.Fatal(err)
	}
	if l.Grid.Bits != 4 || l.Grid.Group(arch.Hidden) != 32 {
		t.Errorf("lm_head read back with %s, want 4 bits in groups of 32", l.Grid.Describe())
	}
	head, ok := m.LinearByName("lm_head")
	if d, isDense := (*head).(*llm.Dense); !ok || !isDense || !slices.Equal(d.W, l.Dequantize()) {
		t.Errorf("the loader's lm_head is not the layer read back")
	}
	for _, bad := range []struct {
		name string
		opt  evals.SynthOptions
	}{
		{"bf16", evals.SynthOptions{Arch: arch, Bits: 16, Group: 32}},
		{"tied", evals.SynthOptions{Arch: &evals.Preset{Hidden: 128, Intermediate: 256, Layers: 1, Heads: 4, KVHeads: 2,
			Vocab: 8192, MaxPositions: 256, RopeTheta: 10000, Tied: true, Arch: "LlamaForCausalLM", ModelType: "llama"}, Bits: 4, Group: 32}},
	} {
		bad.opt.QuantizeLMHead, bad.opt.Tokenizer, bad.opt.Out = true, tok, filepath.Join(t.TempDir(), bad.name)
		var oe *evals.SynthOptionError
		if err := evals.Synth(bad.opt); !errors.As(err, &oe) || oe.Field != "QuantizeLMHead" {
			t.Errorf("%s: QuantizeLMHead gave %v, want a SynthOptionError naming it", bad.name, err)
		}
	}
}

// Each preset has its published model's size: the parameter count the
// loader's config gives (embeddings counted once when tied) is within 2%
// of the figure on the model's card.
func TestSynthPresetParams(t *testing.T) {
	published := map[string]float64{
		"llama3-1b":     1.24e9,  // meta-llama/Llama-3.2-1B
		"llama3-8b":     8.03e9,  // meta-llama/Meta-Llama-3-8B
		"llama3-70b":    70.6e9,  // meta-llama/Meta-Llama-3-70B
		"llama2-7b":     6.74e9,  // meta-llama/Llama-2-7b-hf
		"mistral-7b":    7.25e9,  // mistralai/Mistral-7B-v0.3
		"qwen2-7b":      7.62e9,  // Qwen/Qwen2-7B
		"qwen3-8b":      8.2e9,   // Qwen/Qwen3-8B: "8.2B"
		"gemma3-12b":    11.77e9, // google/gemma-3-12b: 12.2B with the 0.4B vision tower; keras-hub's gemma3_12b_text: 11,765,788,416
		"mixtral-8x7b":  46.7e9,  // mistralai/Mixtral-8x7B-v0.1: "46.7B total parameters"
		"qwen3-30b-a3b": 30.5e9,  // Qwen/Qwen3-30B-A3B: "30.5B in total and 3.3B activated"
	}
	if len(published) != len(evals.Presets) {
		t.Errorf("%d presets, %d published sizes", len(evals.Presets), len(published))
	}
	for _, name := range evals.PresetNames() {
		c, err := evals.Presets[name].Config()
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		n, want := float64(c.Params()), published[name]
		t.Logf("%-14s %15d parameters (published %.2fB)", name, c.Params(), want/1e9)
		if math.Abs(n-want) > 0.02*want {
			t.Errorf("%s: %d parameters, published %.2fB", name, c.Params(), want/1e9)
		}
	}
}

// The presets of the newer families, shrunk to the shapes of the zoo's
// tiny models of the same family (written by transformers), synthesize the
// zoo model's tensors — the same names, shapes and dtypes — and its family
// settings; they load and run with finite logits in bf16 and at 4 bits.
// Quantized, every decoder linear layer (each expert's) is packed and the
// routers and norms are not, as the quantizer leaves them, and
// modules_in_block_to_quantize lists the experts and not the routers.
func TestSynthPresetsLayout(t *testing.T) {
	for preset, zoo := range map[string]string{"qwen3-8b": "qwen3-rand", "gemma3-12b": "gemma3-rand",
		"mixtral-8x7b": "mixtral-rand", "qwen3-30b-a3b": "qwen3moe-rand"} {
		t.Run(preset, func(t *testing.T) {
			src := shared.Path(t, "models/archzoo/"+zoo)
			ref, err := checkpoint.Open(src)
			if err != nil {
				t.Fatal(err)
			}
			defer ref.Close()
			arch := shrink(evals.Presets[preset], ref.Config)
			for _, bits := range []int{16, 4} {
				out := filepath.Join(t.TempDir(), "m")
				opt := evals.SynthOptions{Preset: preset, Arch: arch, Bits: bits, Group: 32, Layers: 1, Tokenizer: src, Out: out}
				if err := evals.Synth(opt); err != nil {
					t.Fatalf("%d bits: %v", bits, err)
				}
				m, err := pack.OpenModel(out)
				if err != nil {
					t.Fatalf("%d bits: %v", bits, err)
				}
				defer m.Close()
				ck, c, rc := m.Checkpoint, m.Checkpoint.Config, ref.Config
				if c.Layers != 1 || c.Architecture != rc.Architecture || c.Act != rc.Act || c.QKNorm != rc.QKNorm ||
					c.NormPlusOne != rc.NormPlusOne || c.SandwichNorm != rc.SandwichNorm || c.TieEmbeddings != rc.TieEmbeddings ||
					(c.MoE == nil) != (rc.MoE == nil) || c.MoE != nil && (c.MoE.Experts != rc.MoE.Experts || c.MoE.TopK != rc.MoE.TopK ||
					c.MoE.Intermediate != rc.MoE.Intermediate || c.MoE.NormTopK != rc.MoE.NormTopK) {
					t.Errorf("%d bits: config %+v, the zoo's %+v", bits, c, rc)
				}
				if bits == 16 {
					for _, n := range ref.Names() {
						if strings.HasPrefix(n, "model.layers.") && !strings.HasPrefix(n, "model.layers.0.") {
							continue
						}
						a, _ := ref.Tensor(n)
						b, err := ck.Tensor(n)
						if err != nil || b.DType != a.DType || !slices.Equal(b.Shape, a.Shape) {
							t.Errorf("%s: %s %v in the zoo model, %s %v synthesized (%v)", n, a.DType, a.Shape, b.DType, b.Shape, err)
						}
					}
					if n, want := len(ck.Names()), len(layerZero(ref.Names())); n != want {
						t.Errorf("%d tensors synthesized, the zoo model's first layer and the rest have %d", n, want)
					}
				} else {
					checkQuantized(t, ck)
				}
				ids := m.Tokenizer.Encode("The history of the", true)
				cache, _ := m.NewCache(len(ids))
				logits := make([]float32, len(ids)*c.Vocab)
				if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: logits}}); err != nil {
					t.Fatalf("%d bits: %v", bits, err)
				}
				for _, v := range logits {
					if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
						t.Fatalf("%d bits: non-finite logit", bits)
					}
				}
			}
		})
	}
}

// shrink is a preset with the shapes of a zoo model of its family.
func shrink(p evals.Preset, c *checkpoint.Config) *evals.Preset {
	p.Hidden, p.Intermediate, p.Layers, p.Heads, p.KVHeads, p.HeadDim = c.Hidden, c.Intermediate, c.Layers, c.Heads, c.KVHeads, c.HeadDim
	p.Vocab, p.Tied = c.Vocab, c.TieEmbeddings
	if c.MoE != nil {
		p.Experts, p.TopK = c.MoE.Experts, c.MoE.TopK
		if p.MoEIntermediate > 0 {
			p.MoEIntermediate = c.MoE.Intermediate
		}
	}
	return &p
}

// layerZero keeps the names outside the decoder layers and those of layer 0.
func layerZero(names []string) []string {
	return slices.DeleteFunc(slices.Clone(names), func(n string) bool {
		return strings.HasPrefix(n, "model.layers.") && !strings.HasPrefix(n, "model.layers.0.")
	})
}

// checkQuantized checks that a synthesized checkpoint stores every decoder
// linear layer packed and its norms and routers as plain weights, and that
// modules_in_block_to_quantize names the packed layers and no router.
func checkQuantized(t *testing.T, ck *checkpoint.Checkpoint) {
	t.Helper()
	c := ck.Config
	q, err := pack.ParseQuantConfig(c.Quantization)
	if err != nil || q == nil {
		t.Fatalf("quantization_config: %+v, %v", q, err)
	}
	listed := map[string]bool{}
	for _, g := range q.ModulesInBlockToQuantize {
		for _, n := range g {
			listed[n] = true
		}
	}
	if (c.MoE != nil) != (len(listed) > 0) {
		t.Errorf("modules_in_block_to_quantize %v for a model with mixture %+v", q.ModulesInBlockToQuantize, c.MoE)
	}
	for l := 0; l < c.Layers; l++ {
		pre := fmt.Sprintf("model.layers.%d.", l)
		for _, s := range llm.BlockLinears(c, l) {
			if !ck.Has(s.Name+".qweight") || ck.Has(s.Name+".weight") || c.MoE != nil && !listed[strings.TrimPrefix(s.Name, pre)] {
				t.Errorf("%s is not packed, or not listed in modules_in_block_to_quantize", s.Name)
			}
		}
		for _, n := range new(llm.Block).Norms(c) {
			if !ck.Has(pre + n.Name) {
				t.Errorf("%s%s is not a plain weight", pre, n.Name)
			}
		}
		if c.Sparse(l) {
			r := llm.RouterName(c, l)
			if !ck.Has(r+".weight") || ck.Has(r+".qweight") || listed[strings.TrimPrefix(r, pre)] {
				t.Errorf("the router %s is packed or listed for quantization", r)
			}
		}
	}
}

// A Qwen3-MoE with mlp_only_layers (SynthOptions.MLPOnly) mixes dense and
// sparse layers: the listed layer has a dense MLP and no router, the
// others experts and a router, and the model runs. MLPOnly is refused
// for an architecture without mlp_only_layers and for a layer past the
// last.
func TestSynthMixesDenseAndSparseLayers(t *testing.T) {
	arch := &evals.Preset{Hidden: 256, Intermediate: 512, Layers: 3, Heads: 4, KVHeads: 2, HeadDim: 64, Vocab: 8192,
		MaxPositions: 256, RopeTheta: 1e6, Arch: "Qwen3MoeForCausalLM", ModelType: "qwen3_moe",
		Experts: 8, TopK: 2, MoEIntermediate: 128, NormTopK: true}
	tok := filepath.Dir(shared.Path(t, "models/llama-tiny/tokenizer.json"))
	out := filepath.Join(t.TempDir(), "mixed")
	if err := evals.Synth(evals.SynthOptions{Arch: arch, Bits: 4, Group: 64, Tokenizer: tok, Out: out, MLPOnly: []int{1}}); err != nil {
		t.Fatal(err)
	}
	m, err := pack.OpenModel(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c := m.Checkpoint.Config
	if c.MoE == nil || !c.Sparse(0) || c.Sparse(1) || !c.Sparse(2) {
		t.Fatalf("sparse layers: %v %v %v, want true false true", c.Sparse(0), c.Sparse(1), c.Sparse(2))
	}
	for _, name := range []string{"model.layers.1.mlp.gate_proj.qweight", "model.layers.0.mlp.gate.weight",
		"model.layers.2.mlp.experts.7.down_proj.qweight"} {
		if !m.Checkpoint.Has(name) {
			t.Errorf("no tensor %s", name)
		}
	}
	if m.Checkpoint.Has("model.layers.1.mlp.gate.weight") {
		t.Error("the dense layer 1 has a router")
	}
	ids := m.Tokenizer.Encode("The history of the", true)
	cache, _ := m.NewCache(len(ids))
	logits := make([]float32, len(ids)*c.Vocab)
	if err := m.Forward(context.Background(), []llm.Step{{Cache: cache, Tokens: ids, Logits: logits}}); err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(logits, func(v float32) bool { return math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) }); i >= 0 {
		t.Fatalf("logit %d is %v", i, logits[i])
	}
	llama := &evals.Preset{Hidden: 256, Intermediate: 512, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 8192, MaxPositions: 256,
		RopeTheta: 10000, Arch: "LlamaForCausalLM", ModelType: "llama"}
	for _, bad := range []struct {
		arch *evals.Preset
		only []int
		want string
	}{{llama, []int{0}, "want a Qwen3-MoE preset"}, {arch, []int{3}, "want layers 0 … 2"}} {
		err := evals.Synth(evals.SynthOptions{Arch: bad.arch, Bits: 4, Group: 64, Tokenizer: tok, MLPOnly: bad.only,
			Out: filepath.Join(t.TempDir(), "x")})
		var oe *evals.SynthOptionError
		if !errors.As(err, &oe) || oe.Field != "MLPOnly" || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("MLPOnly %v on %s: %v, want a MLPOnly error saying %q", bad.only, bad.arch.Arch, err, bad.want)
		}
	}
}

package quantize

import (
	"context"
	"math"
	"path/filepath"
	"slices"
	"testing"

	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// logitsOf runs 8 reference tokens through a checkpoint on the CPU.
func logitsOf(t *testing.T, dir string) []float32 {
	t.Helper()
	m, err := pack.OpenModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c, _ := m.Model.NewCache(8)
	out := make([]float32, 8*m.Model.Cfg.Vocab)
	ids := shared.Int32s(t, "reference/llama-tiny.logits.input.i32")[:8]
	if err := m.Model.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: ids, Logits: out}}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestCompressedTensorsMatchesGPTQLayout: the same quantization written in
// the GPTQ layout and as compressed-tensors gives bit-identical logits on
// llama-tiny: RTN asymmetric (zero points packed along the outputs), and
// GPTQ symmetric with act-order (g_idx, actorder "group").
func TestCompressedTensorsMatchesGPTQLayout(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	gopt := gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 64, Sym: true}, Damp: 0.01, ActOrder: true}
	for _, c := range []struct {
		name string
		m    Method
		want string // the weights' actorder
	}{
		{"rtn-w4-asym-g128", RTN{G: pack.Grid{Bits: 4, GroupSize: 128}}, ""},
		{"gptq-w4-sym-g64-actorder", GPTQ{Opt: gopt}, "group"},
		{"rtn-w8-channel", RTN{G: pack.Grid{Bits: 8, GroupSize: -1, Sym: true}}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			var logits [2][]float32
			for i, format := range []string{"gptq", pack.MethodCT} {
				out := filepath.Join(dir, c.name+"-"+format)
				rep, err := Run(context.Background(), Options{Src: src, Out: out, Method: c.m, Format: format,
					Calib: shared.Path(t, "data/calib.txt"), NSamples: 4, SeqLen: 64, TrueSequential: true})
				if err != nil {
					t.Fatal(err)
				}
				if format == pack.MethodCT {
					if rep.Format != pack.CTPackQuantized {
						t.Errorf("report format %q", rep.Format)
					}
					m, err := pack.OpenModel(out)
					if err != nil {
						t.Fatal(err)
					}
					q, err := pack.ParseQuantConfig(m.Checkpoint.Config.Quantization)
					m.Close()
					if err != nil || q.CT == nil {
						t.Fatalf("config: %v", err)
					}
					s := q.CT.ConfigGroups["group_0"]
					if q.CT.Format != pack.CTPackQuantized || len(q.CT.Ignore) != 1 || q.CT.Ignore[0] != "lm_head" ||
						s.Weights.Actorder != nil != (c.want != "") || c.want != "" && s.Weights.Actorder != c.want {
						t.Errorf("config: format %q ignore %v actorder %v", q.CT.Format, q.CT.Ignore, s.Weights.Actorder)
					}
				}
				logits[i] = logitsOf(t, out)
			}
			for i := range logits[0] {
				if math.Float32bits(logits[0][i]) != math.Float32bits(logits[1][i]) {
					t.Fatalf("logit %d: %v (gptq layout) vs %v (compressed-tensors)", i, logits[0][i], logits[1][i])
				}
			}
		})
	}
}

// TestFP8Checkpoint: --method fp8 writes float-quantized F8_E4M3 weights
// with float32 scales (per channel, or one per layer) that read back to
// exactly pack.FP8's weights, and a mixed plan (a skipped layer) lands in
// ignore.
func TestFP8Checkpoint(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	orig, err := pack.OpenModel(src)
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	const name = "model.layers.1.mlp.down_proj"
	w, err := orig.Checkpoint.Float32(name+".weight", 256, 768)
	if err != nil {
		t.Fatal(err)
	}
	for _, perTensor := range []bool{false, true} {
		out := filepath.Join(dir, map[bool]string{false: "channel", true: "tensor"}[perTensor])
		plan := pack.Dynamic{{Pattern: `model\.layers\.3\.self_attn\.o_proj$`, Skip: true}}
		// Per tensor: llm-compressor's FP8 scheme, static activation scales.
		meth := FP8{PerTensor: perTensor, StaticActivations: perTensor}
		if _, err := Run(context.Background(), Options{Src: src, Out: out, Method: meth, Plan: plan,
			Calib: shared.Path(t, "data/calib.txt"), NSamples: 4, SeqLen: 64}); err != nil {
			t.Fatal(err)
		}
		m, err := pack.OpenModel(out)
		if err != nil {
			t.Fatal(err)
		}
		ck := m.Checkpoint
		q, err := pack.ParseQuantConfig(ck.Config.Quantization)
		if err != nil {
			t.Fatal(err)
		}
		if q.CT.Format != pack.CTFloatQuantized || !slices.Equal(q.CT.Ignore, []string{"lm_head", "model.layers.3.self_attn.o_proj"}) {
			t.Errorf("config: format %q, ignore %v", q.CT.Format, q.CT.Ignore)
		}
		s := q.CT.ConfigGroups["group_0"]
		wantAct, wantDynamic := "token", true
		if perTensor {
			wantAct, wantDynamic = "tensor", false
		}
		if ia := s.InputActivations; ia == nil || ia.Strategy != wantAct || ia.Dynamic != wantDynamic || ia.Type != "float" {
			t.Errorf("input_activations %+v: want FP8 %s, dynamic %v", ia, wantAct, wantDynamic)
		}
		// Static scales: one per layer input, shared by the layers that
		// read it (q, k, v), absent when dynamic.
		var scales []float32
		for _, n := range []string{"q_proj", "k_proj", "v_proj", "o_proj"} {
			outs := map[string]int{"q_proj": 256, "k_proj": 128, "v_proj": 128, "o_proj": 256} // 2 KV heads of 64
			l, err := q.Read(ck, "model.layers.0.self_attn."+n, 256, outs[n])
			if err != nil {
				t.Fatal(err)
			}
			scales = append(scales, l.InputScale)
		}
		if perTensor && (scales[0] <= 0 || scales[0] != scales[1] || scales[1] != scales[2] || scales[3] <= 0 || scales[3] == scales[0]) ||
			!perTensor && slices.ContainsFunc(scales, func(s float32) bool { return s != 0 }) {
			t.Errorf("per-tensor %v: input scales of q, k, v, o: %v", perTensor, scales)
		}
		wt, _ := ck.Tensor(name + ".weight")
		st, _ := ck.Tensor(name + ".weight_scale")
		if !wt.Float8 || st.DType.String() != "F32" {
			t.Errorf("weight %s, scale %s", wt.DTypeName(), st.DTypeName())
		}
		l, err := q.Read(ck, name, 768, 256)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := pack.FP8(w, 256, 768, perTensor)
		if !slices.Equal(l.Dequantize(), want.Dequantize()) || l.Grid.PerTensor != perTensor {
			t.Errorf("per-tensor %v: weights read back differ from pack.FP8's", perTensor)
		}
		if q.Stored(ck, "model.layers.3.self_attn.o_proj") {
			t.Error("the skipped layer is stored quantized")
		}
		m.Close()
	}
}

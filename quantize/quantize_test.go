package quantize

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/awq"
	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/gptq"
	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/mat"
	"github.com/llmq/llmq/pack"
	"github.com/nlpodyssey/safetensors"
)

func TestRunErrors(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	tmp := t.TempDir()
	short := filepath.Join(tmp, "short.txt")
	os.WriteFile(short, []byte("only a few words of calibration text"), 0o644)
	gptqOpt := gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128}, Damp: 0.01}
	base := Options{Src: src, Method: GPTQ{Opt: gptqOpt}, NSamples: 4, SeqLen: 128, TrueSequential: true}

	o := base
	o.Out, o.Calib = filepath.Join(tmp, "a"), short
	if _, err := Run(context.Background(), o); err == nil || !strings.Contains(err.Error(), "0 windows of 128") {
		t.Errorf("short calibration: %v", err)
	}
	o = base
	o.Out, o.Calib = filepath.Join(tmp, "b"), shared.Path(t, "data/calib.txt")
	bad := gptqOpt
	bad.Grid.GroupSize = 96
	o.Method = GPTQ{Opt: bad}
	if _, err := Run(context.Background(), o); err == nil || !strings.Contains(err.Error(), "96") {
		t.Errorf("bad group: %v", err)
	}
	// A cancelled run (Ctrl-C) leaves neither output nor temp dir, with
	// GPTQ and with RTN (which reads no calibration data).
	for i, m := range []Method{GPTQ{Opt: gptqOpt}, RTN{G: gptqOpt.Grid}} {
		o = base
		o.Method, o.Out, o.Calib = m, filepath.Join(tmp, fmt.Sprint("c", i)), shared.Path(t, "data/calib.txt")
		ctx, cancel := context.WithCancel(context.Background())
		o.Progress = func(block, blocks int, stage string) {
			if block == 2 {
				cancel()
			}
		}
		if _, err := Run(ctx, o); !errors.Is(err, context.Canceled) || !errors.Is(err, ErrInterrupted) {
			t.Errorf("%s cancelled: %v, want context.Canceled and ErrInterrupted", m.Name(), err)
		}
	}
	// It leaves no output, only the finished blocks for --resume.
	entries, _ := os.ReadDir(tmp)
	for _, e := range entries {
		if e.Name() != "short.txt" && e.Name() != ".c0.partial" && e.Name() != ".c1.partial" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
	// Windows longer than the model's context are refused before any work.
	o = base
	o.Out, o.Calib, o.SeqLen = filepath.Join(tmp, "d"), shared.Path(t, "data/calib.txt"), 4096
	if _, err := Run(context.Background(), o); !errors.Is(err, ErrCalibration) || !strings.Contains(err.Error(), "longer than the model's 2048 positions") {
		t.Errorf("seqlen 4096: %v", err)
	}
	// An existing output is refused without Force.
	os.Mkdir(filepath.Join(tmp, "exists"), 0o755)
	o = base
	o.Method, o.Out = RTN{G: gptqOpt.Grid}, filepath.Join(tmp, "exists")
	if _, err := Run(context.Background(), o); !errors.Is(err, fs.ErrExist) {
		t.Errorf("existing output: %v, want fs.ErrExist", err)
	}
}

// TestExportsAgree quantizes llama-tiny with AWQ (a short calibration) into
// the GPTQ layout and the AutoAWQ layout: both load, carry the right
// quantization_config, and dequantize to identical weights.
func TestExportsAgree(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	opt := awq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}, Clip: true}
	var stats []awq.LinearStats
	run := func(format string, st *[]awq.LinearStats) string {
		out := filepath.Join(dir, format)
		_, err := Run(context.Background(), Options{Src: src, Out: out, Method: AWQ{Opt: opt, Record: st}, Format: format,
			Calib: shared.Path(t, "data/calib.txt"), NSamples: 4, SeqLen: 64})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	a, b := run("gptq", &stats), run("awq", nil)
	cka, err := checkpoint.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer cka.Close()
	ckb, err := checkpoint.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	defer ckb.Close()
	qa, _ := pack.ParseQuantConfig(cka.Config.Quantization)
	qb, _ := pack.ParseQuantConfig(ckb.Config.Quantization)
	if qa.QuantMethod != "gptq" || qb.QuantMethod != "awq" || qb.Version != "gemm" || qb.ZeroPoint == nil || !*qb.ZeroPoint {
		t.Fatalf("configs: %+v / %+v", qa, qb)
	}
	for _, name := range []string{"model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"} {
		in, out := 256, 256
		if name == "model.layers.3.mlp.down_proj" {
			in = 768
		}
		la, err := qa.Read(cka, name, in, out)
		if err != nil {
			t.Fatal(err)
		}
		lb, err := qb.Read(ckb, name, in, out)
		if err != nil {
			t.Fatal(err)
		}
		wa, wb := la.Dequantize(), lb.Dequantize()
		for i := range wa {
			if wa[i] != wb[i] {
				t.Fatalf("%s weight %d: %v (gptq layout) vs %v (awq layout)", name, i, wa[i], wb[i])
			}
		}
	}
	// The folded norms are stored exactly, and the model runs.
	if nt, _ := cka.Tensor("model.layers.0.input_layernorm.weight"); nt.DType.String() != "F32" {
		t.Errorf("folded norm stored as %s", nt.DType)
	}
	// Stats: per block q/o/gate/down inputs; α and its loss curve for the
	// three groups llama-tiny has (no v→o under GQA), the chosen α the
	// curve's minimum; clip shrinks of the layers reading each input.
	if len(stats) != 16 {
		t.Fatalf("stats: %d entries, want 16", len(stats))
	}
	for i, st := range stats {
		if st.SaliencyMax < st.SaliencyP50 || st.Tokens != 4*64 {
			t.Errorf("%s: saliency max %v < p50 %v, or %d tokens", st.Layer, st.SaliencyMax, st.SaliencyP50, st.Tokens)
		}
		if i%4 == 1 {
			if st.Alpha != nil || len(st.ClipShrink) != 1 {
				t.Errorf("%s: α %v (want none), clip %v", st.Layer, st.Alpha, st.ClipShrink)
			}
			continue
		}
		if st.Alpha == nil || len(st.AlphaLoss) != 20 {
			t.Fatalf("%s: α %v, %d losses", st.Layer, st.Alpha, len(st.AlphaLoss))
		}
		best := 0
		for j, l := range st.AlphaLoss {
			if l < st.AlphaLoss[best] {
				best = j
			}
		}
		if float64(best)/20 != *st.Alpha {
			t.Errorf("%s: α %v, but the smallest loss is at %v", st.Layer, *st.Alpha, float64(best)/20)
		}
		wantClip := map[int]int{0: 1, 2: 2, 3: 1}[i%4]
		if len(st.ClipShrink) != wantClip {
			t.Errorf("%s: clip shrinks %v, want %d", st.Layer, st.ClipShrink, wantClip)
		}
		for name, v := range st.ClipShrink {
			if v < 0.55 || v > 1 {
				t.Errorf("%s: %s mean shrink %v outside [0.55, 1]", st.Layer, name, v)
			}
		}
	}
	m, err := pack.OpenModel(b)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := llm.Generate(context.Background(), m.Model, []int{0, 462}, llm.GenerateOptions{MaxTokens: 3}, nil); err != nil {
		t.Fatal(err)
	}
}

// awq+gptq: scales searched and folded into each block, then GPTQ on the
// scaled weights. The folded norms are written as F32 and differ from the
// originals, and the model stays close to the unquantized one (a scale
// applied on one side only would wreck its perplexity).
func TestAWQThenGPTQ(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	out := filepath.Join(t.TempDir(), "awq-gptq")
	grid := pack.Grid{Bits: 4, GroupSize: 128}
	m := AWQGPTQ{GPTQ: GPTQ{Opt: gptq.Options{Grid: grid, Damp: 0.01, BlockSize: 128}},
		Scales: awq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}}}
	_, err := Run(context.Background(), Options{Src: src, Out: out, Method: m, TrueSequential: true,
		Calib: shared.Path(t, "data/calib.txt"), NSamples: 4, SeqLen: 256})
	if err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	orig, _ := checkpoint.Open(src)
	defer orig.Close()
	q, _ := pack.ParseQuantConfig(ck.Config.Quantization)
	if q == nil || q.Meta == nil || q.Meta.Method != "awq+gptq" || q.QuantMethod != "gptq" {
		t.Fatalf("quantization_config %+v", q)
	}
	name := "model.layers.0.input_layernorm.weight"
	tq, _ := ck.Tensor(name)
	a, _ := ck.Float32(name, 256)
	b, _ := orig.Float32(name, 256)
	same := true
	for i := range a {
		same = same && a[i] == b[i]
	}
	if tq.DType != safetensors.F32 || same {
		t.Errorf("%s: dtype %s, equal to the original: %v (scales not folded?)", name, tq.DType, same)
	}
	ppl := func(dir string) float64 {
		m, err := pack.OpenModel(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
		res, err := evals.Perplexity(context.Background(), m, ids, evals.PPLOptions{SeqLen: 512, Windows: 2})
		if err != nil {
			t.Fatal(err)
		}
		return res.Perplexity
	}
	pq, pf := ppl(out), ppl(src)
	t.Logf("awq+gptq w4 perplexity %.3f, unquantized %.3f (2 windows of 512)", pq, pf)
	if pq > pf*1.05 {
		t.Errorf("awq+gptq perplexity %.3f is more than 5%% above the unquantized %.3f", pq, pf)
	}
}

// TestLegacyLayouts: checkpoints in the layouts older quantizers wrote —
// AutoGPTQ's settings in quantize_config.json (no quant_method) and its
// weights in gptq_model-4bit-128g.safetensors; AutoAWQ's settings in
// quant_config.json (w_bit, q_group_size, version "GEMM") — load to the
// same logits as the modern layout they were made from. Packed weights
// without any settings, and several weight files without an index, are
// errors that say so.
func TestLegacyLayouts(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	tmp := t.TempDir()
	grid := pack.Grid{Bits: 4, GroupSize: 128}
	logits := func(dir string) ([]float32, error) {
		m, err := pack.OpenModel(dir)
		if err != nil {
			return nil, err
		}
		defer m.Close()
		c, _ := m.Model.NewCache(8)
		out := make([]float32, 8*m.Model.Cfg.Vocab)
		ids := shared.Int32s(t, "reference/llama-tiny.logits.input.i32")[:8]
		return out, m.Model.Forward(context.Background(), []llm.Step{{Cache: c, Tokens: ids, Logits: out}})
	}
	// legacy rewrites a modern output: config.json without
	// quantization_config, settings in file, weights renamed to weights.
	legacy := func(modern, name, file, settings, weights string) string {
		dir := filepath.Join(tmp, name)
		os.MkdirAll(dir, 0o755)
		entries, _ := os.ReadDir(modern)
		for _, e := range entries {
			data, _ := os.ReadFile(filepath.Join(modern, e.Name()))
			switch e.Name() {
			case "config.json":
				var cfg map[string]any
				json.Unmarshal(data, &cfg)
				delete(cfg, "quantization_config")
				data, _ = json.Marshal(cfg)
			case "model.safetensors":
				if weights != "" {
					os.WriteFile(filepath.Join(dir, weights), data, 0o644)
					continue
				}
			}
			os.WriteFile(filepath.Join(dir, e.Name()), data, 0o644)
		}
		if file != "" {
			os.WriteFile(filepath.Join(dir, file), []byte(settings), 0o644)
		}
		return dir
	}
	for _, c := range []struct {
		format, file, settings, weights string
		g                               pack.Grid
	}{
		{"gptq", "quantize_config.json", `{"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": false, "sym": true, "true_sequential": true, "model_file_base_name": "gptq_model-4bit-128g"}`,
			"gptq_model-4bit-128g.safetensors", pack.Grid{Bits: 4, GroupSize: 128, Sym: true}},
		{"awq", "quant_config.json", `{"zero_point": true, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}`, "", grid},
	} {
		modern := filepath.Join(tmp, c.format)
		if _, err := Run(context.Background(), Options{Src: src, Out: modern, Method: RTN{G: c.g}, Format: c.format}); err != nil {
			t.Fatal(err)
		}
		want, err := logits(modern)
		if err != nil {
			t.Fatal(err)
		}
		got, err := logits(legacy(modern, c.format+"-legacy", c.file, c.settings, c.weights))
		if err != nil {
			t.Fatalf("%s in %s: %v", c.format, c.file, err)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%s in %s: logit %d is %v, the modern layout gives %v", c.format, c.file, i, got[i], want[i])
			}
		}
		if _, err := logits(legacy(modern, c.format+"-bare", "", "", "")); err == nil ||
			!strings.Contains(err.Error(), ".qweight") || !strings.Contains(err.Error(), "quantize_config.json") {
			t.Errorf("%s without settings: %v", c.format, err)
		}
	}
	two := legacy(filepath.Join(tmp, "gptq"), "two", "", "", "a.safetensors")
	b, _ := os.ReadFile(filepath.Join(two, "a.safetensors"))
	os.WriteFile(filepath.Join(two, "b.safetensors"), b, 0o644)
	if _, err := logits(two); err == nil || !strings.Contains(err.Error(), "a.safetensors, b.safetensors") {
		t.Errorf("two weight files without an index: %v", err)
	}
}

// TestModelCard: an output carries a README.md that says what it was made
// from and how (method, bits, group, calibration, the command line), and
// the config's meta names llmq's version.
func TestModelCard(t *testing.T) {
	out := filepath.Join(t.TempDir(), "out")
	opt := Options{Src: shared.Path(t, "models/llama-tiny"), Out: out, TrueSequential: true,
		Method: GPTQ{Opt: gptq.Options{Grid: pack.Grid{Bits: 3, GroupSize: 64, Sym: true}, Damp: 0.01}},
		Calib:  shared.Path(t, "data/calib.txt"), NSamples: 2, SeqLen: 64,
		CommandLine: "llmq quantize llama-tiny --bits 3 --group 64 --sym", Version: "abc123"}
	if _, err := Run(context.Background(), opt); err != nil {
		t.Fatal(err)
	}
	card, err := os.ReadFile(filepath.Join(out, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"base_model: llama-tiny", "# llama-tiny, 3-bit GPTQ", "to 3 bits, groups of 64, symmetric",
		"calib.txt, the first 2 windows of 64 tokens (128 tokens)", "llmq abc123", "llmq quantize llama-tiny --bits 3 --group 64 --sym"} {
		if !strings.Contains(string(card), want) {
			t.Errorf("model card lacks %q:\n%s", want, card)
		}
	}
	ck, err := checkpoint.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	q, err := pack.ParseQuantConfig(ck.Config.Quantization)
	if err != nil || q.Meta == nil || q.Meta.Quantizer != "llmq" || q.Meta.Version != "abc123" || q.Meta.Method != "gptq" {
		t.Errorf("meta %+v, %v", q.Meta, err)
	}
}

// goldenCPU is the processor the BLAS-dependent digests below were taken
// on (with OpenBLAS): GPTQ and AWQ sum in BLAS kernels, whose rounding
// differs between BLAS builds and instruction sets.
const goldenCPU = "AMD EPYC"

// TestDigestsMatchPreRefactor pins the driver to what the code before it
// (commit 197d88f) wrote: the SHA-256 of every tensor (name, dtype, shape,
// bytes) of llama-tiny quantized by that binary, per method. RTN involves
// no BLAS and is checked everywhere; the calibrated methods where the
// digests were taken (OpenBLAS on goldenCPU).
func TestDigestsMatchPreRefactor(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	calib := shared.Path(t, "data/calib.txt")
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	sameBLAS := mat.Backend == "openblas" && strings.Contains(string(cpuinfo), "model name\t: "+goldenCPU+"\n")
	g4 := pack.Grid{Bits: 4, GroupSize: 128}
	awqOpt := awq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}, Clip: true}
	gopt := gptq.Options{Grid: g4, Damp: 0.01}
	act := gptq.Options{Grid: pack.Grid{Bits: 3, GroupSize: 64, Sym: true}, Damp: 0.01, ActOrder: true}
	for _, c := range []struct {
		name    string
		m       Method
		n, T    int
		digest  string
		useBLAS bool
	}{
		{"rtn w4 g128", RTN{G: g4}, 0, 0, "c2bd48913d6bf5016f504861d79b1b934ab153dad57060db2ae2b97d78106f86", false},
		{"gptq w4 g128", GPTQ{Opt: gopt}, 4, 128, "e43da004b7eb13c2c3d6eb145025ca3ed5796977b4c170da864c758445cc79d2", true},
		{"gptq w3 g64 act-order sym", GPTQ{Opt: act}, 4, 128, "d09610ba91ee8951390d5e09813519fec121de22ee077d7a9b54e5426876e853", true},
		{"awq w4 g128", AWQ{Opt: awqOpt}, 4, 64, "c7370ed490b9db223bd75bbdc26a46f7efa0ee0362b796a35345d74bff224089", true},
		{"awq+gptq w4 g128", AWQGPTQ{GPTQ: GPTQ{Opt: gopt}, Scales: awqOpt}, 4, 128, "5306bffb3095b4aed4a360ac3dde2092002f45bb26cce4cb10aced5013eb69bf", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.useBLAS && !sameBLAS {
				t.Skipf("digest taken with OpenBLAS on %s; this is %s", goldenCPU, mat.Backend)
			}
			out := filepath.Join(t.TempDir(), "out")
			if _, err := Run(context.Background(), Options{Src: src, Out: out, Method: c.m, TrueSequential: true,
				Calib: calib, NSamples: c.n, SeqLen: c.T}); err != nil {
				t.Fatal(err)
			}
			ck, err := checkpoint.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			h := sha256.New()
			for _, n := range ck.Names() {
				tn, _ := ck.Tensor(n)
				fmt.Fprintf(h, "%s %s %v\n", n, tn.DType, tn.Shape)
				h.Write(tn.Data)
			}
			if got := fmt.Sprintf("%x", h.Sum(nil)); got != c.digest {
				t.Errorf("tensors digest %s, the pre-refactor code wrote %s", got, c.digest)
			}
		})
	}
}

// TestMixedPrecisionPlan: with a plan, each layer is quantized on its
// rule's grid (8-bit block 0, 8-bit g64 down_proj, an 8-bit lm_head), a
// skipped layer is written exactly as the source holds it, the checkpoint
// carries the plan as GPTQModel's "dynamic", and every layer reads back as
// round-to-nearest on its grid computed here from the source weights.
func TestMixedPrecisionPlan(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	out := filepath.Join(t.TempDir(), "mixed")
	rule := func(p string, skip bool, bits, group int) pack.Rule {
		return pack.Rule{Pattern: p, Skip: skip, Bits: bits, GroupSize: group}
	}
	plan := pack.Dynamic{rule(`model\.layers\.3\.mlp\.up_proj$`, true, 0, 0), rule(`model\.layers\.0\.`, false, 8, 0),
		rule(`.*\.down_proj$`, false, 8, 64), rule(`lm_head$`, false, 8, 0)}
	base := pack.Grid{Bits: 4, GroupSize: 128}
	rep, err := Run(context.Background(), Options{Src: src, Out: out, Method: RTN{G: base}, Plan: plan, QuantizeLMHead: true})
	if err != nil {
		t.Fatal(err)
	}
	bits := map[string]int{}
	for _, l := range rep.Layers {
		bits[l.Name] = l.Bits
	}
	orig, _ := checkpoint.Open(src)
	defer orig.Close()
	ck, err := checkpoint.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	q, err := pack.ParseQuantConfig(ck.Config.Quantization)
	if err != nil || len(q.Dynamic) != 4 {
		t.Fatalf("quantization_config %s: %v", ck.Config.Quantization, err)
	}
	for _, c := range []struct {
		name    string
		in, out int
		g       pack.Grid
		skip    bool
	}{
		{"model.layers.0.self_attn.q_proj", 256, 256, pack.Grid{Bits: 8, GroupSize: 128}, false},
		{"model.layers.1.self_attn.q_proj", 256, 256, base, false},
		{"model.layers.2.mlp.down_proj", 768, 256, pack.Grid{Bits: 8, GroupSize: 64}, false},
		{"model.layers.0.mlp.down_proj", 768, 256, pack.Grid{Bits: 8, GroupSize: 128}, false}, // block 0's rule comes first
		{"model.layers.3.mlp.up_proj", 256, 768, pack.Grid{}, true},
		{"lm_head", 256, 8192, pack.Grid{Bits: 8, GroupSize: 128}, false},
	} {
		w, err := orig.Float32(c.name+".weight", c.out, c.in)
		if err != nil {
			t.Fatal(err)
		}
		if c.skip {
			got, err := ck.Float32(c.name+".weight", c.out, c.in)
			if err != nil || !slices.Equal(got, w) || bits[c.name] != 0 {
				t.Errorf("%s: kept weights differ from the source (%v), report bits %d", c.name, err, bits[c.name])
			}
			continue
		}
		l, err := q.Read(ck, c.name, c.in, c.out)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := pack.RTN(w, c.out, c.in, c.g)
		if l.Grid != c.g || !slices.Equal(l.Dequantize(), want.Dequantize()) || bits[c.name] != c.g.Bits {
			t.Errorf("%s: read with grid %+v (report %d bits), want RTN on %+v", c.name, l.Grid, bits[c.name], c.g)
		}
	}
	m, err := pack.OpenModel(out)
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
}

// TestProposePlanByHand: layers are raised by cost per weight while the
// average stays within the target: with 4 → 8 bits and a 4.5 target, the
// budget is one eighth of the weights at 8 bits.
func TestProposePlanByHand(t *testing.T) {
	costs := []LayerCost{
		{Name: "model.layers.0.self_attn.q_proj", Params: 100, Delta: 0.01}, // 1e-4 per weight
		{Name: "model.layers.0.mlp.down_proj", Params: 300, Delta: 0.06},    // 2e-4
		{Name: "model.layers.1.mlp.down_proj", Params: 300, Delta: 0.03},    // 1e-4
		{Name: "model.layers.1.self_attn.k_proj", Params: 100, Delta: 0.05}, // 5e-4
		{Name: "mlp.up_proj", Params: 800, Delta: -0.01},                    // helps: never raised
	}
	// 1600 weights: 4.5 bits allows 200 weights raised by 4 bits.
	p, err := ProposePlan(costs, 4, 8, 4.5)
	if err != nil {
		t.Fatal(err)
	}
	// k_proj (5e-4) fits (100 weights); down_proj 0 (300) would exceed; q_proj (100) fits.
	if !slices.Equal(p.Raised, []string{"model.layers.1.self_attn.k_proj", "model.layers.0.self_attn.q_proj"}) || p.AverageBits != 4.5 {
		t.Errorf("raised %v, average %.3f bits", p.Raised, p.AverageBits)
	}
	if g, ok := p.Dynamic.For("model.layers.1.self_attn.k_proj", pack.Grid{Bits: 4, GroupSize: 128}); !ok || g.Bits != 8 {
		t.Errorf("plan gives k_proj %+v", g)
	}
	if g, _ := p.Dynamic.For("model.layers.1.self_attn.q_proj", pack.Grid{Bits: 4, GroupSize: 128}); g.Bits != 4 {
		t.Errorf("plan gives block 1's q_proj %+v", g)
	}
	if _, err := ProposePlan(costs, 4, 4, 5); err == nil {
		t.Error("high bits = base bits accepted")
	}
}

// TestSensitivityOnLlamaTiny: every layer's cost is measured (28 layers),
// costs are real (quantizing a layer to 2 bits raises the NLL of most),
// and the model is restored after each one.
func TestSensitivityOnLlamaTiny(t *testing.T) {
	ck, err := checkpoint.Open(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	m, err := llm.Load(ck, llm.DenseLoader)
	if err != nil {
		t.Fatal(err)
	}
	ids := shared.Int32s(t, "reference/wikitext2-test.tokens.i32")
	windows := [][]int{ids[:128], ids[128:256]}
	before, _ := meanNLL(context.Background(), m, windows)
	costs, base, err := Sensitivity(context.Background(), m, windows, pack.Grid{Bits: 2, GroupSize: 128}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	after, _ := meanNLL(context.Background(), m, windows)
	if len(costs) != 28 || base != before || after != before {
		t.Fatalf("%d costs; NLL %v before, %v as base, %v after", len(costs), before, base, after)
	}
	worse := 0
	for _, c := range costs {
		if c.Delta > 0 {
			worse++
		}
	}
	if worse < 20 {
		t.Errorf("only %d of 28 layers cost anything at 2 bits", worse)
	}
	types, _, err := Sensitivity(context.Background(), m, windows, pack.Grid{Bits: 2, GroupSize: 128}, true, nil)
	if err != nil || len(types) != 7 || types[6].Name != "mlp.down_proj" || types[6].Params != 4*768*256 {
		t.Errorf("by type: %+v, %v", types, err)
	}
}

// TestSeededCalibration: --seed samples other windows (a different
// checkpoint), the same seed the same ones (an identical checkpoint), and
// the report and meta say how many tokens were used of how many.
func TestSeededCalibration(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	dir := t.TempDir()
	run := func(name string, seed uint64) (*Report, [32]byte) {
		out := filepath.Join(dir, name)
		rep, err := Run(context.Background(), Options{Src: src, Out: out, Method: GPTQ{Opt: gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128}, Damp: 0.01}},
			TrueSequential: true, Calib: shared.Path(t, "data/calib.txt"), NSamples: 2, SeqLen: 64, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		data, _ := os.ReadFile(filepath.Join(out, "model.safetensors"))
		return rep, sha256.Sum256(data)
	}
	r0, h0 := run("first", 0)
	_, h7 := run("seed7", 7)
	_, h7b := run("seed7b", 7)
	if h0 == h7 || h7 != h7b {
		t.Errorf("first windows vs seed 7 equal: %v; seed 7 twice equal: %v", h0 == h7, h7 == h7b)
	}
	if r0.CalibTokens != 128 || r0.CalibSourceTokens < 10000 {
		t.Errorf("report: %d calibration tokens of %d", r0.CalibTokens, r0.CalibSourceTokens)
	}
	ck, _ := checkpoint.Open(filepath.Join(dir, "seed7"))
	defer ck.Close()
	if q, _ := pack.ParseQuantConfig(ck.Config.Quantization); q.Meta.Seed != 7 {
		t.Errorf("meta %+v", q.Meta)
	}
}

// TestResume: a run interrupted after two blocks and resumed writes the
// same checkpoint, file for file, as an uninterrupted run — for GPTQ
// (the next block reads the quantized block, rebuilt from what was
// written) and AWQ (it reads the unquantized block); a resume with other
// settings is refused, and a fresh run refuses to overwrite the parts.
func TestResume(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	calib := shared.Path(t, "data/calib.txt")
	for _, c := range []struct {
		name string
		m    Method
		T    int
	}{
		{"gptq", GPTQ{Opt: gptq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128}, Damp: 0.01}}, 128},
		{"awq", AWQ{Opt: awq.Options{Grid: pack.Grid{Bits: 4, GroupSize: 128, MinMax: true}, Clip: true}}, 64},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			opt := Options{Src: src, Method: c.m, TrueSequential: true, Calib: calib, NSamples: 3, SeqLen: c.T, QuantizeLMHead: true}
			whole := opt
			whole.Out = filepath.Join(dir, "whole")
			if _, err := Run(context.Background(), whole); err != nil {
				t.Fatal(err)
			}
			cut := interruptAt(t, opt, filepath.Join(dir, "cut"), 2)
			if _, err := Run(context.Background(), cut); !errors.Is(err, pack.ErrPartial) {
				t.Errorf("a fresh run over the parts: %v, want ErrPartial", err)
			}
			other := cut
			other.NSamples, other.Resume = 2, true
			if _, err := Run(context.Background(), other); err == nil || !strings.Contains(err.Error(), "other settings") {
				t.Errorf("resume with other settings: %v", err)
			}
			cut.Resume = true
			rep, err := Run(context.Background(), cut)
			if err != nil {
				t.Fatal(err)
			}
			if rep.ResumedAt != 2 {
				t.Errorf("resumed at block %d, want 2", rep.ResumedAt)
			}
			assertSameFiles(t, whole.Out, cut.Out)
			if _, err := os.Stat(pack.PartialDir(cut.Out)); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("the parts were left after finishing: %v", err)
			}
		})
	}
}

// interruptAt runs opt into out and cancels it when block starts: the
// returned options are the interrupted run's, ready to be run again.
func interruptAt(t *testing.T, opt Options, out string, block int) Options {
	t.Helper()
	opt.Out = out
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opt.Progress = func(b, blocks int, stage string) {
		if b == block {
			cancel()
		}
	}
	if _, err := Run(ctx, opt); !errors.Is(err, ErrInterrupted) {
		t.Fatalf("interrupted run: %v", err)
	}
	opt.Progress = nil
	return opt
}

// assertSameFiles checks that every file of the whole run's output is in
// the resumed run's, byte for byte.
func assertSameFiles(t *testing.T, whole, resumed string) {
	t.Helper()
	entries, err := os.ReadDir(whole)
	if err != nil || len(entries) == 0 {
		t.Fatalf("%s: %d files (%v)", whole, len(entries), err)
	}
	for _, e := range entries {
		a, _ := os.ReadFile(filepath.Join(whole, e.Name()))
		b, err := os.ReadFile(filepath.Join(resumed, e.Name()))
		if err != nil || !bytes.Equal(a, b) {
			t.Errorf("%s differs between the whole and the resumed run (%v)", e.Name(), err)
		}
	}
}

// TestSmoothBeforeQuantizing: with SmoothQuant factors, each block's norms
// are written divided by them and its layers are RTN of the smoothed
// weights (columns multiplied), so the checkpoint computes the smoothed
// model the W8A8 recipe runs; a resumed run must use the same factors.
func TestSmoothBeforeQuantizing(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	orig, err := checkpoint.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	c := orig.Config
	f := actquant.SmoothFor{Attn: make([]float32, c.Hidden), MLP: make([]float32, c.Hidden)}
	for j := range f.Attn {
		f.Attn[j], f.MLP[j] = 1+float32(j%7)/4, 2/(1+float32(j%5))
	}
	sc := &actquant.Scales{Alpha: 0.5, Smooth: map[int]actquant.SmoothFor{1: f}}
	g := pack.Grid{Bits: 8, GroupSize: 128}
	out := filepath.Join(t.TempDir(), "smooth")
	if _, err := Run(context.Background(), Options{Src: src, Out: out, Method: RTN{G: g}, Smooth: sc}); err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	q, err := pack.ParseQuantConfig(ck.Config.Quantization)
	if err != nil || q.Meta == nil || q.Meta.SmoothAlpha != 0.5 {
		t.Fatalf("quantization_config %s: %v", ck.Config.Quantization, err)
	}
	for _, blk := range []int{0, 1} {
		p := fmt.Sprintf("model.layers.%d.", blk)
		for _, n := range []struct {
			norm  string
			s     []float32
			layer string
			out   int
		}{{"input_layernorm", f.Attn, "self_attn.k_proj", c.KVHeads * c.HeadDim}, {"post_attention_layernorm", f.MLP, "mlp.up_proj", c.Intermediate}} {
			norm, _ := orig.Float32(p+n.norm+".weight", c.Hidden)
			got, err := ck.Float32(p+n.norm+".weight", c.Hidden)
			if err != nil {
				t.Fatal(err)
			}
			out := n.out
			w, err := orig.Float32(p+n.layer+".weight", out, c.Hidden)
			if err != nil {
				t.Fatal(err)
			}
			for j := range norm {
				if blk == 1 {
					norm[j] /= n.s[j]
				}
			}
			if !slices.Equal(got, norm) {
				t.Errorf("block %d %s: not the source divided by the factors", blk, n.norm)
			}
			if blk == 1 {
				for r := 0; r < out; r++ {
					for j := 0; j < c.Hidden; j++ {
						w[r*c.Hidden+j] *= n.s[j]
					}
				}
			}
			want, _ := pack.RTN(w, out, c.Hidden, g)
			l, err := q.Read(ck, p+n.layer, c.Hidden, out)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(l.Dequantize(), want.Dequantize()) {
				t.Errorf("block %d %s: not RTN of the smoothed weights", blk, n.layer)
			}
		}
	}
	bad := &actquant.Scales{Smooth: map[int]actquant.SmoothFor{9: f}}
	if _, err := Run(context.Background(), Options{Src: src, Out: out + "2", Method: RTN{G: g}, Smooth: bad}); err == nil || !strings.Contains(err.Error(), "block 9") {
		t.Errorf("factors for a missing block: %v", err)
	}
}

// failingRTN is RTN failing on one layer.
type failingRTN struct {
	RTN
	layer string
}

func (m failingRTN) Quantize(l Layer, s Stats) (*pack.Linear, float64, error) {
	if l.Name == m.layer {
		return nil, 0, errors.New("planted failure")
	}
	return m.RTN.Quantize(l, s)
}

// RTN's blocks are rounded and written in the background while the next
// block is read (finish.go): a failure there stops the run with the
// layer's name and leaves nothing behind.
func TestBackgroundFinishingFails(t *testing.T) {
	src := shared.Path(t, "models/llama-tiny")
	tmp := t.TempDir()
	m := failingRTN{RTN{G: pack.Grid{Bits: 4, GroupSize: 128}}, "model.layers.1.mlp.down_proj"}
	_, err := Run(context.Background(), Options{Src: src, Out: filepath.Join(tmp, "q"), Method: m})
	if err == nil || !strings.Contains(err.Error(), "model.layers.1.mlp.down_proj: planted failure") {
		t.Fatalf("run with a failing layer: %v", err)
	}
	if entries, _ := os.ReadDir(tmp); len(entries) != 0 {
		t.Errorf("left behind: %v", entries)
	}
	// Without the failure every layer is reported, in order, and the
	// rounding's time is in the split.
	rep, err := Run(context.Background(), Options{Src: src, Out: filepath.Join(tmp, "q"), Method: m.RTN})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Layers) != 28 || rep.Layers[0].Name != "model.layers.0.self_attn.q_proj" || rep.Layers[27].Name != "model.layers.3.mlp.down_proj" || rep.Timing["round"] <= 0 {
		t.Errorf("report: %d layers %v, round %g s", len(rep.Layers), rep.Layers, rep.Timing["round"])
	}
}

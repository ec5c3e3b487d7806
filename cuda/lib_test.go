//go:build cgo

package cuda

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
	"github.com/llmq/llmq/llm/checkpoint"
)

// TestOpenSaysWhereItLooked: without a library, the error is one short
// line naming every absolute path tried and how to build the library.
func TestOpenSaysWhereItLooked(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("LLMQ_CUDA_LIB", filepath.Join(dir, "nowhere", "libllmqcuda.so"))
	if DefaultPath() != "" {
		t.Skip("a CUDA library is installed here")
	}
	_, err := Open("")
	if err == nil {
		t.Fatal("Open found a library that is not there")
	}
	msg := err.Error()
	for _, p := range Candidates() {
		if !filepath.IsAbs(p) || !strings.Contains(msg, p) {
			t.Errorf("error %q does not name the absolute path %s", msg, p)
		}
	}
	if !strings.Contains(msg, "make cuda") || strings.Contains(msg, "\n") || len(msg) > 400 {
		t.Errorf("error is not one short line saying how to build the library: %q", msg)
	}
}

// TestSupports: the GPU backend accepts every zoo family, mixtures of
// experts included, and refuses a mixture past its route kernel (300
// experts, or a top k of 17); the GPU calibrator refuses the mixtures and
// Gemma 3 by architecture.
func TestSupports(t *testing.T) {
	for name, calib := range map[string]string{
		"mistral-swa-rand": "", "mistral-rand": "", "qwen2-rand": "", "llama31-rand": "", "qwen3-rand": "",
		"qwen3moe-rand": "Qwen3MoeForCausalLM", "mixtral-rand": "MixtralForCausalLM", "gemma3-rand": "Gemma3ForCausalLM",
	} {
		cfg, err := checkpoint.LoadConfig(shared.Path(t, "models/archzoo/"+name))
		if err != nil {
			t.Fatal(err)
		}
		if err := Supports(cfg); err != nil {
			t.Errorf("%s refused: %v", name, err)
		}
		// The GPU calibrator refuses the mixtures and Gemma 3 (its
		// sandwich norms), by name.
		err = CalibratorSupports(cfg)
		if (err != nil) != (calib != "") || err != nil && !strings.Contains(err.Error(), calib) {
			t.Errorf("%s: the calibrator says %v, want a refusal naming %q", name, err, calib)
		}
		// A mixture past the route kernel's 256 experts or top 16 is refused.
		if cfg.MoE != nil {
			for _, edit := range []func(*checkpoint.MoE){func(m *checkpoint.MoE) { m.Experts = 300 }, func(m *checkpoint.MoE) { m.TopK = 17 }} {
				wide := *cfg.MoE
				edit(&wide)
				c := *cfg
				c.MoE = &wide
				if err := Supports(&c); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d top %d", wide.Experts, wide.TopK)) {
					t.Errorf("%s with %d experts, top %d: %v", name, wide.Experts, wide.TopK, err)
				}
			}
		}
	}
}

// TestUploadOrderAndReuse: an upload's source may be overwritten as soon
// as Upload returns, and uploads keep the stream's order around the work
// queued between them — a copy out of a buffer sees the bytes uploaded
// before it, not the ones after. Sizes
// from a decode step's few ints to more than one staging chunk; the
// buffers are first filled with a marker no upload writes, and the values
// depend on the size, so nothing left from an earlier case can pass for a
// copy that did not happen.
func TestUploadOrderAndReuse(t *testing.T) {
	x := openContext(t)
	for _, n := range []int{1, 37, 1 << 20, 9 << 20} {
		first0 := func(i int) int32 { return int32(i^n) & 0x3fffffff }  // ≥ 0
		second := func(i int) int32 { return -int32(i) - 1 - int32(n) } // < 0
		src := make([]int32, n)
		for i := range src {
			src[i] = first0(i)
		}
		buf, err := x.Alloc(4 * n)
		if err != nil {
			t.Fatal(err)
		}
		first, err := x.Alloc(4 * n)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range []Buf{buf, first} { // 0x7f7f7f7f: neither upload's
			if err := x.Memset(b, 0x7f, 4*n); err != nil {
				t.Fatal(err)
			}
		}
		if err := Upload(x, buf, src); err != nil {
			t.Fatal(err)
		}
		if err := x.Copy(first, buf, 4*n); err != nil { // queued after the first upload
			t.Fatal(err)
		}
		for i := range src { // the same slice, reused at once
			src[i] = second(i)
		}
		if err := Upload(x, buf, src); err != nil {
			t.Fatal(err)
		}
		got, again := make([]int32, n), make([]int32, n)
		if err := Download(x, got, first); err != nil {
			t.Fatal(err)
		}
		if err := Download(x, again, buf); err != nil {
			t.Fatal(err)
		}
		for i := range got {
			if got[i] != first0(i) || again[i] != second(i) {
				t.Fatalf("%d ints: at %d the copy holds %d (want the first upload's %d), the buffer %d (want the second's %d)",
					n, i, got[i], first0(i), again[i], second(i))
			}
		}
		x.Free(buf)
		x.Free(first)
	}
}

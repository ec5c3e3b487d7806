package checkpoint

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestF8E4M3RoundTrip: a file with an F8_E4M3 tensor (which the
// safetensors library does not know) is written with the dtype spelled
// out in its header, read back with the tensor marked Float8 and its bytes
// intact, and the file on disk is not changed by reading it (the header is
// renamed in a private copy only).
func TestF8E4M3RoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f8.safetensors")
	codes := []byte{0x00, 0x7e, 0xfe, 0x38, 0x01, 0x80}
	err := WriteFile(path, map[string]Out{
		"a.weight":       F8E4M3(codes, 2, 3),
		"a.weight_scale": F32([]float32{0.5, 0.25}, 2, 1),
		"b.shape":        I64([]int64{2, 3}, 2),
	}, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(before[:8])
	var hdr map[string]struct {
		DType   string   `json:"dtype"`
		Shape   []int    `json:"shape"`
		Offsets [2]int64 `json:"data_offsets"`
	}
	if err := json.Unmarshal(before[8:8+n], &hdr); err != nil || n%8 != 0 {
		t.Fatalf("header (%d bytes): %v", n, err)
	}
	if h := hdr["a.weight"]; h.DType != "F8_E4M3" || h.Offsets[1]-h.Offsets[0] != 6 {
		t.Fatalf("header entry %+v", h)
	}
	if hdr["b.shape"].Offsets[0] != 0 { // 8-byte elements first, aligned
		t.Errorf("I64 tensor at offset %d", hdr["b.shape"].Offsets[0])
	}
	f, err := OpenFile(path)
	if err != nil {
		t.Fatal(err)
	}
	w, ok := f.Tensor("a.weight")
	if !ok || !w.Float8 || w.DTypeName() != "F8_E4M3" || !bytes.Equal(w.Data, codes) {
		t.Fatalf("read back %+v", w)
	}
	if err := w.ToFloat32(make([]float32, 6)); err == nil || !strings.Contains(err.Error(), "weight_scale") {
		t.Errorf("ToFloat32 of FP8 codes: %v", err)
	}
	if s, _ := f.Tensor("a.weight_scale"); s.Float8 || s.DTypeName() != "F32" {
		t.Errorf("scale read as %s", s.DTypeName())
	}
	f.Close()
	after, _ := os.ReadFile(path)
	if !bytes.Equal(before, after) {
		t.Error("reading the file changed it")
	}
	// Other dtypes the library lacks stay refused.
	bad := bytes.Replace(before, []byte(`"F8_E4M3"`), []byte(`"F8_E5M2"`), 1)
	if err := os.WriteFile(path, bad, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenFile(path); err == nil || !strings.Contains(err.Error(), `unsupported dtype "F8_E5M2"`) {
		t.Errorf("F8_E5M2: %v", err)
	}
}

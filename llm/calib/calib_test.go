package calib

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// TestWindows: the first n non-overlapping windows, and errors that say
// what the data holds and what was asked for (in the library's words: the
// command line names its flags).
func TestWindows(t *testing.T) {
	ids := make([]int, 300)
	for i := range ids {
		ids[i] = i
	}
	w, err := Windows(ids, 2, 128)
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 2 || !reflect.DeepEqual(w[0], ids[:128]) || !reflect.DeepEqual(w[1], ids[128:256]) {
		t.Errorf("windows %v", w)
	}
	if _, err := Windows(ids, 4, 128); err == nil || err.Error() != "calibration data has 300 tokens, 2 windows of 128; 4 windows need 512 tokens" {
		t.Errorf("too few tokens: %v", err)
	}
	if _, err := Windows(ids, 0, 128); err == nil || err.Error() != "0 calibration windows of 128 tokens: want a positive number of windows and tokens" {
		t.Errorf("no windows: %v", err)
	}
}

func TestReadTokensErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.i32")
	if err := os.WriteFile(bad, make([]byte, 10), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadTokens(bad, nil); err == nil || err.Error() != "calibration data "+bad+": 10 bytes is not a whole number of int32 ids" {
		t.Errorf("10-byte .i32: %v", err)
	}
	good := filepath.Join(dir, "good.i32")
	if err := os.WriteFile(good, []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, 0o644); err != nil {
		t.Fatal(err)
	}
	if ids, err := ReadTokens(good, nil); err != nil || !reflect.DeepEqual(ids, []int{1, -1}) {
		t.Errorf("ids %v, %v; want [1 -1]", ids, err)
	}
	if _, err := ReadTokens(filepath.Join(dir, "missing.txt"), nil); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

package evals

import (
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
)

// TestStampedCommit: the commit comes from the build's VCS stamp, marked
// dirty when the stamp says the tree was modified.
func TestStampedCommit(t *testing.T) {
	const rev = "0123456789abcdef0123456789abcdef01234567"
	for _, c := range []struct {
		settings []debug.BuildSetting
		want     string
	}{
		{nil, ""},
		{[]debug.BuildSetting{{Key: "-tags", Value: "openblas"}}, ""},
		{[]debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: "false"}}, rev},
		{[]debug.BuildSetting{{Key: "vcs.modified", Value: "true"}, {Key: "vcs.revision", Value: rev}}, rev + "-dirty"},
	} {
		if got := stampedCommit(c.settings); got != c.want {
			t.Errorf("stampedCommit(%v) = %q, want %q", c.settings, got, c.want)
		}
	}
}

// TestCommitFallsBackToLinkedRevision: a test binary has no VCS stamp, so
// Commit is the revision linked in with -ldflags -X, or "unknown".
func TestCommitFallsBackToLinkedRevision(t *testing.T) {
	if bi, ok := debug.ReadBuildInfo(); ok && stampedCommit(bi.Settings) != "" {
		t.Skip("this test binary carries a VCS stamp")
	}
	want := revision
	if want == "" {
		want = "unknown"
	}
	if got := Commit(); got != want {
		t.Errorf("Commit() = %q, want %q", got, want)
	}
	defer func(r string) { revision = r }(revision)
	revision = "feedface-dirty"
	if got := Commit(); got != "feedface-dirty" {
		t.Errorf("with a linked revision, Commit() = %q", got)
	}
}

// A result measured with one of the library's tuning variables set says
// so in its command, before the arguments; others are left out.
func TestCommandLineNamesTuningVariables(t *testing.T) {
	for _, k := range tuningEnv { // unset, whatever this shell has, and restored after
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	t.Setenv("LLMQ_PDL", "1")
	t.Setenv("LLMQ_SHARED", "/somewhere")
	if got, want := NewRecord("test", nil).Command, "LLMQ_PDL=1 "+strings.Join(os.Args, " "); got != want {
		t.Errorf("command %q, want %q", got, want)
	}
}

// tuningEnv lists exactly the LLMQ_ variables the CUDA library reads
// (getenv in cuda/*.cu) and its Go side reads (os.Getenv in cuda/*.go,
// tests aside), so that none is run without being recorded.
func TestTuningEnvMatchesTheLibrary(t *testing.T) {
	files, err := filepath.Glob("../cuda/*")
	if err != nil {
		t.Fatal(err)
	}
	patterns := map[string]*regexp.Regexp{
		".cu": regexp.MustCompile(`getenv\("(LLMQ_\w+)"\)`),
		".go": regexp.MustCompile(`os\.Getenv\("(LLMQ_\w+)"\)`),
	}
	var read []string
	for _, file := range files {
		re := patterns[filepath.Ext(file)]
		if re == nil || strings.HasSuffix(file, "_test.go") {
			continue
		}
		src, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllSubmatch(src, -1) {
			read = append(read, string(m[1]))
		}
	}
	if !slices.Contains(read, "LLMQ_CUDA_LIB") || !slices.Contains(read, "LLMQ_PDL") {
		t.Fatalf("found %v in ../cuda: the loader's LLMQ_CUDA_LIB or runtime.cu's LLMQ_PDL missing (files moved?)", read)
	}
	slices.Sort(read)
	read = slices.Compact(read)
	if listed := slices.Sorted(slices.Values(tuningEnv)); !slices.Equal(read, listed) {
		t.Errorf("the library reads %v, tuningEnv lists %v", read, listed)
	}
}

type fakeGPU struct{}

func (fakeGPU) DeviceName() string { return "Some GPU 80GB" }

// A result measured on a GPU backend names the GPU before the host; on
// any other backend the device is the host alone.
func TestNewRecordOnNamesTheGPU(t *testing.T) {
	host := Device()
	if got, want := NewRecordOn("test", nil, GPUName(fakeGPU{})).Device, "Some GPU 80GB; host "+host; got != want {
		t.Errorf("device %q, want %q", got, want)
	}
	if got := NewRecordOn("test", nil, GPUName(struct{}{})).Device; got != host {
		t.Errorf("device %q on a backend without a GPU, want %q", got, host)
	}
}

package evals

import (
	"os"
	"runtime/debug"
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
	t.Setenv("LLMQ_PDL", "1")
	t.Setenv("LLMQ_SHARED", "/somewhere")
	got := NewRecord("test", nil).Command
	if !strings.HasPrefix(got, "LLMQ_PDL=1 "+os.Args[0]) || strings.Contains(got, "LLMQ_SHARED") {
		t.Errorf("command %q, want LLMQ_PDL=1 then the arguments, without LLMQ_SHARED", got)
	}
}

package evals

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Record is one result as committed under evals/results/: what was run, on
// which commit and machine, and what came out.
type Record struct {
	Kind    string         `json:"kind"`
	Command string         `json:"command"`
	Commit  string         `json:"commit"`
	Device  string         `json:"device"`
	Date    string         `json:"date"`
	Data    map[string]any `json:"data"`
}

// NewRecord stamps data with the command line, the git commit (or
// $LLMQ_COMMIT where there is no git, as on the GPU machine) and the device.
func NewRecord(kind string, data map[string]any) Record {
	return Record{
		Kind:    kind,
		Command: strings.Join(os.Args, " "),
		Commit:  Commit(),
		Device:  Device(),
		Date:    time.Now().UTC().Format(time.RFC3339),
		Data:    data,
	}
}

// Commit is the current git commit, marked "-dirty" when the tree has
// uncommitted changes outside evals/results (results are outputs: a run
// that writes several of them must not mark its own later records dirty).
func Commit() string {
	if c := os.Getenv("LLMQ_COMMIT"); c != "" {
		return c
	}
	out, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)evals/results").Output(); err == nil && len(st) > 0 {
		c += "-dirty"
	}
	return c
}

// Device describes the CPU (model name and cores); GPU runs add theirs.
func Device() string {
	cpu := "unknown cpu"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				if _, v, ok := strings.Cut(line, ":"); ok {
					cpu = strings.TrimSpace(v)
				}
				break
			}
		}
	}
	return cpu + ", " + strconv.Itoa(runtime.NumCPU()) + " cores, " + runtime.GOOS + "/" + runtime.GOARCH
}

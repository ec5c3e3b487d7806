package evals

import (
	"os"
	"runtime"
	"runtime/debug"
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

// NewRecord stamps data with the command line (after the tuning variables
// set in its environment, see tuningEnv), the commit the binary was built
// from (see Commit) and the device.
func NewRecord(kind string, data map[string]any) Record {
	return Record{
		Kind:    kind,
		Command: commandLine(),
		Commit:  Commit(),
		Device:  Device(),
		Date:    time.Now().UTC().Format(time.RFC3339),
		Data:    data,
	}
}

// NewRecordOn is NewRecord for a result measured on the GPU named gpu
// ("": on the host alone): the record's device names it before the host.
func NewRecordOn(kind string, data map[string]any, gpu string) Record {
	r := NewRecord(kind, data)
	if gpu != "" {
		r.Device = gpu + "; host " + r.Device
	}
	return r
}

// GPUName is the GPU a backend runs on, for NewRecordOn: its DeviceName
// where it has one (cuda.Model), else "".
func GPUName(backend any) string {
	if d, ok := backend.(interface{ DeviceName() string }); ok {
		return d.DeviceName()
	}
	return ""
}

// tuningEnv are the environment variables the CUDA library reads to
// change how it runs (runtime.cu's ctx_create; cuda.Model's
// LLMQ_SPLIT_SUMS), and LLMQ_CUDA_LIB, which picks the library itself (an
// A/B run's baseline): a result measured with one set must say so.
var tuningEnv = []string{"LLMQ_ATTN_EARLY", "LLMQ_COMBINE_EARLY", "LLMQ_CUDA_LIB", "LLMQ_DECODE_WAVE", "LLMQ_MOE_FUSED_ACT", "LLMQ_MOE_FUSED_DOWN", "LLMQ_MOE_FUSED_STAGE", "LLMQ_MOE_NORM_ROUTER", "LLMQ_MOE_PREFETCH", "LLMQ_MOE_ROUTED", "LLMQ_MOE_SPLITS", "LLMQ_PDL", "LLMQ_SPLIT_SUMS", "LLMQ_W4_FUSED_MAX_M", "LLMQ_W4_GEMV_MAX_M",
	"LLMQ_W4_MMA_MAX_M", "LLMQ_W4_SPLITS", "LLMQ_W4_SWAP_MAX_M", "LLMQ_W4_SWAP_VARIANT", "LLMQ_W4_MMA_VARIANT", "LLMQ_W4_FUSED_VARIANT", "LLMQ_W4_WGMMA_MAX_M"}

// commandLine is the running command: the tuning variables that are set
// (NAME=value), then the arguments, joined by spaces, unquoted.
func commandLine() string {
	var parts []string
	for _, k := range tuningEnv {
		if v, ok := os.LookupEnv(k); ok {
			parts = append(parts, k+"="+v)
		}
	}
	return strings.Join(append(parts, os.Args...), " ")
}

// revision is the commit the Makefile links in (-ldflags "-X
// github.com/llmq/llmq/evals.revision=HASH[-dirty]") for builds that carry
// no VCS stamp: make device's binaries (run on a machine without git),
// test binaries, builds with -buildvcs=false.
var revision string

// Commit is the commit the running binary was built from, with "-dirty"
// when its tree had uncommitted changes: Go's VCS stamp (vcs.revision and
// vcs.modified in the build info), else the revision linked in by the
// Makefile, else "unknown". It never looks at the working directory, which
// need not be the repository the binary came from.
func Commit() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		if c := stampedCommit(bi.Settings); c != "" {
			return c
		}
	}
	if revision != "" {
		return revision
	}
	return "unknown"
}

// stampedCommit reads the VCS stamp of a build's settings ("" without one).
func stampedCommit(settings []debug.BuildSetting) string {
	var rev string
	dirty := false
	for _, s := range settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev != "" && dirty {
		rev += "-dirty"
	}
	return rev
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

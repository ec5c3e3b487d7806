//go:build !cgo

// Package cuda runs llmq's CUDA kernels from Go; this build has no cgo, so
// the GPU is unavailable and Open says so.
package cuda

import (
	"context"
	"errors"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

var errNoCgo = errors.New("GPU unavailable: llmq was built without cgo (CGO_ENABLED=0); rebuild with cgo to load the CUDA library")

// Lib is unavailable without cgo.
type Lib struct{}

// Open always fails without cgo.
func Open(path string) (*Lib, error) {
	return nil, errNoCgo
}

// OpenModel always fails without cgo.
func OpenModel(ck *checkpoint.Checkpoint) (Backend, error) { return nil, errNoCgo }

// OpenModelWith always fails without cgo.
func OpenModelWith(ck *checkpoint.Checkpoint, opt LoadOptions) (Backend, error) { return nil, errNoCgo }

// Calibrator is unavailable without cgo.
type Calibrator struct{ Busy map[string]float64 }

// Hessian is unavailable without cgo.
type Hessian struct{ In, Rows int }

// Stats is unavailable without cgo.
type Stats struct{ QKV, O, Up, Down *Hessian }

// Device is unavailable without cgo.
type Device struct{ Name string }

func (*Lib) Device() (Device, error) { return Device{}, errNoCgo }

func NewCalibrator(*Lib, *checkpoint.Config, [][]float32, int) (*Calibrator, error) {
	return nil, errNoCgo
}
func (*Calibrator) Windows() int                                      { return 0 }
func (*Calibrator) Close() error                                      { return errNoCgo }
func (*Calibrator) PeakBytes() (int64, error)                         { return 0, errNoCgo }
func (*Calibrator) Download() ([][]float32, error)                    { return nil, errNoCgo }
func (*Calibrator) SetBlock(*llm.Block) error                         { return errNoCgo }
func (*Calibrator) SetLinear(string, []float32) error                 { return errNoCgo }
func (*Calibrator) Statistics(context.Context, Stats) error           { return errNoCgo }
func (*Calibrator) Propagate(context.Context) error                   { return errNoCgo }
func (*Calibrator) AttentionInput(context.Context, *Hessian) error    { return errNoCgo }
func (*Calibrator) AttentionOutput(context.Context, *Hessian) error   { return errNoCgo }
func (*Calibrator) MLPInput(context.Context, *Hessian) error          { return errNoCgo }
func (*Calibrator) MLPAct(context.Context, *Hessian) error            { return errNoCgo }
func (*Calibrator) Outputs(context.Context) error                     { return errNoCgo }
func (*Calibrator) NewHessian(int) (*Hessian, error)                  { return nil, errNoCgo }
func (*Calibrator) Free(*Hessian)                                     {}
func (*Calibrator) Diag(*Hessian) ([]float64, error)                  { return nil, errNoCgo }
func (*Calibrator) GPTQFactor(*Hessian, []int, float64) (bool, error) { return false, errNoCgo }
func (*Calibrator) GPTQ(*Hessian, []float32, int, int, []int32, []float32, []uint8, pack.Grid, bool, bool) ([]uint8, float64, error) {
	return nil, 0, errNoCgo
}

// AWQFeatures is unavailable without cgo.
type AWQFeatures struct {
	Windows int
	Mean    [4][]float64
	Gram    [4]*Hessian
}

func (*Calibrator) AWQCollect(context.Context, int, int) (*AWQFeatures, error) { return nil, errNoCgo }
func (*Calibrator) FreeAWQ(*AWQFeatures)                                       {}
func (*Calibrator) AWQLoss(context.Context, *AWQFeatures, int, int) (float64, error) {
	return 0, errNoCgo
}
func (*Calibrator) AWQAdvance(context.Context, *AWQFeatures) error    { return errNoCgo }
func (*Calibrator) AWQQuantize([]float32, pack.Grid, ...string) error { return errNoCgo }
func (*Calibrator) Restore(...string) error                           { return errNoCgo }
func (*Calibrator) AWQClip(*AWQFeatures, string, []float32, []float32, int, pack.Grid, int) ([]float32, error) {
	return nil, errNoCgo
}

// Supports always fails without cgo: nothing runs on the GPU.
func Supports(c *checkpoint.Config) error { return errNoCgo }

// CalibratorSupports always fails without cgo: nothing runs on the GPU.
func CalibratorSupports(c *checkpoint.Config) error { return errNoCgo }

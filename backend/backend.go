// Package backend opens a model directory on a device: it is the one place
// that chooses between the CPU backend (package llm, weights read by
// package pack) and the GPU backend (package cuda).
//
// The packages that run models — the engine, the server, perplexity — see
// only an llm.Backend with the checkpoint's tokenizer and chat template,
// so they import neither pack nor cuda; a program (cmd/llmq, or a Go chat
// server) calls Open and hands the result on:
//
//	m, err := backend.Open(dir, "auto") // the GPU when it can, else the CPU
//	defer m.Close()
//	e, err := engine.New(m, engine.Options{})
package backend

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/llmq/llmq/actquant"
	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/chat"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/llmq/llmq/pack"
)

// ErrUnknownDevice is returned by Open for a device other than auto, cpu
// and cuda.
var ErrUnknownDevice = errors.New("unknown device")

// Model is a checkpoint opened on a device, with its tokenizer and chat
// template.
type Model struct {
	Dir       string
	Config    *checkpoint.Config
	Backend   llm.Backend
	Tokenizer *tokenizer.Tokenizer
	Template  *chat.Template // nil without a chat_template
	LoadTime  time.Duration
	// Fallback says why device "auto" runs on the CPU (empty otherwise).
	Fallback string
	close    func() error
}

// Close releases the model (its mapped files, its GPU memory).
func (m *Model) Close() error { return m.close() }

// Parts returns what an engine runs: the backend, the tokenizer and the
// chat template (nil when the checkpoint has none). It makes *Model an
// engine.Model.
func (m *Model) Parts() (llm.Backend, *tokenizer.Tokenizer, *chat.Template) {
	if m == nil {
		return nil, nil, nil
	}
	return m.Backend, m.Tokenizer, m.Template
}

// Open loads a model directory — packed by llmq quantize or unquantized —
// on device "cpu" (float32, dequantized), "cuda" (the GPU backend: packed
// layers stay 4-bit, the rest fp16), or "auto": the GPU when its library
// and a device are there and the model fits, else the CPU, with the reason
// in Model.Fallback.
func Open(dir, device string) (*Model, error) { return OpenWith(dir, device, Options{}) }

// Options adjust a model as it is opened.
type Options struct {
	// CPU, if set, runs on the CPU model before it is returned (e.g.
	// actquant.Apply wrapping its layers). Only the CPU backend has one:
	// with CPU set, device "auto" means the CPU and "cuda" is an error.
	CPU func(*llm.Model) error
	// Act, when set, quantizes and dequantizes every decoder linear
	// layer's input (a W8A8-style simulation), on either backend.
	Act *Act
}

// Act is an activation scheme and, for per-tensor schemes, the
// calibrated thresholds (llmq calibrate); SmoothQuant factors in Scales
// are folded on the CPU only.
type Act struct {
	Scheme actquant.Scheme
	Scales *actquant.Scales
	Source string // where Scales came from, for errors (e.g. "--act-scales FILE")
}

// cuda is the scheme as the GPU backend takes it.
func (a *Act) cuda() (*cuda.ActQuant, error) {
	if a.Scales != nil && len(a.Scales.Smooth) > 0 {
		return nil, fmt.Errorf("activation scales with SmoothQuant factors run on the CPU backend only (--device cpu)")
	}
	q := &cuda.ActQuant{Bits: a.Scheme.Bits, FP8: a.Scheme.FP8, PerToken: a.Scheme.PerToken}
	if a.Scales != nil {
		q.Thresholds = map[string]float32{}
		for name, l := range a.Scales.Layers {
			q.Thresholds[name] = l.Threshold
		}
	}
	return q, nil
}

// OpenWith is Open with options.
func OpenWith(dir, device string, opt Options) (*Model, error) {
	if opt.CPU != nil {
		switch device {
		case "auto":
			device = "cpu"
		case "cuda":
			return nil, fmt.Errorf("this option runs on the CPU backend only")
		}
	}
	if device == "auto" {
		m, err := OpenWith(dir, "cuda", opt)
		if err == nil {
			return m, nil
		}
		m, cerr := OpenWith(dir, "cpu", opt)
		if cerr != nil { // not a GPU problem (a bad checkpoint, say)
			return nil, cerr
		}
		m.Fallback = err.Error() + "; running on the CPU"
		return m, nil
	}
	if device != "" && device != "cpu" && device != "cuda" {
		return nil, fmt.Errorf("%w %q: want auto, cpu or cuda", ErrUnknownDevice, device)
	}
	start := time.Now()
	tmpl, err := chat.Load(dir)
	if err != nil && !errors.Is(err, chat.ErrNoTemplate) {
		return nil, err
	}
	if device == "cuda" {
		ck, err := checkpoint.Open(dir)
		if err != nil {
			return nil, err
		}
		defer ck.Close() // the weights are copied to the GPU
		tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
		if err != nil {
			return nil, err
		}
		var lo cuda.LoadOptions
		if opt.Act != nil {
			if lo.Act, err = opt.Act.cuda(); err != nil {
				return nil, err
			}
		}
		b, err := cuda.OpenModelWith(ck, lo)
		if err != nil {
			return nil, err
		}
		return &Model{Dir: dir, Config: ck.Config, Backend: b, Tokenizer: tok, Template: tmpl,
			LoadTime: time.Since(start), close: b.Close}, nil
	}
	m, err := pack.OpenModel(dir)
	if err != nil {
		return nil, err
	}
	if opt.CPU != nil {
		if err := opt.CPU(m.Model); err != nil {
			m.Close()
			return nil, err
		}
	}
	if opt.Act != nil {
		if err := actquant.Apply(m.Model, opt.Act.Scheme, opt.Act.Scales); err != nil {
			m.Close()
			if opt.Act.Source != "" {
				err = fmt.Errorf("%s: %w", opt.Act.Source, err)
			}
			return nil, err
		}
	}
	return &Model{Dir: dir, Config: m.Checkpoint.Config, Backend: m.Model, Tokenizer: m.Tokenizer, Template: tmpl,
		LoadTime: time.Since(start), close: m.Close}, nil
}

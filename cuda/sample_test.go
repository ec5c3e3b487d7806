//go:build cgo

package cuda

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/llmq/llmq/llm"
)

// TestSampleRowsMatchesHost: sample_rows picks, from each row and draw,
// the token llm's sampler picks on the host with the same draw (Draw.Pick)
// — peaked rows like a language model's and flat ones, ties, the
// temperature, top-k and top-p cuts across their range, temperature 0 as
// the argmax, vocabularies of 128,256, 32,003 and 7 — or leaves the row to
// the host (−1), which peaked rows never need under the cuts a server
// uses (top-p or a small top-k).
func TestSampleRowsMatchesHost(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(31, 32))
	draws := []struct {
		llm.Draw
		fits bool // on peaked rows the candidates must fit the kernel
	}{
		{llm.Draw{Temperature: 0.8, TopP: 0.95}, true}, {llm.Draw{Temperature: 1}, false},
		{llm.Draw{Temperature: 0.7, TopK: 40}, true}, {llm.Draw{Temperature: 1.2, TopK: 50, TopP: 0.9}, true},
		{llm.Draw{Temperature: 0.3, TopP: 0.5}, true}, {llm.Draw{Temperature: 2}, false},
		{llm.Draw{Temperature: 1, TopP: 0.01}, true}, {llm.Draw{Temperature: 1, TopK: 1}, true},
		{llm.Draw{Temperature: 0.6, TopK: 3000}, false}, {llm.Draw{}, true}, {llm.Draw{Temperature: 1e-6}, true},
	}
	fallbacks, rows := 0, 0
	for _, V := range []int{128256, 32003, 7} {
		for _, peaked := range []bool{true, false} {
			T := len(draws) * 3
			logits := make([]float32, T*V)
			ds := make([]*llm.Draw, T)
			fits := make([]bool, T)
			for i := range T {
				row := logits[i*V : (i+1)*V]
				if peaked {
					peakedRow(r, row)
				} else {
					for j := range row {
						row[j] = float32(r.Float64()*10 - 5)
					}
				}
				if i%5 == 0 && V > 10 { // ties among the likeliest: the lower id first
					row[V-1], row[V/2], row[3] = 30, 30, 30
				}
				d := draws[i%len(draws)].Draw
				d.U = r.Float64()
				ds[i], fits[i] = &d, draws[i%len(draws)].fits
			}
			ld, pd, od := rowBuffers(t, x, logits, ds, T)
			got := make([]int32, T)
			if err := x.SampleRows(ld, pd, od, T, V); err != nil {
				t.Fatal(err)
			}
			if err := Download(x, got, od); err != nil {
				t.Fatal(err)
			}
			for _, b := range []Buf{ld, pd, od} {
				x.Free(b)
			}
			for i, d := range ds {
				rows++
				want := d.Pick(logits[i*V : (i+1)*V])
				switch {
				case got[i] == -1 && peaked && fits[i]:
					t.Errorf("V %d, peaked row %d %+v: left to the host", V, i, d)
				case got[i] == -1:
					fallbacks++
				case int(got[i]) != want:
					t.Errorf("V %d, peaked %v, row %d %+v: the GPU picked %d, the host %d", V, peaked, i, d, got[i], want)
				}
			}
		}
	}
	t.Logf("%d rows, %d left to the host", rows, fallbacks)
	if fallbacks > rows/4 { // the flat and uncut rows are about a seventh
		t.Errorf("%d of %d rows left to the host", fallbacks, rows)
	}
}

// hostPicks hides the model's Drawer and Greedier methods: Generate then
// copies the logits and samples on the host.
type hostPicks struct{ llm.Backend }

// TestSampledStepsOnDevice: generating with sampling on the GPU, with the
// tokens drawn on the device, gives the tokens the host's sampler picks
// from the GPU's logits (another run: split-K sums may differ in their
// last bits, which could move a draw that falls on a boundary), for
// several seeds and cuts; a drawn step batched with one that wants its
// logits is picked on the host from its row.
func TestSampledStepsOnDevice(t *testing.T) {
	_, gpu := loadBoth(t, "llama-tiny")
	if !llm.IsDrawer(gpu) {
		t.Fatal("the GPU model does not answer drawn steps")
	}
	ctx := context.Background()
	prompt := []int{1, 450, 4955, 310, 278}
	for _, o := range []llm.SampleOptions{{Temperature: 0.8, TopP: 0.95, Seed: 1}, {Temperature: 1.2, TopK: 40, Seed: 2}, {Temperature: 1, Seed: 3}} {
		opt := llm.GenerateOptions{MaxTokens: 24, Sample: o}
		device, err := llm.Generate(ctx, gpu, prompt, opt, nil)
		if err != nil {
			t.Fatal(err)
		}
		host, err := llm.Generate(ctx, hostPicks{gpu}, prompt, opt, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(device, host) {
			t.Errorf("%+v: drawn on the device %v, sampled on the host %v", o, device, host)
		}
	}
	// A batch of a greedy step and two drawn ones, one so hot and uncut
	// that its candidates likely overflow the kernel (picked on the host
	// from its row), against the same batch picked on the host from the
	// logits (another pass: the rounding caveat above).
	hot := llm.Draw{Temperature: 5, U: 0.6}
	warm := llm.Draw{Temperature: 0.8, TopP: 0.95, U: 0.25}
	var ids [2][3]int
	for k, b := range []llm.Backend{gpu, hostPicks{gpu}} {
		steps := make([]llm.Step, 3)
		for i := range steps {
			c, err := gpu.NewCache(16)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			steps[i] = llm.Step{Cache: c, Tokens: prompt, Logits: make([]float32, gpu.Config().Vocab), LastOnly: true}
		}
		steps[0].Greedy, steps[1].Draw, steps[2].Draw = k == 0, &hot, &warm
		if err := b.Forward(ctx, steps); err != nil {
			t.Fatal(err)
		}
		if k == 0 {
			for i := range steps {
				ids[0][i] = steps[i].Argmax
			}
		} else {
			ids[1] = [3]int{llm.Argmax(steps[0].Logits), hot.Pick(steps[1].Logits), warm.Pick(steps[2].Logits)}
		}
	}
	if ids[0] != ids[1] {
		t.Errorf("greedy, hot and warm rows picked on the device %v, on the host %v", ids[0], ids[1])
	}
	// A batch mixing a drawn step with one that wants its logits: the
	// logits come to the host and the drawn step is picked there, from its
	// row, with its draw.
	V := gpu.Config().Vocab
	d := llm.Draw{Temperature: 0.9, TopP: 0.9, U: 0.37}
	batch := make([]llm.Step, 2)
	for i := range batch {
		c, err := gpu.NewCache(16)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		batch[i] = llm.Step{Cache: c, Tokens: prompt, Logits: make([]float32, V), LastOnly: true}
	}
	batch[0].Draw = &d
	if err := gpu.Forward(ctx, batch); err != nil {
		t.Fatal(err)
	}
	if want := d.Pick(batch[0].Logits); batch[0].Argmax != want {
		t.Errorf("drawn step beside a step with logits: %d, its row's pick %d", batch[0].Argmax, want)
	}
}

// BenchmarkSampleRows times sample_rows against argmax_rows on llama3's
// 128,256-token rows, peaked like a language model's, at the batch sizes
// of issue 16 (temperature 0.8, top-p 0.95; a graph of 20 calls).
func BenchmarkSampleRows(b *testing.B) {
	x := openContext(b)
	const V = 128256
	r := rand.New(rand.NewPCG(41, 42))
	for _, B := range []int{1, 8, 32, 64} {
		logits := make([]float32, B*V)
		peakedRow(r, logits)
		ds := make([]*llm.Draw, B)
		for i := range ds {
			ds[i] = &llm.Draw{Temperature: 0.8, TopP: 0.95, U: r.Float64()}
		}
		ld, pd, od := rowBuffers(b, x, logits, ds, B)
		for _, op := range []struct {
			name string
			run  func(int) error
		}{
			{"sample", func(int) error { return x.SampleRows(ld, pd, od, B, V) }},
			{"argmax", func(int) error { return x.ArgmaxRows(ld, od, B, V) }},
		} {
			b.Run(fmt.Sprintf("batch%d/%s", B, op.name), func(b *testing.B) {
				b.ReportMetric(timeGraph(b, x, 20, op.run), "µs/call")
			})
		}
		for _, buf := range []Buf{ld, pd, od} {
			x.Free(buf)
		}
	}
}

// peakedRow fills row like a language model's logits: a normal spread of
// 2.5 with one token in 500 lifted by 10.
func peakedRow(r *rand.Rand, row []float32) {
	for j := range row {
		row[j] = float32(r.NormFloat64() * 2.5)
		if r.IntN(500) == 0 {
			row[j] += 10
		}
	}
}

// rowBuffers uploads T rows of logits and, unless ds is nil, their draws'
// parameters (drawParams), and allocates T int32 picks: the buffers of
// sample_rows and argmax_rows.
func rowBuffers(tb testing.TB, x *Context, logits []float32, ds []*llm.Draw, T int) (ld, pd, od Buf) {
	tb.Helper()
	ld, err := AllocFrom(x, logits)
	if err == nil && ds != nil {
		pd, err = AllocFrom(x, drawParams(ds))
	}
	if err == nil {
		od, err = x.Alloc(T * 4)
	}
	if err != nil {
		tb.Fatal(err)
	}
	return ld, pd, od
}

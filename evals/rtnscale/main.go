// Command rtnscale measures how the precision of RTN's group scales moves
// perplexity, to explain llmq's RTN figures against the reference code's:
// llmq rounds each scale to float16 when it is fitted (what a GPTQ-format
// checkpoint stores), the reference IST-DASLab code keeps float32 scales in
// its fake quantization. It fake-quantizes every decoder linear layer of a
// model with RTN w4 g128 (asymmetric, range holding 0) with the scale kept
// in float32 ("f32"), rounded to float16 ("f16", llmq), or computed in
// bfloat16 arithmetic ("bf16", the reference run on bf16 weights), or
// leaves the model as is ("none"), and prints wikitext-2 perplexity.
// "minmax32" and "minmax16" use AWQ's grid instead (the range is the
// group's min..max, not widened to hold 0), with float32 or float16 scales.
//
//	go run -tags openblas ./evals/rtnscale ../shared/models/llama-tiny f32 0
//
// The last argument limits the windows (0: all 189).
package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"strings"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

func bf16(x float32) float32 { return math.Float32frombits(uint32(checkpoint.ToBF16(x)) << 16) }

// rtn fake-quantizes w [out][in] in place with the chosen scale precision.
func rtn(w []float32, in int, mode string) {
	for o := 0; o < len(w)/in; o++ {
		for g := 0; g < in/128; g++ {
			seg := w[o*in+g*128 : o*in+(g+1)*128]
			var xmin, xmax float32
			if strings.HasPrefix(mode, "minmax") { // AWQ's grid: the range need not hold 0
				xmin, xmax = seg[0], seg[0]
			}
			for _, v := range seg {
				xmin, xmax = min(xmin, v), max(xmax, v)
			}
			if xmin == 0 && xmax == 0 {
				xmin, xmax = -1, 1
			}
			scale := (xmax - xmin) / 15
			switch mode {
			case "f16", "minmax16":
				scale = pack.RoundF16(scale)
			case "bf16":
				scale = bf16(bf16(xmax-xmin) / 15)
			}
			zero := min(max(float32(math.RoundToEven(float64(-xmin/scale))), 0), 15)
			if mode == "bf16" {
				zero = float32(math.RoundToEven(float64(bf16(-xmin / scale))))
			}
			for i, v := range seg {
				d := v / scale
				if mode == "bf16" {
					d = bf16(d)
				}
				q := min(max(float32(math.RoundToEven(float64(d)))+zero, 0), 15)
				r := scale * (q - zero)
				if mode == "bf16" {
					r = bf16(bf16(q-zero) * scale)
				}
				seg[i] = r
			}
		}
	}
}

func main() {
	model, mode := os.Args[1], os.Args[2]
	ck, _ := checkpoint.Open(model)
	m, _ := llm.Load(ck, nil)
	for _, b := range m.Blocks {
		for _, nl := range b.Linears() {
			d := (*nl.L).(*llm.Dense)
			if mode != "none" {
				rtn(d.W, d.In(), mode)
			}
		}
	}
	raw, _ := os.ReadFile("../shared/reference/wikitext2-test.tokens.i32")
	ids := make([]int, len(raw)/4)
	for i := range ids {
		ids[i] = int(int32(uint32(raw[4*i]) | uint32(raw[4*i+1])<<8 | uint32(raw[4*i+2])<<16 | uint32(raw[4*i+3])<<24))
	}
	n := 0
	fmt.Sscan(os.Args[3], &n)
	res, _ := evals.Perplexity(context.Background(), m, ids, evals.PPLOptions{SeqLen: 2048, Windows: n})
	fmt.Printf("%s %s windows=%d ppl=%.4f\n", model, mode, res.Windows, res.Perplexity)
}

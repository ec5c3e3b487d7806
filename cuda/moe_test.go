//go:build cgo

package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
	"github.com/x448/float16"
)

// TestMoERouteMatchesCPU: the route kernel against llm.RouteLogits on
// random router logits — Mixtral's 8 experts top 2, Qwen3-MoE's 128 top 8,
// 256 (the most) top 1, with and without renormalisation — the same
// experts in the same order and the same weights to fp32 rounding; logits
// drawn apart (no near-ties, where the exponentials' last bit could swap
// two experts) except for one row of exact ties (the lower expert first).
func TestMoERouteMatchesCPU(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(5, 6))
	for _, tc := range []struct {
		T, E, k int
		norm    bool
	}{{37, 8, 2, true}, {19, 128, 8, true}, {19, 128, 8, false}, {5, 256, 1, false}, {70, 60, 4, true}} {
		logits := make([]float32, tc.T*tc.E)
		for row := 0; row < tc.T; row++ {
			perm := r.Perm(tc.E) // distinct values 0.05 apart
			for e := range perm {
				logits[row*tc.E+e] = float32(perm[e])*0.05 - 2
			}
		}
		for e := 0; e < tc.E; e++ { // row 0: every logit equal
			logits[e] = 0.5
		}
		lb, err := AllocFrom(x, logits)
		if err != nil {
			t.Fatal(err)
		}
		ib, _ := x.Alloc(tc.T * tc.k * 4)
		wb, _ := x.Alloc(tc.T * tc.k * 4)
		if err := x.MoERoute(lb, ib, wb, tc.T, tc.E, tc.k, tc.norm); err != nil {
			t.Fatal(err)
		}
		ids, w := make([]int32, tc.T*tc.k), make([]float32, tc.T*tc.k)
		if err := Download(x, ids, ib); err != nil {
			t.Fatal(err)
		}
		if err := Download(x, w, wb); err != nil {
			t.Fatal(err)
		}
		want := llm.RouteLogits(logits, tc.T, tc.E, tc.k, tc.norm)
		worst := 0.0
		for i := range ids {
			if int(ids[i]) != want.Expert[i] {
				t.Fatalf("%+v: row %d choice %d: expert %d, want %d", tc, i/tc.k, i%tc.k, ids[i], want.Expert[i])
			}
			worst = max(worst, math.Abs(float64(w[i]-want.Weight[i]))/float64(want.Weight[i]))
		}
		t.Logf("%+v: same experts; weights within %.1e (relative)", tc, worst)
		if worst > 1e-5 {
			t.Errorf("%+v: weights differ by %.1e", tc, worst)
		}
		for _, b := range []Buf{lb, ib, wb} {
			x.Free(b)
		}
	}
	if err := x.MoERoute(Buf{}, Buf{}, Buf{}, 1, 300, 2, false); err == nil {
		t.Error("300 experts: no error")
	}
}

// TestMoEGemvMatchesReference runs the grouped expert GEMV (4-bit and
// fp16 experts, chunks of 1 and 4 slots, inputs shared by a row's k slots
// or one a slot) on random routings against a float64 reference, after
// checking the plan: every slot listed once, expert by expert, in chunks
// of at most mt, the unused chunks empty. On a joined gate/up output it
// then runs the activation, which must leave the fp32 output zeroed.
func TestMoEGemvMatchesReference(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(7, 8))
	for _, c := range []struct {
		T, E, k, N, K, group, mt, aDiv int
		fp16, joined                   bool
	}{
		{T: 1, E: 8, k: 2, N: 128, K: 256, group: 128, mt: 1, aDiv: 2, joined: true},
		{T: 5, E: 16, k: 4, N: 64, K: 128, group: 64, mt: 1, aDiv: 1},
		{T: 37, E: 8, k: 2, N: 256, K: 512, group: 512, mt: 4, aDiv: 2, joined: true},
		{T: 9, E: 128, k: 8, N: 256, K: 2048, group: 32, mt: 1, aDiv: 8, joined: true},
		{T: 1, E: 8, k: 2, N: 64, K: 2048, group: 128, mt: 1, aDiv: 2}, // K split 4 ways on the H200's 132 SMs
		{T: 3, E: 8, k: 2, N: 192, K: 128, mt: 1, aDiv: 2, fp16: true, joined: true},
		{T: 40, E: 8, k: 2, N: 128, K: 96, mt: 4, aDiv: 1, fp16: true},
	} {
		S := c.T * c.k
		ids := randomRouting(r, c.T, c.E, c.k)
		// W[e] in [K][N] order for the reference.
		W := make([][]float32, c.E)
		var w4 *W4
		var w16 Buf
		if c.fp16 {
			bits, vals := randomHalf(r, c.E*c.N*c.K) // [E][N][K]
			for e := range W {
				W[e] = make([]float32, c.K*c.N)
				for n := 0; n < c.N; n++ {
					for k := 0; k < c.K; k++ {
						h := float16.Fromfloat32(vals[(e*c.N+n)*c.K+k] * 0.05)
						W[e][k*c.N+n], bits[(e*c.N+n)*c.K+k] = h.Float32(), h.Bits()
					}
				}
			}
			w16, _ = AllocFrom(x, bits)
		} else {
			W, w4 = randomExperts(t, x, r, c.E, c.N, c.K, c.group)
		}
		p := newPass(t, x, r, ids, c.E, c.mt, c.aDiv, c.K)
		A, avals, idb, order, chunks, maxChunks := p.A, p.avals, p.ids, p.order, p.chunks, p.maxChunks
		out, _ := x.Alloc(S * c.N * 4)
		x.Memset(out, 0, out.Bytes)
		if err := x.MoEGemv(A, c.aDiv, order, chunks, maxChunks, c.mt, S, w4, w16, out, Buf{}, c.N, c.K); err != nil {
			t.Fatal(err)
		}
		ord, ch := make([]int32, S), make([]int32, maxChunks*3)
		if err := errors.Join(Download(x, ord, order), Download(x, ch, chunks)); err != nil {
			t.Fatal(err)
		}
		checkPlan(t, ids, ord, ch, c.E, c.mt)

		got := checkSlots(t, fmt.Sprintf("%+v", c), x, out, avals, W, ids, c.aDiv, c.N, c.K)

		if c.joined { // the activation of gate (first half) and up, from the kernel's own sums
			I := c.N / 2
			g, _ := x.Alloc(S * I * 2)
			if err := x.MoEAct(out, g, S, I, "silu", false); err != nil {
				t.Fatal(err)
			}
			gh := make([]uint16, S*I)
			if err := Download(x, gh, g); err != nil {
				t.Fatal(err)
			}
			for s := 0; s < S; s++ {
				for i := 0; i < I; i++ {
					a, u := roundHalf(got[s*c.N+i]), roundHalf(got[s*c.N+I+i]) // as gated_act's fp16 inputs
					want := a / (1 + math.Exp(-a)) * u
					if v := float64(float16.Frombits(gh[s*I+i]).Float32()); math.Abs(v-want) > 2e-3*math.Abs(want)+1e-5 {
						t.Fatalf("%+v: act slot %d column %d: %v, want %v", c, s, i, v, want)
					}
				}
			}
			if err := Download(x, got, out); err != nil {
				t.Fatal(err)
			}
			for i, v := range got {
				if v != 0 {
					t.Fatalf("%+v: moe_act left %v at %d of the gate/up sums (they must come back zeroed)", c, v, i)
				}
			}
			x.Free(g)
		}
		for _, b := range []Buf{out, A, idb, order, chunks, w16} {
			x.Free(b)
		}
		if w4 != nil {
			w4.Free(x)
		}
	}
}

// randomExperts uploads E random 4-bit experts of N×K (UploadExperts) and
// returns their dequantized weights, each [K][N], for the reference.
func randomExperts(t *testing.T, x *Context, r *rand.Rand, E, N, K, group int) ([][]float32, *W4) {
	t.Helper()
	W := make([][]float32, E)
	gs := make([]*pack.GPUWeights, E)
	for e := range gs {
		var err error
		if gs[e], err = randomLayer(r, K, N, group, 4, false, false).GPULayout(); err != nil {
			t.Fatal(err)
		}
		W[e] = gs[e].Dequantize()
	}
	w4, err := x.UploadExperts(gs)
	if err != nil {
		t.Fatal(err)
	}
	return W, w4
}

// checkSlots downloads an expert GEMV's output out (fp32 [S][N], S =
// len(ids)) and checks it against float64: slot s is A row s/aDiv (avals
// [·][K]) times W[ids[s]] ([K][N]), to a relative Frobenius error of 1e-3.
func checkSlots(t *testing.T, name string, x *Context, out Buf, avals []float32, W [][]float32, ids []int32, aDiv, N, K int) []float32 {
	t.Helper()
	S := len(ids)
	got := make([]float32, S*N)
	if err := Download(x, got, out); err != nil {
		t.Fatal(err)
	}
	var num, den float64
	for s := 0; s < S; s++ {
		ref := reference(avals[(s/aDiv)*K:(s/aDiv+1)*K], W[ids[s]], nil, 1, K, N)
		for j, want := range ref {
			d := float64(got[s*N+j]) - want
			num += d * d
			den += want * want
		}
	}
	rel := math.Sqrt(num / den)
	t.Logf("%s: relative Frobenius error %.2e", name, rel)
	if rel > 1e-3 {
		t.Errorf("%s: relative error %.3g > 1e-3", name, rel)
	}
	return got
}

// TestMoEGemvGatedMatchesReference: experts whose gate and up are
// interleaved (W4.Gated, as the model loads them) write act(gate)·up —
// in the GEMV's epilogue where one K split serves (a decode step's tiles
// filling 132 SMs, or one split planned), else as the sums in K splits
// then MoEAct over the interleaved halves (few tiles and a long K), as
// always with LLMQ_MOE_FUSED_ACT=0 — chunks of 1 and 4 slots, matching
// float64, twice over (a first pass must leave nothing in the way of the
// next), with the fp32 output zero after.
func TestMoEGemvGatedMatchesReference(t *testing.T) {
	onAndOff(t, "LLMQ_MOE_FUSED_ACT", func(t *testing.T, x *Context, _ bool) {
		r := rand.New(rand.NewPCG(15, 16))
		for _, c := range []struct{ T, E, k, I, K, group, mt, aDiv int }{
			{T: 1, E: 8, k: 8, I: 768, K: 2048, group: 128, mt: 1, aDiv: 8},  // qwen3-30b-a3b's decode step: 192 tiles, fused
			{T: 1, E: 8, k: 2, I: 64, K: 4096, group: 128, mt: 1, aDiv: 2},   // 4 tiles: K split, then MoEAct
			{T: 37, E: 8, k: 2, I: 128, K: 2048, group: 128, mt: 4, aDiv: 2}, // chunks of 4, K split
			{T: 37, E: 8, k: 2, I: 128, K: 256, group: 128, mt: 4, aDiv: 2},  // chunks of 4, one split planned: fused
			{T: 9, E: 16, k: 4, I: 64, K: 128, group: 64, mt: 1, aDiv: 4},    // one split planned: fused
		} {
			name := fmt.Sprintf("%+v", c)
			S, N := c.T*c.k, 2*c.I
			ids := randomRouting(r, c.T, c.E, c.k)
			gate, up, w4 := randomGatedExperts(t, x, r, c.E, c.I, c.K, c.group)
			p := newPass(t, x, r, ids, c.E, c.mt, c.aDiv, c.K)
			A, avals, idb, order, chunks, maxChunks := p.A, p.avals, p.ids, p.order, p.chunks, p.maxChunks
			ws, _ := x.Alloc(S * N * 4)
			g, _ := x.Alloc(S * c.I * 2)
			x.Memset(ws, 0, ws.Bytes)
			for range 2 { // twice: the first pass must leave its workspace ready for the second
				x.Memset(g, 0xff, g.Bytes) // poison (fp16 NaN)
				if err := x.MoEGemv(A, c.aDiv, order, chunks, maxChunks, c.mt, S, w4, Buf{}, ws, g, N, c.K); err != nil {
					t.Fatal(err)
				}
				checkGatedSlots(t, name, x, g, avals, gate, up, ids, c.aDiv, c.I, c.K)
				checkZero(t, name, x, ws)
			}
			if err := x.MoEGemv(A, c.aDiv, order, chunks, maxChunks, c.mt, S, w4, Buf{}, ws, Buf{}, N, c.K); err == nil ||
				!strings.Contains(err.Error(), "need an output g") {
				t.Errorf("%s: gated experts without g: %v, want a refusal", name, err)
			}
			for _, b := range []Buf{A, idb, order, chunks, ws, g} {
				x.Free(b)
			}
			w4.Free(x)
		}
	})
}

// expertPass is a grouped GEMV's input on the device: random rows A (avals
// their values, S/aDiv rows of K), the routing ids and its plan (MoEPlan
// with mt; the chunks poisoned first, so the plan must clear the unused
// ones).
type expertPass struct {
	A, ids, order, chunks Buf
	avals                 []float32
	maxChunks             int
}

func newPass(t *testing.T, x *Context, r *rand.Rand, ids []int32, E, mt, aDiv, K int) expertPass {
	t.Helper()
	S := len(ids)
	var p expertPass
	var abits []uint16
	abits, p.avals = randomHalf(r, S/aDiv*K)
	p.A, _ = AllocFrom(x, abits)
	p.ids, _ = AllocFrom(x, ids)
	p.maxChunks = MoEMaxChunks(S, E, mt)
	p.order, _ = x.Alloc(S * 4)
	p.chunks, _ = x.Alloc(p.maxChunks * 3 * 4)
	x.Memset(p.chunks, 0x7f, p.chunks.Bytes)
	if err := x.MoEPlan(p.ids, p.order, p.chunks, S, E, mt, p.maxChunks); err != nil {
		t.Fatal(err)
	}
	return p
}

// randomRouting gives each of T rows k distinct experts of E at random:
// ids [T·k], slot t·k + j row t's j-th.
func randomRouting(r *rand.Rand, T, E, k int) []int32 {
	ids := make([]int32, T*k)
	for row := 0; row < T; row++ {
		for j, e := range r.Perm(E)[:k] {
			ids[row*k+j] = int32(e)
		}
	}
	return ids
}

// onAndOff runs body once with the library's switch name on (1) and once
// off (0), each in a subtest with a context of its own (the library
// reads its switches when a context is made).
func onAndOff(t *testing.T, name string, body func(t *testing.T, x *Context, on bool)) {
	inSettings(t, []string{name + "=1", name + "=0"}, func(t *testing.T, x *Context, setting string) {
		body(t, x, strings.HasSuffix(setting, "=1"))
	})
}

// inSettings runs body once in each setting of the library's switches
// (space-separated NAME=value pairs), each in a subtest with a context of
// its own.
func inSettings(t *testing.T, settings []string, body func(t *testing.T, x *Context, setting string)) {
	for _, setting := range settings {
		t.Run(setting, func(t *testing.T) {
			for _, kv := range strings.Fields(setting) {
				name, v, _ := strings.Cut(kv, "=")
				t.Setenv(name, v)
			}
			body(t, openContext(t), setting)
		})
	}
}

// randomGatedExperts uploads E random 4-bit experts' gate and up (I×K
// each) interleaved as the model loads them (pack.InterleaveGPU,
// W4.Gated SiLU), and returns their dequantized weights, each [K][I].
func randomGatedExperts(t *testing.T, x *Context, r *rand.Rand, E, I, K, group int) (gate, up [][]float32, w *W4) {
	t.Helper()
	gate, up = make([][]float32, E), make([][]float32, E)
	gs := make([]*pack.GPUWeights, E)
	for e := range gs {
		g, err := randomLayer(r, K, I, group, 4, false, false).GPULayout()
		if err != nil {
			t.Fatal(err)
		}
		u, err := randomLayer(r, K, I, group, 4, false, false).GPULayout()
		if err != nil {
			t.Fatal(err)
		}
		gate[e], up[e] = g.Dequantize(), u.Dequantize()
		if gs[e], err = pack.InterleaveGPU(g, u); err != nil {
			t.Fatal(err)
		}
	}
	w, err := x.UploadExperts(gs)
	if err != nil {
		t.Fatal(err)
	}
	w.Gated = GatedSiLU
	return gate, up, w
}

// checkGatedSlots downloads a gated expert GEMV's output g (fp16 [S][I], S =
// len(ids)) and checks it against float64: slot s's SiLU(gate)·up from A
// row s/aDiv, gate and up rounded to fp16 first as the kernels do, to a
// relative Frobenius error of 2e-3. It returns g's values.
func checkGatedSlots(t *testing.T, name string, x *Context, g Buf, avals []float32, gate, up [][]float32, ids []int32, aDiv, I, K int) []float32 {
	t.Helper()
	S := len(ids)
	gh := make([]uint16, S*I)
	if err := Download(x, gh, g); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, S*I)
	var num, den float64
	for s := 0; s < S; s++ {
		a := avals[(s/aDiv)*K : (s/aDiv+1)*K]
		gs, us := reference(a, gate[ids[s]], nil, 1, K, I), reference(a, up[ids[s]], nil, 1, K, I)
		for j := range I {
			gv, uv := roundHalf(float32(gs[j])), roundHalf(float32(us[j]))
			want := gv / (1 + math.Exp(-gv)) * uv
			got[s*I+j] = float16.Frombits(gh[s*I+j]).Float32()
			d := float64(got[s*I+j]) - want
			num += d * d
			den += want * want
		}
	}
	rel := math.Sqrt(num / den)
	t.Logf("%s: act(gate)·up, relative Frobenius error %.2e", name, rel)
	if rel > 2e-3 || math.IsNaN(rel) {
		t.Errorf("%s: act(gate)·up: relative error %.3g > 2e-3", name, rel)
	}
	return got
}

// roundHalf is v rounded to fp16, as float64.
func roundHalf(v float32) float64 { return float64(float16.Fromfloat32(v).Float32()) }

// checkZero: a gated GEMV left its fp32 output zeroed, as the next layer
// needs it.
func checkZero(t *testing.T, name string, x *Context, ws Buf) {
	t.Helper()
	w := make([]float32, ws.Bytes/4)
	if err := Download(x, w, ws); err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(w, func(v float32) bool { return v != 0 }); i >= 0 {
		t.Errorf("%s: the fp32 output holds %v at %d (want it zeroed)", name, w[i], i)
	}
}

// TestMoEGemvRoutedMatchesCPU: the routed expert GEMV (every CTA routes a
// decode step's rows itself) gives llm.RouteLogits' experts and weights,
// a valid plan of exactly S chunks of one slot (an expert's slots in slot
// order when routed in one launch), and each slot's product with its
// expert; a second grouped GEMV over that plan (the down GEMV's place: a
// row per slot, maxChunks S) gives each slot's product too — in one
// launch, again with LLMQ_MOE_ROUTED=0 (route+plan, then the GEMV), and
// with LLMQ_MOE_FUSED_ACT=0 (gated experts' sums, then MoEAct), and with
// the second GEMV's experts asked into L2 after routing and after the
// loop (LLMQ_MOE_PREFETCH=1, 2: only a hint, so the same checks; 3, no
// mode, is refused with the context). Gated experts then run the whole
// mixture in one call (API 28: the second GEMV's output given), the
// second GEMV in the routed launch where LLMQ_MOE_FUSED_DOWN=1 can (its
// gate/up from shared memory, or streamed with LLMQ_MOE_FUSED_STAGE=0; the
// gated cases that write act(gate)·up in one K split: 4 rows,
// qwen3-30b-a3b's widths, and 2 rows whose second GEMV has 36 n-tiles,
// past the 32 a fused CTA keeps in shared memory, and 4 rows whose
// gate/up's K is past what it keeps there), else in its own after:
// act(gate)·up and the second GEMV's output checked against float64
// again; bit for bit the separate second GEMV's where the call must have
// launched that GEMV again, and not where it must have fused it (so a
// silent fallback fails); and at qwen3-30b-a3b's widths (whose down
// GEMV's warps pair steps as the fused one does) within 1e-5 of it, fp32
// reordering. The outputs start poisoned, so a routing or plan left
// unwritten fails.
// Cases: a qwen3-30b-a3b step (1 row of 128 experts, top 8), 4 rows (32
// slots), each also with gated experts (their act(gate)·up the second
// GEMV's input), qwen3-30b-a3b's widths gated (16 experts: its down of
// 2048 columns the second GEMV), 2 rows of 8 experts gated with a second
// GEMV of 2304 columns, 4 rows of 16 experts gated with K 2304, 256
// experts top 16 over 2 rows without renormalisation, a K split, a row of
// NaN logits (the lowest experts, NaN weights, as on the CPU).
func TestMoEGemvRoutedMatchesCPU(t *testing.T) {
	settings := []string{"LLMQ_MOE_ROUTED=1", "LLMQ_MOE_ROUTED=0", "LLMQ_MOE_FUSED_ACT=0", "LLMQ_MOE_PREFETCH=1", "LLMQ_MOE_PREFETCH=2",
		"LLMQ_MOE_FUSED_DOWN=1", "LLMQ_MOE_FUSED_DOWN=1 LLMQ_MOE_FUSED_STAGE=0", "LLMQ_MOE_FUSED_DOWN=1 LLMQ_MOE_FUSED_ACT=0"}
	inSettings(t, settings, func(t *testing.T, x *Context, setting string) {
		// From the environment the setting leaves, which a run may have set
		// beforehand too (cuda/device-model.sh zoo under LLMQ_MOE_FUSED_DOWN=1).
		routed := os.Getenv("LLMQ_MOE_ROUTED") != "0"
		fusedDown := routed && os.Getenv("LLMQ_MOE_FUSED_DOWN") == "1" && os.Getenv("LLMQ_MOE_FUSED_ACT") != "0"
		r := rand.New(rand.NewPCG(13, 14))
		for _, c := range []struct {
			T, E, k, N, K, group int
			nan, raw, gated      bool // raw: the weights not renormalised
			n2, g2               int  // the second GEMV's columns and group (0: 64, 64)
			// fuses: gated in one K split, so LLMQ_MOE_FUSED_DOWN=1 runs the
			// second GEMV in the routed launch; pairs: the separate second
			// GEMV's warps pair its steps as the fused down does, so the two
			// agree to fp32 order (MoEDown).
			fuses, pairs bool
		}{
			{T: 1, E: 128, k: 8, N: 256, K: 2048, group: 128},
			{T: 1, E: 128, k: 8, N: 256, K: 2048, group: 128, gated: true}, // 32 tiles: K split, then MoEAct
			{T: 4, E: 128, k: 8, N: 128, K: 512, group: 64},
			{T: 4, E: 128, k: 8, N: 128, K: 512, group: 64, gated: true, fuses: true},                                   // one split planned
			{T: 1, E: 16, k: 8, N: 1536, K: 2048, group: 128, gated: true, n2: 2048, g2: 128, fuses: true, pairs: true}, // 192 tiles
			{T: 2, E: 8, k: 2, N: 128, K: 512, group: 64, gated: true, n2: 2304, g2: 64, fuses: true},                   // 36 n-tiles of down, 4 past kDownStaged
			{T: 4, E: 16, k: 8, N: 384, K: 2304, group: 128, gated: true, n2: 128, g2: 64, fuses: true},                 // 192 tiles; gate/up's K past FusedStage
			{T: 2, E: 256, k: 16, N: 64, K: 256, group: 256, raw: true},
			{T: 3, E: 8, k: 2, N: 64, K: 2048, group: 128},
			{T: 2, E: 8, k: 3, N: 64, K: 128, group: 32, nan: true},
		} {
			name := fmt.Sprintf("%+v", c)
			S := c.T * c.k
			logits := make([]float32, c.T*c.E)
			for row := 0; row < c.T; row++ {
				for e, p := range r.Perm(c.E) { // distinct values 0.05 apart: no near-ties
					logits[row*c.E+e] = float32(p)*0.05 - 2
					if c.nan && row == 0 {
						logits[e] = float32(math.NaN())
					}
				}
			}
			var W, gate, up [][]float32
			var w4 *W4
			var gated Buf
			if c.gated {
				gate, up, w4 = randomGatedExperts(t, x, r, c.E, c.N/2, c.K, c.group)
				gated, _ = x.Alloc(S * c.N / 2 * 2)
				x.Memset(gated, 0xff, gated.Bytes) // poison (fp16 NaN): every slot's row must be written
			} else {
				W, w4 = randomExperts(t, x, r, c.E, c.N, c.K, c.group)
			}
			abits, avals := randomHalf(r, c.T*c.K)
			A, _ := AllocFrom(x, abits)
			lb, _ := AllocFrom(x, logits)
			// The second GEMV's experts: a row per slot over the plan the
			// first leaves, the routed launch's next layer.
			N2, K2 := cmp.Or(c.n2, 64), c.N
			if c.gated {
				K2 = c.N / 2
			}
			W2, w42 := randomExperts(t, x, r, c.E, N2, K2, cmp.Or(c.g2, 64))
			ib, _ := x.Alloc(S * 4)
			wb, _ := x.Alloc(S * 4)
			ob, _ := x.Alloc(S * 4)
			cb, _ := x.Alloc(MoEMaxChunks(S, c.E, 1) * 3 * 4)
			for _, b := range []Buf{ib, wb, ob, cb} {
				x.Memset(b, 0x7f, b.Bytes) // poison: all of it must be written
			}
			out, _ := x.Alloc(S * c.N * 4)
			x.Memset(out, 0, out.Bytes)
			if err := x.MoEGemvRouted(A, lb, c.T, c.E, c.k, !c.raw, ib, wb, ob, cb, w4, out, gated, c.N, c.K, w42, Buf{}); err != nil {
				t.Fatal(err)
			}
			ids, w, ord, ch := make([]int32, S), make([]float32, S), make([]int32, S), make([]int32, S*3)
			if err := errors.Join(Download(x, ids, ib), Download(x, w, wb), Download(x, ord, ob), Download(x, ch, cb)); err != nil {
				t.Fatal(err)
			}
			want := llm.RouteLogits(logits, c.T, c.E, c.k, !c.raw)
			for i := range ids {
				wi, gi := float64(want.Weight[i]), float64(w[i])
				if int(ids[i]) != want.Expert[i] || math.IsNaN(wi) != math.IsNaN(gi) ||
					!math.IsNaN(wi) && math.Abs(gi-wi) > 1e-5*wi {
					t.Fatalf("%s: slot %d: expert %d weight %v, want %d, %v", name, i, ids[i], w[i], want.Expert[i], want.Weight[i])
				}
			}
			checkPlan(t, ids, ord, ch, c.E, 1)
			if routed { // the routed plan lists an expert's slots in slot order (llmq.h)
				for i := 1; i < S; i++ {
					if ids[ord[i-1]] == ids[ord[i]] && ord[i-1] > ord[i] {
						t.Fatalf("%s: order[%d] = %d after %d, both of expert %d: want slot order", name, i, ord[i], ord[i-1], ids[ord[i]])
					}
				}
			}
			// The down GEMV's place, whose input is the gated output where
			// there is one.
			var A2 Buf
			var a2vals []float32
			if c.gated {
				a2vals = checkGatedSlots(t, name, x, gated, avals, gate, up, ids, c.k, c.N/2, c.K)
				checkZero(t, name, x, out)
				A2 = gated
			} else {
				checkSlots(t, name, x, out, avals, W, ids, c.k, c.N, c.K)
				var a2bits []uint16
				a2bits, a2vals = randomHalf(r, S*K2)
				A2, _ = AllocFrom(x, a2bits)
			}
			out2, _ := x.Alloc(S * N2 * 4)
			x.Memset(out2, 0, out2.Bytes)
			if err := x.MoEGemv(A2, 1, ob, cb, MoEMaxChunks(S, c.E, 1), 1, S, w42, Buf{}, out2, Buf{}, N2, K2); err != nil {
				t.Fatal(err)
			}
			checkSlots(t, name+" then the plan's second GEMV", x, out2, a2vals, W2, ids, 1, N2, K2)
			if c.gated { // the whole mixture in one call: the second GEMV's sums again
				x.Memset(gated, 0xff, gated.Bytes)
				x.Memset(out2, 0, out2.Bytes)
				if err := x.MoEGemvRouted(A, lb, c.T, c.E, c.k, !c.raw, ib, wb, ob, cb, w4, out, gated, c.N, c.K, w42, out2); err != nil {
					t.Fatal(err)
				}
				whole := name + ", the whole mixture in one call"
				checkGatedSlots(t, whole, x, gated, avals, gate, up, ids, c.k, c.N/2, c.K)
				got2 := checkSlots(t, whole, x, out2, a2vals, W2, ids, 1, N2, K2)
				checkZero(t, whole, x, out)
				// The separate second GEMV again, over this call's own
				// act(gate)·up (a K-split gate/up's sums meet in no fixed
				// order, so the first call's g may differ in its last bits).
				sep, err := x.Alloc(S * N2 * 4)
				if err != nil {
					t.Fatal(err)
				}
				x.Memset(sep, 0, sep.Bytes)
				sepv := make([]float32, S*N2)
				if err := errors.Join(x.MoEGemv(gated, 1, ob, cb, MoEMaxChunks(S, c.E, 1), 1, S, w42, Buf{}, sep, Buf{}, N2, K2),
					Download(x, sepv, sep)); err != nil {
					t.Fatal(err)
				}
				x.Free(sep)
				if c.pairs {
					var num, den float64
					for i, v := range sepv {
						d := float64(got2[i]) - float64(v)
						num, den = num+d*d, den+float64(v)*float64(v)
					}
					rel := math.Sqrt(num / den)
					t.Logf("%s: relative Frobenius difference %.2e from the separate second GEMV's", whole, rel)
					if !(rel <= 1e-5) {
						t.Errorf("%s: differs from the separate second GEMV's by %.3g (want ≤ 1e-5)", whole, rel)
					}
				}
				// Which launch ran it: the separate GEMV (one K split in
				// every case here) adds each value once, so a call that
				// launched it again repeats its bits; the fused one adds
				// its gate/up tiles' products in no fixed order
				// (qwen3-30b-a3b's 24), or pairs other steps in half2 than
				// the separate one's warps do, which never repeats them all.
				fused := fusedDown && c.fuses
				if same := slices.Equal(got2, sepv); same == fused {
					t.Errorf("%s: the output's bits repeat the separate GEMV's: %v, want %v (the down fused in the routed launch: %v)", whole, same, !fused, fused)
				}
			}
			for _, b := range []Buf{A, lb, ib, wb, ob, cb, out, A2, out2} {
				x.Free(b)
			}
			w4.Free(x)
			w42.Free(x)
		}
		// What the kernel cannot route is refused, naming the limits (the
		// library's check: the codes' size passes Go's), and experts that
		// are not E of UploadExperts' are refused before the library.
		big := &W4{N: 64, K: 128, Group: 128, B: Buf{Bytes: 128 * 64 * 128 / 2}}
		y, err := x.Alloc(8 * 128 * 4) // an output for the next layer: never written, every call below fails first
		if err != nil {
			t.Fatal(err)
		}
		defer x.Free(y)
		for _, bad := range []struct {
			T, E, k int
			w, next *W4
			nextOut bool
			want    string
		}{
			{T: 1, E: 128, k: 8, w: big, nextOut: true, want: "needs gated experts and their next layer"},
			{T: 1, E: 128, k: 8, w: big, next: &W4{N: 128, K: 64, Group: 64, B: big.B}, nextOut: true, want: "needs gated experts"},
			{T: 1, E: 128, k: 8, w: big, next: &W4{N: 128, K: 64, Group: 64, B: Buf{Bytes: 64 * 128 / 2}}, want: "next layer's codes hold fewer than 128"},
			{T: 1, E: 128, k: 8, w: big, next: &W4{N: 128, K: 64, Group: 64, Bits: 8}, want: "next layer's experts must be"},
			{T: 1, E: 128, k: 8, w: &W4{N: 64, K: 128, Group: 128, B: big.B, Gated: GatedSiLU}, next: &W4{N: 128, K: 64, Group: 64}, nextOut: true,
				want: "next layer's experts of 128×64 run as 128×32"}, // it reads g, 32 wide
			{T: 5, E: 128, k: 8, w: big, want: "rows·top ≤ 32"}, {T: 1, E: 128, k: 0, w: big, want: "rows·top ≤ 32"},
			{T: 1, E: 128, k: 8, want: "no experts"}, {T: 1, E: 128, k: 8, w: &W4{N: 64, K: 128, Group: 128, Bits: 8}, want: "4-bit"},
			{T: 1, E: 128, k: 8, w: &W4{N: 64, K: 128, Group: 128, B: Buf{Bytes: 64 * 128 / 2}}, want: "fewer than 128 experts"},
			{T: 1, E: 128, k: 8, w: &W4{N: 64, K: 128, Group: 128, B: big.B, Gated: GatedSiLU}, want: "need an output g"},
		} {
			var nextOut Buf
			if bad.nextOut {
				nextOut = y
			}
			err := x.MoEGemvRouted(Buf{}, Buf{}, bad.T, bad.E, bad.k, true, Buf{}, Buf{}, Buf{}, Buf{}, bad.w, Buf{}, Buf{}, 64, 128, bad.next, nextOut)
			if err == nil || !strings.Contains(err.Error(), bad.want) {
				t.Errorf("%d rows of %d experts, top %d: %v; want an error naming %q", bad.T, bad.E, bad.k, err, bad.want)
			}
		}
	})
	// A prefetch mode the kernel does not have is refused with the context.
	t.Setenv("LLMQ_MOE_PREFETCH", "3")
	if x, err := openLib(t).NewContext(); err == nil || !strings.Contains(err.Error(), "LLMQ_MOE_PREFETCH=3") {
		if err == nil {
			x.Close()
		}
		t.Errorf("a context with LLMQ_MOE_PREFETCH=3: %v; want an error naming it", err)
	}
}

// TestMoERoutePlanMatchesCPU: the fused route and plan (one launch) gives
// llm.RouteLogits' experts and weights and a valid plan of them.
func TestMoERoutePlanMatchesCPU(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(11, 12))
	for _, tc := range []struct{ T, E, k, mt int }{{1, 128, 8, 1}, {8, 128, 8, 1}, {300, 8, 2, 4}, {64, 128, 8, 4}, {40, 256, 16, 4}} {
		logits := make([]float32, tc.T*tc.E)
		for row := 0; row < tc.T; row++ {
			for e, p := range r.Perm(tc.E) { // distinct values 0.05 apart: no near-ties
				logits[row*tc.E+e] = float32(p)*0.05 - 2
			}
		}
		S, maxChunks := tc.T*tc.k, MoEMaxChunks(tc.T*tc.k, tc.E, tc.mt)
		lb, _ := AllocFrom(x, logits)
		ib, _ := x.Alloc(S * 4)
		wb, _ := x.Alloc(S * 4)
		ob, _ := x.Alloc(S * 4)
		cb, _ := x.Alloc(maxChunks * 3 * 4)
		if err := x.MoERoutePlan(lb, ib, wb, tc.T, tc.E, tc.k, true, tc.mt, ob, cb, maxChunks); err != nil {
			t.Fatal(err)
		}
		ids, w, ord, ch := make([]int32, S), make([]float32, S), make([]int32, S), make([]int32, maxChunks*3)
		if err := errors.Join(Download(x, ids, ib), Download(x, w, wb), Download(x, ord, ob), Download(x, ch, cb)); err != nil {
			t.Fatal(err)
		}
		want := llm.RouteLogits(logits, tc.T, tc.E, tc.k, true)
		for i := range ids {
			if int(ids[i]) != want.Expert[i] || math.Abs(float64(w[i]-want.Weight[i])) > 1e-5*float64(want.Weight[i]) {
				t.Fatalf("%+v: slot %d: expert %d weight %v, want %d, %v", tc, i, ids[i], w[i], want.Expert[i], want.Weight[i])
			}
		}
		checkPlan(t, ids, ord, ch, tc.E, tc.mt)
		for _, b := range []Buf{lb, ib, wb, ob, cb} {
			x.Free(b)
		}
	}
	// A row of NaN logits (an overflow upstream) routes, as on the CPU, to
	// the lowest experts with NaN weights, and the plan stays in bounds.
	const T, E, k = 2, 8, 3
	logits := make([]float32, T*E)
	for e := range E {
		logits[e], logits[E+e] = float32(math.NaN()), float32(e)
	}
	maxChunks := MoEMaxChunks(T*k, E, 1)
	lb, _ := AllocFrom(x, logits)
	ib, _ := x.Alloc(T * k * 4)
	wb, _ := x.Alloc(T * k * 4)
	ob, _ := x.Alloc(T * k * 4)
	cb, _ := x.Alloc(maxChunks * 3 * 4)
	if err := x.MoERoutePlan(lb, ib, wb, T, E, k, true, 1, ob, cb, maxChunks); err != nil {
		t.Fatal(err)
	}
	ids, w, ord, ch := make([]int32, T*k), make([]float32, T*k), make([]int32, T*k), make([]int32, maxChunks*3)
	if err := errors.Join(Download(x, ids, ib), Download(x, w, wb), Download(x, ord, ob), Download(x, ch, cb)); err != nil {
		t.Fatal(err)
	}
	want := llm.RouteLogits(logits, T, E, k, true)
	for i := range ids {
		if int(ids[i]) != want.Expert[i] || math.IsNaN(float64(w[i])) != math.IsNaN(float64(want.Weight[i])) {
			t.Errorf("NaN row test, slot %d: expert %d weight %v, want %d, %v", i, ids[i], w[i], want.Expert[i], want.Weight[i])
		}
	}
	checkPlan(t, ids, ord, ch, E, 1)
	for _, b := range []Buf{lb, ib, wb, ob, cb} {
		x.Free(b)
	}
}

// checkPlan checks a plan of slots ids: order lists each slot once,
// grouped by expert in ascending order; the chunks, in order, cover it
// with at most mt slots of one expert each, then are empty.
func checkPlan(t *testing.T, ids, order, chunks []int32, E, mt int) {
	t.Helper()
	seen := make([]bool, len(ids))
	for i, s := range order {
		if s < 0 || int(s) >= len(ids) || seen[s] {
			t.Fatalf("order[%d] = %d: not a slot, or listed twice", i, s)
		}
		seen[s] = true
		if i > 0 && ids[order[i-1]] > ids[s] {
			t.Fatalf("order[%d]: expert %d after expert %d", i, ids[s], ids[order[i-1]])
		}
	}
	at := 0
	for c := 0; c < len(chunks)/3; c++ {
		e, start, n := chunks[3*c], int(chunks[3*c+1]), int(chunks[3*c+2])
		if at == len(ids) {
			if n != 0 {
				t.Fatalf("chunk %d after the last slot has %d slots", c, n)
			}
			continue
		}
		if start != at || n < 1 || n > mt {
			t.Fatalf("chunk %d: start %d, %d slots; want start %d and 1 to %d slots", c, start, n, at, mt)
		}
		for _, s := range order[start : start+n] {
			if ids[s] != e {
				t.Fatalf("chunk %d of expert %d holds slot %d of expert %d", c, e, s, ids[s])
			}
		}
		at += n
	}
	if at != len(ids) {
		t.Fatalf("the chunks cover %d of %d slots", at, len(ids))
	}
}

// TestMoERouterAndCombine: the router's logits (fp16 rows by an fp32
// router) against float64, and the combine (each row's k expert outputs,
// weighted, added in ascending expert order) against the CPU's float32
// sums in that order; the combine zeroes the outputs it read.
func TestMoERouterAndCombine(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(9, 10))
	const T, E, H, k = 7, 12, 96, 3
	hb, hv := randomHalf(r, T*H)
	Wr := make([]float32, E*H)
	for i := range Wr {
		Wr[i] = float32(r.NormFloat64() * 0.1)
	}
	hd, _ := AllocFrom(x, hb)
	wd, _ := AllocFrom(x, Wr)
	ld, _ := x.Alloc(T * E * 4)
	if err := x.MoERouter(hd, wd, ld, T, E, H); err != nil {
		t.Fatal(err)
	}
	logits := make([]float32, T*E)
	Download(x, logits, ld)
	worst := 0.0
	for i := range logits {
		var ref, mag float64
		for j := 0; j < H; j++ {
			p := float64(hv[i/E*H+j]) * float64(Wr[i%E*H+j])
			ref, mag = ref+p, mag+math.Abs(p)
		}
		worst = max(worst, math.Abs(float64(logits[i])-ref)/mag)
	}
	t.Logf("router logits within %.1e of float64 (relative to Σ|products|)", worst)
	if worst > 1e-5 {
		t.Errorf("router logits off by %.1e", worst)
	}

	ids, wts := make([]int32, T*k), make([]float32, T*k)
	for row := 0; row < T; row++ {
		for j, e := range r.Perm(E)[:k] {
			ids[row*k+j], wts[row*k+j] = int32(e), float32(r.Float64())
		}
	}
	_, yv := randomHalf(r, T*k*H)
	// Row 0, column 0 tells the order of the additions: experts 5, 1, 3 in
	// slot order carry −2²⁴, 2²⁴, 1 (weights 1); in expert order the sum is
	// 2²⁴ + 1 = 2²⁴ (fp32), − 2²⁴ = 0; in slot order it would be 1.
	copy(ids, []int32{5, 1, 3})
	copy(wts, []float32{1, 1, 1})
	yv[0], yv[H], yv[2*H] = -(1 << 24), 1<<24, 1
	yd, _ := AllocFrom(x, yv)
	idd, _ := AllocFrom(x, ids)
	wtd, _ := AllocFrom(x, wts)
	// The combine is the next norm's: x (zero here) += each row's sum.
	ones := make([]float32, H)
	for i := range ones {
		ones[i] = 1
	}
	xd, _ := x.Alloc(T * H * 4)
	nd, _ := AllocFrom(x, ones)
	od, _ := x.Alloc(T * H * 2)
	if err := x.Memset(xd, 0, T*H*4); err != nil {
		t.Fatal(err)
	}
	if err := x.RMSNormExperts(xd, Buf{}, Buf{}, ExpertSum{Y: yd, IDs: idd, Weights: wtd, K: k}, Buf{}, Buf{}, nd, od, T, H, 1e-6); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, T*H)
	left := make([]float32, T*k*H)
	if err := errors.Join(Download(x, got, xd), Download(x, left, yd)); err != nil {
		t.Fatal(err)
	}
	if got[0] != 0 {
		t.Errorf("row 0 column 0: %v, want 0 (the experts' outputs added in ascending expert order)", got[0])
	}
	if i := slices.IndexFunc(left, func(v float32) bool { return v != 0 }); i >= 0 {
		t.Fatalf("the experts' sum left %v at %d of the expert outputs (they must come back zeroed)", left[i], i)
	}
	for row := 0; row < T; row++ {
		js := []int{0, 1, 2}
		slices.SortFunc(js, func(a, b int) int { return int(ids[row*k+a] - ids[row*k+b]) })
		for c := 0; c < H; c++ {
			var want float32
			for _, j := range js {
				want += yv[(row*k+j)*H+c] * wts[row*k+j]
			}
			if g := got[row*H+c]; math.Abs(float64(g-want)) > 1e-6*math.Abs(float64(want))+1e-6 {
				t.Fatalf("row %d column %d: %v, want %v", row, c, g, want)
			}
		}
	}
	for _, b := range []Buf{hd, wd, ld, yd, idd, wtd, xd, nd, od} {
		x.Free(b)
	}
}

//go:build cgo

package cuda

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/llmq/llmq/pack"
)

// timeGraph is Context.TimeGraph for a benchmark: reps calls of op in a
// graph, one warm-up replay, then b.N timed ones; it returns the mean
// microseconds a call took on the GPU.
func timeGraph(b *testing.B, x *Context, reps int, op func(i int) error) float64 {
	b.Helper()
	b.ResetTimer()
	times, err := x.TimeGraph(reps, op, 1, b.N)
	if err != nil {
		b.Fatal(err)
	}
	var ms float64
	for _, t := range times {
		ms += t
	}
	return ms * 1e3 / float64(len(times))
}

// decodeOp is one kernel call of a decode layer (BenchmarkDecodeOps): run
// makes call i, bytes is the weights it reads (for GB/s; 0 for none).
type decodeOp struct {
	name  string
	bytes int64
	run   func(i int) error
}

// decodeShape is one decoder layer's dimensions: dense when experts is 0,
// else a mixture of experts of inter each, top k.
type decodeShape struct {
	name                              string
	hidden, heads, kvHeads, hd, vocab int
	inter, experts, topK              int
}

// BenchmarkDecodeOps times each kernel of a decode step's layer on its
// own — the residual add and norm, q/k/v, RoPE and the cache store,
// attention over 2048 keys, o, the MLP or the mixture's router, routing,
// experts, activation and the experts' sum joined to the next norm, the
// lm_head and the greedy argmax — each replayed in a graph of many calls with
// its weights rotating through copies (or, for the experts, random
// routings over all 128) so that they come from memory, not L2; for
// llama3-8b's dense layer and qwen3-30b-a3b's sparse one, at batch 1 and
// 8. It answers where a decode step's time goes: the sum over a layer's
// kernels against the measured step (decode-h200-*.json).
//
//	cuda.test -test.run '^$' -test.bench DecodeOps -test.benchtime 10x
func BenchmarkDecodeOps(b *testing.B) {
	x := openContext(b)
	r := rand.New(rand.NewPCG(3, 4))
	const ctx, reps = 2048, 64
	for _, sh := range []decodeShape{
		{name: "llama3-8b", hidden: 4096, heads: 32, kvHeads: 8, hd: 128, vocab: 128256, inter: 14336},
		{name: "qwen3-30b-a3b", hidden: 2048, heads: 32, kvHeads: 4, hd: 128, vocab: 151936, inter: 768, experts: 128, topK: 8},
	} {
		var bufs []Buf
		var w4s []*W4
		alloc := func(n int) Buf {
			buf, err := x.Alloc(n)
			if err == nil {
				err = x.Memset(buf, 0, n)
			}
			if err != nil {
				b.Fatal(err)
			}
			bufs = append(bufs, buf)
			return buf
		}
		// copies uploads a random 4-bit layer often enough that the copies
		// together exceed L2 several times.
		copies := func(K, N int) []*W4 {
			g, err := randomLayer(r, K, N, 128, 4, false, false).GPULayout()
			if err != nil {
				b.Fatal(err)
			}
			n := max(2, (256<<20)/(K*N/2))
			ws := make([]*W4, n)
			for i := range ws {
				if ws[i], err = x.UploadW4(g); err != nil {
					b.Fatal(err)
				}
			}
			w4s = append(w4s, ws...)
			return ws
		}
		H, qd, kvd := sh.hidden, sh.heads*sh.hd, sh.kvHeads*sh.hd
		qkv, o := copies(H, qd+2*kvd), copies(qd, H)
		var gateUp, down []*W4
		var experts [2]*W4 // gate+up, down: all experts, one random layer each uploaded E times
		var router Buf
		if sh.experts == 0 {
			gateUp, down = copies(H, 2*sh.inter), copies(sh.inter, H)
		} else {
			for i, kn := range [][2]int{{H, 2 * sh.inter}, {sh.inter, H}} {
				g, err := randomLayer(r, kn[0], kn[1], 128, 4, false, false).GPULayout()
				if err != nil {
					b.Fatal(err)
				}
				gs := make([]*pack.GPUWeights, sh.experts)
				for e := range gs {
					gs[e] = g
				}
				if experts[i], err = x.UploadExperts(gs); err != nil {
					b.Fatal(err)
				}
				w4s = append(w4s, experts[i])
			}
			router = alloc(sh.experts * H * 4)
		}
		lmHead := alloc(sh.vocab * H * 2)
		// The cache: each sequence's layers, enough of them to pass 128 MiB.
		layerBytes := 2 * ctx * kvd * 2
		layers := max(1, (128<<20)/layerBytes)
		for _, B := range []int{1, 8} {
			b.Run(fmt.Sprintf("%s/batch%d", sh.name, B), func(b *testing.B) {
				seqs, pos, caps, bases := make([]int32, B), make([]int32, B), make([]int32, B), make([]uint64, B)
				for s := range seqs {
					seqs[s], pos[s], caps[s], bases[s] = int32(s), ctx-1, ctx, alloc(layers*layerBytes).Ptr()
				}
				var m RowMeta
				var err error
				for _, u := range []struct {
					dst *Buf
					src []int32
				}{{&m.RowSeq, seqs}, {&m.RowPos, pos}, {&m.KVCap, caps}} {
					if *u.dst, err = AllocFrom(x, u.src); err != nil {
						b.Fatal(err)
					}
					bufs = append(bufs, *u.dst)
				}
				if m.KVBase, err = AllocFrom(x, bases); err != nil {
					b.Fatal(err)
				}
				bufs = append(bufs, m.KVBase)
				xs, h, q, k, v, att, delta := alloc(B*H*4), alloc(B*H*2), alloc(B*qd*2), alloc(B*kvd*2), alloc(B*kvd*2), alloc(B*qd*2), alloc(B*H*2)
				norm, cos, sin := alloc(H*4), alloc(ctx*sh.hd/2*4), alloc(ctx*sh.hd/2*4)
				attnWS := alloc(x.Lib().AttentionWorkspaceBytes(B, sh.heads, sh.hd, ctx))
				gemmWS := alloc(x.Lib().WorkspaceBytes(B, max(qd+2*kvd, 2*sh.inter, H)))
				logits := alloc(B * sh.vocab * 4)
				w4 := func(in Buf, ws []*W4, cols []int, gated Gating, outs ...Buf) func(int) error {
					return func(i int) error {
						w := ws[i%len(ws)]
						w.Cols, w.Gated = cols, gated
						return x.GemmW4Into(in, outs, w, B, gemmWS, Buf{}, Buf{})
					}
				}
				ops := []decodeOp{
					{"add+rmsnorm", 0, func(int) error { return x.RMSNorm(xs, delta, Buf{}, Buf{}, norm, h, B, H, 1e-6) }},
					{"qkv", qkv[0].Bytes(), w4(h, qkv, []int{qd, kvd, kvd}, NotGated, q, k, v)},
					{"rope+store", 0, func(i int) error {
						return x.QKRoPEStore(q, k, v, Buf{}, Buf{}, Buf{}, 1e-6, m, cos, sin, i%layers, layers, B, sh.heads, sh.kvHeads, sh.hd, true)
					}},
					{"attention", 0, func(i int) error {
						return x.Attention(q, att, attnWS, m, i%layers, layers, B, sh.heads, sh.kvHeads, sh.hd, ctx, AttnOptions{})
					}},
					{"o", o[0].Bytes(), w4(att, o, nil, NotGated, delta)},
				}
				if sh.experts == 0 {
					g, u := alloc(B*sh.inter*2), alloc(B*sh.inter*2)
					ops = append(ops,
						decodeOp{"gate+up", gateUp[0].Bytes(), w4(h, gateUp, []int{sh.inter, sh.inter}, NotGated, g, u)},
						decodeOp{"act", 0, func(int) error { return x.GatedAct(g, u, B*sh.inter, "silu") }},
						// The two above as one: SiLU(gate)·up in the GEMM's epilogue (W4.Gated).
						decodeOp{"gate+up·act", gateUp[0].Bytes(), w4(h, gateUp, nil, GatedSiLU, g)},
						decodeOp{"down", down[0].Bytes(), w4(g, down, nil, NotGated, delta)})
				} else {
					E, kk, I := sh.experts, sh.topK, sh.inter
					S := B * kk
					mt := moeChunk(S, E)
					chunks := MoEMaxChunks(S, E, mt)
					rl, ids, wts := alloc(B*E*4), alloc(S*4), alloc(S*4)
					order, chunk := alloc(S*4), alloc(chunks*3*4)
					gu, g, y := alloc(S*2*I*4), alloc(S*I*2), alloc(S*H*4)
					sums := alloc(B * H * 4) // o's fp32 sums (their values do not change the time)
					// Random routings, planned before the capture: the
					// expert kernels read 8 random experts of 128 a row.
					const plans = 16
					pIDs, pOrder, pChunks := make([]Buf, plans), make([]Buf, plans), make([]Buf, plans)
					for p := range plans {
						idv := make([]int32, S)
						for t := 0; t < B; t++ {
							for j, e := range r.Perm(E)[:kk] {
								idv[t*kk+j] = int32(e)
							}
						}
						if pIDs[p], err = AllocFrom(x, idv); err != nil {
							b.Fatal(err)
						}
						bufs = append(bufs, pIDs[p])
						pOrder[p], pChunks[p] = alloc(S*4), alloc(chunks*3*4)
						if err := x.MoEPlan(pIDs[p], pOrder[p], pChunks[p], S, E, mt, chunks); err != nil {
							b.Fatal(err)
						}
					}
					// A step reads each chosen expert's weights once; at
					// batch 8 some are shared, so this overstates GB/s there.
					expertBytes := func(w *W4) int64 { return w.Bytes() / int64(E) * int64(min(S, E)) }
					// The same codes read as gated experts (gate and up
					// interleaved: the layout the model loads; the values do
					// not change the time).
					gatedUp := *experts[0]
					gatedUp.Gated = GatedSiLU
					ops = append(ops,
						decodeOp{"router", int64(E * H * 4), func(int) error { return x.MoERouter(h, router, rl, B, E, H) }},
						// The norm before the experts and the router above as one launch.
						decodeOp{"add+rmsnorm+router", int64(E * H * 4), func(int) error {
							return x.RMSNormRouter(xs, delta, Buf{}, norm, h, router, rl, B, H, E, 1e-6)
						}},
						// The same with o's fp32 sums as the delta (moeSums).
						decodeOp{"sums+rmsnorm+router", int64(E * H * 4), func(int) error {
							return x.RMSNormRouter(xs, Buf{}, sums, norm, h, router, rl, B, H, E, 1e-6)
						}},
						decodeOp{"route+plan", 0, func(int) error {
							return x.MoERoutePlan(rl, ids, wts, B, E, kk, true, mt, order, chunk, chunks)
						}},
						decodeOp{"experts gate+up", expertBytes(experts[0]), func(i int) error {
							return x.MoEGemv(h, kk, pOrder[i%plans], pChunks[i%plans], chunks, mt, S, experts[0], Buf{}, gu, Buf{}, 2*I, H)
						}},
						decodeOp{"experts act", 0, func(int) error { return x.MoEAct(gu, g, S, I, "silu", false) }},
						// The two above as one: the gated experts write act(gate)·up.
						decodeOp{"experts gate+up·act", expertBytes(experts[0]), func(i int) error {
							return x.MoEGemv(h, kk, pOrder[i%plans], pChunks[i%plans], chunks, mt, S, &gatedUp, Buf{}, gu, g, 2*I, H)
						}},
						decodeOp{"experts down", expertBytes(experts[1]), func(i int) error {
							return x.MoEGemv(g, 1, pOrder[i%plans], pChunks[i%plans], chunks, mt, S, experts[1], Buf{}, y, Buf{}, H, I)
						}},
						decodeOp{"combine+rmsnorm", 0, func(i int) error {
							return x.RMSNormExperts(xs, Buf{}, Buf{}, ExpertSum{Y: y, IDs: pIDs[i%plans], Weights: wts, K: kk}, Buf{}, Buf{}, norm, h, B, H, 1e-6)
						}},
						// The combine after o's sums (moeSums): (x + sums) + experts.
						decodeOp{"sums+combine+rmsnorm", 0, func(i int) error {
							return x.RMSNormExperts(xs, Buf{}, sums, ExpertSum{Y: y, IDs: pIDs[i%plans], Weights: wts, K: kk}, Buf{}, Buf{}, norm, h, B, H, 1e-6)
						}},
						// The combine with one slot a row: against add+rmsnorm, what
						// reading a row's ids and weights and ordering its slots
						// costs; against combine+rmsnorm, the other seven rows.
						decodeOp{"combine1+rmsnorm", 0, func(i int) error {
							return x.RMSNormExperts(xs, Buf{}, Buf{}, ExpertSum{Y: y, IDs: pIDs[i%plans], Weights: wts, K: 1}, Buf{}, Buf{}, norm, h, B, H, 1e-6)
						}})
				}
				next := alloc(B * 4)
				ops = append(ops, decodeOp{"lm_head", int64(sh.vocab * H * 2), func(int) error { return x.GemmNT(h, lmHead, logits, B, sh.vocab, H, true) }},
					decodeOp{"argmax", 0, func(int) error { return x.ArgmaxRows(logits, next, B, sh.vocab) }})
				for _, o := range ops {
					b.Run(o.name, func(b *testing.B) {
						us := timeGraph(b, x, reps, o.run)
						b.ReportMetric(us, "µs/call")
						if o.bytes > 0 {
							b.ReportMetric(float64(o.bytes)/(us*1e-6)/1e9, "GB/s")
						}
					})
				}
			})
		}
		for _, w := range w4s {
			w.Free(x)
		}
		for _, buf := range bufs {
			x.Free(buf)
		}
	}
}

//go:build cgo

package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/x448/float16"
)

// TestAttentionDecodeMatchesReference runs the cache attention kernels on
// random caches and queries and compares with softmax attention in
// float64: decode batches (rows of different sequences and positions,
// some past a 64-key chunk, some past 2000 keys) through
// attention_decode_kernel — GQA groups of 1, 2, 4, 8 and 6 query heads a
// key head (a block takes 4, 2 or 1 of them), head dims 48, 64, 128 and
// 256 (two 16-byte slices a lane), a sliding window, a score scale,
// queries 40× larger (scores past e^88, float32's largest exponential:
// the softmax must subtract its max) and 24 rows of one sequence (a short prefill into a filled cache)
// — head_dim 36 (not a multiple of 8: attention_kernel decodes it), and a
// prefill-sized pass (attention_kernel, one head a block). Every case runs
// twice: on contiguous caches, then on caches drawn the same way but paged
// (blocks of 16 positions in shuffled order through block tables, what
// cuda.Cache uses). The workspace starts as huge values, so a chunk
// record left unwritten fails the test. All of it runs with
// LLMQ_ATTN_EARLY on and off (the decode kernel's lookups and L2 requests,
// and its combine's, before their PDL gates, or after): each against the
// reference, and the two the same bits (where a value is read changes no
// arithmetic; the L2 requests are hints). Here the kernels follow host
// copies, so nothing runs beside their early reads; the chain they
// guard (the cache store just before the attention under PDL) is the
// model tests' (TestJoinedLinearsMatchSeparate, the zoo's logits against
// the CPU). attention_combine reads only each
// row's own records (rows at random positions below the key bound leave
// empty records after theirs; the windowed cases, before). A third
// setting shrinks the decode grid's target to 8 blocks (LLMQ_DECODE_WAVE),
// so that rows take several sub-chunks a block and the grid fewer chunks
// than the key bound's (min_spans > 1): the combine's chunk arithmetic
// beyond 64 keys, windows included (a bound too narrow drops keys and
// fails the reference); its chunks round differently, so it is held to
// the reference only.
func TestAttentionDecodeMatchesReference(t *testing.T) {
	first := map[string][]uint16{} // the first setting's outputs by case
	settings := []string{"LLMQ_ATTN_EARLY=1", "LLMQ_ATTN_EARLY=0", "LLMQ_DECODE_WAVE=8"}
	inSettings(t, settings, func(t *testing.T, x *Context, setting string) {
		first := first
		if strings.Contains(setting, "LLMQ_DECODE_WAVE") {
			first = map[string][]uint16{} // other chunks: other rounding
		}
		testAttentionDecode(t, x, first)
	})
}

func testAttentionDecode(t *testing.T, x *Context, first map[string][]uint16) {
	r := rand.New(rand.NewPCG(21, 22))
	for ci, tc := range []struct {
		rows, heads, kvHeads, hd, window int
		scale                            float32
		maxPos                           int     // positions drawn from 0..maxPos−1 (200 when 0)
		qScale                           float32 // queries times this (1 when 0): scores far from 0
		oneSeq                           bool    // every row in one sequence, at consecutive positions
	}{
		{3, 8, 8, 64, 0, 0, 0, 0, false}, {4, 8, 4, 128, 0, 0, 0, 0, false}, {2, 16, 4, 64, 0, 0, 0, 0, false},
		{5, 32, 4, 128, 0, 0, 0, 0, false}, {3, 12, 2, 48, 0, 0, 0, 0, false}, {4, 8, 1, 64, 50, 0, 0, 0, false},
		{2, 16, 2, 128, 0, 0.05, 0, 0, false}, {70, 4, 2, 64, 0, 0, 0, 0, false}, {3, 8, 2, 128, 0, 0, 2500, 0, false},
		{2, 8, 4, 256, 0, 0, 0, 0, false}, {2, 4, 4, 256, 300, 0, 700, 0, false}, {3, 8, 2, 36, 0, 0, 0, 0, false},
		{4, 8, 2, 64, 0, 0, 0, 40, false}, {24, 8, 2, 128, 0, 0, 300, 0, true}, {5, 16, 2, 128, 0, 0, 0, 0, false},
	} {
		for _, paged := range []bool{false, true} {
			const layers, layer = 2, 1
			seqs := tc.rows
			if tc.oneSeq {
				seqs = 1
			}
			caps := make([]int32, seqs)
			pos := make([]int32, tc.rows)
			seqOf := make([]int32, tc.rows)
			maxKeys := 0
			start := int32(r.IntN(cmp.Or(tc.maxPos, 200)))
			for i := range pos {
				if tc.oneSeq { // a short prefill into a cache that holds start keys
					pos[i] = start + int32(i)
					caps[0] = pos[i] + 1 + int32(r.IntN(8))
				} else {
					seqOf[i] = int32(i)
					pos[i] = int32(r.IntN(cmp.Or(tc.maxPos, 200)))
					caps[i] = pos[i] + 1 + int32(r.IntN(8))
				}
				maxKeys = max(maxKeys, int(pos[i])+1)
			}
			kvd, qd := tc.kvHeads*tc.hd, tc.heads*tc.hd
			gen := func(n int) []float32 {
				v := make([]float32, n)
				for i := range v {
					v[i] = float32(r.NormFloat64())
				}
				return fromF16(toF16(v)) // the values the GPU sees
			}
			// Each sequence's cache: [2][layers][cap][kv_dim] fp16.
			caches := make([][]float32, seqs)
			bases := make([]uint64, seqs)
			var bufs []Buf
			for s := range caches {
				caches[s] = gen(2 * layers * int(caps[s]) * kvd)
				b, err := AllocFrom(x, toF16(caches[s]))
				if err != nil {
					t.Fatal(err)
				}
				bufs = append(bufs, b)
				bases[s] = b.Ptr()
			}
			q := gen(tc.rows * qd)
			if tc.qScale != 0 {
				for i := range q {
					q[i] *= tc.qScale
				}
				q = fromF16(toF16(q))
			}
			qb, _ := AllocFrom(x, toF16(q))
			out, _ := x.Alloc(tc.rows * qd * 2)
			if err := x.Memset(out, 0xFF, tc.rows*qd*2); err != nil { // NaNs: an output left unwritten shows
				t.Fatal(err)
			}
			// The workspace starts as 3.4e38s (bytes 0x7F): a chunk record the
			// kernels leave unwritten wins the combine's max and shows.
			wsBytes := x.Lib().AttentionWorkspaceBytes(tc.rows, tc.heads, tc.hd, maxKeys)
			ws, _ := x.Alloc(wsBytes)
			if err := x.Memset(ws, 0x7F, wsBytes); err != nil {
				t.Fatal(err)
			}
			kvCap := caps
			if paged { // the same caches in blocks of 16 positions, in shuffled order
				var pb []Buf
				bases, pb = pagedCaches(t, x, r, caches, caps, layers, kvd)
				bufs = append(bufs, pb...)
				kvCap = make([]int32, seqs)
				for s := range kvCap {
					kvCap[s] = -1
				}
			}
			var m RowMeta
			m.RowSeq, _ = AllocFrom(x, seqOf)
			m.RowPos, _ = AllocFrom(x, pos)
			m.KVBase, _ = AllocFrom(x, bases)
			m.KVCap, _ = AllocFrom(x, kvCap)
			bufs = append(bufs, qb, out, ws, m.RowSeq, m.RowPos, m.KVBase, m.KVCap)
			if err := x.Attention(qb, out, ws, m, layer, layers, tc.rows, tc.heads, tc.kvHeads, tc.hd, maxKeys,
				AttnOptions{Window: tc.window, Scale: tc.scale}); err != nil {
				t.Fatal(err)
			}
			got16 := make([]uint16, tc.rows*qd)
			if err := Download(x, got16, out); err != nil {
				t.Fatal(err)
			}
			key := fmt.Sprintf("case %d paged=%v", ci, paged)
			if prev, ok := first[key]; !ok {
				first[key] = got16
			} else {
				for i := range prev {
					if prev[i] != got16[i] {
						t.Errorf("%s: output %d is %#04x, %#04x in the first setting", key, i, got16[i], prev[i])
						break
					}
				}
			}
			got := fromF16(got16)
			var worst float64
			for row := 0; row < tc.rows; row++ {
				s, p := int(seqOf[row]), int(pos[row])
				lo := 0
				if tc.window > 0 {
					lo = max(0, p-tc.window+1)
				}
				for h := 0; h < tc.heads; h++ {
					kv := (h / (tc.heads / tc.kvHeads)) * tc.hd
					cached := func(kind int) func(j, i int) float64 {
						return func(j, i int) float64 { return float64(caches[s][((kind*layers+layer)*int(caps[s])+j)*kvd+kv+i]) }
					}
					want := refAttention(q[(row*tc.heads+h)*tc.hd:][:tc.hd], cached(0), cached(1), lo, p, tc.scale)
					for i, o := range want {
						worst = math.Max(worst, math.Abs(float64(got[(row*tc.heads+h)*tc.hd+i])-o))
					}
				}
			}
			t.Logf("%+v paged=%v: max |error| %.2e", tc, paged, worst)
			if worst > 4e-3 || math.IsNaN(worst) {
				t.Errorf("%+v paged=%v: output differs from the reference by %.2e", tc, paged, worst)
			}
			for _, b := range bufs {
				x.Free(b)
			}
		}
	}
}

// pagedCaches lays contiguous caches ([2][layers][cap][kvd] each) out as
// the paged layout the kernels read when kv_cap < 0 (cache_row): blocks
// of 16 positions of one layer, [2][16][kvd], in one buffer in shuffled
// order, and per sequence a block table [block][layer] of their device
// addresses. It returns the tables' addresses (kv_base) and the buffers.
func pagedCaches(t *testing.T, x *Context, r *rand.Rand, caches [][]float32, caps []int32, layers, kvd int) ([]uint64, []Buf) {
	t.Helper()
	const B = 16
	total := 0
	for _, c := range caps {
		total += (int(c) + B - 1) / B * layers
	}
	blockHalves := 2 * B * kvd
	pool := make([]float32, total*blockHalves)
	pb, err := x.Alloc(len(pool) * 2)
	if err != nil {
		t.Fatal(err)
	}
	bufs := []Buf{pb}
	perm := r.Perm(total)
	k := 0
	bases := make([]uint64, len(caches))
	for s, c := range caches {
		cp := int(caps[s])
		nb := (cp + B - 1) / B
		table := make([]uint64, nb*layers)
		for b := range nb {
			for l := range layers {
				id := perm[k]
				k++
				table[b*layers+l] = pb.Ptr() + uint64(id*blockHalves*2)
				for kind := range 2 {
					for o := 0; o < B && b*B+o < cp; o++ {
						src := ((kind*layers+l)*cp + b*B + o) * kvd
						copy(pool[((id*2+kind)*B+o)*kvd:][:kvd], c[src:src+kvd])
					}
				}
			}
		}
		tb, err := AllocFrom(x, table)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, tb)
		bases[s] = tb.Ptr()
	}
	if err := Upload(x, pb, toF16(pool)); err != nil {
		t.Fatal(err)
	}
	return bases, bufs
}

// refAttention is softmax attention in float64 for one query q of one
// head over keys lo…hi: key(j, i) and value(j, i) are dimension i of
// key and value j, the scores are scaled by scale (0: len(q)^-½). It
// returns the len(q) outputs; the attention tests compare the kernels
// with it.
func refAttention(q []float32, key, value func(j, i int) float64, lo, hi int, scale float32) []float64 {
	sc := 1 / math.Sqrt(float64(len(q)))
	if scale > 0 {
		sc = float64(scale)
	}
	p := make([]float64, hi-lo+1)
	mx := math.Inf(-1)
	for j := lo; j <= hi; j++ {
		var d float64
		for i, qi := range q {
			d += float64(qi) * key(j, i)
		}
		p[j-lo] = d * sc
		mx = math.Max(mx, p[j-lo])
	}
	var sum float64
	for j := range p {
		p[j] = math.Exp(p[j] - mx)
		sum += p[j]
	}
	out := make([]float64, len(q))
	for i := range out {
		for j := lo; j <= hi; j++ {
			out[i] += p[j-lo] * value(j, i)
		}
		out[i] /= sum
	}
	return out
}

// BenchmarkAttentionDecode times one layer's attention in a decode step
// (attention_decode_kernel and attention_combine) for llama3-8b's heads
// (32 query heads sharing 8 key heads of 128) at batch B, each sequence
// with C cached keys, replayed from a CUDA graph and timed with events.
// The calls walk through enough layers of cache (256 MiB at least, five
// times the H200's L2) that each reads its keys from memory, as a decode
// step does. It reports µs a call and the rate at which the call reads
// the cache (B·C rows of keys and values, 4 KiB a key): decoding is
// bound by that read.
//
//	cuda.test -test.run '^$' -test.bench AttentionDecode -test.benchtime 20x
func BenchmarkAttentionDecode(b *testing.B) {
	x := openContext(b)
	const heads, kvHeads, hd = 32, 8, 128
	for _, tc := range []struct{ batch, ctx int }{{1, 128}, {1, 2048}, {1, 8192}, {8, 2048}, {32, 2048}, {32, 8192}} {
		b.Run(fmt.Sprintf("batch%d/ctx%d", tc.batch, tc.ctx), func(b *testing.B) {
			var bufs []Buf
			defer func() {
				for _, buf := range bufs {
					x.Free(buf)
				}
			}()
			alloc := func(n int) Buf {
				buf, err := x.Alloc(n)
				if err != nil {
					b.Fatal(err)
				}
				bufs = append(bufs, buf)
				return buf
			}
			kvBytes := 2 * tc.ctx * kvHeads * hd * 2 // one layer's keys and values
			layers := min(512, max(1, (256<<20)/(tc.batch*kvBytes)))
			reps := max(20, layers)
			seqs, pos, caps, bases := make([]int32, tc.batch), make([]int32, tc.batch), make([]int32, tc.batch), make([]uint64, tc.batch)
			for s := range seqs {
				c := alloc(layers * kvBytes)
				if err := x.Memset(c, 0, layers*kvBytes); err != nil {
					b.Fatal(err)
				}
				seqs[s], pos[s], caps[s], bases[s] = int32(s), int32(tc.ctx-1), int32(tc.ctx), c.Ptr()
			}
			var m RowMeta
			for _, a := range []struct {
				dst *Buf
				src any
			}{{&m.RowSeq, seqs}, {&m.RowPos, pos}, {&m.KVCap, caps}, {&m.KVBase, bases}} {
				var err error
				switch v := a.src.(type) {
				case []int32:
					*a.dst, err = AllocFrom(x, v)
				case []uint64:
					*a.dst, err = AllocFrom(x, v)
				}
				if err != nil {
					b.Fatal(err)
				}
				bufs = append(bufs, *a.dst)
			}
			q := alloc(tc.batch * heads * hd * 2)
			if err := x.Memset(q, 0, tc.batch*heads*hd*2); err != nil {
				b.Fatal(err)
			}
			out := alloc(tc.batch * heads * hd * 2)
			ws := alloc(x.Lib().AttentionWorkspaceBytes(tc.batch, heads, hd, tc.ctx))
			us := timeGraph(b, x, reps, func(i int) error {
				return x.Attention(q, out, ws, m, i%layers, layers, tc.batch, heads, kvHeads, hd, tc.ctx, AttnOptions{})
			})
			b.ReportMetric(us, "µs/call")
			b.ReportMetric(float64(tc.batch*kvBytes)/(us*1e-6)/1e9, "GB/s")
		})
	}
}

// TestQKRoPEStoreMatchesReference: qk_rope_store's q and k against a
// host reference — Qwen3's per-head norm (each value rounded to fp16 as
// the kernel rounds it), then the rotation by each row's position, each
// result rounded to fp16 — within 2.5e-3·(|a| + |b|) of a pair (a, b)'s
// results (the kernel's float32 and rsqrtf against float64 may round a
// normed input, and then the result, one fp16 step the other way; a wrong
// angle or pair is off by about |a| + |b|), and the cache rows: k's rotated, v's as
// given, at each row's position with store, none without. Head dims 36,
// 48, 128, 256 and 320: a lane's first four rotation pairs and, at 320,
// the pairs past them; with LLMQ_ATTN_EARLY on and off (the row's
// position, cache slot and first cos/sin values read before the PDL gate,
// or after).
func TestQKRoPEStoreMatchesReference(t *testing.T) {
	onAndOff(t, "LLMQ_ATTN_EARLY", func(t *testing.T, x *Context, _ bool) {
		r := rand.New(rand.NewPCG(25, 26))
		const T, heads, kvHeads, positions, eps = 2, 4, 2, 30, 1e-6
		pos := []int32{7, 29}
		for _, hd := range []int{36, 48, 128, 256, 320} {
			for _, normed := range []bool{false, true} {
				for _, store := range []bool{false, true} {
					name := fmt.Sprintf("hd %d normed=%v store=%v", hd, normed, store)
					qd, kd, half := heads*hd, kvHeads*hd, hd/2
					qh, qv := randomHalf(r, T*qd)
					kh, kv := randomHalf(r, T*kd)
					vh, _ := randomHalf(r, T*kd)
					cosT, sinT := make([]float32, positions*half), make([]float32, positions*half)
					for i := range cosT {
						a := r.Float64() * 2 * math.Pi
						cosT[i], sinT[i] = float32(math.Cos(a)), float32(math.Sin(a))
					}
					w := make([]float32, hd)
					for i := range w {
						w[i] = float32(0.5 + r.Float64())
					}
					var bufs []Buf
					up := func(b Buf, err error) Buf {
						t.Helper()
						if err != nil {
							t.Fatal(err)
						}
						bufs = append(bufs, b)
						return b
					}
					qb, kb, vb := up(AllocFrom(x, qh)), up(AllocFrom(x, kh)), up(AllocFrom(x, vh))
					cb, sb := up(AllocFrom(x, cosT)), up(AllocFrom(x, sinT))
					var qn, kn Buf
					if normed {
						qn, kn = up(AllocFrom(x, w)), up(AllocFrom(x, w))
					}
					// One contiguous cache a row (sequence), one layer: [2][positions][kd] fp16, zeros.
					caches := make([]Buf, T)
					bases := make([]uint64, T)
					for s := range caches {
						caches[s] = up(AllocFrom(x, make([]uint16, 2*positions*kd)))
						bases[s] = caches[s].Ptr()
					}
					m := RowMeta{RowSeq: up(AllocFrom(x, []int32{0, 1})), RowPos: up(AllocFrom(x, pos)),
						KVBase: up(AllocFrom(x, bases)), KVCap: up(AllocFrom(x, []int32{positions, positions}))}
					if err := x.QKRoPEStore(qb, kb, vb, Buf{}, qn, kn, eps, m, cb, sb, 0, 1, T, heads, kvHeads, hd, store); err != nil {
						t.Fatal(err)
					}
					gotQ, gotK := make([]uint16, T*qd), make([]uint16, T*kd)
					if err := errors.Join(Download(x, gotQ, qb), Download(x, gotK, kb)); err != nil {
						t.Fatal(err)
					}
					// rope is the reference for one head's values at row t, and
					// each result's tolerance.
					f16 := func(v float64) float64 { return float64(float16.Fromfloat32(float32(v)).Float32()) }
					rope := func(vals []float32, t int) (out, tol []float64) {
						out, tol = make([]float64, hd), make([]float64, hd)
						inv := 1.0
						if normed {
							ss := 0.0
							for _, v := range vals {
								ss += float64(v) * float64(v)
							}
							inv = 1 / math.Sqrt(ss/float64(hd)+eps)
						}
						for j := 0; j < half; j++ {
							a, b := float64(vals[j]), float64(vals[j+half])
							if normed {
								a, b = f16(a*inv*float64(w[j])), f16(b*inv*float64(w[j+half]))
							}
							c, s := float64(cosT[int(pos[t])*half+j]), float64(sinT[int(pos[t])*half+j])
							out[j], out[j+half] = f16(a*c-b*s), f16(b*c+a*s)
							tol[j] = 2.5e-3*(math.Abs(a)+math.Abs(b)) + 1e-6
							tol[j+half] = tol[j]
						}
						return out, tol
					}
					check := func(what string, got []uint16, want, tol []float64) {
						t.Helper()
						for i, wv := range want {
							g := float64(float16.Frombits(got[i]).Float32())
							if math.Abs(g-wv) > tol[i] {
								t.Fatalf("%s: %s value %d is %v, want %v ± %.1e", name, what, i, g, wv, tol[i])
							}
						}
					}
					for row := 0; row < T; row++ {
						for h := 0; h < heads; h++ {
							at := (row*heads + h) * hd
							want, tol := rope(qv[at:at+hd], row)
							check(fmt.Sprintf("row %d q head %d", row, h), gotQ[at:at+hd], want, tol)
						}
						cache := make([]uint16, 2*positions*kd)
						if err := Download(x, cache, caches[row]); err != nil {
							t.Fatal(err)
						}
						for h := 0; h < kvHeads; h++ {
							at := (row*kvHeads + h) * hd
							want, tol := rope(kv[at:at+hd], row)
							check(fmt.Sprintf("row %d k head %d", row, h), gotK[at:at+hd], want, tol)
							slot := int(pos[row])*kd + h*hd
							for i := 0; i < hd; i++ {
								kc, vc := cache[slot+i], cache[positions*kd+slot+i]
								if store && (kc != gotK[at+i] || vc != vh[at+i]) {
									t.Fatalf("%s: row %d head %d dim %d: cache k %#04x v %#04x, want %#04x %#04x", name, row, h, i, kc, vc, gotK[at+i], vh[at+i])
								}
							}
						}
						if !store && slices.ContainsFunc(cache, func(b uint16) bool { return b != 0 }) {
							t.Fatalf("%s: row %d: the cache was written without store", name, row)
						}
					}
					for _, b := range bufs {
						x.Free(b)
					}
				}
			}
		}
	})
}

// TestQKRoPEStoreFromSums: qk_rope_store fed the fp32 sums a joined q/k/v
// GEMM with no outputs leaves in its workspace writes the same q, k and v
// and the same cache rows, bit for bit, as when fed those sums rounded to
// fp16 in q, k and v (what the GEMV kernels would have written), and
// leaves the sums zeroed — with and without Qwen3's per-head norms. Head
// dimension 48: a lane's rotation reads values other lanes wrote.
func TestQKRoPEStoreFromSums(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(23, 24))
	const T, heads, kvHeads, hd, positions = 3, 4, 2, 48, 40
	qd, kd := heads*hd, kvHeads*hd
	N := qd + 2*kd
	sums := make([]float32, T*N)
	for i := range sums {
		sums[i] = float32(r.NormFloat64() * 3)
	}
	tables := func() []float32 {
		v := make([]float32, positions*hd/2)
		for i := range v {
			v[i] = float32(r.Float64()*2 - 1)
		}
		return v
	}
	norm := make([]float32, hd)
	for i := range norm {
		norm[i] = float32(0.5 + r.Float64())
	}
	upload := func(v any) Buf {
		t.Helper()
		var b Buf
		var err error
		switch v := v.(type) {
		case []float32:
			b, err = AllocFrom(x, v)
		case []uint16:
			b, err = AllocFrom(x, v)
		case []int32:
			b, err = AllocFrom(x, v)
		case []uint64:
			b, err = AllocFrom(x, v)
		default:
			t.Fatalf("upload: no case for %T", v)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { x.Free(b) })
		return b
	}
	cos, sin := upload(tables()), upload(tables())
	// A contiguous cache a row (sequence), one layer: [2][positions][kd] fp16.
	caps := []int32{positions, positions, positions}
	meta := RowMeta{RowSeq: upload([]int32{0, 1, 2}), RowPos: upload([]int32{0, 17, 39}), KVCap: upload(caps)}
	// part returns the fp16 bits of sums' columns [from, from+width) of every row.
	part := func(from, width int) []uint16 {
		out := make([]uint16, 0, T*width)
		for row := 0; row < T; row++ {
			for _, v := range sums[row*N+from : row*N+from+width] {
				out = append(out, float16.Fromfloat32(v).Bits())
			}
		}
		return out
	}
	for _, normed := range []bool{false, true} {
		qn, kn := Buf{}, Buf{}
		if normed {
			qn, kn = upload(norm), upload(norm)
		}
		run := func(fromSums bool) (q, k, v, cache []uint16, ws []float32) {
			caches := make([]Buf, T)
			bases := make([]uint64, T)
			for s := range caches {
				caches[s] = upload(make([]uint16, 2*positions*kd))
				bases[s] = caches[s].Ptr()
			}
			m := meta
			m.KVBase = upload(bases)
			var qb, kb, vb, sb Buf
			if fromSums { // q, k and v zero: the kernel must write them
				qb, kb, vb = upload(make([]uint16, T*qd)), upload(make([]uint16, T*kd)), upload(make([]uint16, T*kd))
				sb = upload(sums)
			} else {
				qb, kb, vb = upload(part(0, qd)), upload(part(qd, kd)), upload(part(qd+kd, kd))
			}
			if err := x.QKRoPEStore(qb, kb, vb, sb, qn, kn, 1e-6, m, cos, sin, 0, 1, T, heads, kvHeads, hd, true); err != nil {
				t.Fatal(err)
			}
			q, k, v = make([]uint16, T*qd), make([]uint16, T*kd), make([]uint16, T*kd)
			for _, d := range []struct {
				dst []uint16
				src Buf
			}{{q, qb}, {k, kb}, {v, vb}} {
				if err := Download(x, d.dst, d.src); err != nil {
					t.Fatal(err)
				}
			}
			for _, c := range caches {
				part := make([]uint16, 2*positions*kd)
				if err := Download(x, part, c); err != nil {
					t.Fatal(err)
				}
				cache = append(cache, part...)
			}
			if fromSums {
				ws = make([]float32, T*N)
				if err := Download(x, ws, sb); err != nil {
					t.Fatal(err)
				}
			}
			return q, k, v, cache, ws
		}
		q0, k0, v0, c0, _ := run(false)
		q1, k1, v1, c1, ws := run(true)
		for _, c := range []struct {
			name       string
			want, have []uint16
		}{{"q", q0, q1}, {"k", k0, k1}, {"v", v0, v1}, {"the caches", c0, c1}} {
			for j := range c.want {
				if c.want[j] != c.have[j] {
					t.Fatalf("norms %v: %s from the sums differs at %d: %#04x, from fp16 %#04x", normed, c.name, j, c.have[j], c.want[j])
				}
			}
		}
		stored := 0
		for _, h := range c0 {
			if h != 0 {
				stored++
			}
		}
		if stored < T*2*kd/2 { // each row's k and v, nearly all nonzero
			t.Fatalf("norms %v: only %d cache values written, want about %d", normed, stored, T*2*kd)
		}
		for i, v := range ws {
			if v != 0 {
				t.Fatalf("norms %v: sum %d (row %d, column %d) left %g, not zeroed", normed, i, i/N, i%N, v)
			}
		}
	}
}

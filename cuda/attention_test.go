//go:build cgo

package cuda

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestAttentionDecodeMatchesReference runs the cache attention kernel on
// random caches and queries and compares with softmax attention in
// float64: decode batches (rows of different sequences and positions,
// some past a 64-key chunk), GQA groups of 1, 2, 4, 8 and 6 query heads a
// key head (a block takes 8, 4, 2 or 2 of them), head dims 64, 128 and 48,
// a sliding window and a score scale, and a prefill-sized pass (one head
// a block).
func TestAttentionDecodeMatchesReference(t *testing.T) {
	x := openContext(t)
	r := rand.New(rand.NewPCG(21, 22))
	for _, tc := range []struct {
		rows, heads, kvHeads, hd, window int
		scale                            float32
	}{
		{3, 8, 8, 64, 0, 0}, {4, 8, 4, 128, 0, 0}, {2, 16, 4, 64, 0, 0}, {5, 32, 4, 128, 0, 0},
		{3, 12, 2, 48, 0, 0}, {4, 8, 1, 64, 50, 0}, {2, 16, 2, 128, 0, 0.05}, {70, 4, 2, 64, 0, 0},
	} {
		const layers, layer = 2, 1
		seqs := tc.rows
		caps := make([]int32, seqs)
		pos := make([]int32, tc.rows)
		seqOf := make([]int32, tc.rows)
		maxKeys := 0
		for i := range pos {
			seqOf[i] = int32(i)
			pos[i] = int32(r.IntN(200))
			caps[i] = pos[i] + 1 + int32(r.IntN(8))
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
		qb, _ := AllocFrom(x, toF16(q))
		out, _ := x.Alloc(tc.rows * qd * 2)
		ws, _ := x.Alloc(x.Lib().AttentionWorkspaceBytes(tc.rows, tc.heads, tc.hd, maxKeys))
		var m RowMeta
		m.RowSeq, _ = AllocFrom(x, seqOf)
		m.RowPos, _ = AllocFrom(x, pos)
		m.KVBase, _ = AllocFrom(x, bases)
		m.KVCap, _ = AllocFrom(x, caps)
		bufs = append(bufs, qb, out, ws, m.RowSeq, m.RowPos, m.KVBase, m.KVCap)
		if err := x.Attention(qb, out, ws, m, layer, layers, tc.rows, tc.heads, tc.kvHeads, tc.hd, maxKeys,
			AttnOptions{Window: tc.window, Scale: tc.scale}); err != nil {
			t.Fatal(err)
		}
		got16 := make([]uint16, tc.rows*qd)
		if err := Download(x, got16, out); err != nil {
			t.Fatal(err)
		}
		got := fromF16(got16)
		scale := 1 / math.Sqrt(float64(tc.hd))
		if tc.scale > 0 {
			scale = float64(tc.scale)
		}
		var worst float64
		for row := 0; row < tc.rows; row++ {
			s, p := int(seqOf[row]), int(pos[row])
			key := func(kind, j, i int) float64 {
				return float64(caches[s][((kind*layers+layer)*int(caps[s])+j)*kvd+i])
			}
			lo := 0
			if tc.window > 0 {
				lo = max(0, p-tc.window+1)
			}
			for h := 0; h < tc.heads; h++ {
				kh := h / (tc.heads / tc.kvHeads)
				sc := make([]float64, p+1)
				mx := math.Inf(-1)
				for j := lo; j <= p; j++ {
					var d float64
					for i := 0; i < tc.hd; i++ {
						d += float64(q[row*qd+h*tc.hd+i]) * key(0, j, kh*tc.hd+i)
					}
					sc[j] = d * scale
					mx = math.Max(mx, sc[j])
				}
				var sum float64
				for j := lo; j <= p; j++ {
					sc[j] = math.Exp(sc[j] - mx)
					sum += sc[j]
				}
				for i := 0; i < tc.hd; i++ {
					var o float64
					for j := lo; j <= p; j++ {
						o += sc[j] * key(1, j, kh*tc.hd+i)
					}
					worst = math.Max(worst, math.Abs(float64(got[row*qd+h*tc.hd+i])-o/sum))
				}
			}
		}
		t.Logf("%+v: max |error| %.2e", tc, worst)
		if worst > 4e-3 || math.IsNaN(worst) {
			t.Errorf("%+v: output differs from the reference by %.2e", tc, worst)
		}
		for _, b := range bufs {
			x.Free(b)
		}
	}
}

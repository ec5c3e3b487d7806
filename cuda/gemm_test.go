//go:build cgo

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/llmq/llmq/pack"
	"github.com/x448/float16"
)

// openLib loads the CUDA library, skipping when there is none (CI, and any
// machine without a GPU).
func openLib(t testing.TB) *Lib {
	t.Helper()
	l, err := Open("")
	if err != nil {
		t.Skip(err)
	}
	if _, err := l.Device(); err != nil {
		t.Skip("GPU unavailable: ", err)
	}
	return l
}

// openContext makes a context for a test, closed (and checked to have
// released everything) when the test ends.
func openContext(t testing.TB) *Context {
	t.Helper()
	x, err := openLib(t).NewContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := x.Close(); err != nil {
			t.Error(err)
		}
	})
	return x
}

// randomLayer makes a layer of 2 to 4 or 8 bits with random grid indices,
// scales and zeros (or the midpoint zero when sym), and a random act-order
// g_idx if asked.
func randomLayer(r *rand.Rand, K, N, group, bits int, sym, actOrder bool) *pack.Linear {
	grid := pack.Grid{Bits: bits, GroupSize: group, Sym: sym}
	g := grid.Group(K)
	G := K / g
	l := &pack.Linear{In: K, Out: N, Grid: grid, Q: make([]uint8, N*K), Scale: make([]float32, G*N), Zero: make([]uint8, G*N), GIdx: pack.SequentialGIdx(K, g)}
	for i := range l.Q {
		l.Q[i] = uint8(r.IntN(1 << bits))
	}
	for i := range l.Scale {
		l.Scale[i] = pack.RoundF16(float32(0.002 + 0.02*r.Float64()))
		l.Zero[i] = uint8(1 << (bits - 1))
		if !sym {
			l.Zero[i] = uint8(r.IntN(1 << bits))
		}
	}
	if actOrder {
		for j, src := range r.Perm(K) {
			l.GIdx[src] = int32(j / g)
		}
	}
	return l
}

func randomHalf(r *rand.Rand, n int) ([]uint16, []float32) {
	bits, vals := make([]uint16, n), make([]float32, n)
	for i := range bits {
		h := float16.Fromfloat32(float32(r.NormFloat64()))
		bits[i], vals[i] = h.Bits(), h.Float32()
	}
	return bits, vals
}

// reference is C[m][n] = Σ_k A[m][src(k)]·W[k][n] in float64, W in kernel
// row order.
func reference(A []float32, W []float32, perm []int32, M, K, N int) []float64 {
	C := make([]float64, M*N)
	for m := 0; m < M; m++ {
		row := C[m*N : (m+1)*N]
		for k := 0; k < K; k++ {
			src := k
			if perm != nil {
				src = int(perm[k])
			}
			a := float64(A[m*K+src])
			if a == 0 {
				continue
			}
			wr := W[k*N : (k+1)*N]
			for n := range row {
				row[n] += a * float64(wr[n])
			}
		}
	}
	return C
}

// upload lays a layer out for the kernel and copies it to the GPU; the
// caller frees it.
func upload(t *testing.T, l *Context, layer *pack.Linear) (*pack.GPUWeights, *W4) {
	t.Helper()
	g, err := layer.GPULayout()
	if err != nil {
		t.Fatal(err)
	}
	w, err := l.UploadW4(g)
	if err != nil {
		t.Fatal(err)
	}
	return g, w
}

type gemmCase struct {
	M, K, N, group, bits int
	sym, act             bool
	path                 int
	// adversarial inputs: "zero-groups" makes every code of some groups
	// equal its zero point (the group contributes exactly 0), "extreme"
	// mixes the largest scales the fp16 weights allow with the smallest
	// subnormal, activations scaled to keep the products finite;
	// "subnormal" gives every group a subnormal scale (a kernel that
	// flushed them to zero would output zeros), activations scaled up.
	edit string
	// split: the layer's columns go to separate outputs of these widths
	// (a joined q/k/v layer), each compared with its slice of the reference.
	split []int
	// sums: the product also through GemmW4Sums, its fp32 sums read from
	// the workspace (which the test then zeroes, as the norm after o and
	// down does) and compared with the reference.
	sums bool
}

func runCase(t *testing.T, l *Context, r *rand.Rand, c gemmCase) {
	t.Helper()
	if c.bits == 0 {
		c.bits = 4
	}
	layer := randomLayer(r, c.K, c.N, c.group, c.bits, c.sym, c.act)
	ascale := float32(1)
	switch c.edit {
	case "zero-groups":
		for o := 0; o < c.N; o++ {
			for k := 0; k < c.K; k++ {
				if grp := int(layer.GIdx[k]); (grp+o)%3 == 0 {
					layer.Q[o*c.K+k] = layer.Zero[grp*c.N+o]
				}
			}
		}
	case "extreme":
		for i := range layer.Scale {
			switch i % 3 {
			case 0: // (q − z)·s stays finite in fp16
				layer.Scale[i] = pack.RoundF16(65000 / float32(int(1)<<c.bits-1))
			case 1:
				layer.Scale[i] = pack.RoundF16(6e-8) // the smallest fp16 subnormal
			}
		}
		ascale = 1e-5
	case "subnormal":
		for i := range layer.Scale {
			layer.Scale[i] = pack.RoundF16(float32(1+i%7) * 6e-8) // 1…7 times the smallest subnormal
		}
		ascale = 1000
	}
	g, w := upload(t, l, layer)
	defer w.Free(l)
	w.Cols = c.split
	abits, avals := randomHalf(r, c.M*c.K)
	for i := range avals {
		h := float16.Fromfloat32(avals[i] * ascale)
		abits[i], avals[i] = h.Bits(), h.Float32()
	}
	A, _ := AllocFrom(l, abits)
	defer l.Free(A)
	parts := c.split
	if parts == nil {
		parts = []int{c.N}
	}
	outs := make([]Buf, len(parts))
	for i, n := range parts {
		outs[i], _ = l.Alloc(c.M * n * 2)
		defer l.Free(outs[i])
	}
	ws, _ := l.Alloc(l.Lib().WorkspaceBytes(c.M, c.N))
	defer l.Free(ws)
	l.Memset(ws, 0, ws.Bytes)
	scratch, _ := l.Alloc(c.K * c.N * 2)
	defer l.Free(scratch)
	var aperm Buf
	if g.Perm != nil {
		aperm, _ = l.Alloc(c.M * c.K * 2)
		defer l.Free(aperm)
	}
	ref := reference(avals, g.Dequantize(), g.Perm, c.M, c.K, c.N)
	if err := l.SetPath(c.path); err != nil {
		t.Fatal(err)
	}
	defer l.SetPath(PathAuto)
	variant, err := l.Plan(w, c.M)
	if err != nil {
		t.Fatal(err)
	}
	for run := 0; run < 2; run++ { // twice: the workspace must come back zeroed
		for _, o := range outs {
			if err := l.Memset(o, 0xff, o.Bytes); err != nil { // poison: 0xffff is NaN
				t.Fatal(err)
			}
		}
		if err := l.GemmW4Into(A, outs, w, c.M, ws, scratch, aperm); err != nil {
			t.Fatal(err)
		}
		if err := l.Sync(); err != nil {
			t.Fatal(err)
		}
		out := make([]uint16, c.M*c.N) // the parts side by side
		off := 0
		for i := range parts {
			part := make([]uint16, c.M*parts[i])
			if err := Download(l, part, outs[i]); err != nil {
				t.Fatal(err)
			}
			for m := 0; m < c.M; m++ {
				copy(out[m*c.N+off:m*c.N+off+parts[i]], part[m*parts[i]:(m+1)*parts[i]])
			}
			off += parts[i]
		}
		var num, den float64
		for i, h := range out {
			v := float64(float16.Frombits(h).Float32())
			if math.IsNaN(v) || math.IsInf(v, 0) {
				t.Fatalf("%+v (%s) run %d: output %d (row %d) not written or not finite: %v", c, variant, run, i, i/c.N, v)
			}
			num += (v - ref[i]) * (v - ref[i])
			den += ref[i] * ref[i]
		}
		if rel := math.Sqrt(num / den); rel > 1e-3 {
			t.Fatalf("%+v (%s) run %d: relative Frobenius error %.3g > 1e-3; %s", c, variant, run, rel,
				whereOff(out, ref, c.M, c.N, math.Sqrt(den/float64(len(ref)))))
		} else if run == 0 {
			t.Logf("%+v (%s): rel err %.2e", c, variant, rel)
		}
	}
	if c.sums {
		checkSums(t, l, c, variant, A, w, ws, scratch, aperm, ref)
	}
}

// checkSums runs case c's product through GemmW4Sums twice, each time
// reading the fp32 sums from the workspace, comparing them with ref, and
// zeroing the rows read (as the norm after o and down does); the rest of
// the workspace must stay zero.
func checkSums(t *testing.T, l *Context, c gemmCase, variant string, A Buf, w *W4, ws, scratch, aperm Buf, ref []float64) {
	t.Helper()
	for run := 0; run < 2; run++ {
		if err := l.GemmW4Sums(A, w, c.M, ws, scratch, aperm); err != nil {
			t.Fatal(err)
		}
		all := make([]float32, ws.Bytes/4)
		if err := Download(l, all, ws); err != nil {
			t.Fatal(err)
		}
		var num, den float64
		for i, v := range all {
			if i >= c.M*c.N {
				if v != 0 {
					t.Fatalf("%+v (%s) sums run %d: workspace float %d past the M·N sums is %g, not 0", c, variant, run, i, v)
				}
				continue
			}
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				t.Fatalf("%+v (%s) sums run %d: sum %d (row %d) not finite: %v", c, variant, run, i, i/c.N, v)
			}
			num += (float64(v) - ref[i]) * (float64(v) - ref[i])
			den += ref[i] * ref[i]
		}
		if rel := math.Sqrt(num / den); rel > 1e-3 {
			t.Fatalf("%+v (%s) sums run %d: relative Frobenius error %.3g > 1e-3", c, variant, run, rel)
		} else if run == 0 {
			t.Logf("%+v (%s) sums: rel err %.2e", c, variant, rel)
		}
		if err := l.Memset(ws, 0, c.M*c.N*4); err != nil {
			t.Fatal(err)
		}
	}
}

// TestGemmW4SumsMatchReference: with no outputs (GemmW4Sums) the GEMV
// kernels at up to 8 rows and dequantize + cuBLAS at any leave the
// product's fp32 sums in the workspace — one K split and several, 4- and
// 8-bit codes, act order; other paths refuse the call.
func TestGemmW4SumsMatchReference(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(uint64(rand.Int64()), 21))
	for _, M := range []int{1, 2, 3, 8, 16, 300} {
		for _, bits := range []int{4, 8} {
			for _, shape := range [][2]int{{4096, 128}, {512, 1024}} { // K, N: many K splits; wide, few
				paths := []int{PathCuBLAS}
				if M <= 8 {
					paths = pathsFor(M, PathAuto, PathCuBLAS)
				}
				for _, path := range paths {
					c := gemmCase{M: M, K: shape[0], N: shape[1], group: 128, bits: bits, path: path, sums: true, act: M == 3}
					t.Run(fmt.Sprintf("M%d/w%d/K%d/path%d", M, bits, shape[0], path), func(t *testing.T) { runCase(t, l, r, c) })
				}
			}
		}
	}
	// Past 8 rows the kernels have no instantiation that leaves the sums.
	_, w := upload(t, l, randomLayer(r, 512, 1024, 128, 4, false, false))
	defer w.Free(l)
	abits, _ := randomHalf(r, 16*512)
	A, _ := AllocFrom(l, abits)
	defer l.Free(A)
	ws, _ := l.Alloc(l.Lib().WorkspaceBytes(16, 1024))
	defer l.Free(ws)
	for _, path := range []int{PathAuto, PathFused, PathMMA, PathSwap} {
		if err := l.SetPath(path); err != nil {
			t.Fatal(err)
		}
		err := l.GemmW4Sums(A, w, 16, ws, Buf{}, Buf{})
		if err == nil || !strings.Contains(err.Error(), "no outputs") {
			t.Errorf("path %d, 16 rows: GemmW4Sums returned %v, want the refusal of a GEMM with no outputs", path, err)
		}
	}
	if err := l.SetPath(PathAuto); err != nil {
		t.Fatal(err)
	}
}

// whereOff says where a wrong product is off, for the failure message:
// the largest error's row, column, value and reference, and the span of
// rows and columns, and the count, of the elements off by more than a
// tenth of the reference's RMS — a wrong row block, n-tile or token
// group shows in the spans.
func whereOff(out []uint16, ref []float64, M, N int, rms float64) string {
	worst, wi, bad := -1.0, 0, 0
	r0, r1, c0, c1 := M, -1, N, -1
	for i, h := range out {
		d := math.Abs(float64(float16.Frombits(h).Float32()) - ref[i])
		if d > worst {
			worst, wi = d, i
		}
		if d > 0.1*rms {
			bad++
			r, col := i/N, i%N
			r0, r1, c0, c1 = min(r0, r), max(r1, r), min(c0, col), max(c1, col)
		}
	}
	return fmt.Sprintf("largest error at row %d column %d: %g, want %g; %d of %d elements off by > 0.1·RMS, rows %d–%d, columns %d–%d",
		wi/N, wi%N, float16.Frombits(out[wi]).Float32(), ref[wi], bad, len(out), r0, r1, c0, c1)
}

// pathsFor is the paths a test runs at M: always, then the GEMV kernel
// (M ≤ 2), v15 (M ≤ 32), v11 (M ≤ 64) and dequantize + cuBLAS (M ≥ 64)
// where they run and always does not already name them.
func pathsFor(M int, always ...int) []int {
	paths := slices.Clone(always)
	if M <= 2 {
		paths = append(paths, PathGEMV)
	}
	if M <= 32 {
		paths = append(paths, PathSwap)
	}
	if M <= 64 {
		paths = append(paths, PathMMA)
	}
	if M >= 64 && !slices.Contains(always, PathCuBLAS) {
		paths = append(paths, PathCuBLAS)
	}
	return paths
}

// TestW4A16MatchesReference checks the kernel against a float64 CPU
// reference over many shapes, groups, sym/asym and act-order, on every path.
func TestW4A16MatchesReference(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(uint64(rand.Int64()), 7))
	for _, M := range []int{1, 3, 8, 16, 17, 64, 100, 256, 1000, 4096} {
		K, N := 1024, 192
		if M >= 1000 {
			K, N = 256, 128
		}
		for _, v := range []struct {
			group    int
			sym, act bool
		}{{128, false, false}, {128, true, false}, {-1, false, false}, {128, false, true}, {32, true, true}} {
			for _, p := range pathsFor(M, PathFused) {
				runCase(t, l, r, gemmCase{M: M, K: K, N: N, group: v.group, sym: v.sym, act: v.act, path: p})
			}
		}
	}
	// A deep K (many splits), a wide N, the smallest shape, 2- and 3-bit
	// codes in the 4-bit layout.
	for _, c := range []gemmCase{
		{M: 5, K: 14336, N: 256, group: 128, path: PathFused}, {M: 2, K: 512, N: 4096, group: 128, path: PathFused},
		{M: 1, K: 16, N: 64, group: -1, path: PathFused}, {M: 3, K: 1024, N: 192, group: 64, bits: 3, path: PathFused},
		{M: 17, K: 1024, N: 192, group: 32, bits: 2, sym: true, act: true, path: PathFused},
		{M: 100, K: 1024, N: 192, group: 128, bits: 3, path: PathCuBLAS},
		// The GEMV kernel: every M it runs, a deep K, a wide N, the
		// smallest shape, small groups (a batch of steps crossing groups),
		// 2/3-bit, and M past its limit refused below.
		{M: 2, K: 14336, N: 256, group: 128, path: PathGEMV}, {M: 2, K: 512, N: 4096, group: 128, path: PathGEMV},
		{M: 1, K: 16, N: 64, group: -1, path: PathGEMV}, {M: 1, K: 48, N: 64, group: 16, path: PathGEMV},
		{M: 1, K: 1024, N: 192, group: 32, bits: 3, path: PathGEMV},
		{M: 2, K: 1024, N: 192, group: 32, bits: 2, sym: true, act: true, path: PathGEMV},
		// The GEMV on the Tensor Cores (v11): its row counts (8, 16, 32,
		// 64) at their edges, the same deep, wide, smallest and small-group
		// cases, 2/3-bit.
		{M: 9, K: 14336, N: 256, group: 128, path: PathMMA}, {M: 16, K: 512, N: 4096, group: 128, path: PathMMA},
		{M: 1, K: 16, N: 64, group: -1, path: PathMMA}, {M: 5, K: 48, N: 64, group: 16, path: PathMMA},
		{M: 12, K: 1024, N: 192, group: 32, bits: 3, path: PathMMA},
		{M: 2, K: 1024, N: 192, group: 32, bits: 2, sym: true, act: true, path: PathMMA},
		{M: 1, K: 4096, N: 448, group: 128, path: PathMMA, split: []int{256, 64, 128}},
		{M: 13, K: 256, N: 448, group: 128, path: PathMMA, split: []int{256, 64, 128}},
		{M: 33, K: 14336, N: 256, group: 128, path: PathMMA}, {M: 24, K: 1024, N: 192, group: 16, bits: 3, act: true, path: PathMMA},
		{M: 47, K: 4096, N: 448, group: 128, path: PathMMA, split: []int{256, 64, 128}},
		// v15 (v11 with the operands swapped): its token counts (8, 16,
		// 32) at their edges, groups short of a batch of steps and
		// per-channel, K splits, the smallest shape, 2/3-bit.
		{M: 1, K: 14336, N: 256, group: 128, path: PathSwap}, {M: 8, K: 512, N: 4096, group: 128, path: PathSwap},
		{M: 9, K: 14336, N: 256, group: 64, path: PathSwap}, {M: 16, K: 4096, N: 192, group: -1, path: PathSwap},
		{M: 17, K: 4096, N: 256, group: 128, path: PathSwap}, {M: 32, K: 1024, N: 192, group: 32, path: PathSwap},
		{M: 1, K: 16, N: 64, group: -1, path: PathSwap}, {M: 5, K: 48, N: 64, group: 16, path: PathSwap},
		{M: 3, K: 1024, N: 192, group: 32, bits: 3, path: PathSwap},
		{M: 2, K: 1024, N: 192, group: 32, bits: 2, sym: true, act: true, path: PathSwap},
		{M: 1, K: 4096, N: 448, group: 128, path: PathSwap, split: []int{256, 64, 128}},
		{M: 21, K: 256, N: 448, group: 128, path: PathSwap, split: []int{256, 64, 128}},
		// One K split and 14 steps a warp whatever the GPU: a full pair of
		// batches, then a tail whose second batch is part-filled, and
		// warps that start inside a group.
		{M: 4, K: 896, N: 64, group: 128, path: PathSwap}, {M: 12, K: 896, N: 64, group: 128, path: PathSwap},
		// A joined layer's columns into three outputs, on every path, with
		// K split across CTAs (the last-CTA store) and without.
		{M: 1, K: 4096, N: 448, group: 128, path: PathGEMV, split: []int{256, 64, 128}},
		{M: 2, K: 256, N: 448, group: 128, path: PathGEMV, split: []int{256, 64, 128}},
		{M: 7, K: 4096, N: 448, group: 128, act: true, path: PathFused, split: []int{256, 64, 128}},
		{M: 40, K: 256, N: 192, group: 64, path: PathFused, split: []int{64, 128}},
		{M: 100, K: 512, N: 448, group: 128, path: PathCuBLAS, split: []int{256, 64, 128}},
		// The automatic plan on a layer of 2^25 weights at M = 33–128: the
		// fused kernel (v18) over two row blocks, into three outputs.
		{M: 100, K: 8192, N: 4096, group: 128, path: PathAuto, split: []int{1024, 1024, 2048}},
	} {
		runCase(t, l, r, c)
	}
	// Adversarial values on every path.
	for _, edit := range []string{"zero-groups", "extreme", "subnormal"} {
		for _, p := range []int{PathFused, PathCuBLAS} {
			runCase(t, l, r, gemmCase{M: 9, K: 1024, N: 64, group: 128, path: p, edit: edit})
		}
		runCase(t, l, r, gemmCase{M: 2, K: 1024, N: 64, group: 128, path: PathGEMV, edit: edit})
		runCase(t, l, r, gemmCase{M: 11, K: 1024, N: 64, group: 128, path: PathMMA, edit: edit})
		runCase(t, l, r, gemmCase{M: 1, K: 1024, N: 64, group: 128, path: PathSwap, edit: edit})
		runCase(t, l, r, gemmCase{M: 30, K: 1024, N: 64, group: 128, path: PathSwap, edit: edit})
		runCase(t, l, r, gemmCase{M: 50, K: 1024, N: 64, group: 128, path: PathMMA, edit: edit})
	}
}

// checkPlans checks the automatic plan for w at each M: the kernel and
// variant it names start with want[M].
func checkPlans(t *testing.T, l *Context, w *W4, want map[int]string) {
	t.Helper()
	for M, prefix := range want {
		if v, err := l.Plan(w, M); err != nil || !strings.HasPrefix(v, prefix) {
			t.Errorf("automatic plan for %d-bit codes, M=%d: %q, %v; want %s…", w.codeBits(), M, v, err, prefix)
		}
	}
}

// TestGEMVRefusesLargeM: the forced GEMV kernels say which M they run,
// and the automatic plan gives 4-bit M = 1 to the CUDA-core GEMV (v15 on
// layers of 2^26 weights or more), M = 2–8 to v15, M = 9–64 to v11 (v15
// to M = 32 on layers that need no K split), M = 33–128 to the fused
// kernel on layers of 2^25 weights or more (v18; on Hopper v21 up to
// 256 rows, from 3 · 2^23 weights; where each is faster, NOTES.md v11,
// v15, v18, "The nineteenth session" and "The twentieth session") and
// larger M to dequantize + cuBLAS.
func TestGEMVRefusesLargeM(t *testing.T) {
	l := openContext(t)
	above32, above64, above128 := fusedAbove32(t, l), fusedAbove64(t, l), fusedAbove128(t, l)
	r := rand.New(rand.NewPCG(5, 5))
	_, w := upload(t, l, randomLayer(r, 256, 128, 128, 4, false, false))
	defer w.Free(l)
	checkPlans(t, l, w, map[int]string{1: "gemv mt1", 2: "gemv-swap v15 mt8", 8: "gemv-swap v15 mt8", 9: "gemv-mma v11 mt16",
		16: "gemv-mma v11 mt16", 17: "gemv-mma v11 mt32", 33: "gemv-mma v11 mt64 u1 pf8", 65: "dequant+cublas"})
	// The plan reads only the shape: 8B gate+up (2^26 weights and more)
	// and down (less) at M = 1.
	// Past 8 tokens v15 takes the layers a wave covers without a K split
	// (8B gate+up's 448 n-tiles), v11 the others (8B down's 64).
	checkPlans(t, l, &W4{K: 4096, N: 28672, Group: 128}, map[int]string{1: "gemv-swap v15 mt8",
		9: "gemv-swap v15 mt16", 16: "gemv-swap v15 mt16 u4 b1 splits1",
		17: onHopper(t, l, v21Plan64, "gemv-swap v15 mt32"), 32: onHopper(t, l, v21Plan64, "gemv-swap v15 mt32 u2 scaled b1 splits1"),
		33: above32, 64: above32, 65: above64, 128: above64, 129: above128, 256: above128,
		257: "dequant+cublas"})
	// The fused kernel takes M = 33–128 on layers of 2^25 weights and more
	// (8B down), not on smaller ones (8B q/k/v) but on Hopper.
	checkPlans(t, l, &W4{K: 14336, N: 4096, Group: 128}, map[int]string{1: "gemv mt1", 16: "gemv-mma v11 mt16",
		32: "gemv-mma v11 mt32", 64: above32, 100: above64, 129: above128, 300: "dequant+cublas"})
	// On Hopper v21 takes them from 3 · 2^23 weights (8B q/k/v), not 8B o.
	checkPlans(t, l, &W4{K: 4096, N: 6144, Group: 128}, map[int]string{
		33: onHopper(t, l, v21Plan64, "gemv-mma v11 mt64"), 65: onHopper(t, l, v21Plan, "dequant+cublas"),
		200: onHopper(t, l, v21Plan, "dequant+cublas")})
	checkPlans(t, l, &W4{K: 4096, N: 6080, Group: 128}, map[int]string{33: "gemv-mma v11 mt64", 65: "dequant+cublas"})
	checkPlans(t, l, &W4{K: 4096, N: 4096, Group: 128}, map[int]string{64: "gemv-mma v11 mt64", 128: "dequant+cublas"})
	// 2^25 weights exactly take the fused kernel; 64 columns fewer do not,
	// but on Hopper.
	checkPlans(t, l, &W4{K: 8192, N: 4096, Group: 128}, map[int]string{100: above64})
	checkPlans(t, l, &W4{K: 8192, N: 4032, Group: 128}, map[int]string{
		64: onHopper(t, l, v21Plan64, "gemv-mma v11 mt64"), 100: onHopper(t, l, v21Plan, "dequant+cublas"),
		200: onHopper(t, l, v21Plan, "dequant+cublas")})
	defer l.SetPath(PathAuto)
	for _, c := range []struct {
		path, M int
		want    string
	}{{PathGEMV, 3, "M ≤ 2"}, {PathMMA, 65, "M ≤ 64"}, {PathSwap, 33, "M ≤ 32"}} {
		if err := l.SetPath(c.path); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Plan(w, c.M); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("path %d forced at M=%d: %v; want an error naming %s", c.path, c.M, err, c.want)
		} else {
			t.Log(err)
		}
	}
	if err := l.SetPath(6); err == nil || !strings.Contains(err.Error(), "path 6") {
		t.Errorf("SetPath(6): %v; want an error naming path 6", err)
	}
}

// TestW8A16MatchesReference: 8-bit codes (one a byte) through the three
// GEMV kernels at every M they run, through the fused kernel (forced: the
// automatic plan does not take it for them) and through dequantize +
// cuBLAS, on the shapes and edges of the 4-bit tests; the automatic plan
// takes the CUDA-core GEMV to M = 2, the Tensor Core one to M = 64 and
// dequantize + cuBLAS beyond.
func TestW8A16MatchesReference(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(8, 8))
	for _, M := range []int{1, 2, 3, 4, 9, 16, 17, 64, 100} {
		for _, v := range []struct {
			group    int
			sym, act bool
		}{{128, false, false}, {128, true, false}, {-1, false, false}, {128, false, true}, {32, true, true}} {
			for _, p := range pathsFor(M, PathAuto, PathCuBLAS, PathFused) {
				runCase(t, l, r, gemmCase{M: M, K: 1024, N: 192, group: v.group, bits: 8, sym: v.sym, act: v.act, path: p})
			}
		}
	}
	for _, c := range []gemmCase{
		{M: 1, K: 14336, N: 256, group: 128}, {M: 2, K: 512, N: 4096, group: 128}, {M: 1, K: 16, N: 64, group: -1},
		{M: 2, K: 48, N: 64, group: 16}, {M: 1, K: 4096, N: 448, group: 128, split: []int{256, 64, 128}},
		{M: 2, K: 256, N: 448, group: 64, act: true, split: []int{256, 64, 128}},
	} {
		for _, p := range []int{PathGEMV, PathFused, PathMMA, PathSwap} {
			c.bits, c.path = 8, p
			runCase(t, l, r, c)
		}
	}
	// The fused kernel's own edges: a deep K (many splits), rows past its
	// 64 a CTA, a joined layer split across CTAs.
	for _, c := range []gemmCase{{M: 5, K: 14336, N: 256, group: 128}, {M: 40, K: 256, N: 192, group: 64, split: []int{64, 128}},
		{M: 7, K: 4096, N: 448, group: 128, act: true, split: []int{256, 64, 128}}} {
		c.bits, c.path = 8, PathFused
		runCase(t, l, r, c)
	}
	for _, edit := range []string{"zero-groups", "extreme", "subnormal"} {
		for _, p := range []int{PathGEMV, PathFused, PathCuBLAS, PathMMA, PathSwap} {
			runCase(t, l, r, gemmCase{M: 2, K: 1024, N: 64, group: 128, bits: 8, path: p, edit: edit})
		}
	}
	_, w := upload(t, l, randomLayer(r, 256, 128, 128, 8, false, false))
	defer w.Free(l)
	checkPlans(t, l, w, map[int]string{1: "gemv w8 mt1", 2: "gemv w8 mt2", 3: "gemv-mma v11 w8 mt8", 9: "gemv-mma v11 w8 mt16",
		16: "gemv-mma v11 w8 mt16", 17: "gemv-mma v11 w8 mt32", 64: "gemv-mma v11 w8 mt64", 65: "dequant w8+cublas"})
	if err := l.SetPath(PathFused); err != nil {
		t.Fatal(err)
	}
	defer l.SetPath(PathAuto)
	if v, err := l.Plan(w, 8); err != nil || !strings.HasPrefix(v, "fused v18 w8") {
		t.Errorf("forced fused kernel on 8-bit codes: %q, %v", v, err)
	}
}

// TestPlanFallsBack: a group size that is not a power of two is refused
// by the forced fused kernel and runs on the automatic path (dequantize +
// cuBLAS).
func TestPlanFallsBack(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(4, 4))
	c := gemmCase{M: 4, K: 480, N: 64, group: 96}
	_, w := upload(t, l, randomLayer(r, c.K, c.N, c.group, 4, false, false))
	defer w.Free(l)
	if err := l.SetPath(PathFused); err != nil {
		t.Fatal(err)
	}
	defer l.SetPath(PathAuto)
	if _, err := l.Plan(w, c.M); err == nil {
		t.Errorf("%+v: the forced fused kernel accepted it", c)
	} else {
		t.Log(err)
	}
	if err := l.SetPath(PathAuto); err != nil {
		t.Fatal(err)
	}
	if v, err := l.Plan(w, c.M); err != nil || v != "dequant+cublas" {
		t.Errorf("%+v: automatic plan %q, %v; want dequant+cublas", c, v, err)
	}
	runCase(t, l, r, c)
}

// TestDequantMatchesCPU: the GPU dequantizer equals the CPU decoder of the
// same layout bit for bit.
func TestDequantMatchesCPU(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(3, 3))
	for _, bits := range []int{4, 8} {
		g, w := upload(t, l, randomLayer(r, 512, 256, 128, bits, false, false))
		defer w.Free(l)
		W, _ := l.Alloc(512 * 256 * 2)
		defer l.Free(W)
		if err := l.Dequant(w, W); err != nil {
			t.Fatal(err)
		}
		got := make([]uint16, 512*256)
		if err := Download(l, got, W); err != nil {
			t.Fatal(err)
		}
		for i, want := range g.Dequantize() {
			if float16.Frombits(got[i]).Float32() != want {
				t.Fatalf("%d-bit codes, element %d: GPU %v, CPU %v", bits, i, float16.Frombits(got[i]).Float32(), want)
			}
		}
	}
}

func TestBadShapeIsAnError(t *testing.T) {
	l := openContext(t)
	w := &W4{K: 100, N: 64, Group: 100}
	if err := l.GemmW4(Buf{}, Buf{}, w, 1, Buf{}, Buf{}, Buf{}); err == nil {
		t.Fatal("K=100 accepted")
	} else {
		t.Log(err)
	}
	// A joined layer's parts must be multiples of 64 adding up to N.
	for _, cols := range [][]int{{100, 92}, {64, 64}, {64, 64, 64, 64}} {
		w := &W4{K: 256, N: 192, Group: 128, Cols: cols}
		outs := make([]Buf, len(cols))
		if err := l.GemmW4Into(Buf{}, outs, w, 1, Buf{}, Buf{}, Buf{}); err == nil {
			t.Errorf("parts %v of N=192 accepted", cols)
		} else {
			t.Log(err)
		}
	}
}

// TestSmallForSanitizer is a quick case for compute-sanitizer (memcheck,
// racecheck): every path at both code widths, act-order, and a K deep enough to split across
// CTAs so the workspace and last-CTA counter logic runs.
func TestSmallForSanitizer(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(9, 9))
	runCase(t, l, r, gemmCase{M: 3, K: 4096, N: 128, group: 128, act: true, path: PathFused})
	runCase(t, l, r, gemmCase{M: 2, K: 4096, N: 128, group: 128, act: true, path: PathGEMV})
	runCase(t, l, r, gemmCase{M: 1, K: 4096, N: 128, group: 64, path: PathGEMV})
	runCase(t, l, r, gemmCase{M: 2, K: 4096, N: 192, group: 128, path: PathGEMV, split: []int{64, 128}})
	runCase(t, l, r, gemmCase{M: 20, K: 512, N: 128, group: 128, path: PathFused})
	runCase(t, l, r, gemmCase{M: 70, K: 512, N: 128, group: 128, path: PathFused})
	runCase(t, l, r, gemmCase{M: 70, K: 256, N: 128, group: 128, path: PathCuBLAS})
	// 8-bit codes: the GEMV, the fused kernel (forced) and the dequantizer.
	runCase(t, l, r, gemmCase{M: 2, K: 4096, N: 128, group: 128, bits: 8, act: true, path: PathGEMV})
	runCase(t, l, r, gemmCase{M: 1, K: 4096, N: 192, group: 64, bits: 8, path: PathGEMV, split: []int{64, 128}})
	runCase(t, l, r, gemmCase{M: 20, K: 512, N: 128, group: 128, bits: 8, path: PathFused})
	runCase(t, l, r, gemmCase{M: 70, K: 256, N: 128, group: 128, bits: 8, path: PathCuBLAS})
	// The GEMV on the Tensor Cores at both of its row counts and widths.
	runCase(t, l, r, gemmCase{M: 6, K: 4096, N: 128, group: 128, act: true, path: PathMMA})
	runCase(t, l, r, gemmCase{M: 14, K: 4096, N: 192, group: 64, path: PathMMA, split: []int{64, 128}})
	runCase(t, l, r, gemmCase{M: 16, K: 4096, N: 128, group: 128, bits: 8, path: PathMMA})
	runCase(t, l, r, gemmCase{M: 40, K: 1024, N: 128, group: 128, path: PathMMA})
	runCase(t, l, r, gemmCase{M: 64, K: 1024, N: 128, group: 128, bits: 8, path: PathMMA})
	// v15 at each of its token counts, both widths, a split and a tail.
	runCase(t, l, r, gemmCase{M: 1, K: 4096, N: 128, group: 128, act: true, path: PathSwap})
	runCase(t, l, r, gemmCase{M: 13, K: 4096, N: 192, group: 64, path: PathSwap, split: []int{64, 128}})
	runCase(t, l, r, gemmCase{M: 32, K: 1040, N: 128, group: -1, path: PathSwap})
	runCase(t, l, r, gemmCase{M: 7, K: 4096, N: 128, group: 128, bits: 8, path: PathSwap})
	runGated(t, l, r, 4, 2048, 5, []int{PathSwap})
	// The gated epilogue: in the CTA (K = 256), through the workspace, and
	// dequantize + cuBLAS with gated_pairs_kernel.
	runGated(t, l, r, 4, 256, 2, pathsFor(2, PathFused))
	runGated(t, l, r, 4, 2048, 3, []int{PathMMA})
	runGated(t, l, r, 8, 2048, 1, []int{PathGEMV})
	runGated(t, l, r, 4, 256, 70, []int{PathFused, PathCuBLAS})
}

// fusedVariants is the fused kernel's instantiations (kFusedVariants in
// w4a16.cu): TestFusedVariantsMatchReference runs each and checks the
// next is refused, so the two counts cannot drift apart.
const fusedVariants = 27

// TestFusedVariantsMatchReference runs each of the fused kernel's (v18)
// instantiations, forced with LLMQ_W4_FUSED_VARIANT, on its edges: 3, 6
// and 7 n-tiles (CTAs with fewer tiles than warps), a partial row block
// and several (of up to 128 rows), a K of 65 steps (no whole number of stages), group 16,
// per-channel, act-order, split K into three outputs, gated and 8-bit.
func TestFusedVariantsMatchReference(t *testing.T) {
	settings := make([]string, fusedVariants)
	for v := range settings {
		settings[v] = fmt.Sprintf("LLMQ_W4_FUSED_VARIANT=%d", v)
	}
	inSettings(t, settings, func(t *testing.T, l *Context, setting string) {
		r := rand.New(rand.NewPCG(11, 11))
		for _, c := range []gemmCase{
			{M: 40, K: 1040, N: 192, group: 16, path: PathFused},
			{M: 100, K: 2048, N: 448, group: 128, path: PathFused, split: []int{256, 64, 128}},
			{M: 17, K: 4096, N: 64, group: -1, sym: true, act: true, path: PathFused},
			{M: 70, K: 1024, N: 192, group: 64, bits: 8, path: PathFused},
			{M: 300, K: 512, N: 192, group: 128, path: PathFused},
			// the largest scales with the last stage part-filled (66 steps):
			// v21's steps past the slice take zero scales
			{M: 40, K: 1056, N: 192, group: 32, bits: 4, path: PathFused, edit: "extreme"},
		} {
			runCase(t, l, r, c)
		}
		runGated(t, l, r, 4, 2048, 130, []int{PathFused})
		runGated(t, l, r, 8, 256, 33, []int{PathFused})
	})
	inSettings(t, []string{fmt.Sprintf("LLMQ_W4_FUSED_VARIANT=%d", fusedVariants)}, func(t *testing.T, l *Context, _ string) {
		if err := l.SetPath(PathFused); err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(12, 12))
		_, w := upload(t, l, randomLayer(r, 256, 128, 128, 4, false, false))
		defer w.Free(l)
		if v, err := l.Plan(w, 40); err == nil || !strings.Contains(err.Error(), "LLMQ_W4_FUSED_VARIANT") {
			t.Errorf("variant %d of %d: plan %q, error %v; want LLMQ_W4_FUSED_VARIANT refused", fusedVariants, fusedVariants, v, err)
		}
	})
}

// TestWgmmaSplitsMidGroup: v21's producer copies each group its stage's
// steps touch, found from the steps' place in K, and a consumer converts
// a group where one starts and at its split's first step, and zeroes the
// scales at its split's end inside a stage. Three K splits
// of 2048 rows (43, 43 and 42 steps) start and end inside groups of 2, 4 and 8
// steps, and inside a stage, for both plan variants (Hopper only).
func TestWgmmaSplitsMidGroup(t *testing.T) {
	inSettings(t, []string{"LLMQ_W4_FUSED_VARIANT=22 LLMQ_W4_SPLITS=3", "LLMQ_W4_FUSED_VARIANT=25 LLMQ_W4_SPLITS=3"},
		func(t *testing.T, l *Context, _ string) {
			if !isHopper(t, l) {
				t.Skip("v21 runs on Hopper's wgmma")
			}
			r := rand.New(rand.NewPCG(13, 13))
			for _, c := range []gemmCase{
				{M: 100, K: 2048, N: 448, group: 32, path: PathFused},
				{M: 100, K: 2048, N: 448, group: 64, path: PathFused},
				{M: 100, K: 2048, N: 448, group: 128, path: PathFused},
				{M: 70, K: 2048, N: 192, group: 64, bits: 8, path: PathFused},
			} {
				// the case is only what it claims if v21 runs in three splits
				// (the path set for each: runCase sets it back to auto)
				if err := l.SetPath(c.path); err != nil {
					t.Fatal(err)
				}
				w := &W4{K: c.K, N: c.N, Group: c.group, Bits: c.bits}
				if v, err := l.Plan(w, c.M); err != nil || !strings.HasPrefix(v, "fused v21") || !strings.HasSuffix(v, "splits3") {
					t.Fatalf("group %d, %d-bit: plan %q, %v; want v21 in three K splits", c.group, w.codeBits(), v, err)
				}
				runCase(t, l, r, c)
			}
		})
}

// v21Plan64 and v21Plan are the plan's v21 variants: 64 tokens over four
// tiles in two warpgroups, eight steps a stage in four stages, and 128
// tokens, eight steps a stage in three.
const (
	v21Plan64 = "fused v21 wgmma-rs n64 t4 wg2 u8 s4"
	v21Plan   = "fused v21 wgmma-rs n128 t4 wg2 u8 s3"
)

// fusedAbove32, fusedAbove64 and fusedAbove128 are the plan's kernels for
// 33–64, 65–128 and 129–256 rows of a large 4-bit layer in groups of 128:
// v21 on Hopper; on other GPUs v18, then dequantize + cuBLAS. (The
// library reports no compute capability, so Hopper is told by name: H100,
// H200, H800, H20, GH200.)
func fusedAbove32(t *testing.T, l *Context) string {
	return onHopper(t, l, v21Plan64, "fused v18 mb4 u2")
}

func fusedAbove64(t *testing.T, l *Context) string {
	return onHopper(t, l, v21Plan, "fused v18 mb4 u2")
}

func fusedAbove128(t *testing.T, l *Context) string { return onHopper(t, l, v21Plan, "dequant+cublas") }

// onHopper is hopper's plan on Hopper, other's elsewhere.
func onHopper(t *testing.T, l *Context, hopper, other string) string {
	if isHopper(t, l) {
		return hopper
	}
	return other
}

func isHopper(t *testing.T, l *Context) bool {
	t.Helper()
	dev, err := l.Lib().Device()
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(dev.Name, "H100") || strings.Contains(dev.Name, "H20") || strings.Contains(dev.Name, "H800")
}

// TestPlanTakesWgmmaWhenAsked: LLMQ_W4_WGMMA_MAX_M (default 256) puts
// v21 (wgmma) in the plan on Hopper above 32 rows on layers of 3 · 2^23
// weights or more (4-bit codes), up to the setting: in v18's place to 128
// rows (fused_max_m), in dequantize + cuBLAS's past it. Groups of 16 stay
// on v18, as do other GPUs.
func TestPlanTakesWgmmaWhenAsked(t *testing.T) {
	inSettings(t, []string{"LLMQ_W4_WGMMA_MAX_M=100"}, func(t *testing.T, l *Context, _ string) {
		v64, v128 := fusedAbove32(t, l), fusedAbove64(t, l)
		checkPlans(t, l, &W4{K: 4096, N: 28672, Group: 128},
			map[int]string{16: "gemv-swap v15", 32: onHopper(t, l, v21Plan64, "gemv-swap v15"), 33: v64, 64: v64, 65: v128,
				100: v128, 101: "fused v18 mb4", 129: "dequant+cublas"})
		checkPlans(t, l, &W4{K: 4096, N: 28672, Group: 16}, map[int]string{64: "fused v18 mb4", 100: "fused v18 mb4"})
	})
	inSettings(t, []string{"LLMQ_W4_WGMMA_MAX_M=200"}, func(t *testing.T, l *Context, _ string) {
		checkPlans(t, l, &W4{K: 4096, N: 28672, Group: 128},
			map[int]string{128: fusedAbove64(t, l), 200: fusedAbove128(t, l), 201: "dequant+cublas"})
		checkPlans(t, l, &W4{K: 4096, N: 28672, Group: 16}, map[int]string{129: "dequant+cublas"})
	})
}

// TestGatedGEMMMatchesReference: a gate and an up layer interleaved in
// 32-column halves (pack.InterleaveGPU) and run with W4.Gated write
// act(gate)·up, half the columns, from the GEMM's epilogue (runGated), on
// every path, both activations, 4- and 8-bit codes, one K split (K = 256:
// the tile's sums meet in the CTA) and several (K = 2048: in the
// workspace).
func TestGatedGEMMMatchesReference(t *testing.T) {
	l := openContext(t)
	r := rand.New(rand.NewPCG(uint64(rand.Int64()), 9))
	for _, bits := range []int{4, 8} {
		for _, K := range []int{256, 2048} {
			for _, M := range []int{1, 2, 5, 16, 32, 40, 64, 65, 130} { // 32: v15's scaled instantiation
				runGated(t, l, r, bits, K, M, pathsFor(M, PathAuto, PathFused))
			}
		}
	}
}

// runGated checks one gated GEMM of M rows (gate and up K × 192 each,
// random) on each of paths against float64 products of the two layers,
// rounded to fp16 before the activation as the GEMM's outputs would be;
// twice a path (the workspace must come back zeroed). The activation is
// SiLU for even M, GELU-tanh for odd.
func runGated(t *testing.T, l *Context, r *rand.Rand, bits, K, M int, paths []int) {
	t.Helper()
	act := func(g float64, gating Gating) float64 {
		if gating == GatedGELU {
			return 0.5 * g * (1 + math.Tanh(0.7978845608028654*(g+0.044715*g*g*g)))
		}
		return g / (1 + math.Exp(-g))
	}
	f16 := func(v float64) float64 { return float64(float16.Fromfloat32(float32(v)).Float32()) }
	const I = 192
	gl, ul := randomLayer(r, K, I, 128, bits, false, false), randomLayer(r, K, I, 128, bits, true, false)
	gg, err := gl.GPULayout()
	if err != nil {
		t.Fatal(err)
	}
	ug, err := ul.GPULayout()
	if err != nil {
		t.Fatal(err)
	}
	il, err := pack.InterleaveGPU(gg, ug)
	if err != nil {
		t.Fatal(err)
	}
	w, err := l.UploadW4(il)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Free(l)
	gating := []Gating{GatedSiLU, GatedGELU}[M%2]
	w.Gated = gating
	abits, avals := randomHalf(r, M*K)
	A, _ := AllocFrom(l, abits)
	out, _ := l.Alloc(M * I * 2)
	ws, _ := l.Alloc(l.Lib().WorkspaceBytes(M, 2*I))
	l.Memset(ws, 0, ws.Bytes)
	scratch, _ := l.Alloc(K * 2 * I * 2)
	for _, b := range []Buf{A, out, ws, scratch} {
		defer l.Free(b)
	}
	gref, uref := reference(avals, gg.Dequantize(), nil, M, K, I), reference(avals, ug.Dequantize(), nil, M, K, I)
	defer l.SetPath(PathAuto)
	for _, p := range paths {
		if err := l.SetPath(p); err != nil {
			t.Fatal(err)
		}
		variant, err := l.Plan(w, M)
		if err != nil {
			t.Fatal(err)
		}
		for run := 0; run < 2; run++ {
			if err := l.Memset(out, 0xff, out.Bytes); err != nil { // poison: 0xffff is NaN
				t.Fatal(err)
			}
			if err := l.GemmW4(A, out, w, M, ws, scratch, Buf{}); err != nil {
				t.Fatalf("%d-bit K=%d M=%d path %d (%s): %v", bits, K, M, p, variant, err)
			}
			got := make([]uint16, M*I)
			if err := Download(l, got, out); err != nil {
				t.Fatal(err)
			}
			var num, den float64
			for i, h := range got {
				v, want := float64(float16.Frombits(h).Float32()), act(f16(gref[i]), gating)*f16(uref[i])
				if math.IsNaN(v) || math.IsInf(v, 0) {
					t.Fatalf("%d-bit K=%d M=%d path %d (%s) run %d: output %d not written or not finite", bits, K, M, p, variant, run, i)
				}
				num += (v - want) * (v - want)
				den += want * want
			}
			if rel := math.Sqrt(num / den); rel > 2e-3 {
				t.Fatalf("%d-bit K=%d M=%d path %d (%s) run %d, gating %d: relative error %.3g > 2e-3", bits, K, M, p, variant, run, gating, rel)
			} else if run == 0 {
				t.Logf("%d-bit K=%d M=%d (%s), gating %d: rel err %.2e", bits, K, M, variant, gating, rel)
			}
		}
	}
}

// TestWhereOff: the failure message of a wrong product names the worst
// element and the span of the wrong ones (a hand-made 3 × 4 product whose
// row 2, columns 1–2 are off). No GPU needed.
func TestWhereOff(t *testing.T) {
	ref := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	out := make([]uint16, len(ref))
	for i, v := range ref {
		out[i] = float16.Fromfloat32(float32(v)).Bits()
	}
	out[9] = float16.Fromfloat32(14).Bits()  // row 2, column 1: off by 4
	out[10] = float16.Fromfloat32(12).Bits() // row 2, column 2: off by 1
	got := whereOff(out, ref, 3, 4, 1)
	want := "largest error at row 2 column 1: 14, want 10; 2 of 12 elements off by > 0.1·RMS, rows 2–2, columns 1–2"
	if got != want {
		t.Errorf("whereOff = %q, want %q", got, want)
	}
}

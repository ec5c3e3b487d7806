//go:build cgo

package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/x448/float16"
)

// TestRMSNormMatchesReference checks rmsnorm_kernel against float64 on
// every form the model calls — the plain norm, the residual add before it
// (fp16, or a GEMM's fp32 sums, zeroed after), Gemma 3's normed residual,
// the gathered rows of a last-token norm, a mixture's experts summed into
// the residual (k = 3, 8 or 11 of 16, the sum zeroed after), and the
// attention's delta or sums a RMSNormRouter left pending before them — at
// hidden sizes that take each register layout
// (1, 2 and 4 chunks of four values a thread, a last warp partly idle),
// and that a hidden size the kernel cannot hold is refused with its name.
//
// It runs with LLMQ_COMBINE_EARLY on and off (the experts' ids and
// weights read before the kernel's PDL gate, or after); here the kernel
// follows host copies, so both must give the reference. The chain the
// early read counts on (the routing two launches ahead) is the model
// tests' (the mixtures' logits against the CPU).
func TestRMSNormMatchesReference(t *testing.T) {
	onAndOff(t, "LLMQ_COMBINE_EARLY", func(t *testing.T, x *Context, _ bool) { testRMSNorm(t, x) })
}

func testRMSNorm(t *testing.T, x *Context) {
	r := rand.New(rand.NewPCG(11, 12))
	const eps = 1e-6
	for _, H := range []int{128, 260, 4096, 5120, 12288} {
		for _, form := range []string{"plain", "delta", "sums", "normed delta", "rows", "experts", "delta then experts", "sums then experts"} {
			t.Run(fmt.Sprintf("H%d/%s", H, form), func(t *testing.T) {
				const T = 3
				xv := make([]float32, T*H)
				for i := range xv {
					xv[i] = float32(r.NormFloat64() * 4)
				}
				w, dw := make([]float32, H), make([]float32, H)
				for i := range w {
					w[i], dw[i] = float32(0.5+r.Float64()), float32(r.NormFloat64())
				}
				db, dv := randomHalf(r, T*H)
				// The sums: the delta's values and what fp16 cannot hold, so
				// that a kernel rounding them to fp16 would miss it.
				sv := make([]float32, len(dv))
				for i := range sv {
					sv[i] = dv[i] + float32(r.NormFloat64()*1e-3)
				}
				rows := []int32{2, 0}
				// A mixture's outputs: row t's k of 16 experts, slot t·k+j;
				// k 11 and 3 on the small rows, whose combine takes eight
				// experts' rows at a time (rmsnorm_kernel's MAXT 512): a
				// round and a part, a part.
				const E = 16
				k := map[int]int{128: 11, 260: 3}[H]
				if k == 0 {
					k = 8
				}
				yv, ids, wts := make([]float32, T*k*H), make([]int32, T*k), make([]float32, T*k)
				for i := range yv {
					yv[i] = float32(r.NormFloat64())
				}
				for t := range T {
					for j, e := range r.Perm(E)[:k] {
						ids[t*k+j], wts[t*k+j] = int32(e), float32(r.Float64())
					}
				}
				var experts ExpertSum
				xs, _ := AllocFrom(x, xv)
				wd, _ := AllocFrom(x, w)
				out, _ := x.Alloc(T * H * 2)
				var delta, sums, deltaNorm, rowsd Buf
				n := T
				switch form {
				case "sums":
					sums, _ = AllocFrom(x, sv)
				case "sums then experts":
					sums, _ = AllocFrom(x, sv)
					experts.Y, _ = AllocFrom(x, yv)
					experts.IDs, _ = AllocFrom(x, ids)
					experts.Weights, _ = AllocFrom(x, wts)
					experts.K = k
				case "normed delta":
					deltaNorm, _ = AllocFrom(x, dw)
					fallthrough
				case "delta":
					delta, _ = AllocFrom(x, db)
				case "rows":
					rowsd, _ = AllocFrom(x, rows)
					n = len(rows)
				case "delta then experts":
					delta, _ = AllocFrom(x, db)
					fallthrough
				case "experts":
					experts.Y, _ = AllocFrom(x, yv)
					experts.IDs, _ = AllocFrom(x, ids)
					experts.Weights, _ = AllocFrom(x, wts)
					experts.K = k
				}
				defer func() {
					for _, b := range []Buf{xs, wd, out, delta, sums, deltaNorm, rowsd, experts.Y, experts.IDs, experts.Weights} {
						x.Free(b)
					}
				}()
				if err := x.RMSNormExperts(xs, delta, sums, experts, deltaNorm, rowsd, wd, out, n, H, eps); err != nil {
					t.Fatal(err)
				}
				for _, b := range []struct {
					name string
					buf  Buf
					n    int
				}{{"the experts' outputs", experts.Y, len(yv)}, {"the sums", sums, len(sv)}} {
					if b.buf.Nil() {
						continue
					}
					left := make([]float32, b.n)
					if err := Download(x, left, b.buf); err != nil {
						t.Fatal(err)
					}
					if i := slices.IndexFunc(left, func(v float32) bool { return v != 0 }); i >= 0 {
						t.Fatalf("%s hold %v at %d after the norm (want them zeroed)", b.name, left[i], i)
					}
				}
				got, gotX := make([]uint16, n*H), make([]float32, T*H)
				if err := errors.Join(Download(x, got, out), Download(x, gotX, xs)); err != nil {
					t.Fatal(err)
				}
				for i := 0; i < n; i++ {
					src := i
					if form == "rows" {
						src = int(rows[i])
					}
					// The residual row after the add, in float64.
					res := make([]float64, H)
					var dss float64
					for j := range res {
						d := float64(dv[src*H+j])
						dss += d * d
					}
					dinv := 1 / math.Sqrt(dss/float64(H)+eps)
					var ss float64
					for j := range res {
						res[j] = float64(xv[src*H+j])
						switch form {
						case "delta":
							res[j] += float64(dv[src*H+j])
						case "sums":
							res[j] += float64(sv[src*H+j])
						case "normed delta":
							res[j] += float64(dv[src*H+j]) * dinv * float64(dw[j])
						case "delta then experts", "sums then experts":
							if form == "sums then experts" {
								res[j] += float64(sv[src*H+j])
							} else {
								res[j] += float64(dv[src*H+j])
							}
							fallthrough
						case "experts":
							for e := range k {
								res[j] += float64(wts[src*k+e]) * float64(yv[(src*k+e)*H+j])
							}
						}
						ss += res[j] * res[j]
					}
					inv := 1 / math.Sqrt(ss/float64(H)+eps)
					for j := range res {
						if g := float64(gotX[src*H+j]); math.Abs(g-res[j]) > 1e-5*(1+math.Abs(res[j])) {
							t.Fatalf("row %d: x[%d] = %v after the add, want %v", src, j, g, res[j])
						}
						want := res[j] * inv * float64(w[j])
						if g := float64(float16.Frombits(got[i*H+j]).Float32()); math.Abs(g-want) > 1e-3*math.Abs(want)+1e-4 {
							t.Fatalf("out row %d column %d: %v, want %v", i, j, g, want)
						}
					}
				}
			})
		}
	}
	xs, _ := x.Alloc(4 * (MaxNormHidden + 4))
	defer x.Free(xs)
	for _, H := range []int{130, MaxNormHidden + 4} {
		if err := x.RMSNorm(xs, Buf{}, Buf{}, Buf{}, xs, xs, 1, H, eps); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("hidden size %d", H)) {
			t.Errorf("hidden size %d: %v, want a refusal naming it", H, err)
		}
	}
}

// TestRMSNormRouterMatchesSeparate: a mixture's norm with its router in
// one launch (RMSNormRouter) writes the normed rows RMSNorm writes, bit
// for bit, and the logits MoERouter computes from them, bit for bit (one
// piece of arithmetic, router_dot), and leaves x as it was — in one
// launch and with LLMQ_MOE_NORM_ROUTER=0 (the norm, then the router); its
// delta as fp16 rows or as fp32 sums (against RMSNormExperts with the same
// sums), which it leaves in place for the next norm.
// Shapes: qwen3-30b-a3b's (hidden 2048, 128 experts: 32 CTAs a row of 4
// experts each), a Mixtral-like 4096 with 8 experts (2 CTAs), 256
// experts over a row of 64 (one warp a CTA: 256 CTAs), a hidden size of 4
// chunks a thread. What it cannot run is refused.
func TestRMSNormRouterMatchesSeparate(t *testing.T) {
	onAndOff(t, "LLMQ_MOE_NORM_ROUTER", func(t *testing.T, x *Context, _ bool) {
		r := rand.New(rand.NewPCG(21, 22))
		const eps = 1e-6
		for _, c := range []struct {
			T, H, E int
			sums    bool
		}{{1, 2048, 128, false}, {1, 2048, 128, true}, {3, 2048, 128, false}, {3, 2048, 128, true}, {2, 4096, 8, false},
			{2, 4096, 8, true}, {2, 64, 256, false}, {1, 6144, 16, false}, {1, 6144, 16, true}, {1, 12288, 60, false},
			{1, 12288, 60, true}} {
			name := fmt.Sprintf("%+v", c)
			xv, w, W := make([]float32, c.T*c.H), make([]float32, c.H), make([]float32, c.E*c.H)
			for i := range xv {
				xv[i] = float32(r.NormFloat64() * 4)
			}
			for i := range w {
				w[i] = float32(0.5 + r.Float64())
			}
			for i := range W {
				W[i] = float32(r.NormFloat64() * 0.05)
			}
			db, dv := randomHalf(r, c.T*c.H)
			xs, _ := AllocFrom(x, xv)
			xs2, _ := AllocFrom(x, xv)
			delta, _ := AllocFrom(x, db)
			var sums, sums2 Buf // fp32 sums, not fp16-exact, and their copy for the reference norm (which zeroes it)
			routed := delta
			for i := range dv {
				dv[i] += float32(r.NormFloat64() * 1e-3)
			}
			if c.sums {
				sums, _ = AllocFrom(x, dv)
				sums2, _ = AllocFrom(x, dv)
				routed = Buf{}
			}
			wd, _ := AllocFrom(x, w)
			Wd, _ := AllocFrom(x, W)
			out, _ := x.Alloc(c.T * c.H * 2)
			out2, _ := x.Alloc(c.T * c.H * 2)
			logits, _ := x.Alloc(c.T * c.E * 4)
			logits2, _ := x.Alloc(c.T * c.E * 4)
			if err := x.RMSNormRouter(xs, routed, sums, wd, out, Wd, logits, c.T, c.H, c.E, eps); err != nil {
				t.Fatal(err)
			}
			// One reference norm: RMSNorm adds its delta into xs2, so running
			// it before the sums' norm would add both.
			var ref error
			if c.sums {
				ref = x.RMSNormExperts(xs2, Buf{}, sums2, ExpertSum{}, Buf{}, Buf{}, wd, out2, c.T, c.H, eps)
			} else {
				ref = x.RMSNorm(xs2, delta, Buf{}, Buf{}, wd, out2, c.T, c.H, eps)
			}
			if err := errors.Join(ref, x.MoERouter(out2, Wd, logits2, c.T, c.E, c.H)); err != nil {
				t.Fatal(err)
			}
			h, h2 := make([]uint16, c.T*c.H), make([]uint16, c.T*c.H)
			l, l2 := make([]float32, c.T*c.E), make([]float32, c.T*c.E)
			gotX := make([]float32, c.T*c.H)
			if err := errors.Join(Download(x, h, out), Download(x, h2, out2), Download(x, l, logits), Download(x, l2, logits2),
				Download(x, gotX, xs)); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(h, h2) {
				t.Fatalf("%s: the normed rows differ from RMSNorm's (RMSNormExperts' with the sums)", name)
			}
			for i := range l {
				if l[i] != l2[i] {
					t.Fatalf("%s: logit %d (row %d, expert %d) %v, MoERouter's %v", name, i, i/c.E, i%c.E, l[i], l2[i])
				}
			}
			if !slices.Equal(gotX, xv) {
				t.Fatalf("%s: x changed (the next norm adds the delta)", name)
			}
			if c.sums {
				// The reference norm added the sums into its x: x + sums in
				// fp32, row by row (so the sums' offsets are checked against
				// the host, not only router against reference).
				refX := make([]float32, len(xv))
				if err := Download(x, refX, xs2); err != nil {
					t.Fatal(err)
				}
				for i := range refX {
					if want := xv[i] + dv[i]; refX[i] != want {
						t.Fatalf("%s: the reference's x[%d] = %v, want x + sums = %v", name, i, refX[i], want)
					}
				}
				left := make([]float32, len(dv))
				if err := Download(x, left, sums); err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(left, dv) {
					t.Fatalf("%s: the sums changed (the next norm adds and zeroes them)", name)
				}
			}
			for _, b := range []Buf{xs, xs2, delta, sums, sums2, wd, Wd, out, out2, logits, logits2} {
				x.Free(b)
			}
		}
		big, _ := x.Alloc(4)
		defer x.Free(big)
		for _, bad := range []struct {
			delta, sums, router, logits Buf
			n, E                        int
			want                        string
		}{
			{Buf{}, Buf{}, big, big, 1, 128, "one of a delta and sums"}, {big, big, big, big, 1, 128, "one of a delta and sums"},
			{big, Buf{}, Buf{}, big, 1, 128, "router's weights"}, {big, Buf{}, big, Buf{}, 1, 128, "logits"},
			{big, Buf{}, big, big, 1, 300, "300 experts"}, {Buf{}, big, big, big, 70000, 8, "70000 rows"},
		} {
			err := x.RMSNormRouter(big, bad.delta, bad.sums, big, big, bad.router, bad.logits, bad.n, 2048, bad.E, eps)
			if err == nil || !strings.Contains(err.Error(), bad.want) {
				t.Errorf("%+v: %v, want a refusal naming %q", bad, err, bad.want)
			}
		}
	})
}

// TestRMSNormAddsPendingDeltaFirst: with both a delta and the experts'
// outputs (the delta a RMSNormRouter left pending, fp16 or fp32 sums), the
// residual is (x + delta) + Σ experts in fp32, the CPU's order, not x +
// (delta + Σ): at x = 2^27 (fp32 spacing 16) a delta of 6 and experts
// summing to 6 leave x as it was in the CPU's order, and would make it
// 2^27 + 16 in the other.
func TestRMSNormAddsPendingDeltaFirst(t *testing.T) {
	x := openContext(t)
	const H, k = 128, 2
	xv, w := make([]float32, H), make([]float32, H)
	yv, ids, wts := make([]float32, k*H), []int32{3, 1}, []float32{0.5, 0.5}
	dh, ds := make([]uint16, H), make([]float32, H)
	for i := range xv {
		xv[i], w[i], dh[i], ds[i] = 1<<27, 1, float16.Fromfloat32(6).Bits(), 6
		yv[i], yv[H+i] = 6, 6 // 0.5·6 + 0.5·6 = 6
	}
	bufs := make([]Buf, 8)
	var err error
	for i, v := range []any{xv, w, dh, yv, ids, wts, ds, xv} {
		switch v := v.(type) {
		case []float32:
			bufs[i], err = AllocFrom(x, v)
		case []uint16:
			bufs[i], err = AllocFrom(x, v)
		case []int32:
			bufs[i], err = AllocFrom(x, v)
		}
		if err != nil {
			t.Fatal(err)
		}
		defer x.Free(bufs[i])
	}
	out, _ := x.Alloc(H * 2)
	defer x.Free(out)
	e := ExpertSum{Y: bufs[3], IDs: bufs[4], Weights: bufs[5], K: k}
	for _, c := range []struct {
		name        string
		xs, d, sums Buf
	}{{"delta", bufs[0], bufs[2], Buf{}}, {"sums", bufs[7], Buf{}, bufs[6]}} {
		if err := Upload(x, e.Y, yv); err != nil { // the first run zeroed them
			t.Fatal(err)
		}
		if err := x.RMSNormExperts(c.xs, c.d, c.sums, e, Buf{}, Buf{}, bufs[1], out, 1, H, 1e-6); err != nil {
			t.Fatal(err)
		}
		got := make([]float32, H)
		if err := Download(x, got, c.xs); err != nil {
			t.Fatal(err)
		}
		for i, v := range got {
			if v != 1<<27 {
				t.Fatalf("%s: x[%d] = %v after it and the experts, want %v ((x + delta) + experts in fp32)", c.name, i, v, float32(1<<27))
			}
		}
	}
	if err := x.RMSNormExperts(bufs[0], bufs[2], Buf{}, e, bufs[1], Buf{}, bufs[1], out, 1, H, 1e-6); err == nil {
		t.Error("a delta norm with a pending delta and experts: no error")
	}
	if err := x.RMSNormExperts(bufs[0], bufs[2], bufs[6], ExpertSum{}, Buf{}, Buf{}, bufs[1], out, 1, H, 1e-6); err == nil ||
		!strings.Contains(err.Error(), "a delta and sums") {
		t.Errorf("a delta and sums: %v, want a refusal naming both", err)
	}
	if err := x.RMSNormExperts(bufs[0], Buf{}, bufs[6], ExpertSum{}, Buf{}, bufs[4], bufs[1], out, 1, H, 1e-6); err == nil ||
		!strings.Contains(err.Error(), "sums with rows") {
		t.Errorf("sums with rows: %v, want a refusal naming them", err)
	}
}

package mat

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestExp32Accuracy(t *testing.T) {
	worst := 0.0
	for i := 0; i < 1_000_000; i++ {
		x := float32(-87 + 175*float64(i)/1e6)
		got := float64(Exp32(x))
		want := math.Exp(float64(x))
		if rel := math.Abs(got-want) / want; rel > worst {
			worst = rel
		}
	}
	// Measured 8.15e-8 (0.7 ulp); the bound is one float32 ulp (2^-23).
	t.Logf("Exp32 worst relative error %.3g", worst)
	if worst > 0x1p-23 {
		t.Fatalf("worst relative error %.3g > 1.19e-7 (1 ulp)", worst)
	}
	if Exp32(0) != 1 || Exp32(-200) != 0 || !math.IsInf(float64(Exp32(100)), 1) {
		t.Fatalf("edge cases: exp(0)=%v exp(-200)=%v exp(100)=%v", Exp32(0), Exp32(-200), Exp32(100))
	}
}

// gemmTol bounds |float32 GEMM − float64 product| in the tests below, whose
// outputs are O(1–4) (a float32 ulp there is 2.4e-7–4.8e-7): the worst
// measured is 1.5e-6 (gonum and OpenBLAS), the bound ~10 ulps; a wrong
// index, stride or transpose is off by O(0.1).
const gemmTol = 4e-6

// TestGemmAgainstNaive checks every transpose combination and strided
// operands against a float64 triple loop.
func TestGemmAgainstNaive(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	m, n, k := 37, 29, 53
	for _, ta := range []bool{false, true} {
		for _, tb := range []bool{false, true} {
			lda, ldb, ldc := k+3, n+5, n+2
			ar, br := m, k
			if ta {
				ar, lda = k, m+3
			}
			if tb {
				br, ldb = n, k+5
			}
			a := make([]float32, ar*lda)
			b := make([]float32, br*ldb)
			c := make([]float32, m*ldc)
			for i := range a {
				a[i] = r.Float32() - 0.5
			}
			for i := range b {
				b[i] = r.Float32() - 0.5
			}
			for i := range c {
				c[i] = r.Float32()
			}
			c0 := append([]float32(nil), c...)
			Gemm(ta, tb, m, n, k, 0.5, a, lda, b, ldb, 2, c, ldc)
			worst := 0.0
			for i := 0; i < m; i++ {
				for j := 0; j < n; j++ {
					var s float64
					for p := 0; p < k; p++ {
						var av, bv float32
						if ta {
							av = a[p*lda+i]
						} else {
							av = a[i*lda+p]
						}
						if tb {
							bv = b[j*ldb+p]
						} else {
							bv = b[p*ldb+j]
						}
						s += float64(av) * float64(bv)
					}
					want := 0.5*s + 2*float64(c0[i*ldc+j])
					d := math.Abs(float64(c[i*ldc+j]) - want)
					worst = max(worst, d)
					if d > gemmTol {
						t.Fatalf("transA=%v transB=%v: C[%d,%d]=%v want %v", ta, tb, i, j, c[i*ldc+j], want)
					}
				}
			}
			t.Logf("transA=%v transB=%v: worst %.3g", ta, tb, worst)
		}
	}
}

func TestParallelForCoversRange(t *testing.T) {
	for _, n := range []int{0, 1, 7, 100, 1001} {
		seen := make([]int32, n)
		ParallelFor(n, 3, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				seen[i]++
			}
		})
		for i, s := range seen {
			if s != 1 {
				t.Fatalf("n=%d: index %d visited %d times", n, i, s)
			}
		}
	}
}

func BenchmarkExp32(b *testing.B) {
	x := float32(-3.7)
	var s float32
	for i := 0; i < b.N; i++ {
		s += Exp32(x)
	}
	_ = s
}

func BenchmarkMathExp(b *testing.B) {
	x := -3.7
	var s float64
	for i := 0; i < b.N; i++ {
		s += math.Exp(x)
	}
	_ = s
}

// TestGemmSingleRow: the matrix-vector path (m = 1) against the naive
// product, both transpositions of B, with beta.
func TestGemmSingleRow(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	n, k := 700, 129
	a := make([]float32, k)
	for i := range a {
		a[i] = r.Float32() - 0.5
	}
	for _, tb := range []bool{false, true} {
		b := make([]float32, n*k)
		for i := range b {
			b[i] = r.Float32() - 0.5
		}
		c := make([]float32, n)
		for i := range c {
			c[i] = 1
		}
		ldb := n
		if tb {
			ldb = k
		}
		Gemm(false, tb, 1, n, k, 2, a, k, b, ldb, 0.5, c, n)
		worst := 0.0
		for j := 0; j < n; j++ {
			var s float64
			for p := 0; p < k; p++ {
				bv := b[p*n+j]
				if tb {
					bv = b[j*k+p]
				}
				s += float64(a[p]) * float64(bv)
			}
			want := 2*s + 0.5
			d := math.Abs(float64(c[j]) - want)
			worst = max(worst, d)
			if d > gemmTol {
				t.Fatalf("transB=%v: c[%d] = %v, want %v", tb, j, c[j], want)
			}
		}
		t.Logf("transB=%v: worst %.3g", tb, worst)
	}
}

// BenchmarkGemm times the GEMM of an MLP projection over a 2048-token
// window (2048×512 · (1536×512)ᵀ), the shape that dominates prefill.
func BenchmarkGemm(b *testing.B) {
	m, n, k := 2048, 1536, 512
	r := rand.New(rand.NewPCG(1, 1))
	a, w, c := make([]float32, m*k), make([]float32, n*k), make([]float32, m*n)
	for i := range a {
		a[i] = r.Float32()
	}
	for i := range w {
		w[i] = r.Float32()
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		MatMulT(c, a, w, m, k, n)
	}
	b.ReportMetric(2*float64(m*n*k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}

// Package mat holds the few dense float32 kernels the CPU forward pass and
// the quantizers need: a general matrix multiply and a parallel-for helper.
//
// The default build uses gonum's pure-Go BLAS, so llmq builds anywhere with
// `go build`. Building with `-tags openblas` routes Gemm through OpenBLAS's
// cblas_sgemm (Debian: libopenblas-dev), 8.4× faster on two AVX2 cores
// (BenchmarkGemm: 111.6 vs 13.3 GFLOP/s);
// both paths compute the same product up to float32 summation order.
package mat

import (
	"runtime"
	"sync"
)

// Gemm computes C = alpha·op(A)·op(B) + beta·C for row-major matrices, where
// op(X) is X or Xᵀ. A is m×k after op, B is k×n after op, C is m×n; lda, ldb
// and ldc are the row strides of the stored (not transposed) matrices.
//
// The work is split across goroutines by rows of C (or by columns when C
// has few rows, as in decoding), each piece running the single-threaded
// kernel: all parallelism lives in Go, so no BLAS thread pool spins against
// the goroutines doing the element-wise work between products.
func Gemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	if m == 1 {
		// A row times a matrix is a matrix-vector product: GEMM kernels
		// repack the whole matrix per call, which doubles the memory
		// traffic that bounds decoding.
		gemvRow(transB, n, k, alpha, a, b, ldb, beta, c)
		return
	}
	w := Workers()
	if w == 1 || int64(m)*int64(n)*int64(k) < 1<<18 {
		gemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
		return
	}
	if m >= 4*w {
		ParallelFor(m, 4, func(lo, hi int) {
			ao := lo * lda
			if transA {
				ao = lo
			}
			gemm(transA, transB, hi-lo, n, k, alpha, a[ao:], lda, b, ldb, beta, c[lo*ldc:], ldc)
		})
		return
	}
	ParallelFor(n, 16, func(lo, hi int) {
		bo := lo
		if transB {
			bo = lo * ldb
		}
		gemm(transA, transB, m, hi-lo, k, alpha, a, lda, b[bo:], ldb, beta, c[lo:], ldc)
	})
}

// gemvRow computes c[0:n] = alpha·a·op(B) + beta·c for one row a, split
// across goroutines by columns of the result.
func gemvRow(transB bool, n, k int, alpha float32, a, b []float32, ldb int, beta float32, c []float32) {
	ParallelFor(n, 256, func(lo, hi int) {
		if transB { // B is n×k: c = B[lo:hi]·a
			gemv(false, hi-lo, k, alpha, b[lo*ldb:], ldb, a, beta, c[lo:])
		} else { // B is k×n: c = B[:, lo:hi]ᵀ·a
			gemv(true, k, hi-lo, alpha, b[lo:], ldb, a, beta, c[lo:])
		}
	})
}

// GemmSerial is Gemm on the calling goroutine alone, for callers that are
// already parallel (attention runs one head per goroutine).
func GemmSerial(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	gemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
}

// MatMulT computes y[t,out] = x[t,in]·W[out,in]ᵀ, the shape of every linear
// layer in a transformer (weights stored out×in as in PyTorch).
func MatMulT(y, x, w []float32, t, in, out int) {
	Gemm(false, true, t, out, in, 1, x, in, w, in, 0, y, out)
}

// Workers is the number of goroutines ParallelFor uses.
func Workers() int { return runtime.GOMAXPROCS(0) }

// ParallelFor calls fn(lo, hi) on disjoint ranges covering [0, n), in
// parallel, and returns when all calls have returned. Small n runs inline.
func ParallelFor(n, minChunk int, fn func(lo, hi int)) {
	w := Workers()
	if minChunk < 1 {
		minChunk = 1
	}
	if n <= minChunk || w == 1 {
		fn(0, n)
		return
	}
	chunks := (n + minChunk - 1) / minChunk
	if chunks > w {
		chunks = w
	}
	size := (n + chunks - 1) / chunks
	var wg sync.WaitGroup
	for lo := 0; lo < n; lo += size {
		hi := min(lo+size, n)
		wg.Add(1)
		go func(lo, hi int) {
			defer wg.Done()
			fn(lo, hi)
		}(lo, hi)
	}
	wg.Wait()
}

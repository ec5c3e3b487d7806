//go:build !openblas

package mat

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Backend names the BLAS in use, for logs and benchmark records.
const Backend = "gonum"

func gemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	ta, tb := blas.NoTrans, blas.NoTrans
	if transA {
		ta = blas.Trans
	}
	if transB {
		tb = blas.Trans
	}
	// gonum's Sgemm parallelises internally too; goroutines compose.
	gonum.Implementation{}.Sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
}

// gemv computes y = alpha·op(A)·x + beta·y for row-major A (r×c, stride lda).
func gemv(trans bool, r, c int, alpha float32, a []float32, lda int, x []float32, beta float32, y []float32) {
	t := blas.NoTrans
	if trans {
		t = blas.Trans
	}
	gonum.Implementation{}.Sgemv(t, r, c, alpha, a, lda, x, 1, beta, y, 1)
}

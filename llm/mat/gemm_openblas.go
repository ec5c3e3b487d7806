//go:build openblas

package mat

/*
#cgo LDFLAGS: -lopenblas
#include <cblas.h>
void openblas_set_num_threads(int);
*/
import "C"

import "unsafe"

// OpenBLAS runs single-threaded: Gemm parallelises in Go.
func init() { C.openblas_set_num_threads(1) }

// Backend names the BLAS in use, for logs and benchmark records.
const Backend = "openblas"

func gemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	ta, tb := uint32(C.CblasNoTrans), uint32(C.CblasNoTrans)
	if transA {
		ta = C.CblasTrans
	}
	if transB {
		tb = C.CblasTrans
	}
	C.cblas_sgemm(C.CblasRowMajor, C.enum_CBLAS_TRANSPOSE(ta), C.enum_CBLAS_TRANSPOSE(tb),
		C.blasint(m), C.blasint(n), C.blasint(k), C.float(alpha),
		(*C.float)(unsafe.Pointer(&a[0])), C.blasint(lda),
		(*C.float)(unsafe.Pointer(&b[0])), C.blasint(ldb), C.float(beta),
		(*C.float)(unsafe.Pointer(&c[0])), C.blasint(ldc))
}

// gemv computes y = alpha·op(A)·x + beta·y for row-major A (r×c, stride lda).
func gemv(trans bool, r, c int, alpha float32, a []float32, lda int, x []float32, beta float32, y []float32) {
	t := uint32(C.CblasNoTrans)
	if trans {
		t = C.CblasTrans
	}
	C.cblas_sgemv(C.CblasRowMajor, C.enum_CBLAS_TRANSPOSE(t), C.blasint(r), C.blasint(c), C.float(alpha),
		(*C.float)(unsafe.Pointer(&a[0])), C.blasint(lda), (*C.float)(unsafe.Pointer(&x[0])), 1,
		C.float(beta), (*C.float)(unsafe.Pointer(&y[0])), 1)
}

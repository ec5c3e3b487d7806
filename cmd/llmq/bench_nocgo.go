//go:build !cgo

package main

import (
	"github.com/llmq/llmq/cuda"
	"github.com/spf13/cobra"
)

func newBenchGemm() *cobra.Command {
	return &cobra.Command{
		Use:   "gemm",
		Short: "Time the W4A16 kernel against cuBLAS fp16 (needs cgo and the CUDA library)",
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := cuda.Open("")
			return err
		},
	}
}

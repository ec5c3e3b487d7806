package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
)

func newBench() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks: the W4A16 GEMM kernel against cuBLAS, decoding, the HTTP server under load",
		Example: `  llmq bench gemm --m 1,16,4096 --json gemm.json                  (GPU)
  llmq bench decode /tmp/llama3-8b-w4 --device cuda --batch 1,8    (GPU)
  llmq bench serve ../shared/models/llama-tiny --clients 8 --requests 32`,
	}
	cmd.AddCommand(newBenchGemm(), newBenchServe(), newBenchDecode())
	return cmd
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}

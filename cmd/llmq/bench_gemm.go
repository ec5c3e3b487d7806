//go:build cgo

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/llmq/llmq/cuda"
	"github.com/llmq/llmq/evals"
	"github.com/spf13/cobra"
)

func newBenchGemm() *cobra.Command {
	var ms, jsonOut, only, peer, path string
	var bits, iters int
	var sums bool
	cmd := &cobra.Command{
		Use:   "gemm",
		Short: "Time the W4A16 kernel against cuBLAS fp16 (and tinygemm) on Llama-3 8B/70B shapes",
		Example: `  llmq bench gemm --json evals/results/gemm-h200.json --peer tinygemm.json
  llmq bench gemm --m 1,16,64 --iters 50
  llmq bench gemm --bits 8 --m 1,2,4,16,64 --json evals/results/gemm-w8-h200.json
  llmq bench gemm --sums --m 1,8 --shape 8B`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			Ms, err := parseInts(ms)
			if err != nil {
				return fmt.Errorf("--m: %w", err)
			}
			if sums && path != "dequant" {
				for _, m := range Ms {
					if m > cuda.SumsMaxRows {
						return fmt.Errorf("--sums: the GEMV kernels leave their sums at M ≤ %d, not M=%d (--path dequant runs any M)", cuda.SumsMaxRows, m)
					}
				}
			}
			var pr *evals.PeerRun
			if peer != "" {
				raw, err := os.ReadFile(peer)
				if err != nil {
					return fmt.Errorf("--peer: %w", err)
				}
				pr = &evals.PeerRun{}
				if err := json.Unmarshal(raw, pr); err != nil {
					return fmt.Errorf("--peer %s: %w", peer, err)
				}
			}
			lib, err := cuda.Open("")
			if err != nil {
				return err
			}
			dev, err := lib.Device()
			if err != nil {
				return err
			}
			if pr != nil && pr.GPU != dev.Name {
				return fmt.Errorf("--peer %s was measured on %q, this is %q: the peer must be timed on the same GPU", peer, pr.GPU, dev.Name)
			}
			gpu, err := lib.NewContext()
			if err != nil {
				return err
			}
			defer gpu.Close()
			paths := map[string]int{"auto": cuda.PathAuto, "fused": cuda.PathFused, "gemv": cuda.PathGEMV, "dequant": cuda.PathCuBLAS, "mma": cuda.PathMMA, "swap": cuda.PathSwap}
			p, ok := paths[path]
			if !ok {
				return fmt.Errorf("--path %q: want auto, gemv, mma, swap, fused or dequant", path)
			}
			if err := gpu.SetPath(p); err != nil {
				return err
			}
			if bits != 4 && bits != 8 {
				return fmt.Errorf("--bits %d: the kernels run 4-bit (2 to 4) and 8-bit codes", bits)
			}
			if bits == 8 && pr != nil {
				return fmt.Errorf("--peer is PyTorch's int4 kernel: it compares with --bits 4")
			}
			b := &evals.GemmBench{GPU: gpu, Iters: iters, Bits: bits, Sums: sums}
			bw, err := b.MeasureReadBW()
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "%s, %d SMs, measured read bandwidth %.2f TB/s\n", dev.Name, dev.SMs, bw/1e12)
			// The peer's columns only when there is a peer.
			peerHead, peerRow := "", func(evals.GemmResult) string { return "" }
			if pr != nil {
				peerHead = fmt.Sprintf(" %10s %8s", "tinygemm", "vs tiny")
				peerRow = func(r evals.GemmResult) string { return fmt.Sprintf(" %10.2f %7.2fx", r.PeerMicros, r.VsPeer) }
			}
			fmt.Fprintf(w, "%-24s %6s %10s %10s %8s%s %8s %6s  %s\n", "shape", "M", fmt.Sprintf("w%da16 µs", bits), "cuBLAS µs", "speedup", peerHead, "TFLOP/s", "%BW", "kernel")
			var all []evals.GemmResult
			for _, s := range evals.LlamaShapes {
				if only != "" && !strings.Contains(s.Name, only) {
					continue
				}
				res, err := b.Run(s, Ms)
				if err != nil {
					return err
				}
				if pr != nil && evals.AddPeer(res, pr) == 0 {
					return fmt.Errorf("--peer %s: no timing for %s at any of these M", peer, s.Name)
				}
				for _, r := range res {
					fmt.Fprintf(w, "%-24s %6d %10.2f %10.2f %7.2fx%s %8.1f %5.0f%%  %s\n", r.Shape, r.M, r.W4Micros, r.CuBLASMicro, r.Speedup, peerRow(r), r.TFLOPS, 100*r.BWFraction, r.Variant)
				}
				all = append(all, res...)
			}
			if jsonOut != "" {
				data := map[string]any{"gpu": dev.Name, "read_bw_bytes_per_s": bw, "iters": iters, "path": path, "bits": bits, "sums": sums, "results": all}
				if pr != nil {
					data["peer"] = map[string]any{"kernel": "torch " + pr.Torch + " _weight_int4pack_mm (tinygemm)", "gpu": pr.GPU, "command": pr.Command, "date": pr.Date}
				}
				return writeJSON(jsonOut, evals.NewRecordOn("bench-gemm", data, dev.Name))
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&ms, "m", "1,2,4,8,16,32,64,128,256,1024,4096", "comma-separated M (tokens) values")
	cmd.Flags().IntVar(&iters, "iters", 100, "timed runs per measurement (median reported)")
	cmd.Flags().IntVar(&bits, "bits", 4, "the weights' codes: 4 or 8 (W8A16; its JSON fields keep the w4a16_ names)")
	cmd.Flags().StringVar(&jsonOut, "json", "", "write results as JSON here")
	cmd.Flags().StringVar(&only, "shape", "", "only shapes whose name contains this")
	cmd.Flags().StringVar(&peer, "peer", "", "JSON of evals/torchref/tinygemm.py from the same machine, shown beside")
	cmd.Flags().BoolVar(&sums, "sums", false, "time the GEMM with no outputs, its fp32 sums left in the workspace (how o and down decode at ≤ 8 rows: no K split's last step)")
	cmd.Flags().StringVar(&path, "path", "auto", "the W4A16 path to time: auto (what the runtime runs), gemv (M ≤ 2), mma (the GEMV on the Tensor Cores, M ≤ 64), swap (the same with the operands swapped, M ≤ 32), fused or dequant (+cuBLAS)")
	return cmd
}

#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA library, check it, time it.
# Run from the repository root with build/device (make device) carried.
# Outputs go to $OUT (the device tool's folder) or build/out.
set -uo pipefail
OUT=${OUT:-build/out}
mkdir -p "$OUT"
export LLMQ_COMMIT=$(tr -d '\n' < build/device/COMMIT)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
nvcc --version | tail -1
t0=$(date +%s)
make cuda NVCC_FLAGS="-O3 -std=c++17 -Xptxas -v" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "registers|spill" "$OUT/build.log" | grep -B1 -A0 "w4a16_fused" | head; grep -A2 "Compiling entry function '_ZN.*w4a16_fused" "$OUT/build.log" | grep -E "registers|spill" | head -8
echo "build $(( $(date +%s) - t0 ))s"
case "${1:-all}" in
  all|test)
    build/device/cuda.test -test.v -test.run . > "$OUT/cudatest.log" 2>&1; rc=$?
    grep -E "^(--- |ok|FAIL|PASS)|rel err" "$OUT/cudatest.log" | tail -25
    echo "cuda tests rc=$rc"
    for tool in memcheck racecheck; do
      timeout 240 compute-sanitizer --tool $tool build/device/cuda.test -test.run 'TestDequant|TestSmallForSanitizer' > "$OUT/$tool.log" 2>&1
      echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
    done
    ;;
esac
case "${1:-all}" in
  all|bench)
    build/device/llmq bench gemm --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.txt"
    ;;
esac
case "${1:-all}" in
  all|tune)
    echo "fused path forced up to M=256:"
    LLMQ_W4_FUSED_MAX_M=256 build/device/llmq bench gemm --m 32,64,128,256 --iters 100 2>&1 | tail -21 | tee "$OUT/gemm-fused-large-m.txt"
    ;;
esac
case "${1:-all}" in
  profile)
    timeout 300 ncu --clock-control none -k regex:w4a16_fused -c 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      build/device/llmq bench gemm --m 1 --shape 70B --iters 20 > "$OUT/ncu.txt" 2>&1
    grep -vE "^==PROF==|^  *-+ *$" "$OUT/ncu.txt" | grep -E "Throughput|Duration|Registers|Shared Memory|Achieved|Theoretical Occ|Block Limit|Warp Cycles|Stall|Issued|Eligible|Active Warps|L2|DRAM|Mem|Grid Size|Waves|WRN|OPT|One or More|smsp|Executed" | head -60
    ;;
esac

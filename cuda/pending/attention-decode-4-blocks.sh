# The attention decode kernel bounded to 4 blocks an SM (cuda/pending/attention-decode-4-blocks.patch, applied here by
# sed: the device has no git) against HEAD's (carry.sh base): BenchmarkAttentionDecode and the decode, in one run.
set -o pipefail
sed -i 's/^__global__ void __launch_bounds__(32 \* kDecodeWarps)$/__global__ void __launch_bounds__(32 * kDecodeWarps, kDecodeWaveBlocks)/' cuda/model.cu
[ "$(grep -c 'kDecodeWarps, kDecodeWaveBlocks' cuda/model.cu)" = 1 ] || { echo "the patch did not apply"; exit 1; }
AB_BITS=4 QUICK_M=1 AB_DECODE=1 SYNTH_CTX=2048 SYNTH_BATCH=8,32 bash cuda/device-model.sh ab
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE '[a-z]+[0-9]{2,4}[a-z]*' | head -1 | tr A-Z a-z)
OUT=${OUT:-build/out}
for lib in base new base new; do
  so=$PWD/build/device/libllmqcuda.so; c=$(cat build/device/COMMIT)+4-blocks
  [ $lib = base ] && so=$PWD/build/base/libllmqcuda.so && c=$(cat .carry/base/COMMIT)
  echo "# $lib ($c): LLMQ_CUDA_LIB=$lib cuda.test -test.run '^\$' -test.bench AttentionDecode -test.benchtime 20x"
  LLMQ_CUDA_LIB=$so build/device/cuda.test -test.run '^$' -test.bench AttentionDecode -test.benchtime 20x 2>&1 | grep -E "µs/call|FAIL|panic"
done | tee "$OUT/attention-decode-$G-ab-4-blocks.txt"
grep -A3 "Compiling entry function '_ZN.*attention_decode.*sm_90a" "$OUT/build.log" | grep -E "registers|spill" > "$OUT/ptxas-attention-4-blocks-$G.txt"
(cd "$OUT" && f=$(ls | grep -vE '^(results.tar)$'); [ -z "$f" ] || tar -rf results.tar --remove-files $f)

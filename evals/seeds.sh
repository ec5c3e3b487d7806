#!/usr/bin/env bash
# The spread of a method's perplexity over calibration samples, on one
# device: quantizes MODEL with METHOD at BITS (g128) once per seed (the
# calibration windows drawn at random offsets, --seed), evaluates each
# checkpoint on WikiText-2 (the full protocol) and prints every seed's
# perplexity with the mean and standard deviation. Run on the CPU and on
# the GPU, it tells a systematic difference between the two paths from the
# method's own sensitivity to its calibration data.
#
#   evals/seeds.sh gptq 4 ../shared/models/llama-tiny cpu
#   LLMQ=build/device/llmq SHARED=.carry/shared evals/seeds.sh gptq 4 .carry/shared/models/llama-tiny cuda
#
# SEEDS (1 2 3 4) picks the seeds; LLMQ the binary (build/llmq); SHARED
# the shared assets (the model's ../..). Calibration: 128 × 512 tokens for
# AWQ (its protocol), 128 × 2048 otherwise. Writes
# evals/results/seeds-<model>-<method>-w<bits>-<device>.txt (with
# EVAL_DEVICE set, checkpoints are evaluated there instead).
set -euo pipefail
METHOD=${1:?method} BITS=${2:?bits} MODEL=${3:?model dir} DEVICE=${4:?device: cpu or cuda}
LLMQ=${LLMQ:-build/llmq}
SHARED=${SHARED:-$(dirname "$(dirname "$MODEL")")}
NAME=$(basename "$MODEL")
SEQLEN=2048; [ "$METHOD" = awq ] && SEQLEN=512
[ -x "$LLMQ" ] || { echo "seeds.sh: no llmq binary at $LLMQ (make build, or set LLMQ)" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
OUT=evals/results/seeds-$NAME-${METHOD/+/-}-w$BITS-$DEVICE.txt
mkdir -p "$(dirname "$OUT")"
{
  echo "# $("$LLMQ" --version): $METHOD w$BITS g128 on $DEVICE, calibration 128 × $SEQLEN at seeds ${SEEDS:-1 2 3 4}, WikiText-2 on ${EVAL_DEVICE:-$DEVICE}, $(date -u +%F)"
  for seed in ${SEEDS:-1 2 3 4}; do
    "$LLMQ" quantize "$MODEL" --method "$METHOD" --bits "$BITS" --group 128 --calib "$SHARED/data/calib.txt" --nsamples 128 \
      --seqlen $SEQLEN --seed "$seed" -o "$TMP/q" --force --device "$DEVICE" > "$TMP/log" 2>&1 || { tail -5 "$TMP/log" >&2; exit 1; }
    "$LLMQ" eval ppl "$TMP/q" --data "$SHARED/data/wikitext2/wiki.test.raw" --seqlen 2048 --device "${EVAL_DEVICE:-$DEVICE}" \
      --json "$TMP/ppl.json" > "$TMP/log" 2>&1 || { tail -5 "$TMP/log" >&2; exit 1; }
    python3 -c "import json,sys; print('seed', sys.argv[2], 'perplexity %.4f' % json.load(open(sys.argv[1]))['data']['result']['perplexity'])" "$TMP/ppl.json" "$seed"
  done
} | tee "$OUT.tmp"
python3 - "$OUT.tmp" <<'PY' | tee -a "$OUT.tmp"
import statistics, sys
p = [float(l.split()[-1]) for l in open(sys.argv[1]) if l.startswith('seed')]
print(f"mean {statistics.mean(p):.4f}, standard deviation {statistics.stdev(p) if len(p) > 1 else 0:.4f} over {len(p)} seeds")
PY
mv "$OUT.tmp" "$OUT"

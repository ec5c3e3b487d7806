#!/usr/bin/env bash
# One table of quantization schemes for one model (issue 17, point 8):
# WikiText-2 perplexity (windows of 2048, the shared protocol) and bytes of
# weights of W16A16, W8A16, W4A16 (RTN, GPTQ, AWQ), FP8 W8A8, W8A8 per
# token with and without SmoothQuant, W4A8 per token, W4A8 per tensor with
# min-max, percentile and KL thresholds, and a sensitivity-guided mixed
# 4/8-bit plan at 4.5 bits on average. Writes
# evals/results/schemes-<model>[-wN].json and .md.
#
#   evals/schemes.sh ../shared/models/llama-tiny       (make schemes MODEL=…)
#   WINDOWS=20 evals/schemes.sh ../shared/models/llama-small
#
# WINDOWS=N: only the first N windows of WikiText-2 (files get -wN).
# NSAMPLES, ACT_NSAMPLES: calibration windows (default 128 each; other
# values add -calibN-M to the names).
# REUSE=1: keep checkpoints, scales and perplexities already under
# $OUTDIR/<model>.
# EVAL_DEVICE=cuda: the rows' perplexities on the GPU (default cpu; the
# GPU's fp16 arithmetic moves llama-tiny's INT8/FP8-activation rows by
# 0.001%/0.012%, ppl-llama-tiny-a8-*-h200.json).
# SCHEMES_COMMAND: the command line the table records, when the steps ran
# apart (default: this script's); SCHEMES_NOTE: a sentence for its title.
# ONLY_ROWS="w16a16 w8a16 …": evaluate only these rows (their checkpoints
# are the ones at hand).
# STEPS: which of prep (quantize, calibrate, sensitivity), rows (the
# evaluations) and table to run (default all three): a GPU machine without
# Go runs STEPS=rows, the table is made where Go is from the perplexities
# brought back (STEPS=table lists the rows without evaluating any).
# Activations are simulated (quantize-dequantize). What each row is:
#   W16A16       the bf16 checkpoint, computed in fp32 (fp16 on the GPU)
#   W8A16        RTN 8-bit, groups of 128, asymmetric (the W8A8 rows' weights)
#   W4A16        4-bit g128 asymmetric: RTN; GPTQ (NSAMPLES×2048 of calib.txt,
#                true-sequential); AWQ (NSAMPLES×512) — quality.sh's protocol
#   FP8 W8A8     E4M3 weights with a scale per output channel, E4M3 activations
#                with a scale per token (llm-compressor's FP8_DYNAMIC)
#   W8A8 per token         the W8A16 checkpoint, INT8 activations per token
#   W8A8 per token smooth  SmoothQuant α=ALPHA (0.5): factors calibrated on the
#                unquantized model (ACT_NSAMPLES×2048 of calib.txt), folded into
#                norms and weights, then RTN 8-bit (quantize --smooth-scales);
#                INT8 activations per token
#   W4A8 per token         the GPTQ W4A16 checkpoint, INT8 activations per token
#   W4A8 per tensor        the same, one static INT8 scale per layer input,
#                calibrated on that checkpoint (ACT_NSAMPLES×2048 of calib.txt)
#                with min-max, percentile (99.99) and KL thresholds
#   mixed 4.5 bits         llmq sensitivity (RTN 4-bit probe, 4×512 of calib.txt)
#                proposes 8 bits for the costliest layers within 4.5 bits per
#                weight on average; GPTQ applies the plan (quantize --plan)
set -euo pipefail
MODEL=${1:?model dir}
NAME=$(basename "$MODEL")
SHARED=${SHARED:-$(dirname "$(dirname "$MODEL")")}
WIKI=$SHARED/data/wikitext2/wiki.test.raw
CALIB=$SHARED/data/calib.txt
LLMQ=${LLMQ:-build/llmq}
NS=${NSAMPLES:-128}
ACT_NS=${ACT_NSAMPLES:-$NS}
ALPHA=${ALPHA:-0.5}
SUFFIX=""
WIN=()
if [ -n "${WINDOWS:-}" ]; then SUFFIX=-w$WINDOWS; WIN=(--windows "$WINDOWS"); fi
# calibration other than the protocol's 128 windows shows in the names
if [ "$NS" != 128 ] || [ "$ACT_NS" != 128 ]; then SUFFIX=$SUFFIX-calib$NS-$ACT_NS; fi
W=${OUTDIR:-build/schemes}/$NAME$SUFFIX
RES=evals/results
mkdir -p "$W" "$RES"
: >"$W/rows.tsv"
[ "${REUSE:-}" = 1 ] || : >"$W/commands.txt"  # with REUSE, the commands that made what is reused stay
run() { echo "+ $*" >&2; echo "$*" >>"$W/commands.txt"; "$@"; }
have() { [ "${REUSE:-}" = 1 ] && [ -e "$1" ]; }
# q NAME ARGS…: quantize the model into $W/NAME with a report.
q() {
  local n=$1; shift
  have "$W/quantize-$n.json" && return 0
  run "$LLMQ" quantize "$MODEL" "$@" -o "$W/$n" --force --report "$W/quantize-$n.json" >"$W/quantize-$n.log"
}
# row ID SCHEME WEIGHTS ACTS CHECKPOINT MADE NOTE [EVAL ARGS…]: evaluate and list a row.
# With STEPS lacking rows it only lists the row, whose perplexity must be
# there already (evaluated elsewhere).
row() {
  local id=$1 scheme=$2 wts=$3 acts=$4 ck=$5 made=$6 note=$7; shift 7
  ids+=("$id")
  [ -z "${ONLY_ROWS:-}" ] || [[ " $ONLY_ROWS " == *" $id "* ]] || return 0
  if step rows && ! have "$W/ppl-$id.json"; then
    run "$LLMQ" eval ppl "$ck" --data "$WIKI" --seqlen 2048 ${WIN[@]+"${WIN[@]}"} --device "${EVAL_DEVICE:-cpu}" "$@" \
      --json "$W/ppl-$id.json" >"$W/ppl-$id.log"
    echo "$scheme: $(grep '^perplexity' "$W/ppl-$id.log")" >&2
  fi
  [ -e "$W/ppl-$id.json" ] || { echo "row $id: no $W/ppl-$id.json (STEPS=rows evaluates it)" >&2; return 1; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$scheme" "$wts" "$acts" "$ck" "$W/ppl-$id.json" "$made" "$note" >>"$W/rows.tsv"
}
step() { [[ " ${STEPS:-prep rows table} " == *" $1 "* ]]; }
G=(--bits 4 --group 128 --calib "$CALIB" --nsamples "$NS" --seqlen 2048)
if step prep; then
q rtn-w8 --method rtn --bits 8 --group 128
q rtn-w4 --method rtn --bits 4 --group 128
q gptq-w4 --method gptq "${G[@]}"
q awq-w4 --method awq --bits 4 --group 128 --calib "$CALIB" --nsamples "$NS" --seqlen 512
q fp8 --method fp8 --fp8-scale per-channel
have "$W/smooth.json" || run "$LLMQ" calibrate "$MODEL" --calib "$CALIB" --nsamples "$ACT_NS" --seqlen 2048 \
  --method minmax --smooth "$ALPHA" -o "$W/smooth.json" >"$W/smooth.log"
q rtn-w8-smooth --method rtn --bits 8 --group 128 --smooth-scales "$W/smooth.json"
# one pass, a file per method (the same thresholds as a run of each)
have "$W/scales-kl.json" || run "$LLMQ" calibrate "$W/gptq-w4" --calib "$CALIB" --nsamples "$ACT_NS" --seqlen 2048 \
  --method minmax,percentile,kl -o "$W/scales-{method}.json" >"$W/scales.log"
have "$W/plan.json" || run "$LLMQ" sensitivity "$MODEL" --data "$CALIB" --windows 4 --seqlen 512 --bits 4 --group 128 \
  --high-bits 8 --target-bits 4.5 -o "$W/plan.json" --json "$W/sensitivity.json" >"$W/sensitivity.log"
q gptq-mixed --method gptq "${G[@]}" --plan "$W/plan.json"
fi
step rows || step table || exit 0
ids=()
plan_bits=? raised=?  # the plan is absent where only other rows are evaluated (ONLY_ROWS)
if [ -f "$W/plan.json" ]; then
  { read -r plan_bits; read -r raised; } < <(python3 -c 'import json, sys
p = json.load(open(sys.argv[1]))
print(round(p["average_bits"], 3)); print(", ".join(p["raised"]))' "$W/plan.json")
fi

# the unquantized activations' precision: the CPU computes in fp32, the GPU in fp16
FP=fp32; [ "${EVAL_DEVICE:-cpu}" = cpu ] || FP=fp16
row w16a16 W16A16 "bf16 (run in $FP)" $FP "$MODEL" - -
row w8a16 W8A16 "INT8 RTN g128" $FP "$W/rtn-w8" "$W/quantize-rtn-w8.json" -
row w4a16-rtn "W4A16 RTN" "INT4 RTN g128" $FP "$W/rtn-w4" "$W/quantize-rtn-w4.json" -
row w4a16-gptq "W4A16 GPTQ" "INT4 GPTQ g128" $FP "$W/gptq-w4" "$W/quantize-gptq-w4.json" -
row w4a16-awq "W4A16 AWQ" "INT4 AWQ g128" $FP "$W/awq-w4" "$W/quantize-awq-w4.json" -
row fp8-w8a8 "FP8 W8A8" "FP8 E4M3 per channel" "FP8 E4M3 per token" "$W/fp8" "$W/quantize-fp8.json" - \
  --act-bits 8 --act-format fp8
row w8a8-token "W8A8 per token" "INT8 RTN g128" "INT8 per token" "$W/rtn-w8" "$W/quantize-rtn-w8.json" - --act-bits 8
row w8a8-token-smooth "W8A8 per token, SmoothQuant" "INT8 RTN g128 of the smoothed weights" "INT8 per token" \
  "$W/rtn-w8-smooth" "$W/quantize-rtn-w8-smooth.json" \
  "SmoothQuant α=$ALPHA: factors calibrated on the unquantized model ($ACT_NS×2048 of calib.txt), folded into norms and weights before RTN (quantize --smooth-scales)" \
  --act-bits 8
row w4a8-token "W4A8 per token" "INT4 GPTQ g128" "INT8 per token" "$W/gptq-w4" "$W/quantize-gptq-w4.json" - --act-bits 8
for m in minmax percentile kl; do
  row "w4a8-tensor-$m" "W4A8 per tensor, $m" "INT4 GPTQ g128" "INT8 per tensor ($m)" "$W/gptq-w4" "$W/quantize-gptq-w4.json" \
    "static thresholds from llmq calibrate --method $m on the W4 checkpoint ($ACT_NS×2048 of calib.txt)" \
    --act-bits 8 --act-scheme per-tensor --act-scales "$W/scales-$m.json"
done
row mixed-4.5 "mixed 4/8-bit, $plan_bits bits" "INT4/INT8 GPTQ g128 by plan" $FP "$W/gptq-mixed" "$W/quantize-gptq-mixed.json" \
  "llmq sensitivity (RTN 4-bit probe, 4×512 of calib.txt) raises the costliest layers to 8 bits within 4.5 bits per weight on average: $raised"

for id in ${ONLY_ROWS:-}; do  # a misspelt id would evaluate nothing, silently
  [[ " ${ids[*]} " == *" $id "* ]] || { echo "ONLY_ROWS: no row $id (rows: ${ids[*]})" >&2; exit 2; }
done
step table || exit 0
title="Quantization schemes on $NAME"
[ -n "${WINDOWS:-}" ] && title="$title (first $WINDOWS windows of WikiText-2 only)"
title="$title. Calibration (calib.txt): GPTQ $NS×2048, AWQ $NS×512, activation thresholds and SmoothQuant factors $ACT_NS×2048.${SCHEMES_NOTE:+ $SCHEMES_NOTE}"
go run ./evals/schemes -manifest "$W/rows.tsv" -commands "$W/commands.txt" -title "$title" \
  -command "${SCHEMES_COMMAND:-${WINDOWS:+WINDOWS=$WINDOWS }evals/schemes.sh $*}" -o "$RES/schemes-$NAME$SUFFIX"
cat "$RES/schemes-$NAME$SUFFIX.md"

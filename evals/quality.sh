#!/usr/bin/env bash
# Quantization quality matrix under the shared protocol: for one model,
# quantize with each method/bit width and evaluate wikitext-2 perplexity
# (189 windows of 2048) and perplexity on text outside shared/ (the Go
# language specification shipped with the Go toolchain). Results land in
# evals/results/quality-<model>-<config>.json.
#
#   evals/quality.sh ../shared/models/llama-small [config ...]
#
# WINDOWS=N evaluates only the first N windows of WikiText-2 (results get a
# -wN suffix), for quicker comparisons between variants.
# configs: fp32 rtn-w4 gptq-w4 gptq-w4-act rtn-w3 gptq-w3 gptq-w3-act awq-w4 awq-w3 awq-gptq-w4
#          gptq-wB-gG (group G), gptq-wB-gG-bs (--groups-from-block-start)
set -euo pipefail
MODEL=${1:?model dir}; shift
NAME=$(basename "$MODEL")
SHARED=${SHARED:-$(dirname "$(dirname "$MODEL")")}
WIKI=$SHARED/data/wikitext2/wiki.test.raw
CALIB=$SHARED/data/calib.txt
OTHER=${OTHER:-$(go env GOROOT)/doc/go_spec.html}
LLMQ=${LLMQ:-build/llmq}
OUTDIR=${OUTDIR:-build/quality}
RES=evals/results
mkdir -p "$OUTDIR" "$RES"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(fp32 rtn-w4 gptq-w4 gptq-w4-act rtn-w3 gptq-w3 gptq-w3-act)
for c in "${configs[@]}"; do
  dir=$OUTDIR/$NAME-$c
  case $c in
    fp32)         dir=$MODEL ;;
    rtn-w*)       $LLMQ quantize "$MODEL" --method rtn  --bits "${c#rtn-w}" --group 128 -o "$dir" --force --report "$RES/quantize-$NAME-$c.json" ;;
    gptq-w?)      $LLMQ quantize "$MODEL" --method gptq --bits "${c#gptq-w}" --group 128 --calib "$CALIB" --nsamples 128 --seqlen 2048 -o "$dir" --force --report "$RES/quantize-$NAME-$c.json" ;;
    gptq-w?-act)  b=${c#gptq-w}; $LLMQ quantize "$MODEL" --method gptq --bits "${b%-act}" --group 128 --act-order --calib "$CALIB" --nsamples 128 --seqlen 2048 -o "$dir" --force --report "$RES/quantize-$NAME-$c.json" ;;
    gptq-w?-g*)   b=${c#gptq-w}; g=${b#*-g}; g=${g%-bs}; extra=(); [[ $c == *-bs ]] && extra=(--groups-from-block-start)
                  $LLMQ quantize "$MODEL" --method gptq --bits "${b%%-*}" --group "$g" "${extra[@]}" --calib "$CALIB" --nsamples 128 --seqlen 2048 -o "$dir" --force --report "$RES/quantize-$NAME-$c.json" ;;
    awq-w?)       $LLMQ quantize "$MODEL" --method awq  --bits "${c#awq-w}" --group 128 --calib "$CALIB" --nsamples 128 --seqlen 512 -o "$dir" --force --report "$RES/quantize-$NAME-$c.json" --stats "$RES/awq-stats-$NAME-$c.json" ;;
    awq-gptq-w?)  $LLMQ quantize "$MODEL" --method awq+gptq --bits "${c#awq-gptq-w}" --group 128 --calib "$CALIB" --nsamples 128 --seqlen 2048 -o "$dir" --force --report "$RES/quantize-$NAME-$c.json" ;;
    *) echo "unknown config $c" >&2; exit 2 ;;
  esac
  if [ -n "${WINDOWS:-}" ]; then # a quicker comparison: the first WINDOWS windows only
    $LLMQ eval ppl "$dir" --data "$WIKI" --seqlen 2048 --windows "$WINDOWS" --json "$RES/ppl-$NAME-$c-wikitext2-w$WINDOWS.json"
    continue
  fi
  $LLMQ eval ppl "$dir" --data "$WIKI" --seqlen 2048 --json "$RES/ppl-$NAME-$c-wikitext2.json"
  $LLMQ eval ppl "$dir" --data "$OTHER" --seqlen 2048 --windows 16 --json "$RES/ppl-$NAME-$c-gospec.json"
done

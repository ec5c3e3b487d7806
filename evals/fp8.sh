#!/usr/bin/env bash
# FP8 E4M3 weights on a model (issue 17 point 3): quantize with llmq
# quantize --method fp8 (compressed-tensors float-quantized) and evaluate
# wikitext-2 perplexity (189 windows of 2048 for llama-tiny) as W8A16, and
# as simulated FP8 W8A8 (activations FP8 per token, dynamic: llm-compressor's
# FP8_DYNAMIC). Results: evals/results/ppl-<model>-fp8-*.json.
#
#   evals/fp8.sh ../shared/models/llama-tiny
set -euo pipefail
MODEL=${1:?model dir}
NAME=$(basename "$MODEL")
SHARED=${SHARED:-$(dirname "$(dirname "$MODEL")")}
WIKI=$SHARED/data/wikitext2/wiki.test.raw
LLMQ=${LLMQ:-build/llmq}
OUTDIR=${OUTDIR:-build/q}
RES=evals/results
mkdir -p "$OUTDIR" "$RES"
$LLMQ quantize "$MODEL" --method fp8 --fp8-scale per-channel -o "$OUTDIR/$NAME-fp8" --force \
  --report "$RES/quantize-$NAME-fp8.json"
$LLMQ quantize "$MODEL" --method fp8 --fp8-scale per-tensor -o "$OUTDIR/$NAME-fp8-pertensor" --force \
  --report "$RES/quantize-$NAME-fp8-pertensor.json"
$LLMQ eval ppl "$OUTDIR/$NAME-fp8" --data "$WIKI" --device cpu \
  --json "$RES/ppl-$NAME-fp8-w8a16-wikitext2.json"
$LLMQ eval ppl "$OUTDIR/$NAME-fp8" --data "$WIKI" --device cpu --act-bits 8 --act-format fp8 \
  --json "$RES/ppl-$NAME-fp8-w8a8-wikitext2.json"
$LLMQ eval ppl "$OUTDIR/$NAME-fp8-pertensor" --data "$WIKI" --device cpu \
  --json "$RES/ppl-$NAME-fp8-pertensor-w8a16-wikitext2.json"

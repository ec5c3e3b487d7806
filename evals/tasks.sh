#!/usr/bin/env bash
# Multiple-choice accuracy of the shared models, unquantized and RTN w4
# (group 128), on evals/tasks/llmq-facts.jsonl: the records
# evals/results/tasks-llmq-facts-<model>[-rtn-w4].json.
#
#   make build && evals/tasks.sh [../shared/models/llama-tiny ...]
set -euo pipefail
LLMQ=${LLMQ:-build/llmq}
OUTDIR=${OUTDIR:-build/tasks}
TASKS=${TASKS:-evals/tasks/llmq-facts.jsonl}
DEVICE=${DEVICE:-cpu}
RES=evals/results
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(../shared/models/llama-tiny ../shared/models/llama-small)
mkdir -p "$OUTDIR" "$RES"
set_name=$(basename "$TASKS" .jsonl)
for model in "${models[@]}"; do
  name=$(basename "$model")
  $LLMQ quantize "$model" --method rtn --bits 4 --group 128 -o "$OUTDIR/$name-rtn-w4" --force
  for dir in "$model" "$OUTDIR/$name-rtn-w4"; do
    $LLMQ eval tasks "$dir" --tasks "$TASKS" --device "$DEVICE" --json "$RES/tasks-$set_name-$(basename "$dir").json"
  done
done

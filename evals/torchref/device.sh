#!/usr/bin/env bash
# Runs evals/torchref/awq.py on the GPU machine: one call, several models,
# bit widths and variants. .carry/awq.tar.xz holds .carry/shared/... (the
# models, calib.txt and the wikitext-2 token ids) and .carry/COMMIT the
# commit (git rev-parse HEAD > .carry/COMMIT):
#
#   bash evals/torchref/device.sh "llama-small:3:ref,go-alpha,noclip,fp16" "llama-small:4:ref"
set -uo pipefail
OUT=${OUT:-build/out}
mkdir -p "$OUT"
for f in .carry/*.tar.xz; do [ -e "$f" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.')" "$f"; done
S=.carry/shared
export LLMQ_COMMIT=$(cat .carry/COMMIT 2>/dev/null)
export PYTHONUNBUFFERED=1
for spec in "$@"; do
  IFS=: read -r model bits variants <<< "$spec"
  args=()
  for v in ${variants//,/ }; do args+=(--variant "$v"); done
  echo "== $model w$bits: $variants"
  python3 evals/torchref/awq.py --model $S/models/$model --calib $S/data/calib.txt \
    --wiki $S/reference/wikitext2-test.tokens.i32 --bits "$bits" "${args[@]}" \
    --go-stats evals/results/awq-stats-$model-awq-w$bits.json \
    --json "$OUT/torchref-awq-$model-w$bits.json" 2>&1 | grep -v Warning
done

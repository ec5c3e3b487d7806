#!/usr/bin/env bash
# How much AWQ's result on a model moves when x̄ (the per-channel mean |x|
# its scales come from) moves by as little as a GPU's fp16 calibration
# forward moves it: builds llmq with evals/awq-perturb.patch (x̄ multiplied
# by 1 + 1e-4·N(0,1), a fixed seed) in a temporary worktree, quantizes
# MODEL with AWQ w4 and w3 on the CPU under the protocol (128 × 512), and
# compares the WikiText-2 perplexity and the search's choices with the
# unperturbed CPU run's committed figures.
#
#   evals/awq-perturb.sh ../shared/models/llama-tiny
#
# Writes evals/results/awq-perturb-<model>.txt.
set -euo pipefail
MODEL=${1:?model dir}
NAME=$(basename "$MODEL")
SHARED=$(dirname "$(dirname "$MODEL")")
ROOT=$(git rev-parse --show-toplevel)
TMP=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$TMP/src" >/dev/null 2>&1 || true; rm -rf "$TMP"' EXIT
git -C "$ROOT" worktree add -q --detach "$TMP/src" HEAD
git -C "$TMP/src" apply "$ROOT/evals/awq-perturb.patch"
TAGS=$(printf '#include <cblas.h>\nint main(void){return 0;}\n' | cc -x c - -lopenblas -o /dev/null 2>/dev/null && echo "-tags openblas" || true)
(cd "$TMP/src" && go build $TAGS -o "$TMP/llmq" ./cmd/llmq)
OUT=$ROOT/evals/results/awq-perturb-$NAME.txt
echo "# $(git -C "$ROOT" rev-parse HEAD) + evals/awq-perturb.patch: AWQ with x̄ × (1 + 1e-4·N(0,1)), CPU, $(date -u +%F)" > "$OUT"
for b in 4 3; do
  "$TMP/llmq" quantize "$MODEL" --method awq --bits $b --group 128 --calib "$SHARED/data/calib.txt" --nsamples 128 --seqlen 512 \
    -o "$TMP/w$b" --force --device cpu --stats "$TMP/stats-w$b.json" > /dev/null
  "$TMP/llmq" eval ppl "$TMP/w$b" --data "$SHARED/data/wikitext2/wiki.test.raw" --seqlen 2048 --device cpu --json "$TMP/ppl-w$b.json" > /dev/null
  python3 - "$TMP/ppl-w$b.json" "$ROOT/evals/results/ppl-$NAME-awq-w$b-wikitext2.json" "$TMP/stats-w$b.json" \
    "$ROOT/evals/results/awq-stats-$NAME-awq-w$b.json" "w$b" >> "$OUT" <<'PY'
import json, sys
ppl = lambda f: json.load(open(f))['data']['result']['perplexity']
p, ref = ppl(sys.argv[1]), ppl(sys.argv[2])
a, b = json.load(open(sys.argv[3]))['layers'], json.load(open(sys.argv[4]))['layers']
same = sum(x.get('alpha') == y.get('alpha') for x, y in zip(a, b) if x.get('alpha') is not None)
groups = sum(x.get('alpha') is not None for x in a)
shrink = max((abs(v - y['clip_shrink'][k]) for x, y in zip(a, b) for k, v in (x.get('clip_shrink') or {}).items()), default=0)
print(f"{sys.argv[5]}: perplexity {p:.4f}, unperturbed {ref:.4f} ({100 * (p / ref - 1):+.3f}%); α equal in {same} of {groups} groups; largest change of a layer's mean clip shrink {shrink:.4f}")
PY
done
cat "$OUT"

#!/usr/bin/env bash
# How much a method's result on a model moves when its calibration
# statistics move by as little as a GPU's fp16 calibration forward moves
# them. Builds llmq with evals/perturb-METHOD.patch in a temporary worktree,
# quantizes MODEL w4 and w3 on the CPU under the method's protocol, and
# compares the WikiText-2 perplexity (and AWQ's choices) with the
# unperturbed CPU run's committed figures:
#
#   awq:  x̄ (the per-channel mean |x| the scales come from) × (1 + 1e-4·N(0,1)),
#         calibration 128 × 512
#   gptq: every entry of H × (1 + 1e-4·N(0,1)), kept symmetric,
#         calibration 128 × 2048
#
# The noise has a fixed seed, so a run is reproducible. EPS sets its size
# in place of 1e-4 (1e-7 is the size of fp32 rounding in sums of these
# lengths: what a GPU's fp32 calibration would move):
#
#   evals/perturb.sh awq ../shared/models/llama-tiny
#   evals/perturb.sh gptq ../shared/models/llama-tiny
#   EPS=1e-7 evals/perturb.sh gptq ../shared/models/llama-tiny
#
# Writes evals/results/perturb-<method>-<model>[-eps<EPS>].txt.
set -euo pipefail
METHOD=${1:?method: awq or gptq}
MODEL=${2:?model dir}
case "$METHOD" in
  awq) SEQLEN=512 ;;
  gptq) SEQLEN=2048 ;;
  *) echo "perturb.sh: method must be awq or gptq, not $METHOD" >&2; exit 2 ;;
esac
NAME=$(basename "$MODEL")
SHARED=$(dirname "$(dirname "$MODEL")")
ROOT=$(git rev-parse --show-toplevel)
TMP=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$TMP/src" >/dev/null 2>&1 || true; rm -rf "$TMP"' EXIT
git -C "$ROOT" worktree add -q --detach "$TMP/src" HEAD
EPS=${EPS:-1e-4}
case "$EPS" in
  ''|*[!0-9.e-]*) echo "perturb.sh: EPS must be a number such as 1e-7, not $EPS" >&2; exit 2 ;;
esac
SUFFIX=; [ "$EPS" = 1e-4 ] || SUFFIX=-eps$EPS
sed "s/1e-4\*r\.NormFloat64/$EPS*r.NormFloat64/" "$ROOT/evals/perturb-$METHOD.patch" | git -C "$TMP/src" apply
TAGS=$(printf '#include <cblas.h>\nint main(void){return 0;}\n' | cc -x c - -lopenblas -o /dev/null 2>/dev/null && echo "-tags openblas" || true)
(cd "$TMP/src" && go build $TAGS -o "$TMP/llmq" ./cmd/llmq)
OUT=$ROOT/evals/results/perturb-$METHOD-$NAME$SUFFIX.txt
echo "# $(git -C "$ROOT" rev-parse HEAD) + evals/perturb-$METHOD.patch at EPS=$EPS, CPU, $(date -u +%F)" > "$TMP/out.txt"
for b in 4 3; do
  stats=(); [ "$METHOD" = awq ] && stats=(--stats "$TMP/stats-w$b.json")
  "$TMP/llmq" quantize "$MODEL" --method "$METHOD" --bits $b --group 128 --calib "$SHARED/data/calib.txt" --nsamples 128 --seqlen $SEQLEN \
    -o "$TMP/w$b" --force --device cpu "${stats[@]}" > /dev/null
  "$TMP/llmq" eval ppl "$TMP/w$b" --data "$SHARED/data/wikitext2/wiki.test.raw" --seqlen 2048 --device cpu --json "$TMP/ppl-w$b.json" > /dev/null
  python3 - "$TMP/ppl-w$b.json" "$ROOT/evals/results/ppl-$NAME-$METHOD-w$b-wikitext2.json" "$TMP/stats-w$b.json" \
    "$ROOT/evals/results/awq-stats-$NAME-awq-w$b.json" "w$b" >> "$TMP/out.txt" <<'PY'
import json, os, sys
ppl = lambda f: json.load(open(f))['data']['result']['perplexity']
p, ref = ppl(sys.argv[1]), ppl(sys.argv[2])
line = f"{sys.argv[5]}: perplexity {p:.4f}, unperturbed {ref:.4f} ({100 * (p / ref - 1):+.3f}%)"
if os.path.exists(sys.argv[3]):  # AWQ: the search's choices beside the unperturbed run's
    a, b = json.load(open(sys.argv[3]))['layers'], json.load(open(sys.argv[4]))['layers']
    same = sum(x.get('alpha') == y.get('alpha') for x, y in zip(a, b) if x.get('alpha') is not None)
    groups = sum(x.get('alpha') is not None for x in a)
    shrink = max((abs(v - y['clip_shrink'][k]) for x, y in zip(a, b) for k, v in (x.get('clip_shrink') or {}).items()), default=0)
    line += f"; α equal in {same} of {groups} groups; largest change of a layer's mean clip shrink {shrink:.4f}"
print(line)
PY
done
mv "$TMP/out.txt" "$OUT" # a run that fails leaves the committed file as it was
cat "$OUT"

#!/usr/bin/env bash
# Bit-for-bit check of a change to the quantizers: runs the same quantize
# commands with two llmq binaries (before and after) and compares every
# output file byte for byte. Used to show that the quantize driver
# refactor (issue 13) writes exactly what the code before it wrote.
#
#   evals/identity.sh OLD_LLMQ NEW_LLMQ [WORKDIR]
set -uo pipefail
OLD=${1:?old llmq binary}; NEW=${2:?new llmq binary}; W=${3:-build/identity}
S=${SHARED:-../shared}; C=$S/data/calib.txt; T=$S/models/llama-tiny; SM=$S/models/llama-small
runs=(
  "tiny-rtn-w4         $T --method rtn --bits 4 --group 128"
  "tiny-gptq-w4        $T --method gptq --bits 4 --group 128 --calib $C --nsamples 128 --seqlen 2048"
  "tiny-gptq-w4-act    $T --method gptq --bits 4 --group 128 --act-order --calib $C --nsamples 32 --seqlen 2048"
  "tiny-gptq-w3-ts     $T --method gptq --bits 3 --group 128 --true-sequential --calib $C --nsamples 32 --seqlen 2048"
  "tiny-awq-w4         $T --method awq --bits 4 --group 128 --calib $C --nsamples 128 --seqlen 512"
  "tiny-awqgptq-w4     $T --method awq+gptq --bits 4 --group 128 --calib $C --nsamples 32 --seqlen 2048"
  "small-rtn-w4        $SM --method rtn --bits 4 --group 128"
  "small-gptq-w4       $SM --method gptq --bits 4 --group 128 --calib $C --nsamples 16 --seqlen 2048"
  "small-awq-w4        $SM --method awq --bits 4 --group 128 --calib $C --nsamples 16 --seqlen 512"
  "tiny-gptq-w4-head   $T --method gptq --bits 4 --group 128 --quantize-lm-head --calib $C --nsamples 16 --seqlen 2048"
)
for r in "${runs[@]}"; do
  set -- $r; name=$1; shift
  for side in old new; do
    bin=$OLD; [ $side = new ] && bin=$NEW
    $bin quantize "$@" -o "$W/$side/$name" --force >"$W/$name.$side.log" 2>&1 || echo "$name: $side failed: $(tail -1 $W/$name.$side.log)"
  done
  if diff -rq "$W/old/$name" "$W/new/$name" >/dev/null; then
    echo "$name: identical ($(ls "$W/new/$name" | wc -l) files): llmq quantize $*"
  else
    echo "$name: DIFFERENT: llmq quantize $*"; diff -rq "$W/old/$name" "$W/new/$name"
  fi
done

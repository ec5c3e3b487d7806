#!/usr/bin/env bash
# Runs llmq's GGUF exports in llama.cpp and compares with llmq:
#
#  1. logits: the F16 exports of llama-tiny and the architecture zoo's
#     qwen2-rand (rotate-half RoPE, q/k/v biases, tied), mistral-rand
#     (head_dim ≠ hidden/heads) and llama31-rand (Llama-3.1 rope_freqs),
#     run by node-llama-cpp's prebuilt llama.cpp, against transformers'
#     reference logits;
#  2. perplexity under llmq's protocol (llmq eval ppl: llmq's token ids, no
#     BOS, WINDOWS windows of SEQLEN, all positions scored) — llmq on the
#     checkpoint, llama.cpp (node-llama-cpp) on its GGUF export;
#  3. with LLAMA_PERPLEXITY=path/to/llama-perplexity (build-llama.sh builds
#     it from the llama.cpp source node-llama-cpp ships): llama.cpp's own
#     tool and protocol (its tokenizer, BOS-led chunks, second half scored)
#     against llmq's CPU backend under that protocol (evals/gguf-check/llamappl).
#
#   bash evals/gguf-llamacpp/run.sh > evals/results/gguf-llamacpp.txt
#   LLAMA_PERPLEXITY=$(bash evals/gguf-llamacpp/build-llama.sh) PARTS=3 \
#     bash evals/gguf-llamacpp/run.sh > evals/results/gguf-llama-perplexity.txt
#
# PARTS (default "1 2 3") picks the parts; the checkpoints part 3 uses
# are made either way.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared}
DATA=$SHARED/data/wikitext2/wiki.test.raw
CALIB=$SHARED/data/calib.txt
SEQLEN=${SEQLEN:-512}
WINDOWS=${WINDOWS:-8}
O=build/gguf-llamacpp
mkdir -p $O
go build -tags "${TAGS-openblas}" -o $O/llmq ./cmd/llmq
go build -tags "${TAGS-openblas}" -o $O/llamappl ./evals/gguf-check/llamappl
(cd evals/gguf-llamacpp && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund --ignore-scripts --loglevel=error)
N="node evals/gguf-llamacpp"
PARTS=${PARTS:-1 2 3}
part() { [[ " $PARTS " == *" $1 "* ]]; }
run() { echo "\$ $*"; "$@"; }

echo "# llmq $(git rev-parse --short HEAD), node-llama-cpp $(node -p 'require("./evals/gguf-llamacpp/node_modules/node-llama-cpp/package.json").version'), $(date -u +%FT%TZ)"
if part 1; then
echo "## 1. llama.cpp logits of F16 exports vs transformers' fp32 reference logits"
for m in models/llama-tiny models/archzoo/qwen2-rand models/archzoo/mistral-rand models/archzoo/llama31-rand; do
  n=$(basename $m)
  $O/llmq export gguf $SHARED/$m -o $O/$n-f16.gguf --force >/dev/null
  echo "$n: $($N/logits.mjs $O/$n-f16.gguf $SHARED/reference/$n.logits.input.i32 $SHARED/reference/$n.logits.f32)"
done
fi

declare -A SRC=(
  [tiny-f16]=$SHARED/models/llama-tiny
  [small-f16]=$SHARED/models/llama-small
)
quant() { # name model args...
  local name=$1 model=$2; shift 2
  echo "\$ llmq quantize $SHARED/models/$model $* --calib $CALIB -o $O/$name"
  $O/llmq quantize $SHARED/models/$model "$@" --calib $CALIB -o $O/$name --force >/dev/null 2>&1
  SRC[$name]=$O/$name
}
echo
echo "## the checkpoints and their exports"
quant tiny-rtn-w4g32-sym llama-tiny --method rtn --bits 4 --group 32 --sym
quant tiny-gptq-w4g128-sym llama-tiny --method gptq --bits 4 --group 128 --sym --nsamples 32 --seqlen 512
quant tiny-rtn-w4g128-asym llama-tiny --method rtn --bits 4 --group 128
quant tiny-gptq-w4g128-act llama-tiny --method gptq --bits 4 --group 128 --sym --act-order --nsamples 32 --seqlen 512
quant small-gptq-w4g128-sym llama-small --method gptq --bits 4 --group 128 --sym --nsamples 32 --seqlen 512
for name in tiny-f16 tiny-rtn-w4g32-sym tiny-gptq-w4g128-sym tiny-rtn-w4g128-asym tiny-gptq-w4g128-act small-f16 small-gptq-w4g128-sym; do
  run $O/llmq export gguf ${SRC[$name]} -o $O/$name.gguf --force 2>&1 | grep -v '^llmq: warning' || true
done

if part 2; then
echo
echo "## 2. perplexity, llmq's protocol: $WINDOWS windows of $SEQLEN of wiki.test.raw"
run $O/llmq tokenize $SHARED/models/llama-tiny $DATA --format i32 -o $O/wiki.i32 >/dev/null
for name in tiny-f16 tiny-rtn-w4g32-sym tiny-gptq-w4g128-sym tiny-rtn-w4g128-asym tiny-gptq-w4g128-act small-f16 small-gptq-w4g128-sym; do
  src=${SRC[$name]}
  echo "### $name"
  echo "\$ llmq eval ppl $src --data $DATA --seqlen $SEQLEN --windows $WINDOWS"
  echo "llmq:      $($O/llmq eval ppl $src --data $DATA --seqlen $SEQLEN --windows $WINDOWS 2>/dev/null | grep perplexity)"
  echo "\$ node evals/gguf-llamacpp/ppl.mjs $O/$name.gguf $O/wiki.i32 $SEQLEN $WINDOWS"
  echo "llama.cpp: $($N/ppl.mjs $O/$name.gguf $O/wiki.i32 $SEQLEN $WINDOWS)"
done
fi

if part 3 && [ -n "${LLAMA_PERPLEXITY:-}" ]; then
  echo
  echo "## 3. llama-perplexity vs llmq under llama-perplexity's protocol (-c $SEQLEN --chunks $WINDOWS)"
  for name in tiny-f16 tiny-rtn-w4g32-sym tiny-gptq-w4g128-sym tiny-rtn-w4g128-asym small-f16 small-gptq-w4g128-sym; do
    echo "### $name"
    echo "\$ llama-perplexity -m $O/$name.gguf -f $DATA -c $SEQLEN --chunks $WINDOWS -b $SEQLEN -t 2"
    # llama.cpp logs from a worker thread and now and then exits before
    # the last lines are out (exit status 0): such a run is repeated.
    for try in 1 2 3; do
      rc=0; "$LLAMA_PERPLEXITY" -m $O/$name.gguf -f $DATA -c $SEQLEN --chunks $WINDOWS -b $SEQLEN -t 2 > $O/$name.llama-perplexity.log 2>&1 || rc=$?
      grep -q 'Final estimate' $O/$name.llama-perplexity.log && break
    done
    echo "llama-perplexity: $(grep -o 'Final estimate: PPL = [0-9.]* +/- [0-9.]*' $O/$name.llama-perplexity.log || echo "no estimate (exit $rc): $(tail -1 $O/$name.llama-perplexity.log)")"
    echo "\$ llamappl ${SRC[$name]} --data $DATA --ctx $SEQLEN --chunks $WINDOWS"
    echo "llmq:             $($O/llamappl ${SRC[$name]} --data $DATA --ctx $SEQLEN --chunks $WINDOWS | grep -o 'Final estimate: PPL = [0-9.]*')"
  done
fi

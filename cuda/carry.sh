#!/usr/bin/env bash
# Packs what a device call needs into .carry/ (ignored by git), as
# device-model.sh unpacks it: archives of repository-relative paths
# (.carry/shared/... from ../shared, build/device/... from make device),
# xz-compressed so that they fit the device tool's 64 MiB carry beside
# the repository.
#
#   bash cuda/carry.sh            # dev + tinynodata + moe (≈ 37 MB; with zoolite too, 56 MB
#                                 # and the repository's own 12 MB pass the 64 MiB: carry
#                                 # zoolite or moe beside dev and tiny, not both)
#   bash cuda/carry.sh dev tiny   # only those
#
# dev:      build/device/{llmq,cuda.test,engine.test,COMMIT} (run make device first)
# tiny:     llama-tiny, its reference logits and greedy outputs, WikiText-2's token ids
# zoolite:  qwen2, qwen3, llama31 (weights and references), the gemma3 and
#           mistral-swa configs only (their zoo subtests then fail on the
#           missing weights: the full zoo does not fit beside the rest)
# moe:      mixtral-rand and qwen3moe-rand with their references
# wiki:     WikiText-2's test text (the perplexity modes: tiny, small, lowbit, ...)
# swa:      gemma3-rand and mistral-swa-rand (the sliding-window checkpoints zoolite leaves out), with
#           their references: bash cuda/carry.sh swa, then carry dev and swa alone
# base:     the CUDA sources (cuda/*.cu, *.cuh, *.h) at git revision $BASE (default main) as
#           .carry/base/cuda, which device-model.sh builds into build/base/libllmqcuda.so beside
#           the working tree's library, for the A/B modes (the same Go binary loads either
#           through LLMQ_CUDA_LIB; the C API must not differ between the two)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d ../shared ] || { echo "carry.sh: ../shared is absent" >&2; exit 1; }
mkdir -p .carry
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/.carry"
ln -s "$(cd ../shared && pwd)" "$stage/.carry/shared"
S=.carry/shared
pack() { # name patterns... (expanded in the staging folder, where .carry/shared is)
  local name=$1; shift
  # shellcheck disable=SC2068 # the patterns are globbed there, not here
  (cd "$stage" && tar -chf - $@) | xz -T0 -6 > ".carry/$name.tar.xz"
  echo "$name: $(du -h ".carry/$name.tar.xz" | cut -f1)"
}
for what in "${@:-dev tiny moe}"; do
  for w in $what; do
    case $w in
      dev)
        [ -x build/device/llmq ] || { echo "carry.sh: run make device first" >&2; exit 1; }
        tar -cf - build/device/llmq build/device/cuda.test build/device/engine.test build/device/COMMIT | xz -T0 -6 > .carry/dev.tar.xz
        echo "dev: $(du -h .carry/dev.tar.xz | cut -f1) ($(cat build/device/COMMIT))" ;;
      tiny) pack tinynodata "$S/models/llama-tiny" "$S/reference/llama-tiny.*" "$S/reference/wikitext2-test.tokens.i32" ;;
      zoolite)
        pack zoolite "$S/models/archzoo/qwen2-rand" "$S/models/archzoo/qwen3-rand" "$S/models/archzoo/llama31-rand" \
          "$S/models/archzoo/gemma3-rand/config.json" "$S/models/archzoo/mistral-swa-rand/config.json" \
          "$S/reference/qwen2-rand.*" "$S/reference/qwen3-rand.*" "$S/reference/llama31-rand.*" ;;
      moe) pack moe "$S/models/archzoo/mixtral-rand" "$S/models/archzoo/qwen3moe-rand" "$S/reference/mixtral-rand.*" "$S/reference/qwen3moe-rand.*" ;;
      wiki) pack wiki "$S/data/wikitext2/wiki.test.raw" ;;
      base)
        rev=$(git rev-parse --verify "${BASE:-main}^{commit}") || { echo "carry.sh: no revision ${BASE:-main}" >&2; exit 1; }
        mkdir -p "$stage/.carry/base"
        git archive "$rev" cuda | tar -x -C "$stage/.carry/base" --wildcards 'cuda/*.cu' 'cuda/*.cuh' 'cuda/*.h'
        echo "$rev" > "$stage/.carry/base/COMMIT"
        pack base .carry/base ;;
      swa) pack swa "$S/models/archzoo/gemma3-rand" "$S/models/archzoo/mistral-swa-rand" "$S/reference/gemma3-rand.*" \
          "$S/reference/mistral-swa-rand.*" ;;
      *) echo "carry.sh: unknown archive $w (want dev, tiny, zoolite, moe, swa, wiki, base)" >&2; exit 1 ;;
    esac
  done
done

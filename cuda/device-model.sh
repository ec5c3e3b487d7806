#!/usr/bin/env bash
# One call on the GPU machine for the GPU runtime (cuda.Model): build the
# library, run the model tests, and measure perplexity, decoding and
# prefill. Run from the repository root with build/device (make device)
# and .carry/shared (the shared assets the mode needs) carried — `make
# device && bash cuda/carry.sh` packs both into .carry/*.tar.xz, which
# this script unpacks (carry those files):
#
#   bash cuda/device-model.sh tiny    # tests + ppl of llama-tiny fp/RTN/GPTQ
#   bash cuda/device-model.sh small   # tests + ppl of llama-small fp/RTN/GPTQ
#   bash cuda/device-model.sh synth   # synthetic llama3-8b W4 and bf16: decode/prefill/ppl speed
#                                     # (SYNTH_BITS, SYNTH_CTX, SYNTH_BATCH, SYNTH_PREFILL, SYNTH_PPL=0: no ppl,
#                                     # SYNTH_LOGITS=1: the decode again with --logits)
#   bash cuda/device-model.sh moe     # synthetic qwen3-30b-a3b W4 decode beside the dense llama3-8b W4
#   bash cuda/device-model.sh trace   # a decode step's kernels in place, in the graph, by nsys or CUPTI (TRACE_PRESET, TRACE_BATCH,
#                                     # TRACE_CTX, TRACE_STEPS)
#   bash cuda/device-model.sh probe   # cuda/probe/stream.cu: the GEMV's streaming alone, by transport, warps an SM,
#                                     # steps a batch and work a step (stream-probe-$G.json; PROBE_MB, PROBE_ARGS)
#   bash cuda/device-model.sh chain   # cuda/probe/chain.cu: a decode step's chain of dependent reads, launched apart or in
#                                     # one persistent kernel (CHAIN_ARGS; chain-probe-$G.json)
#   bash cuda/device-model.sh ops     # every kernel of a decode layer timed alone (llama3-8b, qwen3-30b-a3b; batch 1, 8),
#                                     # once per OPS_ENV setting (decode-ops-$G$OPS_TAG.txt)
#   bash cuda/device-model.sh pdl     # programmatic dependent launch (on unless LLMQ_PDL=0): tests with it, llama3-8b W4 decode off/on
#   bash cuda/device-model.sh serve   # llmq bench serve --device cuda on llama-tiny, memcheck
#   bash cuda/device-model.sh engine  # the engine's paged-cache tests on the GPU (admission, preemption,
#                                     # cancellation, nothing lost under load; llama-tiny)
#   bash cuda/device-model.sh serve8b # llmq bench serve on a synthetic llama3-8b W4, 1/8/32/64 streams
#   bash cuda/device-model.sh load    # W4 llama3-8b load time; --device auto
#   bash cuda/device-model.sh lmhead  # a packed LM head: its model tests (llama-tiny RTN w4 with and without
#                                     # --quantize-lm-head), then llama3-8b W4 decode with it and, in the same run,
#                                     # with the fp16 head (HEAD_CTX, HEAD_BATCH, HEAD_PREFILL)
#   bash cuda/device-model.sh tasks   # eval tasks and echoed logprobs (llmq serve) of llama-tiny
#   bash cuda/device-model.sh zoo     # the model-family tests (flash kernel, zoo logits, joined layers)
#   bash cuda/device-model.sh attn    # the decode attention kernels: tests, BenchmarkAttentionDecode (once per setting
#                                     # in ATTN_ENV, ';'-separated as SWEEP_ENV's), sanitizers
#   bash cuda/device-model.sh schemes # evals/schemes.sh's rows on the GPU (SCHEME_MODEL, SCHEME_ROWS), prep carried
#   bash cuda/device-model.sh check   # every cuda test (kernels and model, llama-tiny), then
#                                     # memcheck with leak checking over kernels and model
#   bash cuda/device-model.sh gemm    # llmq bench gemm with the tinygemm peer (gemm-$G.json)
#   bash cuda/device-model.sh kernel  # the GEMM tests, memcheck and racecheck on the small cases
#   bash cuda/device-model.sh lowbit  # llama-tiny RTN w3 and w2 on the GPU (perplexity)
#   bash cuda/device-model.sh quick   # llmq bench gemm at a few M (QUICK_M)
#   bash cuda/device-model.sh w8      # W8A16: the 8-bit kernels' tests, llmq bench gemm --bits 8 (gemm-w8-$G.json),
#                                     # llama-tiny RTN w8 perplexity on the GPU (carry.sh dev tiny wiki)
#   bash cuda/device-model.sh v11     # the GEMV on the Tensor Cores (path mma): its tests, then bench gemm --path auto
#                                     # and mma at M ≤ 64, 4- and 8-bit (gemm-$G-mma.txt; V11_BITS, QUICK_M)
#   bash cuda/device-model.sh sample  # sampled tokens on the GPU: tests, memcheck, racecheck, BenchmarkSampleRows
#   bash cuda/device-model.sh paths   # llmq bench gemm --path gemv, then fused, at M ≤ 4 (gemm-$G-paths.txt;
#                                     # PATHS="fused dequant" QUICK_M=8,16,32,64: other paths and M)
#   bash cuda/device-model.sh profile # ncu sections of the fused kernel (PROFILE_M, PROFILE_SHAPE, PROFILE_KERNEL,
#                                     # PROFILE_ARGS: more bench gemm flags, PROFILE_TAG: ncu$TAG.txt; PROFILE_SOURCE=1:
#                                     # the stall samples by SASS instruction too, ncu$TAG-sass.txt)
#   bash cuda/device-model.sh wgmma   # v19's and v21's variants on their edges (WGMMA_VARIANTS, WGMMA_COUNT; WGMMA_TEST_S: the
#                                     # tests' time limit), its plan, three sanitizers (WGMMA_SANITIZERS); with
#                                     # carry.sh base, the baseline's BASE_VARIANTS too
#   bash cuda/device-model.sh quant   # GPTQ and AWQ on the GPU: tests, then QMODELS (llama-tiny llama-small)
#                                     # × QCONFIGS (gptq-w4, gptq-wB-gG[-bs], gptq-w4-act, awq-wB, awqgptq-w4) quantized
#                                     # with --device cuda and evaluated on the GPU
#   bash cuda/device-model.sh quant8b # GPTQ (METHOD=awq: AWQ) of a synthetic bf16 llama3-8b on the GPU, timed
#                                     # (PRESET, SYNTH_ARGS="--layers 8", METHOD, NSAMPLES, QARGS: more quantize
#                                     # flags, QSUFFIX: the report's name, KEEP_SYNTH=1: reuse /tmp/b16)
#   bash cuda/device-model.sh reftime # the reference gptq.py timed on a llama3-8b block (.carry/gptq-ref)
#   bash cuda/device-model.sh seeds   # evals/seeds.sh on the GPU: llama-tiny SEED_CONFIGS ("gptq:4 awq:4")
#   bash cuda/device-model.sh act     # llama-tiny with INT8 and FP8 activations per token on the GPU (ppl)
#   bash cuda/device-model.sh sweep   # llmq bench gemm $SWEEP_ARGS (each run at most SWEEP_S seconds) once per setting in SWEEP_ENV (settings separated by
#                                     # ';', each of VAR=value pairs: "LLMQ_W4_SWAP_VARIANT=0;LLMQ_W4_SWAP_VARIANT=3 LLMQ_W4_SPLITS=2"),
#                                     # into gemm-$G-sweep$SWEEP_TAG.txt
#   bash cuda/device-model.sh vtests  # the GEMM tests once per setting in VTEST_ENV (';'-separated as SWEEP_ENV; "" the
#                                     # default alone): a forced variant's correctness, cuda-gemm-tests-SETTING.log (SETTING
#                                     # with '=' as '-', spaces as '_'; the default's cuda-gemm-tests.log); exit 1 if any failed
#   bash cuda/device-model.sh envab   # the llama3-8b W4 decode (ENVAB_PRESET: another synth preset) with each environment
#                                     # setting in ENVAB_ENV (';'-separated as SWEEP_ENV; an empty setting is the default; a
#                                     # setting's --flag=value words go to bench decode: ";--chain=8" times chains of 8),
#                                     # ENVAB_PASSES times each (2), interleaved, in one run of one library (decode-envab-N.json; SYNTH_CTX,
#                                     # SYNTH_BATCH; ENVAB_SYNTH_ARGS: more synth flags, e.g. --layers 12)
#   bash cuda/device-model.sh ab      # this tree's library against a baseline's in one run (carry.sh base, BASE=rev):
#                                     # bench gemm (AB_BITS, QUICK_M), AB_OPS=1 BenchmarkDecodeOps, AB_DECODE=1 decode
#   Result files are named by the GPU ($G: gemm-h100.json on an H100, gemm-h200.json on an H200).
#   Modes join with +, run in order: check+gemm+tiny, synth, ...
#   The build compiles sm_90a only; BUILD_ARCH=all adds the Makefile's sm_80 (run it when kernels change).
#
# Results go to $OUT (the device tool's folder) or build/out.
set -uo pipefail
OUT=${OUT:-build/out}
mkdir -p "$OUT"
# Archives under .carry hold repository-relative paths (.carry/shared/...,
# build/device/...): compressed, more fits in one carry.
# a later call on a warm machine (SKIP_BUILD=1) keeps the library, but the carry replaced .carry: unpack again
{ [ -n "${SKIP_BUILD:-}" ] && [ -d .carry/shared ]; } || for f in .carry/*.tar.xz; do [ -e "$f" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('.')" "$f"; done
export LLMQ_COMMIT=$(tr -d '\n' < build/device/COMMIT)
# The GPU's short name (h100, h200, ...) names the result files: figures of
# different cards never share a canonical file.
export G=${G:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[a-z]+[0-9]{2,4}[a-z]*' | head -1 | tr A-Z a-z)}
G=${G:-gpu}
export LLMQ_SHARED=$PWD/.carry/shared
L=build/device/llmq
[ -n "${SKIP_BUILD:-}" ] || nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
if [ -z "${SKIP_BUILD:-}" ]; then
  t0=$(date +%s)
  # Hopper's code only (the Makefile's default adds sm_80's, which the H200
  # never runs): about half the build, which every call pays. BUILD_ARCH=all
  # builds the default's (do it once when kernels change: sm_80 must compile).
  arch=(CUDA_ARCH="-gencode arch=compute_90a,code=sm_90a")
  [ "${BUILD_ARCH:-}" = all ] && arch=()
  make cuda NVCC_FLAGS="-O3 -std=c++17 -Xptxas -v" "${arch[@]}" > "$OUT/build.log" 2>&1 ||
    { grep -E "error" "$OUT/build.log" | head -20; tail -20 "$OUT/build.log"; exit 1; }
  grep -A3 "Compiling entry function '_ZN.*w4a16_fused.*sm_90a" "$OUT/build.log" | grep -E "registers|spill" | head -12
  grep -A3 "Compiling entry function '_ZN.*attention_decode.*sm_90a" "$OUT/build.log" | grep -E "registers|spill" | sed 's/^/attention_decode: /'
  cp build/libllmqcuda.so build/device/
  if [ -d .carry/base/cuda ]; then  # the A/B modes' baseline (carry.sh base): same flags, its own sources
    mkdir -p build/base
    barch=(-gencode arch=compute_90a,code=sm_90a)
    [ "${BUILD_ARCH:-}" = all ] && barch+=(-gencode arch=compute_80,code=sm_80)
    nvcc -O3 -std=c++17 -Xptxas -v --shared -Xcompiler -fPIC,-fvisibility=hidden "${barch[@]}" \
      -lcublas -lcusolver -o build/base/libllmqcuda.so .carry/base/cuda/*.cu > "$OUT/build-base.log" 2>&1 ||
      { grep -E "error" "$OUT/build-base.log" | head; exit 1; }
    echo "base $(cat .carry/base/COMMIT) built"
  fi
  echo "build $(( $(date +%s) - t0 ))s"
fi
WIKI=$LLMQ_SHARED/data/wikitext2/wiki.test.raw
# split_settings splits a ';'-separated list of environment settings
# (each of VAR=value pairs; "" is the default, "A;" keeps one) into the
# array `settings` (envab, sweep, attn and vtests).
split_settings() { readarray -td';' settings < <(printf '%s;' "$1"); }
ppl() { # name dir
  $L eval ppl "$2" --data "$WIKI" --device cuda --json "$OUT/ppl-$1-wikitext2-cuda.json" 2>&1 | grep -v "^ppl " | tr '\r' '\n' | grep -E "perplexity|speed|loaded|error|Error"
}
# tiny_w4 [--quantize-lm-head]: llama-tiny RTN w4 (groups of 128) in build/q, with its lm_head
# quantized too when asked; prints the directory, nothing if quantize failed (its log: $OUT/quantize.log).
tiny_w4() {
  local d=build/q/llama-tiny-rtn-w4${1:+-head}
  $L quantize "$LLMQ_SHARED/models/llama-tiny" --method rtn --bits 4 --group 128 ${1:-} -o $d --force > "$OUT/quantize.log" 2>&1 &&
    echo "$PWD/$d"
}
# Joined modes run one after another in this call.
case "$1" in
  *+*)
    rc=0
    IFS=+ read -ra modes <<< "$1"
    for m in "${modes[@]}"; do
      [ -n "$m" ] || continue
      echo "===== $m"; SKIP_BUILD=1 bash "$0" "$m" "${@:2}" || rc=1
      # The device tool returns only a few files: pack them into one, after
      # each mode, so a call cut short still returns what finished.
      (cd "$OUT" && f=$(ls | grep -vE '^(build.log|results.tar)$'); [ -z "$f" ] || tar -rf results.tar --remove-files $f)
    done
    exit $rc
    ;;
esac
case "$1" in
  check|zoo) # zoo: the model-family tests only, no sanitizer
    # Packed copies for TestJoinedLinearsMatchSeparate (RTN: deterministic, made here).
    W4=
    for m in models/llama-tiny models/archzoo/qwen2-rand models/archzoo/mixtral-rand models/archzoo/qwen3moe-rand; do
      d=build/q/$(basename $m)-rtn-w4; g=128
      [[ $m == *mixtral* ]] && g=64    # its experts' down has 192 inputs
      [[ $m == *qwen3moe* ]] && g=32   # 96: its experts then run dequantized in fp16
      [ -d "$LLMQ_SHARED/$m" ] && $L quantize "$LLMQ_SHARED/$m" --method rtn --bits 4 --group $g -o $d --force > /dev/null 2>&1 && W4+=":$PWD/$d"
    done
    # a mixture whose middle layer is dense (mlp_only_layers; synthetic, qwen3-30b-a3b's widths: gated experts)
    d=build/q/qwen3-30b-a3b-mixed-synth-w4
    $L synth --preset qwen3-30b-a3b --layers 3 --mlp-only-layers 1 --bits 4 --group 128 -o $d --force \
      --tokenizer "$LLMQ_SHARED/models/llama-tiny" > /dev/null 2>&1 && W4+=":$PWD/$d"
    # and one whose lm_head is quantized too (run packed, headRows rows at a time)
    [ -d "$LLMQ_SHARED/models/llama-tiny" ] && d=$(tiny_w4 --quantize-lm-head) && W4+=":$d"
    export LLMQ_TEST_W4_MODELS=${W4#:}
    run=.; [ "$1" = zoo ] && run='TestAttentionCausal|TestAttentionDecode|TestLongContext|TestMoE|TestZoo|TestSupports|TestJoined|TestModelLogits|TestGreedy|TestWindowNLL|TestRMSNorm|TestArgmax|TestBatched|TestPaged'
    build/device/cuda.test -test.v -test.run "$run" > "$OUT/cuda-tests.log" 2>&1
    rc=$?
    echo "# $LLMQ_COMMIT: cuda.test -test.v -test.run '$run'" | cat - "$OUT/cuda-tests.log" > "$OUT/t" && mv "$OUT/t" "$OUT/cuda-tests.log"
    echo "cuda tests rc=$rc"; grep -E "^(\s*--- |ok|FAIL|PASS)|Δlogit|window|round|held|panic|error" "$OUT/cuda-tests.log" | head -70
    [ "$1" = zoo ] && exit $rc
    [ -n "${NO_SANITIZER:-}" ] && exit $rc  # check's tests alone (a call short of device time)
    r='TestDequant|TestSmallForSanitizer|TestRMSNorm|TestMoEGemvGated|TestMoEGemvRouted'
    echo "# $LLMQ_COMMIT: compute-sanitizer --tool memcheck --leak-check full cuda.test -test.run '$r'" > "$OUT/cuda-memcheck.log"
    timeout 150 compute-sanitizer --tool memcheck --leak-check full build/device/cuda.test -test.run "$r" >> "$OUT/cuda-memcheck.log" 2>&1
    echo "memcheck (kernels): $(grep -E 'ERROR SUMMARY|LEAK SUMMARY' "$OUT/cuda-memcheck.log" | tail -2 | tr '\n' ' ')"
    r='TestLoadUnloadReleasesMemory|TestConcurrentGenerate|TestClosedModel|TestZooLogitsOnGPU|TestPrefillFlash|TestJoined|TestPagedCache|TestGreedyStepsOnDevice'
    echo "# $LLMQ_COMMIT: compute-sanitizer --tool memcheck --leak-check full cuda.test -test.v -test.run '$r'" > "$OUT/cuda-model-memcheck.log"
    timeout 200 compute-sanitizer --tool memcheck --leak-check full build/device/cuda.test -test.v -test.run "$r" >> "$OUT/cuda-model-memcheck.log" 2>&1
    echo "memcheck (model, load/unload) rc=$?: $(grep -E 'ERROR SUMMARY|LEAK SUMMARY|^(--- |ok|FAIL)' "$OUT/cuda-model-memcheck.log" | tail -8 | tr '\n' ' ')"
    ;;
  gemm)
    python3 evals/torchref/tinygemm.py --json "$OUT/tinygemm-$G.json" > "$OUT/tinygemm.log" 2>&1 || tail -5 "$OUT/tinygemm.log"
    peer=; [ -s "$OUT/tinygemm-$G.json" ] && peer="--peer $OUT/tinygemm-$G.json"  # the table without the peer if torch failed
    $L bench gemm $peer --json "$OUT/gemm-$G.json" 2>&1 | tail -60
    ;;
  kernel)
    build/device/cuda.test -test.v -test.run 'TestW4A16|TestW8A16|TestGatedGEMM|TestGEMV|TestDequant|TestPlanFallsBack|TestBadShape|TestSmallForSanitizer|TestFusedVariants' > "$OUT/cuda-kernel-tests.log" 2>&1
    echo "kernel tests rc=$?"; grep -E "^(--- |ok|FAIL|PASS)|panic|error" "$OUT/cuda-kernel-tests.log" | head -30
    if [ -d "$LLMQ_SHARED/models/llama-tiny" ]; then  # the kernels inside the model
      build/device/cuda.test -test.v -test.run 'TestModelLogits|TestGreedy|TestWindowNLL|TestBatchedSteps' > "$OUT/cuda-model-tests.log" 2>&1
      echo "model tests rc=$?"; grep -E "^(--- |ok|FAIL)|Δlogit|window" "$OUT/cuda-model-tests.log" | head -12
    fi
    grep -E "rel err" "$OUT/cuda-kernel-tests.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/largest rel err: /'
    for tool in memcheck racecheck; do
      leak=; [ $tool = memcheck ] && leak="--leak-check full"
      log="$OUT/cuda-$tool-kernels.log"
      r='TestDequant|TestSmallForSanitizer|TestAWQQuant|TestAWQClip|TestAttentionCausal'
      echo "# $LLMQ_COMMIT: compute-sanitizer --tool $tool $leak cuda.test -test.run '$r'" > "$log"
      timeout 200 compute-sanitizer --tool $tool $leak build/device/cuda.test -test.run "$r" >> "$log" 2>&1
      echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY' "$log" | tail -2 | tr '\n' ' ')"
    done
    ;;
  wgmma) # v19 and v21 (w4a16_wgmma, _rs): their variants forced on their edges (WGMMA_COUNT runs each) and the plan's
          # choice, then racecheck, synccheck and memcheck on them; with a baseline (carry.sh base) the
          # baseline's library on BASE_VARIANTS too, plain and under racecheck (a fix's before and after; the
          # baseline's own library: a 64-token v21 variant there shows racecheck's false hazards, rs_warp_arrive)
    # (-test.run takes a top-level '|' as two patterns, then splits each at '/': both levels in parentheses)
    r="(TestFusedVariantsMatchReference|TestPlanTakesWgmmaWhenAsked|TestWgmmaSplitsMidGroup)/(LLMQ_W4_FUSED_VARIANT=(${WGMMA_VARIANTS:-1[0-9]|2[0-6]})\$|LLMQ_W4_WGMMA_MAX_M|LLMQ_W4_SPLITS)"
    # the fences each v19 instantiation compiled to (MEMBAR: the wait for every access in flight)
    cuobjdump -sass build/device/libllmqcuda.so 2>/dev/null |
      python3 evals/sass_steps.py --count MEMBAR,FENCE.VIEW.ASYNC w4a16_wgmma | tee "$OUT/sass-wgmma-fences.txt"
    tools=${WGMMA_SANITIZERS-racecheck synccheck memcheck}  # (set empty: the tests alone)
    # racecheck does not follow v21's elected stage release (rs_warp_arrive in w4a16.cu) and reports
    # its reads as hazards: it checks a library built with one arrival a thread instead
    # (built in the background while the plain tests run; -lineinfo: racecheck's reports name source lines)
    rlib=$PWD/build/device/libllmqcuda.so rpid=
    if [[ " $tools " == *" racecheck "* ]]; then
      mkdir -p build/racecheck
      nvcc -O3 -std=c++17 -lineinfo -DLLMQ_RS_THREAD_ARRIVE --shared -Xcompiler -fPIC,-fvisibility=hidden \
        -gencode arch=compute_90a,code=sm_90a -lcublas -lcusolver -o build/racecheck/libllmqcuda.so cuda/*.cu \
        > "$OUT/build-racecheck.log" 2>&1 &
      rpid=$!
    fi
    # wgmma_run NAME LIB COMMIT PATTERN TOOLS: the tests matching PATTERN on library LIB, WGMMA_COUNT
    # times (cuda-wgmma-tests$NAME.log), then each sanitizer in TOOLS once (cuda-$tool-wgmma$NAME.log)
    wgmma_run() {
      local log="$OUT/cuda-wgmma-tests$1.log" tool lib
      echo "# $3: LLMQ_CUDA_LIB=$2 cuda.test -test.v -test.count ${WGMMA_COUNT:-3} -test.run '$4'" > "$log"
      LLMQ_CUDA_LIB=$2 timeout ${WGMMA_TEST_S:-400} build/device/cuda.test -test.v -test.count ${WGMMA_COUNT:-3} -test.run "$4" >> "$log" 2>&1
      echo "wgmma tests$1 rc=$? $(grep -c -- '^    --- PASS' "$log") passed, $(grep -c -- '^    --- FAIL' "$log") failed"
      grep -E -- "--- FAIL|largest error at" "$log" | head -8
      if [ -n "$rpid" ]; then
        if wait $rpid; then rlib=$PWD/build/racecheck/libllmqcuda.so; else
          echo "the racecheck library (-DLLMQ_RS_THREAD_ARRIVE) failed to build: racecheck runs the measured one"; fi
        rpid=
      fi
      for tool in $5; do
        log="$OUT/cuda-$tool-wgmma$1.log" lib=$2
        [ "$tool" = racecheck ] && [ -z "$1" ] && lib=$rlib
        echo "# $3: LLMQ_CUDA_LIB=$lib compute-sanitizer --tool $tool cuda.test -test.run '$4'" > "$log"
        LLMQ_CUDA_LIB=$lib timeout ${WGMMA_SANITIZER_S:-150} compute-sanitizer --tool $tool build/device/cuda.test -test.run "$4" >> "$log" 2>&1
        echo "$tool$1 rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) $(grep -cE '^(ok|PASS)' "$log") ok"
      done
    }
    wgmma_run "" "$PWD/build/device/libllmqcuda.so" "$LLMQ_COMMIT" "$r" "$tools"
    if [ -s build/base/libllmqcuda.so ]; then  # the baseline: its variants plain, then under racecheck
      wgmma_run -base "$PWD/build/base/libllmqcuda.so" "base $(cat .carry/base/COMMIT)" \
        "TestFusedVariantsMatchReference/LLMQ_W4_FUSED_VARIANT=(${BASE_VARIANTS:-12|17})\$" "$([[ " $tools " == *" racecheck "* ]] && echo racecheck)"
    fi
    ;;
  lowbit)
    # 2- and 3-bit checkpoints run in the 4-bit layout: RTN of llama-tiny
    # (deterministic, so the CPU machine's checkpoint is the same), ppl on the GPU.
    D=$LLMQ_SHARED/models/llama-tiny
    for b in ${LOWBIT_BITS:-3 2}; do
      $L quantize "$D" --method rtn --bits $b --group 128 -o build/q/llama-tiny-rtn-w$b --force > /dev/null 2>&1 || echo "rtn w$b quantize failed"
      echo "== llama-tiny rtn-w$b"; ppl llama-tiny-rtn-w$b build/q/llama-tiny-rtn-w$b
    done
    ;;
  w8) # issue 15, item 3: 8-bit codes through the GEMV kernel (M ≤ 4) and dequantize + cuBLAS
    run='TestW8A16|TestW4A16MatchesReference|TestDequantMatchesCPU|TestGEMVRefuses|TestPlanFallsBack|TestBadShape|TestModelLogits|TestGreedy'
    { echo "# $LLMQ_COMMIT: cuda.test -test.v -test.run '$run'"; build/device/cuda.test -test.v -test.run "$run" 2>&1; } > "$OUT/cuda-w8-tests-$G.log"
    grep -E "^(\s*--- FAIL|--- PASS|ok|FAIL|PASS)|panic|w8" "$OUT/cuda-w8-tests-$G.log" | grep -v "rel err" | head -30
    grep -E "rel err" "$OUT/cuda-w8-tests-$G.log" | grep "bits:8" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/largest 8-bit rel err: /'
    $L bench gemm --bits 8 --m ${W8_M:-1,2,4,16,64} --json "$OUT/gemm-w8-$G.json" 2>&1 | grep -E "^(shape|8B|70B)|rror"
    { echo "# $LLMQ_COMMIT: llmq bench gemm --bits 8 --path fused --m 8,16,32,64"
      $L bench gemm --bits 8 --path fused --m 8,16,32,64 2>&1 | grep -E "^(shape|8B|70B)|rror"; } | tee "$OUT/gemm-w8-$G-fused.txt"
    LOWBIT_BITS=8 SKIP_BUILD=1 bash "$0" lowbit
    ;;
  v11) # the GEMV on the Tensor Cores: registers, tests, then bench gemm --path mma against the automatic plan
    grep -A3 "Compiling entry function '_ZN.*w4a16_gemv_mma.*sm_90a" "$OUT/build.log" 2>/dev/null | grep -E "registers|spill"
    run='TestW4A16MatchesReference|TestW8A16MatchesReference|TestSmallForSanitizer|TestGEMVRefuses|TestBadShape|TestModelLogits|TestGreedy|TestBatched|TestWindowNLL'
    { echo "# $LLMQ_COMMIT: cuda.test -test.v -test.run '$run'"; build/device/cuda.test -test.v -test.run "$run" 2>&1; } > "$OUT/cuda-tests-mma-$G.log"
    grep -E "^(\s*--- FAIL|--- PASS|ok|FAIL|PASS)|panic" "$OUT/cuda-tests-mma-$G.log" | head -20
    grep -E "rel err" "$OUT/cuda-tests-mma-$G.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/largest rel err: /'
    for b in ${V11_BITS:-4 8}; do for p in auto mma; do
      echo "# $LLMQ_COMMIT: llmq bench gemm --bits $b --path $p --m ${QUICK_M:-1,2,4,8,16,32,64} --iters 100"
      $L bench gemm --bits $b --path $p --m ${QUICK_M:-1,2,4,8,16,32,64} --iters 100 2>&1 | grep -E "^(shape|8B|70B)|rror"
    done; done | tee "$OUT/gemm-$G-mma.txt" | cut -c1-150
    ;;
  sample) # sampled tokens on the GPU (sample_rows): tests, sanitizers, the kernel's time against argmax
    run='TestSampleRowsMatchesHost|TestSampledStepsOnDevice|TestArgmaxRows|TestGreedy'
    { echo "# $LLMQ_COMMIT: cuda.test -test.v -test.run '$run'"; build/device/cuda.test -test.v -test.run "$run" 2>&1; } > "$OUT/cuda-tests-sample-$G.log"
    grep -E "^(\s*--- FAIL|--- PASS|ok|FAIL|PASS)|panic|left to the host|GPU picked" "$OUT/cuda-tests-sample-$G.log" | head -20
    for tool in memcheck racecheck; do
      log="$OUT/cuda-$tool-sample-$G.log"
      echo "# $LLMQ_COMMIT: compute-sanitizer --tool $tool cuda.test -test.run TestSampleRowsMatchesHost" > "$log"
      timeout ${SAN_TIMEOUT:-60} compute-sanitizer --tool $tool build/device/cuda.test -test.run TestSampleRowsMatchesHost >> "$log" 2>&1
      echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    done
    { echo "# $LLMQ_COMMIT: cuda.test -test.run '^$' -test.bench SampleRows -test.benchtime 10x"
      build/device/cuda.test -test.run '^$' -test.bench SampleRows -test.benchtime 10x 2>&1; } | tee "$OUT/bench-sample-$G.txt" | grep -E "µs/call"
    ;;
  quick)
    $L bench gemm --m ${QUICK_M:-1,16,32} --iters 60 2>&1 | tail -16 | cut -c1-150
    ;;
  envab) # one library's decode under each environment setting (a tuning switch's A/B where the API differs from main's)
    d=/tmp/envab-b4
    $L synth --preset ${ENVAB_PRESET:-llama3-8b} --bits 4 --group 128 ${ENVAB_SYNTH_ARGS:-} -o $d --force --tokenizer $LLMQ_SHARED/models/llama-tiny 2>&1 | tail -1
    split_settings "${ENVAB_ENV:-}"
    r=0
    for pass in $(seq ${ENVAB_PASSES:-2}); do
      for e in "${settings[@]}"; do
        r=$((r + 1))
        echo "== pass $pass: ${e:-(default)}"
        # a setting's words: VAR=value for the environment, --flag=value for bench decode (--chain=8)
        vars=(); flags=()
        for w in $e; do if [[ $w == --* ]]; then flags+=("$w"); else vars+=("$w"); fi; done
        env "${vars[@]}" $L bench decode $d --device cuda --context ${SYNTH_CTX:-128,2048} --batch ${SYNTH_BATCH:-1,8} \
          --prefill 0 --steps 32 "${flags[@]}" --json "$OUT/decode-envab-$r.json" 2>&1 | grep -E "^decode "
      done
    done
    rm -rf $d
    ;;
  sweep) # one bench gemm per environment setting, the same binary and GPU state
    split_settings "${SWEEP_ENV:-}"
    for e in "${settings[@]}"; do
      echo "# $LLMQ_COMMIT: $e llmq bench gemm ${SWEEP_ARGS:-}"
      env $e timeout ${SWEEP_S:-300} $L bench gemm ${SWEEP_ARGS:-} 2>&1 | grep -E "^(shape|8B|70B)|rror"
    done | tee "$OUT/gemm-$G-sweep${SWEEP_TAG:-}.txt" | cut -c1-150
    ;;
  vtests) # the GEMM tests once per environment setting in VTEST_ENV (';'-separated as SWEEP_ENV): a forced
           # variant's correctness before its timing (cuda-gemm-tests-SETTING.log)
    split_settings "${VTEST_ENV:-}"
    r=${VTEST_RUN:-'TestW4A16|TestGatedGEMM|TestSmallForSanitizer'}  # VTEST_RUN: another -test.run
    vrc=0
    for e in "${settings[@]}"; do
      # the setting in the file name, '=' as '-' and spaces as '_' (anything else the device tool
      # would not return as '_')
      log="$OUT/cuda-gemm-tests$(printf '%s' "${e:+-$e}" | tr ' =' '_-' | tr -c 'A-Za-z0-9._-' '_').log"
      echo "# $LLMQ_COMMIT: $e cuda.test -test.v -test.run '$r'" > "$log"
      env $e build/device/cuda.test -test.v -test.run "$r" >> "$log" 2>&1
      trc=$?
      [ $trc = 0 ] || vrc=1
      # (the largest error of the cases that passed: a failed case's is on its FAIL line below)
      echo "[${e:-default}] rc=$trc $(grep -c '^--- FAIL' "$log") failed; largest rel err" \
        "$(grep -E 'rel err' "$log" | awk '{print $NF}' | sort -g | tail -1)"
      [ $trc = 0 ] || grep -E '^\s*--- FAIL|Frobenius error|not written|^panic' "$log" | head -6
    done
    exit $vrc
    ;;
  paths) # the GEMV kernel against the fused one where both run
    for p in ${PATHS:-gemv fused}; do
      echo "# $LLMQ_COMMIT: llmq bench gemm --path $p --m ${QUICK_M:-1,2,4} --iters 100"
      $L bench gemm --path $p --m ${QUICK_M:-1,2,4} --iters 100 2>&1 | grep -E "^(shape|8B|70B)"
    done | tee "$OUT/gemm-$G-paths.txt" | cut -c1-150
    ;;
  profile)
    # ncu on the fused kernel: 70B down at M = 1 (PROFILE_M, PROFILE_SHAPE);
    # with the warps' stall reasons (cycles stalled per issued instruction,
    # by reason), which the sections alone do not print.
    timeout 300 ncu --clock-control none -k regex:${PROFILE_KERNEL:-w4a16_fused} -c 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      --metrics "$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard short_scoreboard wait \
        mio_throttle lg_throttle math_pipe_throttle barrier membar not_selected selected dispatch_stall no_instruction \
        branch_resolving tex_throttle | sed 's/,$//')" \
      ${PROFILE_SOURCE:+--section SourceCounters --import-source no -o /tmp/prof -f} \
      $L bench gemm --m ${PROFILE_M:-1} --shape "${PROFILE_SHAPE:-70B}" --iters 20 ${PROFILE_ARGS:-} > "$OUT/ncu${PROFILE_TAG:-}.txt" 2>&1
    if [ -n "${PROFILE_SOURCE:-}" ]; then  # PROFILE_SOURCE=1: the sections from the report, and the warps' stall samples by SASS line
      ncu -i /tmp/prof.ncu-rep >> "$OUT/ncu${PROFILE_TAG:-}.txt" 2>&1
      ncu -i /tmp/prof.ncu-rep --page source --print-source sass --csv > /tmp/prof-sass.csv 2>&1
      python3 evals/ncu_stalls.py /tmp/prof-sass.csv > "$OUT/ncu${PROFILE_TAG:-}-sass.txt" 2>&1
      head -40 "$OUT/ncu${PROFILE_TAG:-}-sass.txt"
    fi
    grep -vE "^==PROF==|^  *-+ *$" "$OUT/ncu${PROFILE_TAG:-}.txt" | grep -E "Throughput|Duration|Registers|Shared Memory|Achieved|Theoretical Occ|Block Limit|Warp Cycles|Stall|Issued|Eligible|Active Warps|L2|DRAM|Mem|Grid Size|Waves|One or More|Executed|No Eligible|stalled" | head -80
    ;;
  tiny|small)
    M=llama-$1
    if [ -z "${SKIP_TESTS:-}" ]; then
      build/device/cuda.test -test.v -test.run 'TestModel|TestGreedy|TestBatched|TestWindowNLL|TestKernelError|TestCheckFits|TestLoadUnload|TestConcurrent|TestClosed' > "$OUT/cuda-model-tests-$1.log" 2>&1
      echo "model tests rc=$?"; grep -E "^(--- |ok|FAIL|PASS)|Δlogit|window|difference|panic" "$OUT/cuda-model-tests-$1.log" | head -40
    fi
    # RTN is deterministic, so quantizing here gives the weights whose CPU
    # perplexity is committed; GPTQ/AWQ checkpoints come made on the CPU
    # machine (.carry/q) for the same reason.
    D=$LLMQ_SHARED/models/$M
    $L quantize "$D" --method rtn --bits 4 --group 128 -o build/q/$M-rtn-w4 --force > /dev/null 2>&1 || echo "rtn quantize failed"
    for dir in "$D" build/q/$M-rtn-w4 .carry/q/$M-*; do
      [ -d "$dir" ] || continue
      c=$(basename "$dir"); c=${c#$M-}; [ "$dir" = "$D" ] && c=fp32
      echo "== $M $c"; ppl $M-$c "$dir"
      $L generate "$dir" --device cuda --prompt "The history of the" --max-tokens 32 2>&1 | tail -1
    done
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 300 compute-sanitizer --tool memcheck build/device/cuda.test -test.run 'TestWindowNLL|TestBatched' > "$OUT/cuda-model-memcheck-$1.log" 2>&1
      echo "memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/cuda-model-memcheck-$1.log" | tail -1)"
    fi
    ;;
  serve) # the engine on the GPU under load, and the current kernels under the sanitizer
    $L bench serve $LLMQ_SHARED/models/llama-tiny --device cuda --clients 32 --requests 256 --max-tokens 32 --json "$OUT/serve-load-llama-tiny-$G.json" 2>&1 | tail -6
    timeout 200 compute-sanitizer --tool memcheck build/device/cuda.test -test.run 'TestWindowNLL|TestGreedy|TestKernelError' > "$OUT/cuda-model-memcheck-tiny.log" 2>&1
    echo "memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/cuda-model-memcheck-tiny.log" | tail -1)"
    ;;
  serve8b) # issue 16's serving rows: llmq bench serve on a synthetic llama3-8b W4 at 1, 8, 32, 64 streams
    TOK=$LLMQ_SHARED/models/${2:-llama-tiny}
    $L synth --preset llama3-8b --bits 4 --group 128 -o /tmp/s8b --force --tokenizer "$TOK" 2>&1 | tail -1
    # llmq synth spells every id of the model (filler tokens past the tokenizer's), so each token streams
    # text and the tokens are picked on the GPU; SERVE_LOGPROBS=1 asks for logprobs too (the host's
    # log-softmax over every row, the file then -logprobs).
    # SERVE_CHAINS: a list of --chain values run in turn (the file then -chainN for each but the default 8,
    # and -passK for a value's K-th run from its second on: "8 1 1 8" is an A/B of two passes).
    lp=; [ "${SERVE_LOGPROBS:-0}" = 1 ] && lp="--logprobs"
    declare -A runs=()
    for ch in ${SERVE_CHAINS:-8}; do
      runs[$ch]=$(( ${runs[$ch]:-0} + 1 ))
      tag=; [ "$ch" = 8 ] || tag="-chain$ch"
      [ "${runs[$ch]}" = 1 ] || tag="$tag-pass${runs[$ch]}"
      echo "== --chain $ch"
      $L bench serve /tmp/s8b --device cuda --clients ${SERVE_CLIENTS:-1,8,32,64} --max-batch 64 --requests-per-client ${SERVE_REQUESTS:-8} \
        --max-tokens ${SERVE_TOKENS:-128} --chain $ch $lp --json "$OUT/serve-$G-llama3-8b-w4${lp:+-logprobs}$tag.json" 2>&1 | grep -v "^\s*$"
    done
    ;;
  engine) # issue 16, items 3 and 6, on the GPU: the engine package's paged-cache tests with cuda.Model as the backend
    run='TestContinuousBatching|TestPreemption|TestPreemptScoredPrompt|TestNothingLostUnderLoad|TestCancelFreesBlocks|TestValidatePool|TestChainsMatchSingleSteps|TestChainShortenedToThePool|TestChainsWhileRequestsWait|TestBackendPanicIsAnError'
    { echo "# $LLMQ_COMMIT: LLMQ_TEST_DEVICE=cuda engine.test -test.v -test.run '$run'"
      LLMQ_TEST_DEVICE=cuda build/device/engine.test -test.v -test.run "$run" 2>&1; } > "$OUT/engine-tests-$G.log"
    rc=$?
    grep -E "^(\s*--- |ok|FAIL|PASS)|completed|preempt|panic|rror" "$OUT/engine-tests-$G.log" | head -40
    exit $rc
    ;;
  tasks) # multiple-choice scoring and the server's echoed logprobs on the GPU (llama-tiny)
    D=$LLMQ_SHARED/models/llama-tiny
    $L eval tasks "$D" --tasks evals/tasks/llmq-facts.jsonl --device cuda --json "$OUT/tasks-llmq-facts-llama-tiny-$G.json" 2>&1 | grep -E "^(acc|items|time)|rror"
    $L serve "$D" --device cuda --addr 127.0.0.1:18080 2> "$OUT/serve-tasks.log" & pid=$!
    for i in $(seq 300); do curl -sf 127.0.0.1:18080/health > /dev/null && break; sleep 0.2; done
    python3 evals/echo-logprobs.py http://127.0.0.1:18080 "$LLMQ_SHARED" llama-tiny | tee "$OUT/echo-logprobs-llama-tiny-$G.txt"
    kill $pid; wait $pid
    ;;
  quant)
    if [ -z "${SKIP_TESTS:-}" ]; then
      build/device/cuda.test -test.v -test.run 'TestGPTQOnGPU|TestCalibrator|TestAWQ|TestAttentionCausal' > "$OUT/cuda-gptq-tests.log" 2>&1
      echo "cuda gptq/awq tests rc=$?"; grep -E "^(\s*--- |ok|FAIL|PASS)|codes equal|ΔU|x̄|loss GPU|thresholds|panic|Error" "$OUT/cuda-gptq-tests.log" | head -40
      build/device/quantize.test -test.v -test.run "${QTESTS:-TestGPUMatchesCPU|TestAWQOnGPU|TestGPUQuantizesQwen3}" > "$OUT/quantize-gpu-tests.log" 2>&1
      echo "quantize gpu tests rc=$?"; grep -E "^(\s*--- |ok|FAIL|PASS)|perplexity|panic|Error" "$OUT/quantize-gpu-tests.log" | head -30
    fi
    CALIB=$LLMQ_SHARED/data/calib.txt
    for M in ${QMODELS:-llama-tiny llama-small}; do
      for c in ${QCONFIGS:-gptq-w4}; do
        # METHOD-wB[-gG][-bs|-act]: gptq, awq (128 × 512 calibration, the
        # AWQ protocol) or awqgptq (awq+gptq)
        meth=${c%%-w*}; b=${c#*-w}; b=${b%%-*}; extra=(); seqlen=2048
        g=128; [[ $c == *-g* ]] && { g=${c#*-g}; g=${g%-bs}; }
        [[ $c == *-bs ]] && extra+=(--groups-from-block-start)
        [[ $c == *-act ]] && extra+=(--act-order)
        [ "$meth" = awq ] && { seqlen=512; extra+=(--stats "$OUT/awq-stats-$M-$c-$G.json"); }
        [ "$meth" = awqgptq ] && meth=awq+gptq
        t0=$(date +%s.%N)
        $L quantize "$LLMQ_SHARED/models/$M" --method "$meth" --bits "$b" --group "$g" "${extra[@]}" --calib "$CALIB" --nsamples 128 --seqlen $seqlen \
          -o build/q/$M-$c --force --device cuda --report "$OUT/quantize-$M-$c-$G.json" 2>&1 | grep -E "wall time|^time|rror"
        echo "== $M $c (quantize $(python3 -c "import time;print(round(time.time()-$t0,1))") s)"; ppl $M-$c build/q/$M-$c
      done
    done
    ;;
  quant8b)
    TOK=$LLMQ_SHARED/models/llama-small
    [ -d "$TOK" ] || TOK=$LLMQ_SHARED/models/llama-tiny
    t0=$(date +%s)
    [ -d /tmp/b16 ] && [ -n "${KEEP_SYNTH:-}" ] || $L synth --preset ${PRESET:-llama3-8b} --bits 16 ${SYNTH_ARGS:-} -o /tmp/b16 --force --tokenizer $TOK 2>&1 | tail -1
    echo "synth $(( $(date +%s) - t0 ))s; $(du -sh /tmp/b16 | cut -f1)"
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
    /usr/bin/time -v $L quantize /tmp/b16 --method ${METHOD:-gptq} --bits 4 --group 128 --calib $LLMQ_SHARED/data/calib.txt --nsamples ${NSAMPLES:-128} --seqlen 2048 \
      ${QARGS:-} -o /tmp/q --force --device cuda --report "$OUT/quantize-$G-${PRESET:-llama3-8b}-${METHOD:-gptq}${QSUFFIX:-}.json" > "$OUT/quant8b${QSUFFIX:-}.log" 2>&1
    echo "quantize rc=$?"; grep -E "wall time|^time|rror|Maximum resident|Elapsed" "$OUT/quant8b${QSUFFIX:-}.log"
    rm -rf /tmp/q
    [ -n "${KEEP_SYNTH:-}" ] || rm -rf /tmp/b16
    ;;
  quant70b) # two layers of a synthetic llama3-70b: per-layer time and peak GPU memory
    PRESET=llama3-70b SYNTH_ARGS="--layers ${LAYERS70:-2}" SKIP_BUILD=1 bash "$0" quant8b
    ;;
  seeds) # perplexity over calibration seeds, quantized and evaluated on the GPU (evals/seeds.sh)
    for mc in ${SEED_CONFIGS:-gptq:4 awq:4}; do
      m=${mc%%:*}
      LLMQ=$L SHARED=$LLMQ_SHARED bash evals/seeds.sh "$m" "${mc##*:}" "$LLMQ_SHARED/models/${SEED_MODEL:-llama-tiny}" cuda | tail -1
      cp evals/results/seeds-${SEED_MODEL:-llama-tiny}-${m/+/-}-w${mc##*:}-cuda.txt "$OUT/"
    done
    ;;
  attn) # the decode attention kernels against float64, then their speed (attention-decode-$G.txt)
    { echo "# $LLMQ_COMMIT: cuda.test -test.v -test.run 'TestAttention|TestLongContext'"
      build/device/cuda.test -test.v -test.run 'TestAttention|TestLongContext' 2>&1; } > "$OUT/cuda-attention-tests.log"
    echo "attention tests rc=$?"; grep -E "^(\s*--- |ok|FAIL)|Δlogit" "$OUT/cuda-attention-tests.log" | head -24
    grep -E "max \|error\|" "$OUT/cuda-attention-tests.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/largest attention error: /'
    # Again with the grid target at one block (LLMQ_DECODE_WAVE=1): every block then takes as many
    # sub-chunks as it can (up to 32), so the tests' short contexts run the sub-chunk loop too.
    { echo "# $LLMQ_COMMIT: LLMQ_DECODE_WAVE=1 cuda.test -test.v -test.run 'TestAttention|TestLongContext|TestModelLogits|TestGreedy|TestWindowNLL|TestZoo'"
      LLMQ_DECODE_WAVE=1 build/device/cuda.test -test.v -test.run 'TestAttention|TestLongContext|TestModelLogits|TestGreedy|TestWindowNLL|TestZoo' 2>&1; } > "$OUT/cuda-attention-tests-spans.log"
    echo "attention tests, most sub-chunks a block: rc=$?"; grep -E "^(\s*--- |ok|FAIL)|Δlogit" "$OUT/cuda-attention-tests-spans.log" | grep -vE "^\s*--- PASS" | head -24
    grep -E "max \|error\|" "$OUT/cuda-attention-tests-spans.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/largest attention error: /'
    split_settings "${ATTN_ENV:-}"
    for e in "${settings[@]}"; do
      echo "# $LLMQ_COMMIT: $e cuda.test -test.run '^\$' -test.bench AttentionDecode -test.benchtime 20x"
      env $e build/device/cuda.test -test.run '^$' -test.bench AttentionDecode -test.benchtime 20x 2>&1
    done | tee "$OUT/attention-decode-$G.txt" | grep -E "^#|µs/call"
    for tool in memcheck racecheck; do
      log="$OUT/cuda-$tool-attention-$G.log"
      echo "# $LLMQ_COMMIT: compute-sanitizer --tool $tool cuda.test -test.run 'TestAttentionDecode|TestAttentionRoPE|TestAttentionCausal'" > "$log"
      timeout 200 compute-sanitizer --tool $tool build/device/cuda.test -test.run 'TestAttentionDecode|TestAttentionRoPE|TestAttentionCausal' >> "$log" 2>&1
      LLMQ_DECODE_WAVE=1 timeout 200 compute-sanitizer --tool $tool build/device/cuda.test -test.run 'TestAttentionDecode|TestAttentionRoPE' >> "$log" 2>&1
      echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -2 | tr "\n" " ")"
    done
    ;;
  schemes) # issue 17's table (evals/schemes.sh): its rows evaluated here on the GPU (STEPS=rows), SCHEME_ROWS of
    # them, from the files the prep step made where Go is (.carry/schemes*.tar.xz: build/schemes/<model>/…); the
    # RTN and FP8 checkpoints (deterministic, no calibration) are made here with the prep's own commands.
    M=$LLMQ_SHARED/models/${SCHEME_MODEL:-llama-small}; W=build/schemes/$(basename "$M")
    grep -E "^build/schemes/llmq quantize .* --method (rtn|fp8) " "$W/commands.txt" | while read -r cmd; do
      o=$(sed -E 's/.* -o ([^ ]+) .*/\1/' <<< "$cmd")
      [ -d "$o" ] || [ ! -d "$M" ] || eval "$(sed -e "s#^build/schemes/llmq#$L#" -e "s#\.\./shared#$LLMQ_SHARED#g" <<< "$cmd")" \
        < /dev/null > /dev/null 2>&1 || echo "failed: $cmd"
    done
    LLMQ=$L REUSE=1 STEPS=rows EVAL_DEVICE=cuda ONLY_ROWS="${SCHEME_ROWS:-}" bash evals/schemes.sh "$M" 2>&1 | grep -vE "^\+ "
    mkdir -p "$OUT/schemes"; cp "$W/commands.txt" "$OUT/schemes/commands-device.txt"; cp "$W"/ppl-*.json "$W"/ppl-*.log "$OUT/schemes/"
    ;;
  act) # activations quantized on the GPU (llmq eval ppl --act-bits), llama-tiny, against the CPU's act-*.json
    D=$LLMQ_SHARED/models/llama-tiny
    build/device/cuda.test -test.v -test.run 'TestFakeQuant' 2>&1 | grep -E "^(--- |ok|FAIL)|differ"
    for f in int fp8; do
      $L eval ppl "$D" --data "$WIKI" --device cuda --act-bits 8 --act-format $f --json "$OUT/ppl-llama-tiny-a8-$f-pertoken-wikitext2-$G.json" 2>&1 | grep -E "perplexity|rror"
    done
    ;;
  reftime) # the reference GPTQ code (IST-DASLab gptq.py, carried in .carry/gptq-ref) timed on one llama3-8b block
    python3 evals/torchref/gptq_time.py --ref .carry/gptq-ref --json "$OUT/gptq-reference-time-$G.json" 2>&1 | grep -v Warning | tail -9
    ;;
  load) # load time of a W4 llama3-8b, and --device auto picking the GPU
    $L synth --preset llama3-8b --bits 4 --group 128 -o /tmp/w4 --force --tokenizer $LLMQ_SHARED/models/llama-tiny 2>&1 | tail -1
    $L bench decode /tmp/w4 --device cuda --context 128 --batch 1 --steps 16 --prefill 0 --json "$OUT/decode-$G-llama3-8b-w4-load.json" 2>&1 | grep -v "^\s*$"
    $L generate $LLMQ_SHARED/models/llama-tiny --prompt "The history of the" --max-tokens 8 2>&1 | tail -3
    ;;
  lmhead) # a packed LM head (the W4A16 kernels, headRows rows at a time) against the fp16 one
    W4=; hrc=0
    for h in "" --quantize-lm-head; do
      d=$(tiny_w4 $h) && W4+=":$d" || { echo "quantize $h failed: $(tail -3 "$OUT/quantize.log")"; hrc=1; }
    done
    r='TestJoined|TestEstimate'
    LLMQ_TEST_W4_MODELS=${W4#:} build/device/cuda.test -test.v -test.run "$r" > "$OUT/cuda-tests-lmhead.log" 2>&1 || hrc=1
    echo "# $LLMQ_COMMIT: LLMQ_TEST_W4_MODELS=(llama-tiny RTN w4, and with --quantize-lm-head) cuda.test -test.v -test.run '$r'" |
      cat - "$OUT/cuda-tests-lmhead.log" > "$OUT/t" && mv "$OUT/t" "$OUT/cuda-tests-lmhead.log"
    echo "lm_head tests rc=$hrc"; grep -E "^(\s*--- |ok|FAIL|PASS)|Δlogit|panic" "$OUT/cuda-tests-lmhead.log" | head -30
    [ "${HEAD_DECODE:-1}" = 0 ] && exit $hrc  # HEAD_DECODE=0: the model tests only
    for h in --quantize-lm-head ""; do  # the packed head first, then the fp16 one (decode-$G-llama3-8b-w4-beside-head.json)
      d=/tmp/llama3-8b-w4${h:+-head}; f=decode-$G-llama3-8b-w4-head.json
      [ -z "$h" ] && f=decode-$G-llama3-8b-w4-beside-head.json
      $L synth --preset llama3-8b --bits 4 --group 128 $h -o $d --force --tokenizer $LLMQ_SHARED/models/llama-tiny 2>&1 | tail -1
      echo "== llama3-8b W4, lm_head $([ -n "$h" ] && echo packed || echo fp16)"
      $L bench decode $d --device cuda --context ${HEAD_CTX:-128,2048} --batch ${HEAD_BATCH:-1,8,32,64} --prefill ${HEAD_PREFILL:-512,2048} \
        --steps 32 --json "$OUT/$f" 2>&1 | grep -v "^\s*$" || hrc=1
      rm -rf $d
    done
    exit $hrc
    ;;
  moe) # issue 20's MoE decode: a synthetic qwen3-30b-a3b W4 and, in the same run, the dense llama3-8b W4 it must beat
    TOK=$LLMQ_SHARED/models/${2:-llama-tiny}
    for p in ${MOE_PRESETS:-qwen3-30b-a3b llama3-8b}; do
      d=/tmp/$p-w4; f=decode-$G-$p-w4.json
      [ $p = llama3-8b ] && f=decode-$G-llama3-8b-w4-beside-moe.json
      $L synth --preset $p --bits 4 --group 128 -o $d --force --tokenizer "$TOK" 2>&1 | tail -1
      $L bench decode $d --device cuda --context ${MOE_CTX:-128,2048} --batch ${MOE_BATCH:-1,8} --prefill ${MOE_PREFILL:-512,2048} \
        --steps 32 --json "$OUT/$f" 2>&1 | grep -v "^\s*$"
      rm -rf $d
    done
    ;;
  pdl) # programmatic dependent launch (the default; LLMQ_PDL=0 off): the model tests with it, then llama3-8b W4 decode without and with
    run='TestModelLogits|TestZoo|TestMoE|TestGreedy|TestWindowNLL|TestLongContext|TestBatched|TestPrefillFlash|TestAttention'
    { echo "# $LLMQ_COMMIT: LLMQ_PDL=1 cuda.test -test.v -test.run '$run'"; LLMQ_PDL=1 build/device/cuda.test -test.v -test.run "$run" 2>&1; } > "$OUT/cuda-tests-pdl-$G.log"
    echo "tests with PDL: $(grep -cE '^--- PASS' "$OUT/cuda-tests-pdl-$G.log") passed; $(grep -E '^\s*--- FAIL' "$OUT/cuda-tests-pdl-$G.log" | tr '\n' ' ')"
    grep -E "Δlogit" "$OUT/cuda-tests-pdl-$G.log" | head -12
    TOK=$LLMQ_SHARED/models/${2:-llama-tiny}; d=/tmp/pdl8b
    $L synth --preset llama3-8b --bits 4 --group 128 -o $d --force --tokenizer "$TOK" 2>&1 | tail -1
    for pdl in 0 1; do
      echo "== LLMQ_PDL=$pdl"
      LLMQ_PDL=$pdl $L bench decode $d --device cuda --context 128,2048 --batch ${PDL_BATCH:-1,8,32} --prefill 2048 --steps 32 \
        --json "$OUT/decode-$G-llama3-8b-w4-pdl$pdl.json" 2>&1 | grep -E "^(decode|prefill)"
    done
    rm -rf $d
    ;;
  ab) # the working tree's library against the baseline's (carry.sh base; BASE's commit in each header), in turn
      # in one run: bench gemm at AB_BITS × QUICK_M (gemm-$G-ab.txt), then AB_OPS=1: BenchmarkDecodeOps
      # (decode-ops-$G-ab.txt), AB_DECODE=1: llama3-8b (AB_PRESET) W4 decode at SYNTH_CTX × SYNTH_BATCH (decode-ab-*.json);
      # AB_BASE_ENV: settings for the baseline's decode only (a switch the baseline library lacks turned off)
    [ -s build/base/libllmqcuda.so ] || { echo "ab: no baseline library (carry .carry/base.tar.xz)"; exit 1; }
    base=$(cat .carry/base/COMMIT)
    for bits in ${AB_BITS:-4 8}; do
      for lib in base new; do
        so=$PWD/build/device/libllmqcuda.so; c=$LLMQ_COMMIT
        [ $lib = base ] && so=$PWD/build/base/libllmqcuda.so && c=$base
        echo "# $lib ($c): LLMQ_CUDA_LIB=$lib llmq bench gemm --bits $bits --m ${QUICK_M:-1,2} --iters 100"
        LLMQ_CUDA_LIB=$so $L bench gemm --bits $bits --m ${QUICK_M:-1,2} --iters 100 2>&1 | grep -E "^(shape|8B|70B)|rror"
      done
    done | tee "$OUT/gemm-$G-ab.txt" | cut -c1-150
    if [ -n "${AB_OPS:-}" ]; then
      for lib in base new; do
        so=$PWD/build/device/libllmqcuda.so; c=$LLMQ_COMMIT
        [ $lib = base ] && so=$PWD/build/base/libllmqcuda.so && c=$base
        echo "# $lib ($c): LLMQ_CUDA_LIB=$lib cuda.test -test.run '^\$' -test.bench DecodeOps -test.benchtime 10x"
        LLMQ_CUDA_LIB=$so build/device/cuda.test -test.run '^$' -test.bench DecodeOps -test.benchtime 10x 2>&1 | grep -E "µs/call|FAIL|panic"
      done | tee "$OUT/decode-ops-$G-ab.txt" | grep -E "^#|batch1/(qkv|o|gate|down|experts)"
    fi
    if [ -n "${AB_DECODE:-}" ]; then
      d=/tmp/ab-b4  # AB_PRESET: another synth preset (qwen3-30b-a3b for a mixture's kernels)
      $L synth --preset ${AB_PRESET:-llama3-8b} --bits 4 --group 128 -o $d --force --tokenizer $LLMQ_SHARED/models/llama-tiny 2>&1 | tail -1
      r=0
      for lib in base new base new; do  # twice each, interleaved: the run-to-run spread shows
        r=$((r + 1))
        so=$PWD/build/device/libllmqcuda.so; e=; [ $lib = base ] && so=$PWD/build/base/libllmqcuda.so && e=${AB_BASE_ENV:-}
        echo "== $lib${e:+ ($e)}"
        env $e LLMQ_CUDA_LIB=$so $L bench decode $d --device cuda --context ${SYNTH_CTX:-128,2048} --batch ${SYNTH_BATCH:-1,8} \
          --prefill 0 --steps 32 --json "$OUT/decode-ab-$r-$lib.json" 2>&1 | grep -E "^decode "
      done
      rm -rf $d
    fi
    ;;
  trace) # a decode step's kernels in place: every graph node's start and end on a synthetic W4 model (TRACE_PRESET,
          # default llama3-8b; TRACE_BATCH, TRACE_CTX, TRACE_STEPS, TRACE_SYNTH_ARGS) by nsys, or where nsys is absent by cuda/probe/trace.c's CUPTI
          # library (make trace); decode-trace-$G[-PRESET]-bB-cC.csv.xz, which evals/trace_summary.py reads
    tracer=nsys
    if ! command -v nsys > /dev/null; then
      tracer=cupti
      make trace > "$OUT/build-trace.log" 2>&1 || { tail -5 "$OUT/build-trace.log"
        echo "trace: no nsys, and no CUPTI where the Makefile looks; cupti.h here:"; find /usr /opt -name cupti.h 2>/dev/null | head -5; exit 1; }
    fi
    tp=${TRACE_PRESET:-llama3-8b}; tag=; [ "$tp" = llama3-8b ] || tag=-$tp
    d=/tmp/trace-$tp
    # TRACE_SYNTH_ARGS: more synth flags — "--layers 12" keeps every kind of layer and kernel of a model
    # whose whole synthetic checkpoint takes minutes (qwen3-30b-a3b's took over 200 s), so the trace's
    # per-call figures hold, its step total does not
    $L synth --preset $tp --bits 4 --group 128 ${TRACE_SYNTH_ARGS:-} -o $d --force --tokenizer $LLMQ_SHARED/models/llama-tiny 2>&1 | tail -1
    for b in ${TRACE_BATCH:-1}; do for ctx in ${TRACE_CTX:-128}; do
      f=decode-trace-$G$tag-b$b-c$ctx
      run=(bench decode $d --device cuda --context $ctx --batch $b --prefill 0 --steps ${TRACE_STEPS:-8})
      # the decode untraced, then traced (a tracer's cost): printed and kept in $f-decode.txt
      echo "# $LLMQ_COMMIT: llmq ${run[*]}, untraced then under $tracer" > "$OUT/$f-decode.txt"
      echo "untraced: $($L "${run[@]}" 2>&1 | grep -E "^decode +context|rror")" | tee -a "$OUT/$f-decode.txt"
      rm -f /tmp/$f.csv /tmp/${f}_cuda_gpu_trace.csv
      if [ $tracer = nsys ]; then
        nsys profile -o /tmp/$f --force-overwrite true -t cuda --cuda-graph-trace=node $L "${run[@]}" 2>&1 | grep -E "^decode +context|rror" | tee -a "$OUT/$f-decode.txt"
        nsys stats --report cuda_gpu_trace --format csv -o /tmp/$f /tmp/$f.nsys-rep > /dev/null 2>&1
        { echo "# $LLMQ_COMMIT: nsys profile -t cuda --cuda-graph-trace=node llmq ${run[*]}; nsys stats --report cuda_gpu_trace"
          cat /tmp/${f}_cuda_gpu_trace.csv; } | xz -6 > "$OUT/$f.csv.xz"
      else
        echo "traced:   $(CUDA_INJECTION64_PATH=$PWD/build/libllmqtrace.so LLMQ_TRACE_OUT=/tmp/$f.csv $L "${run[@]}" 2>&1 | grep -E "^decode +context|rror|llmqtrace")" | tee -a "$OUT/$f-decode.txt"
        [ "$(wc -l < /tmp/$f.csv 2>/dev/null || echo 0)" -gt 1 ] || { echo "trace: the tracer wrote no kernel"; continue; }
        { echo "# $LLMQ_COMMIT: CUDA_INJECTION64_PATH=build/libllmqtrace.so (cuda/probe/trace.c) llmq ${run[*]}"
          cat /tmp/$f.csv; } | xz -6 > "$OUT/$f.csv.xz"
      fi
      python3 evals/trace_summary.py "$OUT/$f.csv.xz" 2>&1 | tee "$OUT/$f-summary.txt" | head -24
    done; done
    rm -rf $d
    ;;
  probe) # the weights' streaming alone (cuda/probe/stream.cu): what bytes in flight, transport and issue load
          # reach which bandwidth on this card, at the codes' sizes of 8B gate+up, q/k/v and 70B down
          # (PROBE_MB, PROBE_ARGS; stream-probe-$G.json)
    make probe NVCC_FLAGS="-O3 -std=c++17" > "$OUT/build-probe.log" 2>&1 || { tail -20 "$OUT/build-probe.log"; exit 1; }
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
    # Each size's document is merged into one file; a size that fails keeps its partial output
    # (stream-probe-$G-MB-failed.txt) and the others still run.
    runs=(); prc=0
    for mb in ${PROBE_MB:-56 12 112}; do
      if build/stream-probe --mb $mb ${PROBE_ARGS:-} > /tmp/probe-$mb.json; then
        runs+=(/tmp/probe-$mb.json)
      else
        echo "stream-probe --mb $mb failed"; prc=1; cp /tmp/probe-$mb.json "$OUT/stream-probe-$G-$mb-failed.txt"
      fi
    done
    [ ${#runs[@]} = 0 ] || python3 - "$LLMQ_COMMIT" "build/stream-probe --mb {${PROBE_MB:-56 12 112}} ${PROBE_ARGS:-}" "${runs[@]}" > "$OUT/stream-probe-$G.json" <<'PY' || prc=1
import json, sys
print(json.dumps({"command": sys.argv[2], "commit": sys.argv[1], "runs": [json.load(open(f)) for f in sys.argv[3:]]}, indent=1))
PY
    exit $prc
    ;;
  chain) # what a dependency between a decode step's kernels costs: each op its own kernel in a graph (with and
         # without PDL) or one persistent kernel on counters, against the weights' reads alone
         # (cuda/probe/chain.cu; CHAIN_ARGS, e.g. "--skip rope"; chain-probe-$G$CHAIN_TAG.json, and
         # -qwen3-30b-a3b$CHAIN_TAG.json for issue 20's mixture)
    make -B build/chain-probe NVCC_FLAGS="-O3 -std=c++17" > "$OUT/build-chain.log" 2>&1 || { tail -20 "$OUT/build-chain.log"; exit 1; }
    crc=0
    for model in llama3-8b qwen3-30b-a3b; do  # chain-probe-$G.json (llama3-8b) and chain-probe-$G-qwen3-30b-a3b.json
      f=chain-probe-$G; [ $model = llama3-8b ] || f+=-$model; f+=${CHAIN_TAG:-}  # (CHAIN_TAG: e.g. -skip-rope with --skip rope)
      if timeout 200 build/chain-probe --model $model ${CHAIN_ARGS:-} > /tmp/chain.json 2> "$OUT/$f-stderr.txt"; then
        python3 - "$LLMQ_COMMIT" "build/chain-probe --model $model ${CHAIN_ARGS:-}" /tmp/chain.json > "$OUT/$f.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[3]))
print(json.dumps({"command": sys.argv[2], "commit": sys.argv[1], **d}, indent=1))
PY
        python3 -c "import json,sys; [print(r['pass'], r['mode'], r['small_ops'], r['gemv_grid'], r['us_step'], r['us_layer'], r['gemv_gbps'], sep='\t') for r in json.load(open(sys.argv[1]))['rows']]" "$OUT/$f.json"
      else
        echo "chain-probe --model $model failed: $(tail -2 "$OUT/$f-stderr.txt")"; cp /tmp/chain.json "$OUT/$f-failed.txt"; crc=1
      fi
    done
    exit $crc
    ;;
  ops) # each kernel of a decode layer timed on its own (BenchmarkDecodeOps: llama3-8b and qwen3-30b-a3b, batch 1 and 8),
       # once per setting in OPS_ENV (';'-separated as SWEEP_ENV), OPS_BENCH another -test.bench, OPS_TAG the file's tail
    split_settings "${OPS_ENV:-}"
    bench=${OPS_BENCH:-DecodeOps}
    for e in "${settings[@]}"; do
      echo "# $LLMQ_COMMIT: ${e:+$e }cuda.test -test.run '^\$' -test.bench '$bench' -test.benchtime 10x"
      env $e build/device/cuda.test -test.run '^$' -test.bench "$bench" -test.benchtime 10x 2>&1
    done | tee "$OUT/decode-ops-$G${OPS_TAG:-}.txt" | grep -E "^#|µs/call|FAIL|panic"
    grep -qE "^(FAIL|panic)|^--- FAIL" "$OUT/decode-ops-$G${OPS_TAG:-}.txt" && exit 1
    ;;
  synth)
    TOK=$LLMQ_SHARED/models/${2:-llama-small}
    [ -d "$TOK" ] || TOK=$LLMQ_SHARED/models/llama-tiny
    for b in ${SYNTH_BITS:-4 16}; do
      d=/tmp/llama3-8b-b$b
      $L synth --preset llama3-8b --bits $b --group 128 -o $d --force --tokenizer $TOK 2>&1 | tail -1
      # Issue 16's matrix; llama3-8b's 8192 positions leave 8158 of context for 32 steps and the 2 warm-up steps.
      $L bench decode $d --device cuda --context ${SYNTH_CTX:-128,2048,8158} --batch ${SYNTH_BATCH:-1,8,32,64} --prefill ${SYNTH_PREFILL:-512,2048,8192} \
        --steps 32 --json "$OUT/decode-$G-llama3-8b-b$b.json" 2>&1 | grep -v "^\s*$"
      if [ -n "${SYNTH_LOGITS:-}" ]; then  # the same steps copying every step's logits to the host
        echo "== --logits"
        $L bench decode $d --device cuda --context ${SYNTH_CTX:-128,2048,8158} --batch ${SYNTH_BATCH:-1,8,32,64} --prefill 0 \
          --steps 32 --logits --json "$OUT/decode-$G-llama3-8b-b$b-logits.json" 2>&1 | grep -E "^decode"
      fi
      if [ $b = 4 ] && [ "${SYNTH_PPL:-1}" = 1 ]; then
        echo "== ppl llama3-8b b$b (random weights: the figure is meaningless, the time is not)"
        ppl llama3-8b-b$b $d
      fi
      rm -rf $d
    done
    ;;
esac

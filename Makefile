# llmq — build, test, demo and CUDA targets.
#
#   make demo    inspect, GPTQ-quantize, evaluate and generate with the shared
#                llama-tiny (MODEL=/path/to/checkpoint to use your own)
#   make test    go vet + the whole test suite + the npm client e2e (what CI runs)
#   make test-full  the full wikitext-2 perplexities against the references
#   make fuzz    every parser of outside input, a budget of inputs each (FUZZTIME overrides)
#   make e2e     drive llmq serve with the official openai npm package
#   make gguf-check  llmq export gguf read back by @huggingface/gguf (npm)
#   make cuda    build/libllmqcuda.so with nvcc (on a machine with CUDA)
#   make probe   build/stream-probe and build/chain-probe: the GEMV's streaming alone, and what a
#                dependency between kernels costs (cuda/probe/; on a GPU machine)
#   make trace   build/libllmqtrace.so: every kernel's GPU time through CUPTI, where nsys is absent
#   make cuda-check  compile-check cuda/*.cu without a GPU (cuda/local-check.sh)
#   make schemes the quantization-scheme table for MODEL (evals/schemes.sh;
#                WINDOWS=N for the first N WikiText-2 windows only)

MODEL ?= ../shared/models/llama-tiny
DATA  ?= ../shared/data/wikitext2/wiki.test.raw
CALIB ?= ../shared/data/calib.txt
OUT   ?= build/demo
PROMPT ?= Once upon a time

# Use OpenBLAS (Debian: libopenblas-dev) when it links; pure Go otherwise.
HASH := \#
TAGS ?= $(shell printf '$(HASH)include <cblas.h>\nint main(void){return 0;}\n' | cc -x c - -lopenblas -o /dev/null 2>/dev/null && echo openblas)
GOFLAGS_TAGS = $(if $(TAGS),-tags $(TAGS))

# The commit the binaries are built from, linked into them for builds that
# carry no VCS stamp of Go's (make device's binaries run where there is no
# git; test binaries; -buildvcs=false). "-dirty" when tracked files outside
# evals/results differ from it (results are outputs, not sources).
REVISION := $(shell git rev-parse HEAD 2>/dev/null)$(shell git status --porcelain --untracked-files=no -- ':(top)' ':(top,exclude)evals/results' 2>/dev/null | grep -q . && echo -dirty)
LDFLAGS = -ldflags "-X github.com/llmq/llmq/evals.revision=$(REVISION)"

NVCC ?= nvcc
NVCC_FLAGS ?= -O3 -std=c++17
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80

.PHONY: build test test-full fuzz e2e gguf-check demo cuda cuda-check probe trace bench clean fmt device schemes

# Binaries for the GPU machine (no Go there): pure-Go BLAS, cgo for dlopen,
# without DWARF (-s -w: a quarter smaller, so more assets fit in the
# device tool's 64 MiB carry; panics still print their stacks).
# build/device/COMMIT is for the scripts there that record results of
# programs other than llmq (evals/torchref/awq.py reads $$LLMQ_COMMIT).
DEVICE_LDFLAGS = -ldflags "-s -w -X github.com/llmq/llmq/evals.revision=$(REVISION)"
device:
	@mkdir -p build/device
	go build $(DEVICE_LDFLAGS) -o build/device/llmq ./cmd/llmq
	go test -c $(DEVICE_LDFLAGS) -o build/device/cuda.test ./cuda
	go test -c $(DEVICE_LDFLAGS) -o build/device/quantize.test ./quantize
	go test -c $(DEVICE_LDFLAGS) -o build/device/engine.test ./engine
	echo "$(REVISION)" > build/device/COMMIT

build:
	go build $(GOFLAGS_TAGS) $(LDFLAGS) -o build/llmq ./cmd/llmq

test:
	go vet $(GOFLAGS_TAGS) ./...
	go test $(GOFLAGS_TAGS) -timeout 60m ./...
	$(MAKE) e2e
	$(MAKE) gguf-check

# The opt-in tests that take minutes: the full wikitext-2 perplexity of
# llama-tiny and llama-small against REFERENCE.md's figures.
test-full:
	LLMQ_FULL_PPL=1 go test $(GOFLAGS_TAGS) -timeout 60m -run TestPerplexityFull -v ./evals

# Fuzz every parser that takes outside input; inputs that crash are kept
# in the packages' testdata/fuzz (committed, so plain go test replays
# them). Each target has a budget of inputs (Nx, about 10 s each on two
# cores), not of time: Go 1.26's coordinator can fail a time-bounded run
# with "context deadline exceeded" when a busy worker misses the deadline
# (go.dev/issue/75804, fixed in 1.27), which a count never sets.
# FUZZTIME=30s (or 1000x) overrides every target's budget.
FUZZ_TARGETS = llm/checkpoint:FuzzHeader:50000x llm/checkpoint:FuzzParseConfig:300000x \
	llm/tokenizer:FuzzParse:300000x llm/chat:FuzzRender:250000x pack:FuzzParseQuantConfig:300000x \
	server:FuzzRequest:15000x
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; rest=$${t#*:}; name=$${rest%%:*}; budget=$${FUZZTIME:-$${rest#*:}}; \
	  echo "fuzz $$pkg $$name ($$budget)"; \
	  go test $(GOFLAGS_TAGS) -run '^$$' -fuzz "^$$name\$$" -fuzztime $$budget ./$$pkg; \
	done

# llmq serve end to end with the openai npm client (Node.js 20+ and the npm
# registry); skipped without Node.js unless LLMQ_REQUIRE_SHARED=1 (CI).
e2e:
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
	  if [ "$$LLMQ_REQUIRE_SHARED" = 1 ]; then echo "e2e: node and npm are required"; exit 1; fi; \
	  echo "e2e: skipped (no node/npm)"; exit 0; fi; \
	go build $(GOFLAGS_TAGS) $(LDFLAGS) -o build/e2e/llmq ./cmd/llmq && \
	cd evals/serve-e2e && npm ci --no-audit --no-fund --loglevel=error && node e2e.mjs ../../build/e2e/llmq $(abspath $(MODEL))

# llmq export gguf of llama-tiny (F16, and RTN-packed 4-bit sym/asym and
# 8-bit: Q4_0, Q4_1, Q8_0) parsed by a GGUF reader llmq did not write
# (@huggingface/gguf): metadata against config.json and tokenizer.json,
# tensor names, shapes, types and extents. Skipped without Node.js unless
# LLMQ_REQUIRE_SHARED=1 (CI).
GG = build/gguf-check
gguf-check:
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
	  if [ "$$LLMQ_REQUIRE_SHARED" = 1 ]; then echo "gguf-check: node and npm are required"; exit 1; fi; \
	  echo "gguf-check: skipped (no node/npm)"; exit 0; fi; \
	set -e; mkdir -p $(GG); \
	go build $(GOFLAGS_TAGS) $(LDFLAGS) -o $(GG)/llmq ./cmd/llmq; \
	(cd evals/gguf-check && npm ci --no-audit --no-fund --loglevel=error); \
	$(GG)/llmq export gguf $(MODEL) -o $(GG)/f16.gguf --force; \
	node evals/gguf-check/check.mjs $(GG)/f16.gguf $(MODEL) F16; \
	for q in "q4_0 --bits 4 --group 32 --sym" "q4_1 --bits 4 --group 128" "q8_0 --bits 8 --group 64 --sym"; do \
	  set -- $$q; name=$$1; shift; \
	  $(GG)/llmq quantize $(MODEL) --method rtn $$* --calib $(CALIB) -o $(GG)/$$name --force >/dev/null; \
	  $(GG)/llmq export gguf $(GG)/$$name -o $(GG)/$$name.gguf --force; \
	  node evals/gguf-check/check.mjs $(GG)/$$name.gguf $(GG)/$$name $$(echo $$name | tr a-z A-Z); \
	done

# The main job on a checkpoint: inspect it, quantize it with GPTQ (a short
# calibration, to keep the demo quick), compare perplexities, and generate
# with the quantized model.
demo: build
	./build/llmq inspect $(MODEL)
	./build/llmq quantize $(MODEL) --method gptq --bits 4 --group 128 --calib $(CALIB) --nsamples 32 --seqlen 512 -o $(OUT) --force
	./build/llmq inspect $(OUT)
	./build/llmq eval ppl $(MODEL) --data $(DATA) --windows 8
	./build/llmq eval ppl $(OUT) --data $(DATA) --windows 8
	./build/llmq generate $(OUT) --prompt "$(PROMPT)" --max-tokens 48

# The quantization-scheme table (perplexity and bytes of weights of
# W16A16 … W4A8 and a mixed plan) for MODEL under evals/results/, with its
# own copy of the binary so that a rebuild during the run changes nothing.
schemes:
	@mkdir -p build/schemes
	go build $(GOFLAGS_TAGS) $(LDFLAGS) -o build/schemes/llmq ./cmd/llmq
	LLMQ=build/schemes/llmq WINDOWS=$(WINDOWS) evals/schemes.sh $(MODEL)

bench:
	go test $(GOFLAGS_TAGS) -run XX -bench . -benchtime 3x ./llm/

cuda: build/libllmqcuda.so

# A compile-only check of the CUDA library without a GPU or a CUDA install
# (cuda/local-check.sh: Debian's nvcc 12.4, fetched once into
# ~/.cache/llmq-nvcc): errors, warnings and registers before a device call.
cuda-check:
	bash cuda/local-check.sh

build/libllmqcuda.so: $(wildcard cuda/*.cu cuda/*.cuh cuda/*.h)
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) --shared -Xcompiler -fPIC,-fvisibility=hidden $(CUDA_ARCH) -lcublas -lcusolver -o $@ $(filter %.cu,$^)

# The streaming probe (cuda/probe/stream.cu): a program of its own, for
# Hopper (its bulk copies and L2 prefetch are sm_90's). It includes
# cuda/stream.cuh, the kernels' loads, so a change there rebuilds it.
probe: build/stream-probe build/chain-probe
build/stream-probe: cuda/probe/stream.cu cuda/probe/check.cuh cuda/stream.cuh
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) -gencode arch=compute_90a,code=sm_90a -o $@ $<

# The chain probe (cuda/probe/chain.cu): what a dependency between two
# kernels of a decode step costs, launched apart or inside one persistent
# kernel.
build/chain-probe: cuda/probe/chain.cu cuda/probe/check.cuh cuda/stream.cuh cuda/common.cuh
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) -gencode arch=compute_90a,code=sm_90a -o $@ $<

# The kernel tracer (cuda/probe/trace.c): a CUPTI injection library that
# records every kernel's time on the GPU, graph nodes included, where nsys
# is absent (device-model.sh trace). CUPTI where the toolkit keeps it
# (extras/CUPTI, or beside the toolkit's own headers); CUPTI_DIR and
# CUPTI_LIB override (a Debian-style layout keeps the library in
# lib/x86_64-linux-gnu: name it, or the rpath points nowhere and the
# loader's default libcupti is used). The kernel record's newest version in
# the installed header names the struct the library reads.
CUDA_HOME ?= $(abspath $(dir $(shell command -v $(NVCC)))/..)
CUPTI_DIR ?= $(firstword $(foreach d,$(CUDA_HOME)/extras/CUPTI $(CUDA_HOME),$(if $(wildcard $(d)/include/cupti.h),$(d))))
CUPTI_LIB ?= $(CUPTI_DIR)/lib64
trace: build/libllmqtrace.so
build/libllmqtrace.so: cuda/probe/trace.c
	@mkdir -p build
	@[ -n "$(CUPTI_DIR)" ] || { echo "make trace: no include/cupti.h under $(CUDA_HOME) or its extras/CUPTI (set CUPTI_DIR)" >&2; exit 1; }
	rec=$$(grep -ho 'CUpti_ActivityKernel[0-9]*' $(CUPTI_DIR)/include/cupti_activity.h | sort -V | tail -1); \
	[ -n "$$rec" ] || { echo "make trace: no CUpti_ActivityKernelN in $(CUPTI_DIR)/include/cupti_activity.h" >&2; exit 1; }; \
	$(NVCC) -O2 --shared -Xcompiler -fPIC,-Wall -DKERNEL_RECORD=$$rec \
	  -I$(CUPTI_DIR)/include -o $@ $< -L$(CUPTI_LIB) -Xlinker -rpath,$(CUPTI_LIB) -lcupti -lstdc++

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf build

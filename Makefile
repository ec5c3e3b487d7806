# llmq — build, test, demo and CUDA targets.
#
#   make demo    inspect, GPTQ-quantize, evaluate and generate with the shared
#                llama-tiny (MODEL=/path/to/checkpoint to use your own)
#   make test    go vet + the whole test suite + the npm client e2e (what CI runs)
#   make e2e     drive llmq serve with the official openai npm package
#   make cuda    build/libllmqcuda.so with nvcc (on a machine with CUDA)

MODEL ?= ../shared/models/llama-tiny
DATA  ?= ../shared/data/wikitext2/wiki.test.raw
CALIB ?= ../shared/data/calib.txt
OUT   ?= build/demo
PROMPT ?= Once upon a time

# Use OpenBLAS (Debian: libopenblas-dev) when it links; pure Go otherwise.
HASH := \#
TAGS ?= $(shell printf '$(HASH)include <cblas.h>\nint main(void){return 0;}\n' | cc -x c - -lopenblas -o /dev/null 2>/dev/null && echo openblas)
GOFLAGS_TAGS = $(if $(TAGS),-tags $(TAGS))

NVCC ?= nvcc
NVCC_FLAGS ?= -O3 -std=c++17
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80

.PHONY: build test e2e demo cuda bench clean fmt device

# Binaries for the GPU machine (no Go there): pure-Go BLAS, cgo for dlopen.
device:
	@mkdir -p build/device
	go build -o build/device/llmq ./cmd/llmq
	go test -c -o build/device/cuda.test ./cuda
	git rev-parse HEAD > build/device/COMMIT
	git status --porcelain --untracked-files=no -- ':(top)' ':(top,exclude)evals/results' | grep -q . && echo "-dirty" >> build/device/COMMIT || true

build:
	go build $(GOFLAGS_TAGS) -o build/llmq ./cmd/llmq

test:
	go vet $(GOFLAGS_TAGS) ./...
	go test $(GOFLAGS_TAGS) -timeout 60m ./...
	$(MAKE) e2e

# llmq serve end to end with the openai npm client (Node.js 20+ and the npm
# registry); skipped without Node.js unless LLMQ_REQUIRE_SHARED=1 (CI).
e2e:
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
	  if [ "$$LLMQ_REQUIRE_SHARED" = 1 ]; then echo "e2e: node and npm are required"; exit 1; fi; \
	  echo "e2e: skipped (no node/npm)"; exit 0; fi; \
	go build $(GOFLAGS_TAGS) -o build/e2e/llmq ./cmd/llmq && \
	cd evals/serve-e2e && npm ci --no-audit --no-fund --loglevel=error && node e2e.mjs ../../build/e2e/llmq $(abspath $(MODEL))

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

bench:
	go test $(GOFLAGS_TAGS) -run XX -bench . -benchtime 3x ./llm/

cuda: build/libllmqcuda.so

build/libllmqcuda.so: $(wildcard cuda/*.cu cuda/*.cuh cuda/*.h)
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) --shared -Xcompiler -fPIC,-fvisibility=hidden $(CUDA_ARCH) -lcublas -o $@ $(filter %.cu,$^)

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf build

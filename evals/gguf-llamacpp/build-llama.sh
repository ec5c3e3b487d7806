#!/usr/bin/env bash
# Builds llama.cpp's llama-perplexity (CPU, portable) from the llama.cpp
# source that the node-llama-cpp npm package ships as a git bundle
# (node_modules/node-llama-cpp/llama/gitRelease.bundle), in DIR (default
# build/llama.cpp). Needs cmake and a C++ compiler (Debian: cmake, g++).
# Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")"
DIR=${1:-../../build/llama.cpp}
(NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund --ignore-scripts --loglevel=error) >&2
[ -d "$DIR/.git" ] || git clone -q node_modules/node-llama-cpp/llama/gitRelease.bundle "$DIR" >&2
cmake -S "$DIR" -B "$DIR/build" -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release >&2
cmake --build "$DIR/build" --target llama-perplexity -j"${JOBS:-2}" >&2
realpath "$DIR/build/bin/llama-perplexity"

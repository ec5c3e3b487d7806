#!/usr/bin/env bash
# A compile-only check of the CUDA library where there is no GPU and no CUDA
# install (this machine, CI's): every cuda/*.cu (or the files named) built
# with the Makefile's flags for sm_90a and sm_80, through ptxas, then
# linked with no undefined symbols (and, for the whole library, the
# streaming probe cuda/probe/stream.cu built); cuda/checks' Python
# models of the kernels' arithmetic run before the build. Errors, warnings
# and each kernel's registers and spills are printed. It catches C++, PTX and register
# mistakes before a device call costs device time. The compiler is Debian
# trixie's nvcc 12.4 (packages nvidia-cuda-toolkit, nvidia-cuda-dev and
# libcu++-dev from Debian's non-free archive, about 1 GB), unpacked into
# $LLMQ_NVCC_ROOT (default ~/.cache/llmq-nvcc) on first use, not
# installed; the device's nvcc is 13, so what only 13 rejects still shows
# there first.
#
#   bash cuda/local-check.sh                 # every cuda/*.cu
#   bash cuda/local-check.sh cuda/w4a16.cu   # one file
#
# Logs and objects go to build/local-check/. Exit status: 0 built, 1 a
# file failed to build or link or a cuda/checks model failed, 3 the
# toolkit could not be fetched (the checks, which run first, passed).
set -uo pipefail
files=()
for f in "$@"; do files+=("$(realpath "$f")"); done  # before the cd below
cd "$(dirname "$0")/.."
# The kernels' arithmetic modelled in Python (cuda/checks: the zeros'
# byte permutes). They need no compiler, so they run first, whether or
# not the toolkit can be had.
checks_rc=0
if command -v python3 > /dev/null; then
  for f in cuda/checks/*.py; do
    if log=$(python3 "$f" 2>&1); then echo "$f: ok"; else echo "$f failed:"; printf '%s\n' "$log" | tail -5; checks_rc=1; fi
  done
else
  echo "local-check: no python3, cuda/checks skipped"
fi
# unavailable: the toolkit could not be had — exit 3 (CI skips with a
# warning), unless a check above failed (1).
unavailable() { [ $checks_rc = 0 ] && exit 3 || exit 1; }
ROOT=${LLMQ_NVCC_ROOT:-${HOME:-/tmp}/.cache/llmq-nvcc}
if [ ! -e "$ROOT/.llmq-complete" ]; then
  echo "local-check: fetching Debian trixie's CUDA 12.4 toolkit into $ROOT (about 1 GB, once)"
  apt=$(mktemp -d)
  trap 'rm -rf "$apt"' EXIT
  mkdir -p "$apt/lists/partial" "$apt/debs" "$apt/root"
  echo "deb http://deb.debian.org/debian trixie main contrib non-free" > "$apt/sources.list"
  # apt with its own sources and lists: the machine's configuration is left alone.
  opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$apt/lists"
        -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
  # Exit status 3: the toolkit could not be had (no network, no mirror), as opposed to a failed build.
  apt-get "${opts[@]}" update -qq || { echo "local-check: apt-get update failed" >&2; unavailable; }
  (cd "$apt/debs" && apt-get "${opts[@]}" download nvidia-cuda-toolkit nvidia-cuda-dev libcu++-dev) ||
    { echo "local-check: downloading the toolkit failed" >&2; unavailable; }
  # Unpacked beside, then moved into place whole: a failure leaves ROOT as it was.
  for d in "$apt"/debs/*.deb; do dpkg -x "$d" "$apt/root" || unavailable; done
  touch "$apt/root/.llmq-complete"
  mkdir -p "$(dirname "$ROOT")" && rm -rf "$ROOT.partial" && mv "$apt/root" "$ROOT.partial" &&
    { [ ! -e "$ROOT" ] || [ -z "$(ls -A "$ROOT")" ] || { echo "local-check: $ROOT exists and is not a complete toolkit: remove it" >&2; unavailable; }; } &&
    rm -rf "$ROOT" && mv "$ROOT.partial" "$ROOT" || unavailable
fi
# The package's nvcc.profile links to /etc's, which names /usr: this one
# names the unpacked tree instead (headers, libdevice, libraries).
profile="$ROOT/usr/lib/nvidia-cuda-toolkit/bin/nvcc.profile"
if [ -L "$profile" ] || ! grep -qF "$ROOT" "$profile" 2>/dev/null; then
  rm -f "$profile"
  printf '%s\n' "NVVMIR_LIBRARY_DIR = $ROOT/usr/lib/nvidia-cuda-toolkit/libdevice" \
    "PATH += $ROOT/usr/lib/nvidia-cuda-toolkit/bin:$ROOT/usr/bin:" \
    "INCLUDES += \"-I$ROOT/usr/include\" \$(_SPACE_)" \
    "LIBRARIES =+ \$(_SPACE_) -L$ROOT/usr/lib/x86_64-linux-gnu/stubs -L$ROOT/usr/lib/x86_64-linux-gnu" > "$profile"
fi
export PATH="$ROOT/usr/lib/nvidia-cuda-toolkit/bin:$ROOT/usr/bin:$PATH"
# nvcc 12.4 takes gcc 13 at most.
cxx=$(command -v g++-12 || command -v g++-13 || command -v g++-11 || command -v g++)
out=build/local-check
rm -rf "$out"  # this run's files only: an object left by an older run must not join the link
mkdir -p "$out"
whole=0
[ ${#files[@]} = 0 ] && files=(cuda/*.cu) && whole=1
rc=$checks_rc
for f in "${files[@]}"; do
  b=$(basename "$f" .cu)
  nvcc -ccbin "$cxx" -O3 -std=c++17 -Xptxas -v -Xcompiler -fPIC,-fvisibility=hidden \
    -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80 -c "$f" -o "$out/$b.o" > "$out/$b.log" 2>&1
  r=$?
  [ $r != 0 ] && rc=1
  # ptxas's "Potential Performance Loss" infos (C7513: every wgmma
  # serialized, …) count as warnings, and fail the check: they mean a
  # kernel runs far slower than written.
  grep -q "Performance Loss" "$out/$b.log" && rc=1
  echo "$f: rc=$r, $(grep -c ' error' "$out/$b.log") errors, $(grep -cE 'warning #|Performance Loss' "$out/$b.log") warnings"
  grep -E " error|warning #|Performance Loss" "$out/$b.log" | head -20
done
if [ $rc = 0 ] && [ $whole = 1 ]; then  # the whole library: it links with no symbol missing
  nvcc -ccbin "$cxx" -shared -Xlinker --no-undefined -o "$out/libllmqcuda.so" "$out"/*.o -lcublas -lcusolver -L"$ROOT/usr/lib/x86_64-linux-gnu" \
    > "$out/link.log" 2>&1 || { echo "link failed:"; tail -20 "$out/link.log"; rc=1; }
  [ $rc = 0 ] && echo "linked $out/libllmqcuda.so"
  # The streaming probe (make probe), a program of its own on the kernels' loads (stream.cuh).
  nvcc -ccbin "$cxx" -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o "$out/stream-probe" cuda/probe/stream.cu \
    > "$out/stream-probe.log" 2>&1 || { echo "cuda/probe/stream.cu failed:"; tail -20 "$out/stream-probe.log"; rc=1; }
  [ $rc = 0 ] && echo "built $out/stream-probe"
  nvcc -ccbin "$cxx" -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o "$out/chain-probe" cuda/probe/chain.cu \
    > "$out/chain-probe.log" 2>&1 || { echo "cuda/probe/chain.cu failed:"; tail -20 "$out/chain-probe.log"; rc=1; }
  [ $rc = 0 ] && echo "built $out/chain-probe"
fi
# Registers and spills of each sm_90a kernel, as ptxas reported them.
for f in "$out"/*.log; do
  awk -F"'" '/Compiling entry function/ { name = $2; want = /sm_90a/ }
             want && /Used [0-9]+ registers/ { sub(/.*Used /, ""); print name "\t" $0; want = 0 }' "$f"
done | while IFS=$'\t' read -r name regs; do
  # the demangled name without its parameter list (the last top-level parentheses)
  printf '%s\t%s\n' "$(cu++filt "$name" | sed -E 's/^void //; s/(llmq::)?<unnamed>:://g; s/\([^()]*(\([^()]*\)[^()]*)*\)$//')" "$regs"
done > "$out/registers.txt"
echo "sm_90a registers: $out/registers.txt ($(wc -l < "$out/registers.txt") kernels)"
exit $rc

#!/usr/bin/env python3
"""Where a decode step's time goes, from a trace of its graph.

Reads the CSV that `bash cuda/device-model.sh trace` writes
(decode-trace-*.csv.xz: every kernel of every captured graph node, with
its start and duration — nsys's cuda_gpu_trace report, or the same
columns from cuda/probe/trace.c's CUPTI library where nsys is absent) and prints, per kernel name, over the
last complete decode steps: calls a step, its mean duration, the time it
adds to the step (its end past the latest end before it: under
programmatic dependent launch a kernel can start before the one before it
ends, so durations overlap), and the idle time before it (no kernel
running). A step's adds and idles sum to its length exactly. A step ends
with the greedy argmax (argmax_kernel).

With --layers N (the model's layers in the trace) it adds each kernel's
µs added a layer and the layers' total: every kernel's but the head's
(an fp16 lm_head's cuBLAS kernels, the argmax) and the embedding's.

    python3 evals/trace_summary.py evals/results/decode-trace-h100-b1-c128.csv.xz [--steps 4] [--layers 32]
"""
import argparse
import csv
import io
import lzma
import re
import sys
from collections import defaultdict


def short(name):
    """A kernel's name without its namespace, arguments and template values."""
    name = re.sub(r"\(anonymous namespace\)::|<unnamed>::", "", name.strip())
    name = re.sub(r"\(.*$", "", name)  # the arguments
    name = re.sub(r"^(void )?(\w+::)*", "", name)
    base = re.sub(r"<.*$", "", name)
    if base.startswith(("sm90_", "sm80_", "cutlass", "nvjet", "gemv", "gemmSN", "gemmk")) or "gemm" in base.lower() or "cublas" in name.lower():
        return "cublas(lm_head)"  # cuBLAS's kernels (the lm_head; llmq's own have none of these names)
    return base


def read(path):
    raw = lzma.open(path, "rt") if path.endswith(".xz") else open(path)
    lines = [l for l in raw if not l.startswith("#")]
    rows = list(csv.DictReader(io.StringIO("".join(lines))))
    start = next(k for k in rows[0] if k.startswith("Start"))
    dur = next(k for k in rows[0] if k.startswith("Duration"))
    col = "Name" if "Name" in rows[0] else next(k for k in rows[0] if "Name" in k)
    out = []
    for r in rows:
        name = r.get(col, "")
        if not name or name.startswith("[CUDA mem"):  # copies and sets: not kernels
            continue
        out.append((int(r[start]), int(r[dur]), short(name)))
    out.sort()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=4, help="the last N complete steps")
    ap.add_argument("--layers", type=int, default=0, help="the model's layers: add µs a layer")
    a = ap.parse_args()
    ks = read(a.trace)
    ends = [i for i, k in enumerate(ks) if k[2].startswith("argmax")]
    if len(ends) < a.steps + 1:
        sys.exit(f"{a.trace}: {len(ends)} steps (argmax_kernel calls), want more than {a.steps}")
    per = defaultdict(lambda: [0, 0, 0, 0])  # calls, ns in the kernel, ns added to the step, ns idle before
    wall = 0
    for e0, e1 in zip(ends[-a.steps - 1 : -1], ends[-a.steps:]):
        last = ks[e0][0] + ks[e0][1]  # the latest end so far
        first = last
        for s, d, n in ks[e0 + 1 : e1 + 1]:
            p = per[n]
            p[0] += 1
            p[1] += d
            p[3] += max(0, s - last)
            p[2] += max(0, s + d - max(last, s))
            last = max(last, s + d)
        wall += last - first
    n = a.steps
    print(f"{a.trace}: the last {n} steps, {wall / n / 1e3:.1f} µs a step (argmax end to argmax end)")
    L = a.layers
    print(f"{'kernel':34s} {'calls':>6s} {'µs/call':>8s} {'µs added':>9s} {'µs idle':>8s}" + (f" {'µs a layer':>10s}" if L else ""))
    ta = ti = tl = 0
    for name, (c, b, add, idle) in sorted(per.items(), key=lambda kv: -(kv[1][2] + kv[1][3])):
        ta += add
        ti += idle
        line = f"{name[:34]:34s} {c / n:6.0f} {b / c / 1e3:8.2f} {add / n / 1e3:9.1f} {idle / n / 1e3:8.1f}"
        if L and name not in ("cublas(lm_head)", "argmax_kernel", "embed_kernel"):
            tl += add
            line += f" {add / n / L / 1e3:10.2f}"
        print(line)
    print(f"{'total':34s} {'':6s} {'':8s} {ta / n / 1e3:9.1f} {ti / n / 1e3:8.1f}" + (f" {tl / n / L / 1e3:10.2f}" if L else ""))
    if L:
        print(f"the {L} layers' kernels (all but the lm_head, the argmax and the embedding): {tl / n / 1e3:.1f} µs added a step, {tl / n / L / 1e3:.2f} a layer")

if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Issue 20's ratio as the chain probe sees it (cuda/probe/chain.cu).

Each chain-probe JSON (`bash cuda/device-model.sh chain`) times one
model's decode step as a chain of dependent kernels. A *pair* is a
llama3-8b file and a qwen3-30b-a3b file from one probe run (the same
--skip). For each pair this prints, from the PDL rows (graph-pdl, every
CTA, the pass asked for), the step with the small ops and with the GEMVs
alone, each step plus its model's lm_head and argmax as timed alone (the
BenchmarkDecodeOps file), and their ratio, dense over mixture — the
mixture's speed-up at batch 1 if the runtime matched the probe.

The first pair is the base. For it: the average cost of a small op's
hop (a layer with small ops less one without, over its small ops) and
the ratio that removing 1, 2, 3 hops a layer would give at that cost.
For each later pair: what its removed ops cost a hop (base step less
its step, over layers × ops removed), and the base's ratio rescaled by
the two runs' GEMVs-alone rows (so that a difference between runs is
not counted as the ops').

    python3 evals/chain_ratio.py HEADS_FILE LLAMA.json,QWEN.json [LLAMA.json,QWEN.json ...]

With --smem, each file's smem modes (a GEMV's first steps copied into
shared memory ahead of its wait) against their plain twins of the same
run: graph-pdl-smem against graph-pdl, persistent-smem against
persistent, for each GEMV grid, with and without the small ops.

    python3 evals/chain_ratio.py --smem FILE.json [FILE.json ...]
"""
import json
import re
import sys

PASS = 1


def step(d, small):
    """The step's µs: the graph-pdl row with or without small ops, every CTA."""
    for r in d["rows"]:
        if r["pass"] == PASS and r["mode"] == "graph-pdl" and r["small_ops"] == small and r["gemv_grid"] == "every CTA":
            return r["us_step"]
    sys.exit(f"{d['command']}: no graph-pdl row (small ops {small}, every CTA, pass {PASS})")


def heads(path):
    """Each model's lm_head + argmax µs at batch 1, from a BenchmarkDecodeOps file."""
    us = {}
    for line in open(path):
        m = re.match(r"BenchmarkDecodeOps/([^/]+)/batch1/(lm_head|argmax)-\d+\s.*?([\d.]+) µs/call", line)
        if m:
            us[m.group(1)] = us.get(m.group(1), 0.0) + float(m.group(3))
    return us


def layer_ops(d):
    """A layer's ops: nine (four GEMVs, five small ops) in files from before --skip, which do not say."""
    return d.get("layer_ops", 9)


def load(pair):
    files = pair.split(",")
    if len(files) != 2:
        sys.exit(f"{pair}: want LLAMA.json,QWEN.json")
    ds = [json.load(open(f)) for f in files]
    if [d["model"] for d in ds] != ["llama3-8b", "qwen3-30b-a3b"]:
        sys.exit(f"{pair}: want a llama3-8b file, then a qwen3-30b-a3b one")
    return files, ds


def smem(path):
    """Each smem mode's step against its plain twin's, from one file's rows."""
    d = json.load(open(path))
    rows = {(r["mode"], r["small_ops"], r["gemv_grid"]): r["us_step"] for r in d["rows"] if r["pass"] == PASS}
    print(f"\n{path} ({d['model']}, commit {d['commit'][:7]}, {d['device']}, pass {PASS})")
    for (mode, small, grid), us in rows.items():
        if not mode.endswith("-smem"):
            continue
        twin = rows.get((mode[: -len("-smem")], small, grid))
        if twin is None:
            sys.exit(f"{path}: {mode} ({grid}, small ops {small}) has no plain twin")
        print(f"  {mode:16} {'with' if small else 'without':7} small ops, {grid:22}: {us:8.1f} against {twin:8.1f} µs, "
              f"{us / twin:.3f}×, {(us - twin) / d['layers']:+.2f} µs a layer")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--smem":
        for path in sys.argv[2:]:
            smem(path)
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    h = heads(sys.argv[1])
    print(f"# heads (lm_head + argmax, batch 1, {sys.argv[1]}): llama3-8b {h['llama3-8b']:.1f} µs, "
          f"qwen3-30b-a3b {h['qwen3-30b-a3b']:.1f} µs; probe rows: graph-pdl, every CTA, pass {PASS}")
    base = None
    for pair in sys.argv[2:]:
        files, (dl, dq) = load(pair)
        sl, sq = step(dl, True), step(dq, True)
        gl, gq = step(dl, False), step(dq, False)
        ratio = (sl + h["llama3-8b"]) / (sq + h["qwen3-30b-a3b"])
        print(f"\n{' + '.join(files)} (commit {dl['commit'][:7]}, skipped: {dl.get('skipped') or 'none'})")
        print(f"  step: llama3-8b {sl:.1f} µs, qwen3-30b-a3b {sq:.1f} µs; GEMVs alone {gl:.1f}, {gq:.1f}")
        print(f"  with the heads: {sl + h['llama3-8b']:.1f} against {sq + h['qwen3-30b-a3b']:.1f} µs, ratio {ratio:.3f}")
        if base is None:
            base = dict(sl=sl, sq=sq, gl=gl, gq=gq, dl=dl, dq=dq)
            hop = {}
            for name, d, s, g in (("llama3-8b", dl, sl, gl), ("qwen3-30b-a3b", dq, sq, gq)):
                small = layer_ops(d) - 4  # four GEMVs a layer
                hop[name] = (s - g) / d["layers"] / small
                print(f"  average hop ({name}): {hop[name]:.2f} µs ({small} small ops a layer)")
            for n in (1, 2, 3):
                pl = sl - n * hop["llama3-8b"] * dl["layers"] + h["llama3-8b"]
                pq = sq - n * hop["qwen3-30b-a3b"] * dq["layers"] + h["qwen3-30b-a3b"]
                print(f"  {n} hop(s) fewer a layer at those costs: ratio {pl / pq:.3f}")
            continue
        for name, d, s, b in (("llama3-8b", dl, sl, base["sl"]), ("qwen3-30b-a3b", dq, sq, base["sq"])):
            removed = layer_ops(base["dl"] if name == "llama3-8b" else base["dq"]) - layer_ops(d)
            if removed > 0:
                print(f"  {name}: {removed} op(s) fewer a layer, {(b - s) / d['layers'] / removed:.2f} µs a hop "
                      f"against the base")
        # the base's steps rescaled by this run's GEMVs-alone rows over the base run's
        fl, fq = gl / base["gl"], gq / base["gq"]
        rl, rq = base["sl"] * fl, base["sq"] * fq
        print(f"  base rescaled by the GEMVs-alone rows ({fl:.4f}, {fq:.4f}): ratio "
              f"{(rl + h['llama3-8b']) / (rq + h['qwen3-30b-a3b']):.3f}")
        for name, d, s, r in (("llama3-8b", dl, sl, rl), ("qwen3-30b-a3b", dq, sq, rq)):
            removed = layer_ops(base["dl"] if name == "llama3-8b" else base["dq"]) - layer_ops(d)
            if removed > 0:
                print(f"  {name}: {(r - s) / d['layers'] / removed:.2f} µs a hop against the rescaled base")


if __name__ == "__main__":
    main()

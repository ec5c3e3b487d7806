#!/usr/bin/env python3
"""Settings side by side, from the JSON files of one A/B run.

`bash cuda/device-model.sh envab` writes decode-envab-N.json (bench
decode), each setting of ENVAB_ENV in turn, ENVAB_PASSES times,
interleaved; `serve8b` with SERVE_CHAINS writes one bench serve file a
setting and pass. A file's setting is its command less the --json
argument; files of one setting are its passes, and a setting is labelled
by the words of its command that the first file's lacks (a flag's value
with its flag). For each batch and context (bench decode) or client
count (bench serve) this prints every setting's tokens/s (the passes'
mean, then each pass) and its ratio to the first setting's mean, and for
bench decode the ms a step with its difference in µs.

    python3 evals/envab_summary.py evals/results/decode-h100-llama3-8b-w4-envab-chain8-{1,2,3,4}.json
"""
import json
import re
import sys
from collections import defaultdict


def setting(command):
    """The command less its --json argument, as a tuple of words."""
    return tuple(re.sub(r"\s--json\s+\S+", "", command).split())


def rows(d):
    """A file's rows: {key: (ms a step or None, tokens/s)}."""
    if d["kind"] == "bench-serve":
        return {f"{l['clients']} clients": (None, l["result"]["tokens_per_s"]) for l in d["data"]["levels"]}
    return {f"batch {r['batch']}, context {r['context']}": (r["ms_per_step"], r["tokens_per_s"]) for r in d["data"]["results"]}


def label(s, base):
    words = [(f"{s[i - 1]} {w}" if i > 0 and s[i - 1].startswith("--") and s[i - 1] in base else w)
             for i, w in enumerate(s) if w not in base]
    return " ".join(words) or "(first)"


def main():
    files = sys.argv[1:]
    if not files:
        sys.exit(__doc__)
    runs, order, first = defaultdict(list), [], None
    for f in files:
        d = json.load(open(f))
        first = first or d
        s = setting(d["command"])
        if s not in runs:
            order.append(s)
        runs[s].append(rows(d))
    base = order[0]
    mean = lambda xs: sum(xs) / len(xs)
    print(f"# python3 evals/envab_summary.py {' '.join(files)}")
    print(f"# {first['commit'][:7]}, {first['device']}; the first setting: {' '.join(base)}")
    for key in runs[base][0]:
        print(f"{key}:")
        ms0 = [r[key][0] for r in runs[base]]
        tps0 = mean([r[key][1] for r in runs[base]])
        for s in order:
            ms, tps = [r[key][0] for r in runs[s]], [r[key][1] for r in runs[s]]
            line = f"  {label(s, base):16s}"
            if ms[0] is not None:
                line += f" {mean(ms):7.4f} ms/step ({(mean(ms) - mean(ms0)) * 1e3:+6.1f} µs)"
            passes = " / ".join(f"{t:.1f}" for t in tps)
            print(f"{line} {mean(tps):9.1f} tokens/s ({passes})  ×{mean(tps) / tps0:.3f}")


if __name__ == "__main__":
    main()

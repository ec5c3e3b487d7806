#!/usr/bin/env python3
# gemm_drift.py: how far later `llmq bench gemm` text runs (the automatic
# plan's rows) sit from a canonical run, row by row (same shape and M):
# the sixth session's check while gemm-h200.json (2ccd00e's, now
# gemm-h200-v10.json) waited for a re-run. The file compared against is
# the first argument, that one by default (gemm-h200-drift.txt).
import json, re, sys

base = sys.argv[1] if len(sys.argv) > 1 else 'evals/results/gemm-h200-v10.json'
canon = {(r['shape'], r['m']): r['w4a16_us'] for r in json.load(open(base))['data']['results']}
for f, sec in [('evals/results/gemm-h200-wgmma.txt', '--bits 4 --path auto'), ('evals/results/gemm-h200-splits.txt', 'LLMQ_W4_SPLITS=0 ')]:
    on, rat = False, []
    for line in open(f):
        if line.startswith('#'):
            on = sec in line
            continue
        m = re.match(r'(8B \S+|70B down)\s+\S+\s+(\d+)\s+([\d.]+)', line)
        if on and m:
            key = [k for k in canon if k[1] == int(m.group(2)) and k[0].startswith(m.group(1))]
            if key:
                rat.append(float(m.group(3)) / canon[key[0]])
    print(f"{f} ({sec.strip()}): {len(rat)} rows, µs / {base.split('/')[-1]}'s µs from {min(rat):.3f} to {max(rat):.3f}")

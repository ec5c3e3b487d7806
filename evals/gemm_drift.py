#!/usr/bin/env python3
# gemm_drift.py: how far later `llmq bench gemm` text runs (the automatic
# plan's rows) sit from the canonical evals/results/gemm-h200.json, row by
# row (same shape and M), while that file waits for a re-run.
import json, re

canon = {(r['shape'], r['m']): r['w4a16_us'] for r in json.load(open('evals/results/gemm-h200.json'))['data']['results']}
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
    print(f"{f} ({sec.strip()}): {len(rat)} rows, µs / gemm-h200.json's µs from {min(rat):.3f} to {max(rat):.3f}")

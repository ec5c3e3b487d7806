#!/usr/bin/env python3
"""The stream probe's table (cuda/probe/stream.cu), one line a row.

Reads the stream-probe-*.json that `bash cuda/device-model.sh probe`
writes and prints, for each region size, the read probe's bandwidth and
every row: transport, CTAs an SM (4 warps each), steps a batch, ring
depth, L2 prefetch distance, work a step, registers, resident CTAs, GB/s
and its fraction of the read probe (rows that could not run: "-").

    python3 evals/probe_summary.py evals/results/stream-probe-h200.json
"""
import json
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = json.load(open(sys.argv[1]))
    print(f"# {d.get('command', '')} (commit {d.get('commit', '')[:8]})")
    for run in d["runs"]:
        rp = run["read_probe"]
        print(f"\n{run['device']}: {run['region_bytes'] / 2**20:.0f} MiB a launch, read probe {rp['GBps']} GB/s ({rp['us']} us)")
        print("mode     P  U  S PF   W regs res      GB/s  of probe")
        for r in run["rows"]:
            ok = r["us"] > 0
            gbps = f"{r['GBps']:9.0f}" if ok else f"{'-':>9}"
            frac = f"{r['of_read_probe']:9.3f}" if ok else f"{'-':>9}"
            print(f"{r['mode']:<7} {r['ctas_per_sm']:2d} {r['steps_a_batch']:2d} {r['ring']:2d} {r['l2_prefetch']:2d} "
                  f"{r['work']:3d} {r['registers']:4d} {r['resident']:3d} {gbps} {frac}")


if __name__ == "__main__":
    main()

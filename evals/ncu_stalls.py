#!/usr/bin/env python3
"""Where a kernel's warps wait, by SASS instruction.

Reads the CSV of `ncu -i REPORT --page source --print-source sass --csv`
(a report collected with --section SourceCounters) and prints:
  - the total of the warp-state samples and their share by opcode
    (HGMMA, BAR, LDS, DEPBAR, ...), so that a phase of the loop that
    holds the warps shows as one line;
  - the instructions holding the most samples, with their share and, where
    the report breaks samples down by reason, the top reasons of each.
Column names differ between ncu versions: the sample columns are found
by name ("Sampling"), and the header is printed first so that a reader
can see what the report held.

usage: ncu_stalls.py SASS.csv [TOP]
"""
import csv
import sys
from collections import defaultdict


def number(s):
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # the header is the first row naming a Source column (ncu may print
    # "==PROF==" lines before it)
    h = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if h is None:
        sys.exit(f"{path}: no header row with a 'Source' column; first lines: {rows[:3]}")
    head, body = rows[h], [r for r in rows[h + 1 :] if len(r) == len(rows[h])]
    print("columns:", " | ".join(head))
    src = head.index("Source")
    addr = head.index("Address") if "Address" in head else None
    samp = [i for i, c in enumerate(head) if "Sampling" in c]
    if not samp:
        sys.exit("no sampling columns: was the report collected with --section SourceCounters?")
    allc = next((i for i in samp if "All" in head[i]), samp[0])
    notissued = next((i for i in samp if "Not" in head[i]), None)
    # per-reason columns, where the version has them (names with "stall")
    reasons = [i for i, c in enumerate(head) if "stall" in c.lower() and i not in samp]
    total = sum(number(r[allc]) for r in body)
    if total == 0:
        sys.exit("no samples")
    print(f"samples: {total:.0f} ({head[allc]})")
    by_op = defaultdict(float)
    for r in body:
        op = r[src].strip().split()
        # skip predicates (@P0, @!PT) to name the opcode
        op = [t for t in op if not t.startswith("@")]
        by_op[op[0].split(".")[0] if op else "?"] += number(r[allc])
    print("by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:14]))
    print()
    ranked = sorted(body, key=lambda r: -number(r[allc]))[:top]
    for r in ranked:
        a = r[addr] if addr is not None else ""
        ni = f" not-issued {100 * number(r[notissued]) / total:5.1f}%" if notissued is not None else ""
        why = ""
        if reasons:
            rs = sorted(((number(r[i]), head[i]) for i in reasons), reverse=True)[:3]
            why = "  [" + ", ".join(f"{n} {v:.0f}" for v, n in rs if v > 0) + "]"
        print(f"{a:>8} {100 * number(r[allc]) / total:5.1f}%{ni}  {r[src].strip()[:90]}{why}")


if __name__ == "__main__":
    main()

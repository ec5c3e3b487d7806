#!/usr/bin/env python3
"""Instructions a step in a GEMV kernel's main loop, counted in SASS.

Reads `cuobjdump -sass` output (stdin or a file) and, for every function
whose mangled name matches PATTERN, finds its longest backward branch (the
main loop) and counts the instructions on the loop's common path: those
left after removing every block a forward conditional branch inside the
loop jumps over when that block holds neither an HMMA nor a load of the
codes (LDG.E.NA: ld_stream's no-allocate loads) — that is, the
group-change block, taken once a group; guards around a step's products
or a batch's loads, taken on nearly every pass, are kept.
A step is 8·MB HMMA for v11 (MB = MT/16 m-tiles, 1 at MT ≤ 16) and 4·NB
for v15 (NB = MT/8 token tiles), so instructions a step = common path /
(HMMA on it / HMMA a step).

  cuobjdump -sass -arch sm_90a build/local-check/w4a16.o | python3 evals/sass_steps.py 'w4a16_gemv_mma'

With --count OPS (comma-separated opcode prefixes) it prints instead how
many instructions of each every matching function holds (device-model.sh's
wgmma mode counts v19's MEMBAR and FENCE.VIEW.ASYNC so):

  cuobjdump -sass libllmqcuda.so | python3 evals/sass_steps.py --count MEMBAR,FENCE.VIEW.ASYNC w4a16_wgmma
"""
import re
import sys


def functions(text):
    for f in re.split(r"\n\s*Function : ", text)[1:]:
        yield f.split("\n", 1)[0], [(int(a, 16), b) for a, b in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", f)]


def branch_target(ins):
    m = re.search(r"BRA (0x[0-9a-f]+)", ins)
    return int(m.group(1), 16) if m else None


def common_path(code):
    loops = [(t, a) for a, b in code if (t := branch_target(b)) is not None and t < a]
    if not loops:
        return None
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    body = [(a, b) for a, b in code if lo <= a <= hi]
    skip = set()
    for a, b in body:
        t = branch_target(b)
        if t is not None and b.startswith("@") and a < t <= hi:
            block = [x for x, y in body if a < x < t]
            if not any("HMMA" in y or "LDG.E.NA" in y for x, y in body if a < x < t):
                skip.update(block)
    return len(body), [b for a, b in body if a not in skip]


def count(ops, pattern, text):
    for name, code in functions(text):
        if pattern.search(name):
            ins = [re.sub(r"^@!?U?P\w+\s+", "", b) for a, b in code]  # past a predicate
            print(name + ": " + ", ".join(f"{sum(i.startswith(op) for i in ins)} {op}" for op in ops))


def main():
    args = sys.argv[1:]
    if args[:1] == ["--count"]:
        text = open(args[3]).read() if len(args) > 3 else sys.stdin.read()
        return count(args[1].split(","), re.compile(args[2]), text)
    pattern = re.compile(args[0])
    text = open(args[1]).read() if len(args) > 1 else sys.stdin.read()
    print("kernel (template arguments)\tloop\tcommon path\tHMMA\tsteps\tinstructions a step")
    for name, code in functions(text):
        if not pattern.search(name):
            continue
        r = common_path(code)
        if r is None:
            continue
        loop, path = r
        args = re.findall(r"L[ib](\d+)E", name)
        mt = int(args[0]) if args else 16
        kernel = re.search(r"(w4a16_(?:gemv\w*?|fused))I", name).group(1)  # past the anonymous namespace's w4a16_cu_…
        if kernel == "w4a16_gemv_swap":
            per = 4 * max(1, mt // 8)
        else:
            per = 8 * max(1, mt // 16)
        hmma = sum("HMMA" in b for b in path)
        steps = hmma / per if hmma else 0
        print(f"{kernel}<{','.join(args)}>\t{loop}\t{len(path)}\t{hmma}\t{steps:g}\t{len(path) / steps if steps else 0:.0f}")


if __name__ == "__main__":
    main()

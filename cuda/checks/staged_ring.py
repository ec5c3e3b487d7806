#!/usr/bin/env python3
"""A model of w4a16_gemv_staged's ring (v17, cuda/w4a16.cu): its full and
empty mbarriers with parity waits, expect_tx against the bulk copies
issued, each warp's own K range (warp_range, C's truncating division),
clipped last stages, K splits, and thread 0 refilling the previous
stage's slot. Random interleavings of the four warps and the copies'
completions check that nothing deadlocks, no warp reads a slot before
its bytes landed, no slot is refilled before every warp read it, each
warp multiplies exactly its steps, and no copy is in flight when the ring
becomes the CTA's reduction. Runs in local-check.sh:

    python3 cuda/checks/staged_ring.py
"""
import random
KW = 4
def warp_range(KT, splits, split, warp):
    per_split = -(-KT // splits)
    s0 = split * per_split; s1 = min(KT, s0 + per_split)
    d = s1 - s0 + KW - 1
    per_warp = int(d / KW)  # C truncation toward zero
    k0 = s0 + warp * per_warp; k1 = min(s1, k0 + per_warp)
    return k0, k1
class Bar:
    def __init__(s, count): s.count = count; s.pending = count; s.tx = 0; s.phase = 0
    def _check(s):
        if s.pending == 0 and s.tx == 0: s.phase += 1; s.pending = s.count
    def arrive(s): assert s.pending > 0; s.pending -= 1; s._check()
    def expect_tx(s, b): s.tx += b; s.arrive()
    def complete_tx(s, b): s.tx -= b; s._check()
    def try_wait(s, parity): return (s.phase & 1) != parity
def run(KT, splits, split, U, ST, rng):
    w0a, w0b = warp_range(KT, splits, split, 0)
    stages = -(-(w0b - w0a) // U) if w0b > w0a else 0
    full = [Bar(1) for _ in range(ST)]; empty = [Bar(KW) for _ in range(ST)]
    content = {}  # (slot, w, u) -> stage whose bytes are there
    readers = {}  # slot -> set of warps that read its current stage
    slot_stage = {}
    inflight = []  # (slot, w, nw, stage)
    def issue(slot, i):
        # every warp must have read the slot's previous stage
        if slot in slot_stage:
            assert readers[slot] == set(range(KW)), ("overwrite before read", slot, i)
        slot_stage[slot] = i; readers[slot] = set()
        byts = 0; cps = []
        for w in range(KW):
            a, b = warp_range(KT, splits, split, w)
            kw = a + i * U; nw = max(0, min(U, b - kw)); byts += nw * 512
            assert nw == 0 or (a <= kw and kw + nw <= b), ('a copy outside the warp range', w, i)  # global reads in bounds
            if nw > 0: cps.append((slot, w, nw, i))
        full[slot].expect_tx(byts)
        inflight.extend(cps)
    for i in range(min(ST, stages)): issue(i, i)
    # warp state: (i, phase) phases: 0 wait full, 1 read+arrive, 2 producer wait empty, 3 done stage
    st = [[0, 0] for _ in range(KW)]
    steps_done = {w: [] for w in range(KW)}
    spins = 0
    while True:
        active = [w for w in range(KW) if st[w][0] < stages]
        if not active:  # every warp is past its last stage: the kernel's ring becomes the reduction now
            assert not inflight, ("copies in flight after the last stage", inflight)
            break
        choices = active[:] + (['copy'] if inflight else [])
        c = rng.choice(choices)
        if c == 'copy':
            j = rng.randrange(len(inflight)); slot, w, nw, i = inflight.pop(j)
            for u in range(nw): content[(slot, w, u)] = i
            full[slot].complete_tx(nw * 512); continue
        w = c; i, ph = st[w]; slot = i % ST; par = (i // ST) & 1
        a, b = warp_range(KT, splits, split, w); kb = a + i * U
        if ph == 0:
            if full[slot].try_wait(par): st[w][1] = 1
            else:
                spins += 1
                if spins > 100000: raise Exception("deadlock")
            continue
        if ph == 1:
            assert slot_stage[slot] == i
            for u in range(U):
                if kb + u < b:
                    assert content.get((slot, w, u)) == i, ("early read", w, i, u)
                    steps_done[w].append(kb + u)
            readers[slot].add(w); empty[slot].arrive()
            st[w][1] = 2 if (w == 0 and i > 0 and i - 1 + ST < stages) else 3
            continue
        if ph == 2:
            prev = (i - 1) % ST; ppar = ((i - 1) // ST) & 1
            if empty[prev].try_wait(ppar): issue(prev, i - 1 + ST); st[w][1] = 3
            else:
                spins += 1
                if spins > 100000: raise Exception("deadlock (empty)")
            continue
        if ph == 3: st[w] = [i + 1, 0]; spins = 0
    for w in range(KW):
        a, b = warp_range(KT, splits, split, w)
        assert steps_done[w] == list(range(a, b)), (w, a, b, steps_done[w])
    for s in range(ST):  # every issued tx satisfied
        assert full[s].tx == 0 and full[s].pending == 1
    return stages
rng = random.Random(3)
n = 0
for KT in list(range(1, 70)) + [128, 256, 512, 704, 1792]:
    for splits in (1, 2, 3, 4, 5, 7, 8, 13, 16, 64):
        for split in range(splits):
            for U, ST in ((4, 4), (4, 6), (2, 3), (2, 2), (3, 2)):
                for rep in range(2):
                    run(KT, splits, split, U, ST, rng); n += 1
print("ok", n, "runs")

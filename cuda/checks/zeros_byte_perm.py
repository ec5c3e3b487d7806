#!/usr/bin/env python3
"""Checks convert_group's byte-permute selectors (cuda/w4a16.cu: a group's
zero offsets, landed from the seventh session's swap-zeros-l2prefetch
patch) against the formulas they replaced, on random words. Runs in
local-check.sh: python3 cuda/checks/zeros_byte_perm.py

__byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the
eight bytes x0..x3, y0..y3 (CUDA's default mode), emulated below.
"""
import random


def byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))


def pair(h):
    return h | (h << 16)


rng = random.Random(7)
N = 20000
for _ in range(N):
    zv = rng.getrandbits(32)  # 4-bit zeros, sub-tile j in nibble j
    e, o = zv & 0x0F0F0F0F, (zv >> 4) & 0x0F0F0F0F
    for m in range(4):
        sel = 0x4040 | (m << 8) | m
        for j, (src, src4) in ((2 * m, (e, e << 4)), (2 * m + 1, (o, o << 4))):
            z = (zv >> (4 * j)) & 0xF
            assert byte_perm(src, 0x64646464, sel) == pair(0x6400 | z), ("zlo", j, hex(zv))
            assert byte_perm(src4 & 0xFFFFFFFF, 0x54545454, sel) == pair(0x5400 | (z << 4)), ("zhi", j, hex(zv))
    sw = rng.getrandbits(32)  # two fp16 scales
    assert byte_perm(sw, 0, 0x1010) == pair(sw & 0xFFFF)
    assert byte_perm(sw, 0, 0x3232) == pair(sw >> 16)
    zx = rng.getrandbits(32)  # 8-bit zeros, a byte each
    for j in range(4):
        assert byte_perm(zx, 0x64646464, 0x4040 | (j << 8) | j) == pair(0x6400 | ((zx >> (8 * j)) & 0xFF))
print(f"{N} random words: every selector gives the old formula's value")

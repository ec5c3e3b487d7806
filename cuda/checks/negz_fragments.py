#!/usr/bin/env python3
"""v15's NEGZ variant (cuda/w4a16.cu): the codes with their magic
offsets (codes_offset) plus the negated offsets (convert_group<true>,
neg_zeros) must be, element by element of mma.m16n8k16's A fragment, the
exact codes q − z that codes_word feeds the other variants — so the two
mma sum to the same products in exact arithmetic. Also checks that the
byte permutes against 0xe4 and 0xd4 make −(1024 + z) and −(64 + z) as
fp16 for every zero. Runs in local-check.sh:

    python3 cuda/checks/negz_fragments.py
"""
import random
import struct
def byte_perm(x, y, s):
    b = [(x >> (8*i)) & 0xFF for i in range(4)] + [(y >> (8*i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4*i)) & 7] << (8*i) for i in range(4))
def h(u16): return struct.unpack("<e", struct.pack("<H", u16))[0]
def halves(w): return (h(w & 0xFFFF), h(w >> 16))
# 1. constants: -(1024+z), -(64+z)
for z in range(16):
    zv = z * 0x11111111
    e, o = zv & 0x0F0F0F0F, (zv >> 4) & 0x0F0F0F0F
    for m in range(4):
        sel = 0x4040 | (m << 8) | m
        assert halves(byte_perm(e, 0xe4e4e4e4, sel)) == (-(1024+z),)*2
        assert halves(byte_perm(o, 0xe4e4e4e4, sel)) == (-(1024+z),)*2
        assert halves(byte_perm((e<<4)&0xFFFFFFFF, 0xd4d4d4d4, sel)) == (-(64+z),)*2
        assert halves(byte_perm((o<<4)&0xFFFFFFFF, 0xd4d4d4d4, sel)) == (-(64+z),)*2
print("constants ok")
def lop(a, m, c): return (a & m) | c
def codes_offset(q):
    q8 = q >> 8
    return [lop(q,0x000f000f,0x64006400), lop(q,0x00f000f0,0x54005400), lop(q8,0x000f000f,0x64006400), lop(q8,0x00f000f0,0x54005400)]
def convert_neg(zv):  # returns zlo[8], zhi[8] as convert_group<true>
    zlo=[0]*8; zhi=[0]*8
    e, o = zv & 0x0F0F0F0F, (zv >> 4) & 0x0F0F0F0F
    e4, o4 = (e<<4)&0xFFFFFFFF, (o<<4)&0xFFFFFFFF
    for m in range(4):
        sel = 0x4040 | (m << 8) | m
        f = zlo if m < 2 else zhi; base = 4*(m&1)
        f[base+0] = byte_perm(e, 0xe4e4e4e4, sel); f[base+1] = byte_perm(o, 0xe4e4e4e4, sel)
        f[base+2] = byte_perm(e4, 0xd4d4d4d4, sel); f[base+3] = byte_perm(o4, 0xd4d4d4d4, sel)
    return zlo, zhi
def neg_zeros(zlo, zhi, m): f = zlo if m < 2 else zhi; return f[4*(m&1):4*(m&1)+4]
def convert_pos(zv):
    zlo=[0]*8; zhi=[0]*8
    e, o = zv & 0x0F0F0F0F, (zv >> 4) & 0x0F0F0F0F
    e4, o4 = (e<<4)&0xFFFFFFFF, (o<<4)&0xFFFFFFFF
    for m in range(4):
        sel = 0x4040 | (m << 8) | m
        zlo[2*m] = byte_perm(e, 0x64646464, sel); zlo[2*m+1] = byte_perm(o, 0x64646464, sel)
        zhi[2*m] = byte_perm(e4, 0x54545454, sel); zhi[2*m+1] = byte_perm(o4, 0x54545454, sel)
    return zlo, zhi
# A fragment (m16k16, row) -> (row, col) of each half: reg r, half h
def a_pos(lane, r, hh):
    gid, tig = lane >> 2, lane & 3
    row = gid + (8 if r in (1, 3) else 0); col = 2*tig + hh + (8 if r in (2, 3) else 0)
    return row, col
rng = random.Random(1)
for trial in range(300):
    Aneg = {}; Acod = {}; Aref = {}
    zvs_g = [rng.getrandbits(32) for _ in range(8)]  # a group's zeros word: one a column, so one a gid (every tig alike)
    for lane in range(32):
        gid = lane >> 2
        zv = zvs_g[gid]
        w = [rng.getrandbits(32) for _ in range(4)]
        nzlo, nzhi = convert_neg(zv); pzlo, pzhi = convert_pos(zv)
        for i in range(4):
            b = codes_offset(w[i]); a = [b[0], b[2], b[1], b[3]]
            z = neg_zeros(nzlo, nzhi, i)
            # v15 non-NEGZ: codes_word
            bb = [halves(b[0]), halves(b[1]), halves(b[2]), halves(b[3])]
            ja, jb = 2*i, 2*i+1
            sub = [tuple(x - y for x, y in zip(bb[0], halves(pzlo[ja]))), tuple(x - y for x, y in zip(bb[1], halves(pzhi[ja]))),
                   tuple(x - y for x, y in zip(bb[2], halves(pzlo[jb]))), tuple(x - y for x, y in zip(bb[3], halves(pzhi[jb])))]
            ap = [sub[0], sub[2], sub[1], sub[3]]
            for r in range(4):
                for hh in range(2):
                    row, col = a_pos(lane, r, hh)
                    assert (i,row,col) not in Acod; Acod[i,row,col] = halves(a[r])[hh]; Aneg[i,row,col] = halves(z[r])[hh]; Aref[i,row,col] = ap[r][hh]
    assert len(Acod) == 4*256
    assert all(Acod[k] + Aneg[k] == Aref[k] for k in Acod), trial
    assert all(abs(v) <= 15 and v == int(v) for v in Aref.values())
print("A fragments: codes + negzeros == codes - zeros, elementwise (so the mma sums are equal in exact arithmetic)")

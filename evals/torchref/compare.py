"""Compares the α that evals/torchref/awq.py (variant ref) chose per block
and scaling group with the α in llmq's `quantize --stats` JSON.

    python3 evals/torchref/compare.py TORCHREF.json LLMQ-STATS.json
"""
import json
import sys

ref = json.load(open(sys.argv[1]))
run = next(r for r in ref["runs"] if r["variant"] == "ref")
key = {"self_attn.q_proj": "qkv", "self_attn.o_proj": "vo", "mlp.gate_proj": "gateup", "mlp.down_proj": "down"}
same = total = 0
for s in json.load(open(sys.argv[2]))["layers"]:
    if s.get("alpha") is None:
        continue
    parts = s["layer"].split(".")
    block, group = int(parts[2]), key[".".join(parts[3:])]
    want = run["layers"][block]["alpha"][group]
    total += 1
    same += abs(want - s["alpha"]) < 1e-9
    if abs(want - s["alpha"]) >= 1e-9:
        print(f"block {block} {group}: llmq α {s['alpha']}, reference α {want}")
print(f"{same} of {total} groups chose the same α (reference code ppl {run['ppl']:.3f})")

"""Compares llmq's AWQ choices, from its `quantize --stats` JSON, with
those of evals/torchref/awq.py (variant ref): the α of every block and
scaling group, and the mean clip shrink of every clipped layer.

    python3 evals/torchref/compare.py TORCHREF.json LLMQ-STATS.json
"""
import json
import sys

ref = json.load(open(sys.argv[1]))
run = next(r for r in ref["runs"] if r["variant"] == "ref")
key = {"self_attn.q_proj": "qkv", "self_attn.o_proj": "vo", "mlp.gate_proj": "gateup", "mlp.down_proj": "down"}
same = total = 0
clip = []  # (llmq, reference) mean shrink per clipped layer
for s in json.load(open(sys.argv[2]))["layers"]:
    parts = s["layer"].split(".")
    block, group = int(parts[2]), key[".".join(parts[3:])]
    want = run["layers"][block]
    for name, v in (s.get("clip_shrink") or {}).items():
        clip.append((v, want["clip"][name]))
    if s.get("alpha") is None:
        continue
    total += 1
    if abs(want["alpha"][group] - s["alpha"]) < 1e-9:
        same += 1
    else:
        print(f"block {block} {group}: llmq α {s['alpha']}, reference α {want['alpha'][group]}")
print(f"{same} of {total} groups chose the same α (reference code ppl {run['ppl']:.3f})")
if clip:
    worst = max(abs(a - b) for a, b in clip)
    mean = lambda i: sum(c[i] for c in clip) / len(clip)
    print(f"clip: {len(clip)} layers, mean shrink llmq {mean(0):.4f} reference {mean(1):.4f}, largest difference in a layer {worst:.4f}")

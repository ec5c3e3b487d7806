#!/usr/bin/env python3
"""Checks llmq serve's echoed prompt logprobs against transformers' logits.

Posts the reference input ids of SHARED/reference/MODEL.logits.input.i32 to
/v1/completions with echo, logprobs 1 and max_tokens 0 (the request
lm-evaluation-harness's local-completions sends to score text), and
compares token_logprobs with log-softmax of SHARED/reference/MODEL.logits.f32,
computed here in float64. Standard library only: it runs on the GPU
machine too.

    python3 evals/echo-logprobs.py http://127.0.0.1:8080 ../shared llama-tiny
"""
import json
import math
import struct
import sys
import urllib.request

url, shared, model = sys.argv[1:4]
ref = f"{shared}/reference/{model}"
with open(f"{ref}.logits.input.i32", "rb") as f:
    raw = f.read()
ids = list(struct.unpack(f"<{len(raw) // 4}i", raw))
with open(f"{ref}.logits.f32", "rb") as f:
    raw = f.read()
logits = struct.unpack(f"<{len(raw) // 4}f", raw)
V = len(logits) // len(ids)

name = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
body = json.dumps({"model": name, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}).encode()
req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
lp = json.load(urllib.request.urlopen(req))["choices"][0]["logprobs"]
got = lp["token_logprobs"]
assert len(got) == len(ids) and got[0] is None and lp["top_logprobs"][0] is None, "shape"

worst, greedy_same = 0.0, 0
for i in range(1, len(ids)):
    row = logits[(i - 1) * V:i * V]
    mx = max(row)
    lse = mx + math.log(sum(math.exp(v - mx) for v in row))
    worst = max(worst, abs(got[i] - (row[ids[i]] - lse)))
    # top_logprobs (logprobs 1): the most likely token and the chosen one.
    best = max(range(V), key=lambda j: row[j])
    is_greedy = got[i] >= max(lp["top_logprobs"][i].values())
    greedy_same += is_greedy == (best == ids[i])
print(f"{model}: {len(ids) - 1} echoed prompt logprobs, largest |llmq - transformers| = {worst:.2e}; "
      f"greedy flag agrees at {greedy_same} of {len(ids) - 1} positions")
sys.exit(0 if worst < 1e-3 else 1)

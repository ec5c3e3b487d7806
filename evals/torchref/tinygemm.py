"""Times PyTorch's int4 kernel, torch._weight_int4pack_mm (the tinygemm
kernel of gpt-fast and torchao), on the shapes and M values of
`llmq bench gemm`, the same way llmq times its own kernel and cuBLAS: 20
calls captured in one CUDA graph, rotating among enough copies of the
weights that L2 cannot serve them, median over replays. W4 g128 with
per-group scales and zeros, bf16 activations (the kernel's only input
type). Writes JSON that `llmq bench gemm --peer` reads:

  python3 evals/torchref/tinygemm.py --json build/out/tinygemm.json
"""
import argparse, json, sys, time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--json", required=True)
ap.add_argument("--m", default="1,2,4,8,16,32,64,128,256,1024,4096")
ap.add_argument("--iters", type=int, default=100)
args = ap.parse_args()

# Keep in step with evals.LlamaShapes.
SHAPES = [("8B qkv 4096→6144", 4096, 6144), ("8B o 4096→4096", 4096, 4096),
          ("8B gate+up 4096→28672", 4096, 28672), ("8B down 14336→4096", 14336, 4096),
          ("70B down 28672→8192", 28672, 8192)]
GROUP, INNER_K_TILES, PER_GRAPH = 128, 8, 20
dev = torch.device("cuda")


def pack(N, K):
    """Random 4-bit weights in tinygemm's layout; the argument type of
    _convert_weight_to_int4pack changed in torch 2.5 (uint8 pairs)."""
    q = torch.randint(0, 16, (N, K), dtype=torch.int32, device=dev)
    try:
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(packed, INNER_K_TILES)
    except RuntimeError:
        return torch.ops.aten._convert_weight_to_int4pack(q, INNER_K_TILES)


def median_us(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(PER_GRAPH):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(iters // PER_GRAPH, 5)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / PER_GRAPH)
    times.sort()
    return times[len(times) // 2]


Ms = [int(m) for m in args.m.split(",")]
out = []
for name, K, N in SHAPES:
    w = pack(N, K)
    sz = torch.rand(K // GROUP, N, 2, dtype=torch.bfloat16, device=dev) * 0.01
    nbytes = w.numel() * w.element_size() + sz.numel() * 2
    copies = max(1, min(16, (256 << 20) // nbytes + 1))
    ws = [w.clone() for _ in range(copies)]
    x = torch.randn(max(Ms), K, dtype=torch.bfloat16, device=dev)
    for M in Ms:
        xm = x[:M].contiguous()
        try:
            us = median_us(lambda i: torch.ops.aten._weight_int4pack_mm(xm, ws[i % copies], GROUP, sz), args.iters)
        except RuntimeError as e:  # recorded, not hidden: the row says why it has no time
            print(f"{name} M={M}: {e}")
            out.append({"shape": name, "m": M, "k": K, "n": N, "tinygemm_us": 0, "error": str(e)[:200]})
            continue
        out.append({"shape": name, "m": M, "k": K, "n": N, "tinygemm_us": us})
        print(f"{name:24s} M={M:5d} tinygemm {us:9.2f} µs")
    del ws, w
    torch.cuda.empty_cache()

rec = {"kind": "tinygemm-peer", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
       "command": "python3 " + " ".join(sys.argv),
       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": out}
with open(args.json, "w") as f:
    json.dump(rec, f, indent=1, ensure_ascii=False)

"""Times the reference GPTQ code (IST-DASLab/gptq's gptq.py and quant.py,
fetched from GitHub and carried in .carry/gptq-ref, unmodified) on the linear
layers of one Llama-3-8B block, with the same calibration size llmq uses
(--tokens rows of the layer's input): Hessian accumulation (add_batch, in
batches of --batch rows) and fasterquant (w4 g128, blocks of 128, damp 0.01).
Writes JSON with per-layer seconds. Random weights and activations: the
time of these steps does not depend on the values.

  python3 evals/torchref/gptq_time.py --ref .carry/gptq-ref --json out.json
"""
import argparse, json, os, sys, time, types

ap = argparse.ArgumentParser()
ap.add_argument("--ref", required=True)
ap.add_argument("--json", required=True)
ap.add_argument("--tokens", type=int, default=128 * 2048)
ap.add_argument("--batch", type=int, default=2048)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--intermediate", type=int, default=14336)
ap.add_argument("--kv", type=int, default=1024)
args = ap.parse_args()

try:
    import transformers  # noqa: F401  (gptq.py imports it for Conv1D)
except ImportError:
    stub = types.ModuleType("transformers")
    stub.Conv1D = type("Conv1D", (), {})
    sys.modules["transformers"] = stub
sys.path.insert(0, args.ref)
import torch, torch.nn as nn  # noqa: E402
from gptq import GPTQ  # noqa: E402
from quant import Quantizer  # noqa: E402
import builtins  # noqa: E402

H, I, KV = args.hidden, args.intermediate, args.kv
layers = [("q_proj", H, H), ("k_proj", H, KV), ("v_proj", H, KV), ("o_proj", H, H),
          ("gate_proj", H, I), ("up_proj", H, I), ("down_proj", I, H)]
dev = torch.device("cuda")
torch.manual_seed(0)
res = []
quiet = lambda *a, **k: None  # fasterquant prints its own time and error
for name, fin, fout in layers:
    lin = nn.Linear(fin, fout, bias=False).half().to(dev)
    g = GPTQ(lin)
    g.quantizer = Quantizer()
    g.quantizer.configure(4, perchannel=True, sym=False)
    x = torch.randn(args.batch, fin, device=dev, dtype=torch.float16)
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(args.tokens // args.batch):
        g.add_batch(x, None)
    torch.cuda.synchronize()
    t1 = time.time()
    builtins_print, builtins.print = builtins.print, quiet
    try:
        g.fasterquant(blocksize=128, percdamp=0.01, groupsize=128)
    finally:
        builtins.print = builtins_print
    torch.cuda.synchronize()
    t2 = time.time()
    res.append({"layer": name, "in": fin, "out": fout, "hessian_s": t1 - t0, "fasterquant_s": t2 - t1})
    print(f"{name:10s} {fin:6d}→{fout:6d}  H {t1 - t0:7.3f} s  fasterquant {t2 - t1:7.3f} s", flush=True)
    del g, lin, x
    torch.cuda.empty_cache()
tot = {k: sum(r[k] for r in res) for k in ("hessian_s", "fasterquant_s")}
print(f"block total: H {tot['hessian_s']:.2f} s, fasterquant {tot['fasterquant_s']:.2f} s")
rev = open(os.path.join(args.ref, "REVISION")).read().split()
json.dump({"kind": "gptq-reference-time", "command": " ".join(sys.argv), "reference": "github.com/IST-DASLab/gptq@" + rev[-1],
           "commit": os.environ.get("LLMQ_COMMIT", ""), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "tokens": args.tokens, "layers": res, "total": tot},
          open(args.json, "w"), indent=1)

"""An independent PyTorch AWQ, to cross-check awq/ on the GPU machine.

It implements the algorithm as the llm-awq reference code describes it
(written from the paper and that code's documented behaviour, not copied):
per block, inputs of every linear from the unquantized block; for each
scaling group the α grid of s = x̄^α / sqrt(max·min), scored by the MSE of
the inspected module's output; all groups searched on the original weights,
then folded; then the clip search (max|w| shrunk by 1 − i/20, i < 10, on
512 subsampled tokens, q and k skipped) on the scaled weights and features;
weights quantize-dequantized with the reference's min/max grid. Perplexity
follows ../shared/REFERENCE.md (189 windows of 2048, fp32).

Variants (--variant, repeatable): ref (as above), noclip, go-alpha (α per
group taken from llmq's --stats JSON, clip searched here). Arithmetic is
PyTorch's on the GPU, as the reference figures': notably (max − min)/maxq is
computed as (max − min)·(1/maxq), which decides ties that llmq's pack.Grid
now decides the same way.

    python3 evals/torchref/awq.py --model DIR --calib calib.txt \
        --wiki wikitext2-test.tokens.i32 --bits 3 --variant ref --json OUT
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def pseudo_quant(w, bits, group):
    """Asymmetric min/max quantize-dequantize per group of input columns."""
    shape = w.shape
    w = w.reshape(-1, group)
    hi, lo = w.amax(1, keepdim=True), w.amin(1, keepdim=True)
    maxq = 2**bits - 1
    scale = (hi - lo).clamp(min=1e-5) / maxq
    zero = (-torch.round(lo / scale)).clamp(0, maxq)
    w = (torch.clamp(torch.round(w / scale) + zero, 0, maxq) - zero) * scale
    return w.reshape(shape)


class Stop(Exception):
    pass


def first_layer_inputs(model, ids):
    """The hidden states and keyword arguments the model passes to block 0."""
    got = {}

    def hook(mod, args, kwargs):
        got["x"] = args[0] if args else kwargs["hidden_states"]
        got["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise Stop

    h = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(ids, use_cache=False)
    except Stop:
        pass
    h.remove()
    return got["x"], got["kw"]


def out0(o):
    return o[0] if isinstance(o, tuple) else o


@torch.no_grad()
def search(block, linears, x, fwd, bits, group, n_grid=20, alpha=None):
    """Best α for one scaling group; returns (scales, α, losses)."""
    org = fwd(block, x)
    xmean = x.abs().view(-1, x.shape[-1]).float().mean(0)
    saved = [fc.weight.data.clone() for fc in linears]
    best, best_s, best_a, losses = float("inf"), None, None, []
    grid = [alpha] if alpha is not None else [r / n_grid for r in range(n_grid)]
    for a in grid:
        s = xmean.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        sd = s.to(x.dtype).view(1, -1)
        for fc in linears:
            fc.weight.data = pseudo_quant(fc.weight.data * sd, bits, group) / sd
        loss = (org - fwd(block, x)).float().pow(2).mean().item()
        losses.append(loss)
        if loss < best:
            best, best_s, best_a = loss, s, a
        for fc, w in zip(linears, saved):
            fc.weight.data = w.clone()
    return best_s, best_a, losses


@torch.no_grad()
def clip_layer(w, x, bits, group, n_grid=20, max_shrink=0.5, n_tok=512):
    """Per output channel and group, the max|w| that best keeps the partial outputs."""
    x = x.reshape(-1, x.shape[-1])
    x = x.reshape(1, x.shape[0], -1, group)
    x = x[:, 0 :: max(1, x.shape[1] // n_tok)]
    w_all = w.reshape(w.shape[0], 1, -1, group)
    ob = 256 if w.shape[0] % 256 == 0 else 64
    out = []
    for i in range(w.shape[0] // ob):
        w = w_all[i * ob : (i + 1) * ob]
        org_max = w.abs().amax(dim=-1, keepdim=True)
        best_max = org_max.clone()
        min_err = torch.full_like(org_max, 1e9)
        org_out = (x * w).sum(dim=-1)
        for k in range(int(max_shrink * n_grid)):
            m = org_max * (1 - k / n_grid)
            q = pseudo_quant(torch.clamp(w, -m, m), bits, group)
            err = ((x * q).sum(dim=-1) - org_out).pow(2).mean(dim=1).view(min_err.shape)
            better = err < min_err
            min_err[better] = err[better]
            best_max[better] = m[better]
        out.append(best_max)
    return torch.cat(out, 0).squeeze(1)  # [out, n_group, 1]


@torch.no_grad()
def run_awq(model, ids, bits, group, clip=True, forced=None):
    """Scales and clip thresholds per block; model's weights are changed."""
    layers = model.model.layers
    x, kw = first_layer_inputs(model, ids)
    attn_kw = {k: kw[k] for k in ("position_embeddings", "attention_mask") if k in kw}
    results = []
    for li, layer in enumerate(layers):
        feats, hooks = {}, []
        for name, m in layer.named_modules():
            if isinstance(m, torch.nn.Linear):
                hooks.append(m.register_forward_hook(lambda m, a, o, n=name: feats.__setitem__(n, a[0].detach().clone())))
        nxt = out0(layer(x, **kw))
        for h in hooks:
            h.remove()
        at, mlp = layer.self_attn, layer.mlp
        fa = lambda b, v: out0(b(v, **attn_kw))
        fm = lambda b, v: out0(b(v))
        groups = [
            ("qkv", layer.input_layernorm, [at.q_proj, at.k_proj, at.v_proj], ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], at, fa),
            ("gateup", layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], ["mlp.gate_proj", "mlp.up_proj"], mlp, fm),
            ("down", mlp.up_proj, [mlp.down_proj], ["mlp.down_proj"], mlp.down_proj, fm),
        ]
        if at.v_proj.weight.shape == at.o_proj.weight.shape:
            groups.insert(1, ("vo", at.v_proj, [at.o_proj], ["self_attn.o_proj"], at.o_proj, fm))
        found = []
        for g, prev, lins, names, block, fwd in groups:
            a = None if forced is None else forced[li][g]
            s, a, losses = search(block, lins, feats[names[0]], fwd, bits, group, alpha=a)
            found.append((g, prev, lins, names, s, a, losses))
        rec = {"layer": li, "alpha": {}, "loss": {}, "clip": {}}
        for g, prev, lins, names, s, a, losses in found:
            sd = s.to(prev.weight.dtype)
            if isinstance(prev, torch.nn.Linear):
                prev.weight.data.div_(sd.view(-1, 1))
            else:
                prev.weight.data.div_(sd)
            for fc, n in zip(lins, names):
                fc.weight.data.mul_(sd.view(1, -1))
                feats[n].div_(sd.to(feats[n].dtype).view(1, -1))
            rec["alpha"][g], rec["loss"][g] = a, losses
        if clip:
            for name, m in layer.named_modules():
                if not isinstance(m, torch.nn.Linear) or any(t in name for t in ("q_", "k_")):
                    continue
                mx = clip_layer(m.weight.data, feats[name], bits, group)
                org_max = m.weight.data.reshape(*mx.shape[:2], -1).abs().amax(-1, keepdim=True)
                rec["clip"][name] = (mx / org_max.clamp(min=1e-12)).float().mean().item()
                w = m.weight.data.reshape(*mx.shape[:2], -1)
                m.weight.data = torch.clamp(w, -mx, mx).reshape(m.weight.shape)
        results.append(rec)
        x = nxt
    return results


def quantize_all(model, bits, group):
    for layer in model.model.layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.data = pseudo_quant(m.weight.data, bits, group)


@torch.no_grad()
def perplexity(model, wiki, seqlen=2048, batch=8):
    n = len(wiki) // seqlen
    ids = torch.tensor(wiki[: n * seqlen], dtype=torch.long).view(n, seqlen).cuda()
    nll, cnt = 0.0, 0
    for i in range(0, n, batch):
        x = ids[i : i + batch]
        logits = model(x).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1)
        nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
        cnt += x[:, 1:].numel()
    return float(np.exp(nll / cnt))


def load(path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--wiki", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--go-stats", help="llmq --stats JSON, for --variant go-alpha")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    tok = Tokenizer.from_file(a.model + "/tokenizer.json")
    text = open(a.calib, encoding="utf-8").read()
    cal = tok.encode(text, add_special_tokens=False).ids
    need = a.nsamples * a.seqlen
    if len(cal) < need:
        raise SystemExit(f"{a.calib}: {len(cal)} tokens, need {need}")
    cal = torch.tensor(cal[:need]).view(a.nsamples, a.seqlen).cuda()
    wiki = np.fromfile(a.wiki, dtype="<i4").tolist()

    report = {"kind": "torchref-awq", "command": "python3 " + " ".join(sys.argv), "commit": os.environ.get("LLMQ_COMMIT", ""),
              "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": a.model, "bits": a.bits, "group": a.group, "torch": torch.__version__, "calib_tokens_head": cal[0, :8].tolist(), "runs": []}
    fp = load(a.model, torch.float32)
    report["ppl_fp32"] = perplexity(fp, wiki)
    rtn = load(a.model, torch.float32)
    quantize_all(rtn, a.bits, a.group)
    report["ppl_rtn_minmax"] = perplexity(rtn, wiki)
    del rtn
    print(f"fp32 {report['ppl_fp32']:.3f}  rtn {report['ppl_rtn_minmax']:.3f}", flush=True)
    for v in a.variant:
        t0 = time.time()
        forced = None
        if v == "go-alpha":
            st = json.load(open(a.go_stats))["layers"]
            key = {"self_attn.q_proj": "qkv", "self_attn.o_proj": "vo", "mlp.gate_proj": "gateup", "mlp.down_proj": "down"}
            forced = {}
            for s in st:
                parts = s["layer"].split(".")
                li, name = int(parts[2]), ".".join(parts[3:])
                if s.get("alpha") is not None:
                    forced.setdefault(li, {})[key[name]] = s["alpha"]
        m = load(a.model, torch.float32)
        res = run_awq(m, cal, a.bits, a.group, clip=(v != "noclip"), forced=forced)
        quantize_all(m, a.bits, a.group)
        ppl = perplexity(m, wiki)
        secs = time.time() - t0
        print(f"{v}: ppl {ppl:.3f} ({secs:.1f} s); alpha " + " ".join(f"{r['alpha']}" for r in res), flush=True)
        report["runs"].append({"variant": v, "ppl": ppl, "seconds": secs, "layers": res})
        del m
        torch.cuda.empty_cache()
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

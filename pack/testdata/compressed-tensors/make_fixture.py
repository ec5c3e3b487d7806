#!/usr/bin/env python3
"""Writes a tiny compressed-tensors checkpoint from hand-chosen values.

Built from the published description of the format (neuralmagic/
compressed-tensors: the pack-quantized and float-quantized compressors and
QuantizationArgs), independently of llmq's Go code, with the standard
library only. Output, committed beside this script:

  config.json        a minimal Llama config with a compressed-tensors
                     quantization_config (format mixed-precision, one
                     config group per layer, targeted by name)
  model.safetensors  the layers' tensors
  expected.json      each layer's shape and its weights w[o][i], computed
                     here as scale * (q - zero) (or scale * e4m3(code))

Layers: pack-quantized W4/W8/W3 (groups, channels, act-order g_idx,
packed and unpacked zero points), float-quantized FP8 (per channel, per
tensor with a static input_scale) and int-quantized int8 (per channel
symmetric, per tensor asymmetric).

Run: python3 make_fixture.py (in this directory).
"""
import json
import struct

# --- the safetensors container --------------------------------------------

DTYPE_SIZE = {"I64": 8, "I32": 4, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1}


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, bytes)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors, key=lambda n: (-DTYPE_SIZE[tensors[n][0]], n)):
        dtype, shape, data = tensors[name]
        n = 1
        for d in shape:
            n *= d
        assert len(data) == n * DTYPE_SIZE[dtype], name
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def i32(values):
    return b"".join(struct.pack("<i", v) for v in values)


def i64(values):
    return b"".join(struct.pack("<q", v) for v in values)


def i8(values):
    return b"".join(struct.pack("<b", v) for v in values)


def f32(values):
    return b"".join(struct.pack("<f", v) for v in values)


def f16(values):
    return b"".join(struct.pack("<e", v) for v in values)


def bf16(values):
    # exact for the values used here (at most 8 significant bits)
    out = b""
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        assert bits & 0xFFFF == 0, v
        out += struct.pack("<H", bits >> 16)
    return out


# --- pack-quantized --------------------------------------------------------
# Signed values q in [-2^(b-1), 2^(b-1)-1] are stored as q + 2^(b-1); a
# 32-bit word holds p = 32 // b of them, value k of a run at bits b*k (the
# rest of the word is padding). weight_packed packs each row (along the
# input dimension); weight_zero_point packs each column (along the output
# dimension).


def pack_run(values, b):
    """values: unsigned b-bit ints -> int32 words (padding with zeros)."""
    p = 32 // b
    words = []
    for start in range(0, len(values), p):
        w = 0
        for k, v in enumerate(values[start:start + p]):
            assert 0 <= v < (1 << b)
            w |= v << (b * k)
        words.append(w - (1 << 32) if w >= 1 << 31 else w)
    return words


def packed_layer(name, q, scale, zero, b, group, scale_dtype="F16", zp="packed", g_idx=None, shape_dtype="I64"):
    """q: signed [out][in]; scale, zero: [out][G] (zero None: symmetric)."""
    out, inn = len(q), len(q[0])
    off = 1 << (b - 1)
    G = len(scale[0])
    t = {}
    rows = [pack_run([v + off for v in row], b) for row in q]
    t[name + ".weight_packed"] = ("I32", [out, len(rows[0])], i32([w for r in rows for w in r]))
    enc = {"F16": f16, "BF16": bf16, "F32": f32}[scale_dtype]
    t[name + ".weight_scale"] = (scale_dtype, [out, G], enc([s for r in scale for s in r]))
    t[name + ".weight_shape"] = (shape_dtype, [2], (i64 if shape_dtype == "I64" else i32)([out, inn]))
    if zero is not None:
        if zp == "packed":
            cols = [pack_run([zero[o][g] + off for o in range(out)], b) for g in range(G)]
            nrows = len(cols[0])
            t[name + ".weight_zero_point"] = ("I32", [nrows, G], i32([cols[g][r] for r in range(nrows) for g in range(G)]))
        else:  # older writers: int8 [out, G], signed
            t[name + ".weight_zero_point"] = ("I8", [out, G], i8([z for r in zero for z in r]))
    if g_idx is not None:
        t[name + ".weight_g_idx"] = ("I32", [inn], i32(g_idx))
    w = []
    for o in range(out):
        row = []
        for i in range(inn):
            g = g_idx[i] if g_idx is not None else i // group
            z = zero[o][g] if zero is not None else 0
            row.append(scale[o][g] * (q[o][i] - z))
        w.append(row)
    return t, w


# --- float-quantized (FP8 E4M3, float8_e4m3fn) --------------------------------
# byte = sign(1) exponent(4, bias 7) mantissa(3); exponent 0 is subnormal
# (m/8 * 2^-6); 0x7f and 0xff are NaN; there are no infinities.


def e4m3(byte):
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    assert not (e == 15 and m == 7), "NaN"
    if e == 0:
        return sign * m / 8 * 2.0 ** -6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def fp8_layer(name, codes, scale, per_tensor, scale_dtype="F32"):
    out, inn = len(codes), len(codes[0])
    enc = {"F16": f16, "BF16": bf16, "F32": f32}[scale_dtype]
    t = {name + ".weight": ("F8_E4M3", [out, inn], bytes(c for r in codes for c in r))}
    if per_tensor:
        t[name + ".weight_scale"] = (scale_dtype, [1], enc([scale]))
        w = [[scale * e4m3(c) for c in r] for r in codes]
    else:
        t[name + ".weight_scale"] = (scale_dtype, [out, 1], enc(scale))
        w = [[scale[o] * e4m3(c) for c in codes[o]] for o in range(out)]
    return t, w


# --- the layers ---------------------------------------------------------------


def ramp(out, inn, lo, hi, step=1):
    """Deterministic signed values cycling through [lo, hi]."""
    n = hi - lo + 1
    return [[lo + (o * 7 + i * step) % n for i in range(inn)] for o in range(out)]


def args(bits, typ, sym, strategy, group_size=None, actorder=None):
    return {"num_bits": bits, "type": typ, "symmetric": sym, "strategy": strategy,
            "group_size": group_size, "dynamic": False, "actorder": actorder,
            "block_structure": None, "observer": "minmax", "observer_kwargs": {}}


layers, tensors, groups, expected = [], {}, {}, {}


def add(name, t, w, scheme):
    tensors.update(t)
    expected[name] = {"out": len(w), "in": len(w[0]), "w": w}
    groups["group_%d" % len(groups)] = dict(scheme, targets=[name])


# W4, asymmetric, groups of 8; 10 outputs, so the packed zero points pad
# the second word of each column.
q = ramp(10, 16, -8, 7)
scale = [[2.0 ** -(o % 5 + 3), 0.5 * (o + 1)] for o in range(10)]
zero = [[(o % 16) - 8, 7 - (o % 16)] for o in range(10)]
add("layers.a", *packed_layer("layers.a", q, scale, zero, 4, 8),
    {"weights": args(4, "int", False, "group", 8), "format": "pack-quantized"})

# W8, symmetric, per channel; 6 inputs: 2 words per row, half padding.
q = [[-128, 127, 0, -1, 1, 64], [5, -5, 100, -100, 27, -27], [0, 0, 0, 0, -128, 127]]
scale = [[0.25], [1.0 / 64], [3.0]]
add("layers.b", *packed_layer("layers.b", q, scale, None, 8, 6, scale_dtype="BF16", shape_dtype="I32"),
    {"weights": args(8, "int", True, "channel", -1), "format": "pack-quantized"})

# W3, symmetric, groups of 6: 10 values a word, 12 inputs -> 2 words a row.
q = ramp(4, 12, -4, 3, step=3)
scale = [[0.125, 2.0] for _ in range(4)]
add("layers.c", *packed_layer("layers.c", q, scale, None, 3, 6, scale_dtype="F32"),
    {"weights": args(3, "int", True, "group", 6), "format": "pack-quantized"})

# W4, symmetric, groups of 4, act-order: g_idx assigns inputs to groups
# out of order.
g_idx = [2, 0, 1, 3, 0, 2, 3, 1, 1, 0, 2, 3, 3, 1, 0, 2]
q = ramp(8, 16, -8, 7, step=5)
scale = [[1.0, 0.5, 0.25, 0.125] for _ in range(8)]
add("layers.d", *packed_layer("layers.d", q, scale, None, 4, 4, g_idx=g_idx),
    {"weights": args(4, "int", True, "group", 4, actorder="group"), "format": "pack-quantized"})

# W4, asymmetric, per channel, zero points stored unpacked (int8 [out, G]).
q = ramp(3, 8, -8, 7, step=3)
scale = [[0.5], [0.25], [4.0]]
zero = [[-8], [0], [7]]
add("layers.e", *packed_layer("layers.e", q, scale, zero, 4, 8, zp="int8"),
    {"weights": args(4, "int", False, "channel", -1), "format": "pack-quantized"})

# FP8 per channel: codes chosen to cover normals, subnormals, signs, 448.
codes = [[0x00, 0x80, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE],
         [0x40, 0xC0, 0x3F, 0x30, 0x29, 0x11, 0x57, 0xB3]]
add("layers.f", *fp8_layer("layers.f", codes, [0.5, 2.0 ** -10], False, scale_dtype="BF16"),
    {"weights": args(8, "float", True, "channel"), "format": "float-quantized",
     "input_activations": dict(args(8, "float", True, "token"), dynamic=True, observer=None)})

# FP8 per tensor, with a static input scale (llm-compressor's FP8 scheme).
codes = [[0x3C, 0x44, 0xBC, 0x4F], [0x5A, 0x02, 0x86, 0x70]]
t, w = fp8_layer("layers.g", codes, 0.0625, True)
t["layers.g.input_scale"] = ("F32", [1], f32([0.75]))
add("layers.g", t, w, {"weights": args(8, "float", True, "tensor"), "format": "float-quantized",
                       "input_activations": args(8, "float", True, "tensor")})

# int-quantized (W8A8 INT8): signed int8 weights as they are.
def int8_layer(name, q, scale, zero=None):
    out, inn = len(q), len(q[0])
    t = {name + ".weight": ("I8", [out, inn], i8([v for r in q for v in r]))}
    per_tensor = not isinstance(scale, list)
    t[name + ".weight_scale"] = ("F32", [1] if per_tensor else [out, 1], f32([scale] if per_tensor else scale))
    if zero is not None:
        t[name + ".weight_zero_point"] = ("I8", [1], i8([zero]))
    w = [[(scale if per_tensor else scale[o]) * (q[o][i] - (zero or 0)) for i in range(inn)] for o in range(out)]
    return t, w


int8_act = dict(args(8, "int", True, "token"), dynamic=True, observer=None)
# symmetric, per channel
add("layers.h", *int8_layer("layers.h", [[-128, 127, 3, -3], [0, 1, -1, 64]], [0.5, 2.0 ** -7]),
    {"weights": args(8, "int", True, "channel", -1), "format": "int-quantized", "input_activations": int8_act})
# asymmetric, per tensor
add("layers.i", *int8_layer("layers.i", [[-128, 127, 3, -3], [0, 1, -1, 64]], 0.25, zero=-5),
    {"weights": args(8, "int", False, "tensor"), "format": "int-quantized", "input_activations": int8_act})

for g in groups.values():
    g.setdefault("input_activations", None)
    g["output_activations"] = None
    g["weights"]["group_size"] = g["weights"]["group_size"]

config = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8,
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mixed-precision",
        "quantization_status": "compressed", "config_groups": groups,
        "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
        "sparsity_config": {},
    },
}
write_safetensors("model.safetensors", tensors)
with open("config.json", "w") as f:
    json.dump(config, f, indent=1)
    f.write("\n")
with open("expected.json", "w") as f:
    json.dump(expected, f)
    f.write("\n")

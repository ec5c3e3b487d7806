// Checks a GGUF file written by `llmq export gguf` with a reader llmq did
// not write (@huggingface/gguf): every metadata key llama.cpp's loader
// needs, against the model's config.json, tokenizer.json and
// tokenizer_config.json; every tensor's name, shape and type; and that each
// tensor's data lies inside the file.
//
//   node check.mjs FILE.gguf MODEL_DIR WEIGHT_TYPE   (F16, Q4_0, Q4_1 or Q8_0)
import { gguf, GGMLQuantizationType as T, GGUFValueType as V } from "@huggingface/gguf";
import { readFileSync, statSync } from "node:fs";
import { join, resolve } from "node:path";

const [file, modelDir, weightType] = process.argv.slice(2);
if (!file || !modelDir || !weightType) {
  console.error("usage: node check.mjs FILE.gguf MODEL_DIR F16|Q4_0|Q4_1|Q8_0");
  process.exit(2);
}
const cfg = JSON.parse(readFileSync(join(modelDir, "config.json"), "utf8"));
const tok = JSON.parse(readFileSync(join(modelDir, "tokenizer.json"), "utf8"));
const tcfg = JSON.parse(readFileSync(join(modelDir, "tokenizer_config.json"), "utf8"));

const { metadata: md, typedMetadata: typed, tensorInfos, tensorDataOffset } =
  await gguf(resolve(file), { allowLocalFile: true, typedMetadata: true });

let passed = 0, failed = 0;
function check(what, ok, detail = "") {
  if (ok) passed++;
  else { failed++; console.log(`FAIL ${what} ${detail}`); }
}
function eq(what, got, want) {
  check(what, JSON.stringify(got) === JSON.stringify(want), `got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
}
function typeIs(key, t) { eq(`${key} value type`, typed[key]?.type, t); }

const arch = "llama";
const L = cfg.num_hidden_layers, H = cfg.hidden_size, F = cfg.intermediate_size;
const nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads ?? nh;
const hd = cfg.head_dim ?? H / nh, vocab = cfg.vocab_size;
const theta = cfg.rope_theta ?? cfg.rope_parameters?.rope_theta;

eq("version", md.version, 3);
eq("general.architecture", md["general.architecture"], arch);
eq("general.alignment", md["general.alignment"], 32);
typeIs("general.alignment", V.UINT32);
const fileTypes = { F16: 1, Q4_0: 2, Q4_1: 3, Q8_0: 7 };
eq("general.file_type", md["general.file_type"], fileTypes[weightType]);
check("general.name", typeof md["general.name"] === "string" && md["general.name"].length > 0);
for (const [k, v] of [
  ["context_length", cfg.max_position_embeddings], ["embedding_length", H], ["block_count", L],
  ["feed_forward_length", F], ["attention.head_count", nh], ["attention.head_count_kv", nkv],
  ["rope.dimension_count", hd], ["vocab_size", vocab],
]) { eq(`${arch}.${k}`, md[`${arch}.${k}`], v); typeIs(`${arch}.${k}`, V.UINT32); }
eq(`${arch}.rope.freq_base`, md[`${arch}.rope.freq_base`], Math.fround(theta));
typeIs(`${arch}.rope.freq_base`, V.FLOAT32);
eq(`${arch}.attention.layer_norm_rms_epsilon`, md[`${arch}.attention.layer_norm_rms_epsilon`], Math.fround(cfg.rms_norm_eps));
typeIs(`${arch}.attention.layer_norm_rms_epsilon`, V.FLOAT32);

// tokenizer
eq("tokenizer.ggml.model", md["tokenizer.ggml.model"], "gpt2");
eq("tokenizer.ggml.pre", md["tokenizer.ggml.pre"], "gpt-2");
const tokens = md["tokenizer.ggml.tokens"], types = md["tokenizer.ggml.token_type"];
eq("tokenizer.ggml.tokens length", tokens?.length, vocab);
eq("tokenizer.ggml.token_type length", types?.length, vocab);
let badTok = 0;
const added = new Set(tok.added_tokens.map((a) => a.id));
for (const [s, id] of Object.entries(tok.model.vocab)) if (!added.has(id) && (tokens[id] !== s || types[id] !== 1)) badTok++;
for (const a of tok.added_tokens) if (tokens[a.id] !== a.content || types[a.id] !== (a.special ? 3 : 4)) badTok++;
eq("tokens and types match tokenizer.json", badTok, 0);
const merges = tok.model.merges.map((m) => (Array.isArray(m) ? m.join(" ") : m));
eq("tokenizer.ggml.merges length", md["tokenizer.ggml.merges"]?.length, merges.length);
eq("tokenizer.ggml.merges match", md["tokenizer.ggml.merges"]?.every((m, i) => m === merges[i]), true);
eq("tokenizer.ggml.bos_token_id", md["tokenizer.ggml.bos_token_id"], cfg.bos_token_id);
eq("tokenizer.ggml.eos_token_id", md["tokenizer.ggml.eos_token_id"], cfg.eos_token_id);
eq("tokenizer.ggml.add_bos_token", md["tokenizer.ggml.add_bos_token"], tcfg.add_bos_token);
eq("tokenizer.chat_template", md["tokenizer.chat_template"], tcfg.chat_template);

// tensors
const want = new Map([["token_embd.weight", [[H, vocab], "F16"]], ["output_norm.weight", [[H], "F32"]]]);
if (!cfg.tie_word_embeddings) want.set("output.weight", [[H, vocab], "F16"]);
for (let i = 0; i < L; i++) {
  const b = `blk.${i}.`;
  want.set(b + "attn_norm.weight", [[H], "F32"]);
  want.set(b + "ffn_norm.weight", [[H], "F32"]);
  want.set(b + "attn_q.weight", [[H, nh * hd], weightType]);
  want.set(b + "attn_k.weight", [[H, nkv * hd], weightType]);
  want.set(b + "attn_v.weight", [[H, nkv * hd], weightType]);
  want.set(b + "attn_output.weight", [[nh * hd, H], weightType]);
  want.set(b + "ffn_gate.weight", [[H, F], weightType]);
  want.set(b + "ffn_up.weight", [[H, F], weightType]);
  want.set(b + "ffn_down.weight", [[F, H], weightType]);
}
eq("tensor count", tensorInfos.length, want.size);
const bytesPer = { F32: [1, 4], F16: [1, 2], Q4_0: [32, 18], Q4_1: [32, 20], Q8_0: [32, 34] };
const size = statSync(file).size;
let end = 0;
for (const t of tensorInfos) {
  const w = want.get(t.name);
  if (!w) { check(`unexpected tensor ${t.name}`, false); continue; }
  eq(`${t.name} shape`, t.shape.map(Number), w[0]);
  eq(`${t.name} type`, T[t.dtype], w[1]);
  check(`${t.name} offset aligned`, Number(t.offset) % 32 === 0);
  const [blk, bytes] = bytesPer[T[t.dtype]] ?? [1, 0];
  const n = t.shape.map(Number).reduce((a, b) => a * b, 1);
  end = Math.max(end, Number(tensorDataOffset) + Number(t.offset) + (n / blk) * bytes);
}
check("tensor data inside the file", end <= size, `ends at ${end}, file ${size}`);
console.log(`${file}: ${tensorInfos.length} tensors, ${Object.keys(md).length} metadata keys`);
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);

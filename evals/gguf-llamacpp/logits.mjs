// Logits of a GGUF file in llama.cpp (node-llama-cpp's prebuilt CPU
// build) against transformers' reference logits (../shared/reference:
// input ids .i32, logits [n][vocab] float32).
//
//   node logits.mjs FILE.gguf INPUT.i32 LOGITS.f32
import { getLlama } from "node-llama-cpp";
import { readFileSync } from "node:fs";

const [file, inputPath, refPath] = process.argv.slice(2);
const read = (p, T) => { const b = readFileSync(p); return new T(b.buffer, b.byteOffset, b.length / 4); };
const ids = Array.from(read(inputPath, Int32Array)), ref = read(refPath, Float32Array);
const V = ref.length / ids.length;
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath: file });
const ctx = await model.createContext({ contextSize: Math.max(256, ids.length), batchSize: ids.length, sequences: 1, threads: 2 });
const res = await ctx.getSequence().controlledEvaluate(ids.map((t) => [t, { generateNext: { logits: true } }]));
let maxDiff = 0, maxRef = 0, same = 0;
for (let i = 0; i < ids.length; i++) {
  const logits = res[i].next.logits;
  let a = -1, av = -Infinity, b = -1, bv = -Infinity;
  for (let v = 0; v < V; v++) {
    const x = logits.get(v), r = ref[i * V + v];
    maxDiff = Math.max(maxDiff, Math.abs(x - r));
    maxRef = Math.max(maxRef, Math.abs(r));
    if (x > av) { av = x; a = v; }
    if (r > bv) { bv = r; b = v; }
  }
  if (a === b) same++;
}
console.log(`${ids.length} positions: max |logit − reference| ${maxDiff.toFixed(4)} (largest |reference logit| ${maxRef.toFixed(2)}), argmax equal at ${same}/${ids.length}`);

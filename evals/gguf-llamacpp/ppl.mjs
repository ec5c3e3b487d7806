// Perplexity of a GGUF file in llama.cpp (node-llama-cpp's prebuilt CPU
// build) under llmq eval ppl's protocol: llmq's token ids (a .i32 file
// from `llmq tokenize --format i32`, no BOS), non-overlapping windows of
// SEQLEN, each from an empty context, −log p of tokens 1…SEQLEN−1 from
// llama.cpp's full logits.
//
//   node ppl.mjs FILE.gguf IDS.i32 SEQLEN WINDOWS
import { getLlama } from "node-llama-cpp";
import { readFileSync } from "node:fs";

const [file, idsPath] = process.argv.slice(2, 4);
const seqlen = +process.argv[4], windows = +process.argv[5];
const buf = readFileSync(idsPath);
const ids = new Int32Array(buf.buffer, buf.byteOffset, buf.length / 4);
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath: file });
const ctx = await model.createContext({ contextSize: seqlen, batchSize: seqlen, sequences: 1, threads: 2 });
const seq = ctx.getSequence();
let nll = 0, n = 0;
for (let w = 0; w < windows; w++) {
  const win = Array.from(ids.subarray(w * seqlen, (w + 1) * seqlen));
  await seq.clearHistory();
  const res = await seq.controlledEvaluate(win.map((t, i) => (i + 1 < seqlen ? [t, { generateNext: { logits: true } }] : t)));
  for (let i = 0; i + 1 < seqlen; i++) {
    const logits = res[i].next.logits;
    let mx = -Infinity;
    for (const v of logits.values()) mx = Math.max(mx, v);
    let s = 0;
    for (const v of logits.values()) s += Math.exp(v - mx);
    nll -= logits.get(win[i + 1]) - mx - Math.log(s);
    n++;
  }
}
console.log(`perplexity ${Math.exp(nll / n).toFixed(4)} (${windows} windows of ${seqlen}, ${n} predicted)`);

// End-to-end check of `llmq serve` with the official openai npm client:
// starts the server on a free loopback port, runs a non-streaming chat,
// a streaming chat, a completion, the model list, error cases and /metrics,
// then sends SIGTERM and checks that the server exits cleanly.
//
//   node e2e.mjs ../../build/llmq ../../../shared/models/llama-tiny
import { spawn } from "node:child_process";
import { createServer } from "node:net";
import assert from "node:assert/strict";
import OpenAI from "openai";

const [llmq, model] = process.argv.slice(2);
if (!llmq || !model) {
  console.error("usage: node e2e.mjs LLMQ_BINARY MODEL_DIR");
  process.exit(2);
}

const port = await new Promise((resolve) => {
  const s = createServer().listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); });
});
const server = spawn(llmq, ["serve", model, "--addr", `127.0.0.1:${port}`], { stdio: ["ignore", "inherit", "inherit"] });
const exited = new Promise((resolve) => server.on("exit", (code, signal) => resolve({ code, signal })));
const base = `http://127.0.0.1:${port}`;
for (let i = 0; ; i++) {
  try { if ((await fetch(base + "/health")).ok) break; } catch {}
  if (i > 200) throw new Error("server did not come up");
  await new Promise((r) => setTimeout(r, 50));
}

const client = new OpenAI({ baseURL: base + "/v1", apiKey: "none", maxRetries: 0 });
const name = model.replace(/\/+$/, "").split("/").pop();
const messages = [{ role: "user", content: "Tell me about the history of Rome." }];
let failures = 0;
async function check(what, fn) {
  try { await fn(); console.log("ok   " + what); } catch (e) { failures++; console.log("FAIL " + what + ": " + e.message); }
}

let whole;
await check("chat completion", async () => {
  whole = await client.chat.completions.create({ model: name, messages, max_tokens: 16, temperature: 0 });
  assert.equal(whole.object, "chat.completion");
  assert.equal(whole.choices[0].message.role, "assistant");
  assert.ok(whole.choices[0].message.content.length > 0);
  assert.equal(whole.usage.completion_tokens, 16);
});
await check("streamed chat equals the whole answer", async () => {
  const stream = await client.chat.completions.create({ model: name, messages, max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = "", chunks = 0, usage, finish;
  for await (const c of stream) {
    chunks++;
    if (c.usage) usage = c.usage;
    if (c.choices.length) { text += c.choices[0].delta.content ?? ""; finish ??= c.choices[0].finish_reason ?? undefined; }
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, "length");
  assert.ok(chunks > 5, `${chunks} chunks`);
  assert.equal(usage.total_tokens, whole.usage.total_tokens);
});
await check("completion with a stop string", async () => {
  const r = await client.completions.create({ model: name, prompt: "The history of the", max_tokens: 20, temperature: 0, stop: ["of the h"] });
  assert.equal(r.choices[0].text, " history ");
  assert.equal(r.choices[0].finish_reason, "stop");
});
await check("model list", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, [name]);
});
await check("unknown model is a 404", async () => {
  await assert.rejects(client.chat.completions.create({ model: "gpt-5", messages }), (e) => e.status === 404 && /does not exist/.test(e.message));
});
await check("max_tokens past the context is a 400", async () => {
  await assert.rejects(client.completions.create({ model: name, prompt: "x", max_tokens: 100000 }), (e) => e.status === 400 && /too large/.test(e.message));
});

await check("an unknown route is a 404 in OpenAI's error shape", async () => {
  const r = await fetch(base + "/v1/nothing");
  assert.equal(r.status, 404);
  const body = await r.json();
  assert.deepEqual(Object.keys(body.error).sort(), ["code", "message", "param", "type"]);
  assert.equal(body.error.code, "not_found");
  assert.match(r.headers.get("x-request-id"), /^req-[0-9a-f]{16}$/);
});
await check("/metrics counts the requests", async () => {
  const text = await (await fetch(base + "/metrics")).text();
  assert.match(text, /^llmq_http_requests_total\{route="\/v1\/chat\/completions",status="200"\} 2$/m);
  assert.match(text, /^llmq_completion_tokens_total \d+$/m);
});

// Logprobs, after /metrics (which counts the requests above).
await check("echo with logprobs and max_tokens 0 (lm-evaluation-harness's loglikelihood request)", async () => {
  const prompt = "The history of the";
  const r = await client.completions.create({ model: name, prompt, echo: true, logprobs: 1, max_tokens: 0, temperature: 0 });
  const lp = r.choices[0].logprobs;
  assert.equal(r.choices[0].text, prompt);
  assert.deepEqual(Object.keys(lp).sort(), ["text_offset", "token_logprobs", "tokens", "top_logprobs"]);
  const n = lp.tokens.length;
  assert.equal(n, r.usage.prompt_tokens);
  for (const k of ["token_logprobs", "top_logprobs", "text_offset"]) assert.equal(lp[k].length, n, k);
  assert.equal(lp.token_logprobs[0], null);
  assert.equal(lp.top_logprobs[0], null);
  assert.equal(lp.tokens.slice(1).join(""), prompt);
  for (let i = 1; i < n; i++) {
    assert.ok(lp.token_logprobs[i] < 0, `logprob ${lp.token_logprobs[i]}`);
    assert.equal(lp.top_logprobs[i][lp.tokens[i]], lp.token_logprobs[i]);
    assert.equal(lp.text_offset[i], lp.tokens.slice(1, i).join("").length);
  }
});
await check("chat logprobs, whole and streamed", async () => {
  const req = { model: name, messages, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 2 };
  const r = await client.chat.completions.create(req);
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 8);
  assert.equal(content.map((c) => c.token).join(""), r.choices[0].message.content);
  for (const c of content) { assert.equal(c.top_logprobs.length, 2); assert.ok(c.logprob <= c.top_logprobs[0].logprob); }
  const stream = await client.chat.completions.create({ ...req, stream: true });
  const streamed = [];
  for await (const c of stream) if (c.choices.length && c.choices[0].logprobs) streamed.push(...c.choices[0].logprobs.content);
  assert.deepEqual(streamed.map((c) => c.token), content.map((c) => c.token));
});

server.kill("SIGTERM");
const { code, signal } = await exited;
await check("SIGTERM stops the server cleanly", async () => assert.equal(code, 0, `exit code ${code}, signal ${signal}`));
console.log(failures ? `${failures} check(s) failed` : "all checks passed");
process.exit(failures ? 1 : 0);

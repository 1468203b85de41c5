// One greedy run of llama.cpp compiled to WebAssembly (npm @wllama/wllama 2.x, its CPU backend) on prompt token
// ids, for benchmarks/browser_chat.py. The ids go to llama_decode as they are (wllama's token API: no
// tokenizer, no BOS added), then one token at a time: sample (greedy: top_k 1, temperature 0), accept, decode.
//
// URL parameters: model (URL of the GGUF file), ids (prompt token ids), max_tokens, threads (1: the
// single-threaded build; more needs a cross-origin-isolated page, else wllama falls back to one), n_ctx.
// window.wllamaRun resolves to {prompt_ids, token_ids, load_s, prefill_ms, decode_ms, tokens_per_s, threads,
// multithread, cross_origin_isolated} or {error, log}. Timed as batchgpu's page times itself: prefill_ms from
// the first decode call to the first sampled id, decode_ms from there to the last id, tokens_per_s = the ids
// after the first over decode_ms. The package sits in ./wllama/ (the benchmark links its npm copy there).
import { Wllama } from "./wllama/esm/index.js";

const logs = [];
const keep = (level) => (...args) => logs.push(`${level}: ${args.map(String).join(" ")}`);
const logger = { debug: keep("debug"), log: keep("log"), warn: keep("warn"), error: keep("error") };

async function run() {
  const params = new URLSearchParams(location.search);
  const ids = params.get("ids").split(",").filter(Boolean).map(Number);
  const maxTokens = Number(params.get("max_tokens") ?? 16);
  const threads = Number(params.get("threads") ?? 1);
  const nCtx = Number(params.get("n_ctx") ?? 1024);
  const asset = (path) => new URL(`./wllama/esm/${path}`, location.href).href;
  const wllama = new Wllama(
    { "single-thread/wllama.wasm": asset("single-thread/wllama.wasm"), "multi-thread/wllama.wasm": asset("multi-thread/wllama.wasm") },
    { logger },
  );
  const loading = performance.now();
  const blob = await (await fetch(params.get("model"))).blob();
  await wllama.loadModel([blob], { n_ctx: nCtx, n_batch: nCtx, n_threads: threads, seed: 1 });
  const loadSeconds = (performance.now() - loading) / 1000;
  await wllama.samplingInit({ temp: 0, top_k: 1 });
  await wllama.kvClear();

  const tokens = [];
  const started = performance.now();
  await wllama.samplingAccept(ids);
  await wllama.decode(ids, {});
  let first;
  for (;;) {
    const { token } = await wllama.samplingSample();
    tokens.push(token);
    first ??= performance.now();
    if (tokens.length >= maxTokens) break;
    await wllama.samplingAccept([token]);
    await wllama.decode([token], {});
  }
  const decodeMs = performance.now() - first;
  const out = {
    prompt_ids: ids,
    token_ids: tokens,
    load_s: loadSeconds,
    prefill_ms: first - started,
    decode_ms: decodeMs,
    tokens_per_s: tokens.length > 1 ? (1000 * (tokens.length - 1)) / decodeMs : 0,
    threads: wllama.getNumThreads(),
    multithread: wllama.isMultithread(),
    cross_origin_isolated: self.crossOriginIsolated,
  };
  await wllama.exit();
  return out;
}

window.wllamaRun = run().catch((error) => ({ error: String(error?.stack ?? error), log: logs.slice(-30) }));

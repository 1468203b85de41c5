// The exported chat model behind an OpenAI-shaped API, run in a dedicated Web Worker (./worker.js): the model, its
// GPU buffers, the tokenizer and every generation step live there, so the page's main thread only passes messages
// (streamed pieces of text, stop, load progress) and never stalls while the model loads or generates.
//
//   import { createEngine } from "./engine.js";
//   const engine = await createEngine(new URL(".", location.href), { worker: true, cache: "opfs" });
//   const reply = await engine.chat.completions.create({ messages: [{ role: "user", content: "Hi!" }], max_tokens: 64 });
//   reply.choices[0].message.content; reply.usage;            // a chat.completion object
//   const chunks = await engine.chat.completions.create({ messages, stream: true });
//   for await (const chunk of chunks) text += chunk.choices[0]?.delta?.content ?? "";   // chat.completion.chunk objects
//   await engine.completions.create({ prompt: "Once upon a time", max_tokens: 32 });   // a text_completion object
//   engine.info;      // { worker, loaded_from, network_bytes, storage_bytes, stored, shader_f16, self_test, ... }
//   await engine.forget();     // remove the model's stored copy (the next load downloads it again)
//   await engine.unload();
//
// createEngine's options: worker (default true where the page has Workers; false runs everything on the calling
// thread, as under Node), cache ("opfs": the origin private file system, else the Cache API; "cache"; "none"),
// f16 ("auto", true, false: see precision.js), retries and verify (storage.js), onProgress({phase, done, total,
// network, storage}). Requests run one at a time, in order (the model has one KV cache, and keeps the rows a new
// prompt shares with the last one). engine.generate(ids, options) is the low level of ./batchgpu.js's
// ChatModel.generate (ids in, ids out) through the worker; engine.stream(input, options) yields {tokens, text}.
// A request's speculative (true, or {tokens, min_ngram, max_ngram}; greedy only: temperature 0) runs speculative
// decoding by prompt lookup (ChatModel.generate's speculative): the same text, in fewer steps where the reply copies
// the prompt; engine.stats then counts verify_steps, drafted and accepted.

const BUSY = "batchgpu: the model is generating already (one sequence at a time: its KV cache is one); finish or stop that first";
const PROGRESS_MS = 50; // the worker posts load progress at most this often

/** A bad request: ``param`` names the field, as OpenAI's 400 errors do. */
export class RequestError extends Error {
  constructor(message, param = null) {
    super(`batchgpu: ${message}`);
    this.name = "RequestError";
    this.param = param;
    this.status = 400;
  }
}

// the worker's side --------------------------------------------------------------------------------------

/** Holds back text that may begin a stop string, and ends the text at the first stop string. */
export class StopStrings {
  constructor(stops) {
    this.stops = stops.filter((stop) => stop.length);
    this.held = "";
  }

  /** ``{text, stopped}``: what of the text so far can be sent. */
  push(text) {
    if (!this.stops.length) return { text, stopped: false };
    const all = this.held + text;
    let cut = -1;
    for (const stop of this.stops) {
      const at = all.indexOf(stop);
      if (at >= 0 && (cut < 0 || at < cut)) cut = at;
    }
    if (cut >= 0) {
      this.held = "";
      return { text: all.slice(0, cut), stopped: true };
    }
    let keep = 0;
    for (const stop of this.stops) {
      for (let k = Math.min(stop.length - 1, all.length); k > keep; k--) {
        if (all.endsWith(stop.slice(0, k))) {
          keep = k;
          break;
        }
      }
    }
    this.held = all.slice(all.length - keep);
    return { text: all.slice(0, all.length - keep), stopped: false };
  }

  /** The rest of the text once the generation ended. */
  finish(text) {
    const out = this.push(text);
    if (out.stopped) return out;
    const rest = out.text + this.held;
    this.held = "";
    return { text: rest, stopped: false };
  }
}

/** The model's side of the engine: loads it and runs requests, answering each message ``{id, op, ...}`` through
 * ``post`` with ``{id, op: "progress" | "delta"}`` events, then ``{id, op: "result" | "done"}`` or ``{id, op:
 * "error", message}``. Runs in the worker (./worker.js), or on the page's thread (worker: false). */
export class Backend {
  constructor(post, { gpu = null } = {}) {
    this.post = post;
    this.gpu = gpu;
    this.model = null;
    this.base = null;
    this.runs = new Map(); // run id -> its AbortController
  }

  async receive(message) {
    const { id, op } = message;
    try {
      if (op === "stop") {
        this.runs.get(message.run)?.abort();
        return;
      }
      if (op === "generate") {
        await this.generate(message);
        return;
      }
      let value;
      if (op === "load") value = await this.load(id, message);
      else if (op === "forget") value = await this.forget();
      else if (op === "unload") value = this.unload();
      else throw new Error(`batchgpu: the engine has no operation ${op}`);
      this.post({ id, op: "result", value });
    } catch (error) {
      this.post({ id, op: "error", message: String(error?.message ?? error), param: error?.param ?? null });
    }
  }

  async load(id, { base, options }) {
    if (this.model) throw new Error("batchgpu: the engine has a model loaded already");
    const { loadModel } = await import("./batchgpu.js");
    this.base = new URL(base);
    let last = 0;
    const onProgress = (progress) => {
      const now = performance.now();
      if (now - last < PROGRESS_MS && progress.done < progress.total) return;
      last = now;
      this.post({ id, op: "progress", progress });
    };
    const started = performance.now();
    this.model = await loadModel(this.base, { ...options, gpu: this.gpu, onProgress });
    const { manifest, loading, precision, memory, adapter, codec } = this.model;
    return {
      model: manifest.model.name,
      max_context: manifest.model.max_context,
      vocab: manifest.model.vocab,
      speculative_tokens: manifest.model.speculative_tokens ?? 0,
      has_chat_template: Boolean(codec?.hasChatTemplate),
      adapter,
      load_s: (performance.now() - started) / 1000,
      ...loading,
      shader_f16: precision.shader_f16,
      self_test: precision.self_test,
      self_test_cases: precision.cases,
      memory,
    };
  }

  promptIds(input) {
    const codec = this.model.codec;
    if (input.ids) return Array.from(input.ids, Number);
    if (!codec) throw new Error("batchgpu: the model was loaded without its tokenizer; pass token ids");
    if (input.messages) {
      if (!codec.hasChatTemplate) throw new RequestError("the model has no chat template; use completions.create with a prompt", "messages");
      return codec.encodeChat(input.messages);
    }
    return codec.encode(input.prompt, { special: true });
  }

  async generate({ id, input, options }) {
    const model = this.model;
    if (!model) throw new Error("batchgpu: no model is loaded");
    const ids = this.promptIds(input);
    const controller = new AbortController();
    this.runs.set(id, controller);
    const { stop = [], stopIds = null, maxTokens = null, ...settings } = options;
    const stopSet = new Set(stopIds ?? model.codec?.stopIds ?? []);
    const text = model.codec?.stream() ?? null;
    const stops = new StopStrings(stop);
    let stopString = false;
    let last = null;
    let count = 0;
    try {
      const limit = maxTokens ?? model.maxContext;
      for await (const token of model.generate(ids, { ...settings, maxTokens: limit, stop: stopSet, signal: controller.signal })) {
        count += 1;
        last = token;
        const piece = stops.push(text ? text.push(token) : "");
        this.post({ id, op: "delta", tokens: [token], text: piece.text });
        if (piece.stopped) {
          stopString = true;
          break;
        }
      }
      const stopped = stopString || (last !== null && stopSet.has(last));
      const finish = stopped ? "stop" : controller.signal.aborted ? "abort" : "length";
      const rest = stopString ? "" : stops.finish(text ? text.finish() : "").text;
      const stats = { ...model.stats };
      const usage = { prompt_tokens: ids.length, completion_tokens: count, total_tokens: ids.length + count, prompt_tokens_details: { cached_tokens: stats.cached_tokens } };
      this.post({ id, op: "done", text: rest, finish_reason: finish, prompt_ids: ids, stats, usage });
    } catch (error) {
      this.post({ id, op: "error", message: String(error?.message ?? error), param: error?.param ?? null });
    } finally {
      this.runs.delete(id);
    }
  }

  async forget() {
    const { fetchJson } = await import("./io.js");
    const { forgetModel } = await import("./storage.js");
    const weights = this.model?.manifest.weights ?? (await fetchJson(new URL("model.json", this.base))).weights;
    return forgetModel(new URL(weights.file, this.base), weights);
  }

  unload() {
    this.model?.destroy();
    this.model = null;
    return true;
  }
}

// the page's side --------------------------------------------------------------------------------------

function workerPort() {
  const worker = new Worker(new URL("./worker.js", import.meta.url), { type: "module", name: "batchgpu" });
  let failed = null;
  return {
    post: (message) => worker.postMessage(message),
    listen: (receive, fail) => {
      worker.onmessage = (event) => receive(event.data);
      worker.onerror = (event) => {
        event.preventDefault?.();
        failed = new Error(`batchgpu: the model's worker failed: ${event.message || "it could not start (./worker.js)"}`);
        fail(failed);
      };
      worker.onmessageerror = () => fail(new Error("batchgpu: a message from the model's worker could not be read"));
    },
    close: () => worker.terminate(),
  };
}

function localPort(gpu) {
  let receive = null;
  const backend = new Backend((message) => queueMicrotask(() => receive?.(message)), { gpu });
  return {
    post: (message) => void backend.receive(message),
    listen: (onMessage) => (receive = onMessage),
    close: () => {},
  };
}

function randomBytes(count) {
  const bytes = new Uint8Array(count);
  if (globalThis.crypto?.getRandomValues) return globalThis.crypto.getRandomValues(bytes);
  return bytes.map(() => Math.floor(Math.random() * 256)); // Node 18 without the global webcrypto
}

function randomId(prefix) {
  const bytes = randomBytes(12);
  return prefix + Array.from(bytes, (b) => b.toString(36).padStart(2, "0")).join("").slice(0, 24);
}

// request checks ------------------------------------------------------------------------------------------

const UNSUPPORTED = {
  tools: "tool calls", tool_choice: "tool calls", functions: "function calls", function_call: "function calls",
  logit_bias: "logit_bias", logprobs: "logprobs", top_logprobs: "logprobs", response_format: "response_format",
  frequency_penalty: "frequency_penalty", presence_penalty: "presence_penalty", suffix: "suffix", echo: "echo",
};
const NEUTRAL = { logprobs: false, frequency_penalty: 0, presence_penalty: 0, echo: false, top_logprobs: 0 };

function number(body, name, fallback, ok, range) {
  const value = body[name] ?? fallback;
  if (typeof value !== "number" || !ok(value)) throw new RequestError(`${name} must be ${range}, got ${JSON.stringify(body[name])}`, name);
  return value;
}

/** A request's ``speculative`` (true, or {tokens, min_ngram, max_ngram}) as ChatModel.generate's option, or null;
 * ``most``: the export's speculative_tokens. Greedy only: with temperature > 0 it is refused. */
function speculativeOf(body, most, temperature) {
  const option = body.speculative;
  if (option === undefined || option === null || option === false) return null;
  const fail = (why) => {
    throw new RequestError(`speculative ${why}`, "speculative");
  };
  if (!most) fail("decoding needs verify steps, and this model's export has none (exported with --speculative-tokens 0)");
  const given = option === true ? {} : option;
  if (typeof given !== "object" || Array.isArray(given)) fail(`must be true or an object {tokens, min_ngram, max_ngram}, got ${JSON.stringify(option)}`);
  const unknown = Object.keys(given).filter((key) => !["tokens", "min_ngram", "max_ngram"].includes(key));
  if (unknown.length) fail(`has no field ${unknown.join(", ")} (its fields: tokens, min_ngram, max_ngram)`);
  const { tokens = most, min_ngram: minNgram = 2, max_ngram: maxNgram = 4 } = given;
  if (!(Number.isInteger(tokens) && tokens >= 1 && tokens <= most)) fail(`tokens must be an integer in [1, ${most}] (the export's verify steps), got ${JSON.stringify(tokens)}`);
  if (!(Number.isInteger(minNgram) && minNgram >= 1)) fail(`min_ngram must be an integer >= 1, got ${JSON.stringify(minNgram)}`);
  if (!(Number.isInteger(maxNgram) && maxNgram >= minNgram)) fail(`max_ngram must be an integer >= min_ngram (${minNgram}), got ${JSON.stringify(maxNgram)}`);
  if (temperature > 0) {
    const asked = body.temperature ?? null;
    fail(`decoding is greedy only: set temperature to 0 (got ${asked === null ? "none: the default is 1" : asked})`);
  }
  return { tokens, minNgram, maxNgram };
}

/** The generation settings of an OpenAI request body (chat or completion), checked; ``info``: the engine's (the
 * export's speculative_tokens). */
function settingsOf(body, info = null) {
  if (typeof body !== "object" || body === null || Array.isArray(body)) throw new RequestError("the request must be an object");
  for (const [name, what] of Object.entries(UNSUPPORTED)) {
    const value = body[name];
    if (value === undefined || value === null || value === NEUTRAL[name]) continue;
    if (name === "response_format" && value?.type === "text") continue;
    throw new RequestError(`${name} is not supported here (${what})`, name);
  }
  if ((body.n ?? 1) !== 1 || (body.best_of ?? 1) !== 1) throw new RequestError("n and best_of must be 1 (the model runs one sequence)", "n");
  const cap = body.max_completion_tokens ?? body.max_tokens ?? null;
  if (cap !== null && !(Number.isInteger(cap) && cap >= 1)) throw new RequestError(`max_tokens must be an integer >= 1, got ${JSON.stringify(cap)}`, "max_tokens");
  let stop = body.stop ?? [];
  if (typeof stop === "string") stop = [stop];
  if (!Array.isArray(stop) || stop.length > 4 || stop.some((s) => typeof s !== "string")) throw new RequestError("stop must be a string or up to 4 strings", "stop");
  const seed = body.seed ?? new Uint32Array(randomBytes(4).buffer)[0];
  if (!Number.isInteger(seed) || seed < 0 || seed >= 2 ** 32) throw new RequestError(`seed must be an integer in [0, 2**32), got ${JSON.stringify(body.seed)}`, "seed");
  if (body.stream !== undefined && body.stream !== null && typeof body.stream !== "boolean") throw new RequestError("stream must be a boolean", "stream");
  const temperature = number(body, "temperature", 1, (v) => v >= 0 && v <= 2, "a number in [0, 2]");
  const speculative = speculativeOf(body, info?.speculative_tokens ?? 0, temperature);
  return {
    settings: {
      maxTokens: cap,
      temperature,
      topP: number(body, "top_p", 1, (v) => v > 0 && v <= 1, "a number in (0, 1]"),
      topK: number(body, "top_k", 0, (v) => Number.isInteger(v) && v >= 0, "an integer >= 0"),
      minP: number(body, "min_p", 0, (v) => v >= 0 && v <= 1, "a number in [0, 1]"),
      seed,
      stop,
      ...(speculative ? { speculative } : {}),
    },
    stream: Boolean(body.stream),
    includeUsage: Boolean(body.stream_options?.include_usage),
  };
}

function messagesOf(body) {
  const { messages } = body ?? {};
  if (!Array.isArray(messages) || !messages.length) throw new RequestError("messages must be a non-empty array", "messages");
  return messages.map((message, i) => {
    if (typeof message !== "object" || message === null || typeof message.role !== "string") throw new RequestError(`messages[${i}] must be an object with a role`, "messages");
    let { content } = message;
    if (Array.isArray(content)) {
      if (content.some((part) => part?.type !== "text" || typeof part.text !== "string")) throw new RequestError(`messages[${i}]: only text content parts are supported`, "messages");
      content = content.map((part) => part.text).join("");
    }
    if (typeof content !== "string") throw new RequestError(`messages[${i}].content must be a string`, "messages");
    return { role: message.role, content };
  });
}

function promptOf(body) {
  const { prompt } = body ?? {};
  const single = Array.isArray(prompt) && prompt.length === 1 ? prompt[0] : prompt;
  if (typeof single === "string") return { prompt: single };
  if (Array.isArray(single) && single.length && single.every((id) => Number.isInteger(id))) return { ids: single };
  throw new RequestError("prompt must be a string, or an array of token ids (one prompt)", "prompt");
}

// the engine ----------------------------------------------------------------------------------------------

class Engine {
  #port;
  #pending = new Map();
  #next = 1;
  #queue = Promise.resolve();
  #busy = false;
  #current = null;

  constructor(port, worker) {
    this.#port = port;
    this.worker = worker;
    this.info = null;
    this.stats = null; // the last generation's (batchgpu.js ChatModel.stats)
    this.last = null; // the last generation's {finish_reason, prompt_ids, stats, usage}
    this.chat = { completions: { create: (body, options) => this.#create("chat.completion", body, options) } };
    this.completions = { create: (body, options) => this.#create("text_completion", body, options) };
    port.listen(
      (message) => this.#receive(message),
      (error) => {
        for (const pending of this.#pending.values()) pending.reject(error);
        this.#pending.clear();
      },
    );
  }

  get model() {
    return this.info?.model ?? null;
  }

  #receive(message) {
    const pending = this.#pending.get(message.id);
    if (!pending) return;
    if (message.op === "error") {
      this.#pending.delete(message.id);
      const error = new Error(message.message);
      if (message.param) Object.assign(error, { name: "RequestError", param: message.param, status: 400 });
      pending.reject(error);
    } else if (message.op === "result" || message.op === "done") {
      this.#pending.delete(message.id);
      pending.resolve(message);
    } else {
      pending.onEvent?.(message);
    }
  }

  /** Send ``op`` and resolve to its final message (``onEvent`` gets the events before it). */
  call(op, payload = {}, onEvent = null) {
    const id = this.#next++;
    const done = new Promise((resolve, reject) => this.#pending.set(id, { resolve, reject, onEvent }));
    this.#port.post({ id, op, ...payload });
    return { id, done };
  }

  async load(base, options, onProgress) {
    const { done } = this.call("load", { base: String(base), options }, (message) => onProgress?.(message.progress));
    this.info = { worker: this.worker, ...(await done).value };
    return this.info;
  }

  /** Run one generation: ``input`` {ids} | {messages} | {prompt}; yields the worker's ``{op: "delta", tokens,
   * text}`` messages, then its ``{op: "done", ...}``. Ending the iteration early stops the generation. */
  async *#run(input, options, signal) {
    if (this.#busy) throw new Error(BUSY);
    this.#busy = true;
    const events = [];
    let wake = null;
    let finished = false;
    let failure = null;
    let final = null;
    const { id, done } = this.call("generate", { input, options }, (message) => {
      events.push(message);
      wake?.();
    });
    done.then(
      (message) => ((final = message), (finished = true), wake?.()),
      (error) => ((failure = error), (finished = true), wake?.()),
    );
    const stop = () => this.#port.post({ id: 0, op: "stop", run: id });
    this.#current = stop;
    signal?.addEventListener("abort", stop);
    if (signal?.aborted) stop();
    try {
      for (;;) {
        if (events.length) {
          yield events.shift();
        } else if (finished) {
          break;
        } else {
          await new Promise((resolve) => (wake = resolve));
          wake = null;
        }
      }
      if (failure) throw failure;
      this.last = { finish_reason: final.finish_reason, prompt_ids: final.prompt_ids, stats: final.stats, usage: final.usage };
      this.stats = final.stats;
      yield final;
    } finally {
      signal?.removeEventListener("abort", stop);
      this.#current = null;
      if (!finished) {
        stop();
        await done.catch(() => {});
      }
      this.#busy = false;
    }
  }

  /** The ids generated for the prompt ``ids``, one at a time, as ChatModel.generate gives them (the same options:
   * maxTokens, temperature, topK, topP, minP, seed, stop (ids), signal, ahead, reuse, speculative); ``this.stats``
   * then holds the generation's figures. */
  async *generate(ids, { signal = null, stop = null, ...options } = {}) {
    const settings = stop ? { ...options, stopIds: [...stop] } : options;
    for await (const message of this.#run({ ids: Array.from(ids, Number) }, settings, signal)) {
      if (message.op === "delta") yield* message.tokens;
    }
  }

  /** Pieces ``{tokens, text}`` of the reply to ``input`` ({ids}, {messages} through the chat template, or
   * {prompt}), with ChatModel.generate's options and ``stop`` (strings); ``this.last`` then holds its
   * finish_reason, prompt_ids, stats and usage. */
  async *stream(input, { signal = null, ...options } = {}) {
    for await (const message of this.#run(input, options, signal)) {
      if (message.op === "delta") yield { tokens: message.tokens, text: message.text };
      else if (message.text) yield { tokens: [], text: message.text };
    }
  }

  /** Stop the generation running now, if any. */
  interruptGenerate() {
    this.#current?.();
  }

  async #acquire() {
    const before = this.#queue;
    let release;
    this.#queue = new Promise((resolve) => (release = resolve));
    await before;
    return release;
  }

  #create(kind, body, { signal = null } = {}) {
    let request;
    try {
      const { settings, stream, includeUsage } = settingsOf(body, this.info);
      const input = kind === "chat.completion" ? { messages: messagesOf(body) } : promptOf(body);
      request = { settings, stream, includeUsage, input };
    } catch (error) {
      return Promise.reject(error);
    }
    const meta = { id: randomId(kind === "chat.completion" ? "chatcmpl-" : "cmpl-"), created: Math.floor(Date.now() / 1000), model: this.model };
    if (request.stream) return Promise.resolve(this.#streamed(kind, meta, request, signal));
    return this.#whole(kind, meta, request, signal);
  }

  async #whole(kind, meta, { settings, input }, signal) {
    const release = await this.#acquire();
    try {
      let text = "";
      let final = null;
      for await (const message of this.#run(input, settings, signal)) {
        text += message.text;
        if (message.op === "done") final = message;
      }
      const choice = kind === "chat.completion"
        ? { index: 0, message: { role: "assistant", content: text }, logprobs: null, finish_reason: final.finish_reason }
        : { index: 0, text, logprobs: null, finish_reason: final.finish_reason };
      return { ...meta, object: kind, system_fingerprint: null, choices: [choice], usage: final.usage };
    } finally {
      release();
    }
  }

  #streamed(kind, meta, { settings, input, includeUsage }, signal) {
    const controller = new AbortController();
    signal?.addEventListener("abort", () => controller.abort());
    const engine = this;
    const object = kind === "chat.completion" ? "chat.completion.chunk" : "text_completion";
    const chunk = (delta, finish) => {
      const choice = kind === "chat.completion" ? { index: 0, delta, logprobs: null, finish_reason: finish } : { index: 0, text: delta.content ?? "", logprobs: null, finish_reason: finish };
      return { ...meta, object, system_fingerprint: null, choices: [choice], ...(includeUsage ? { usage: null } : {}) };
    };
    async function* chunks() {
      const release = await engine.#acquire();
      try {
        if (kind === "chat.completion") yield chunk({ role: "assistant", content: "" }, null);
        for await (const message of engine.#run(input, settings, controller.signal)) {
          if (message.text) yield chunk({ content: message.text }, null);
          if (message.op === "done") {
            yield chunk({}, message.finish_reason);
            if (includeUsage) yield { ...meta, object, system_fingerprint: null, choices: [], usage: message.usage };
          }
        }
      } finally {
        release();
      }
    }
    return { [Symbol.asyncIterator]: chunks, controller };
  }

  /** Remove the model's copy in browser storage (the loaded model keeps working); resolves to the stores it was
   * in ("opfs", "cache"). */
  async forget() {
    return (await this.call("forget").done).value;
  }

  /** Free the model's GPU buffers and end the worker. */
  async unload() {
    try {
      await this.call("unload").done;
    } finally {
      this.#port.close();
    }
  }
}

/** Load the exported model at ``base`` (the folder's URL) into a new engine (see the top of this file). */
export async function createEngine(
  base = new URL(".", import.meta.url),
  { worker = true, cache = "opfs", f16 = "auto", retries = 4, verify = false, slabBytes = undefined, onProgress = null, gpu = null } = {},
) {
  const inWorker = Boolean(worker) && typeof Worker !== "undefined";
  const engine = new Engine(inWorker ? workerPort() : localPort(gpu), inWorker);
  let persisted = null;
  if (cache !== "none" && typeof navigator !== "undefined" && navigator.storage?.persist) {
    try { // only pages may ask (not workers): persistent storage is not evicted under storage pressure
      persisted = (await navigator.storage.persisted()) || (await navigator.storage.persist());
    } catch {
      persisted = false;
    }
  }
  const options = { cache, f16, retries, verify, ...(slabBytes ? { slabBytes } : {}) };
  try {
    await engine.load(base, options, onProgress);
  } catch (error) {
    engine.unload().catch(() => {});
    throw error;
  }
  engine.info.persisted = persisted;
  return engine;
}

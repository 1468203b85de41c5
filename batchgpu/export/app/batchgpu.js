// A batchgpu chat model exported for WebGPU (python -m batchgpu export-chat): the decoder's recorded steps run on
// the page's GPU, the weights built from the model's GGUF file as it streams in (from the network, or from the
// browser's storage where an earlier load kept it: ./storage.js).
//
//   import { loadModel } from "./batchgpu.js";
//   const model = await loadModel(new URL(".", import.meta.url), { onProgress: (p) => console.log(p.phase, p.done / p.total) });
//   const ids = model.codec.encodeChat([{ role: "user", content: "Hi!" }]);
//   for await (const id of model.generate(ids, { maxTokens: 64, temperature: 0.7, seed: 1 })) ...
//
// This is the low level, on the thread that calls it; ./engine.js runs it in a Web Worker behind an OpenAI-shaped
// API (createEngine). The next turn's prompt (the conversation so far) prefills only what follows the ids the KV
// cache holds (model.cachedIds; model.stats.cached_tokens counts them), unless generate(ids, { reuse: false }).
// generate(ids, { speculative: true }) decodes greedily by prompt lookup: the same ids, fewer steps where drafts hold.
//
// Under Node the GPU comes from the `webgpu` npm package (./node_gpu.js), or pass one: loadModel(base, { gpu }).
// Call model.destroy() and node_gpu.js's releaseGpu() when done, so the process can exit.

import { fetchJson } from "./io.js";
import { getGpu } from "./node_gpu.js";
import { Program, requestAdapter, withErrors } from "./plan.js";
import { choosePrecision, planFiles } from "./precision.js";
import { ModelSource } from "./storage.js";

const FORMAT = "batchgpu-chat/1";

/** Load the exported model at ``base`` (the folder's URL): plan, shaders, weights (``onProgress({phase, done,
 * total, network, storage})`` as the GGUF file arrives, written ``slabBytes`` at a time), and its tokenizer
 * unless ``tokenizer`` is false.
 *
 * ``cache``: where the GGUF file is kept between loads: "none" (fetched every time), "opfs" (the origin private
 * file system, else the Cache API) or "cache" (the Cache API); ``retries``: how often a download cut off resumes
 * (HTTP Range) before the load fails; ``verify``: hash a stored copy again (its SHA-256 is checked when it is
 * downloaded). ``f16``: "auto" (the f16 kernels where the adapter offers shader-f16 and their self-test passes),
 * true (insist), false (f32). ``model.loading`` and ``model.precision`` then say what happened. */
export async function loadModel(
  base = new URL(".", import.meta.url),
  { onProgress = null, gpu = null, tokenizer = true, slabBytes = 1 << 22, cache = "none", retries = 4, verify = false, f16 = "auto" } = {},
) {
  const at = (name) => new URL(name, base);
  const manifest = await fetchJson(at("model.json"));
  if (manifest.format !== FORMAT) throw new Error(`batchgpu: ${at("model.json")} is not a chat export (format ${manifest.format})`);
  const { adapter, description } = await requestAdapter(gpu ?? (await getGpu()));
  const choice = await choosePrecision(adapter, manifest, at, { f16 });
  const { plan, device } = choice;
  const program = await Program.create(device, plan, await planFiles(plan, at));
  const started = performance.now();
  const { file, bytes, sha256 = null } = manifest.weights;
  const source = new ModelSource(at(file), { bytes, sha256, cache, retries, verify, onProgress });
  const loading = await withErrors(device, "writing the weights", () => loadWeights(program, source, slabBytes));
  loading.seconds = (performance.now() - started) / 1000;
  let codec = null;
  if (tokenizer) {
    const { loadCodec } = await import("./tokenizer.js");
    codec = await loadCodec(base);
  }
  const model = new ChatModel(plan, program, codec, description);
  model.loading = loading;
  model.precision = { shader_f16: choice.shader_f16, self_test: choice.self_test, cases: choice.cases };
  return model;
}

// weights --------------------------------------------------------------------------------------------------

/** The file's bytes from ``start`` on, as they arrive, with the chunks no pending buffer needs let go. */
class ByteWindow {
  constructor() {
    this.chunks = [];
    this.start = 0; // file offset of chunks[0]
    this.end = 0;
  }

  push(chunk) {
    this.chunks.push(chunk);
    this.end += chunk.byteLength;
    this.peak = Math.max(this.peak ?? 0, this.end - this.start);
  }

  /** Bytes [from, to) of the file (a view when one chunk holds them, else a copy). */
  slice(from, to) {
    let offset = this.start;
    let k = 0;
    while (offset + this.chunks[k].byteLength <= from) offset += this.chunks[k++].byteLength;
    if (to <= offset + this.chunks[k].byteLength) return this.chunks[k].subarray(from - offset, to - offset);
    const out = new Uint8Array(to - from);
    let at = 0;
    for (let position = from; position < to; k++) {
      const chunk = this.chunks[k];
      const piece = chunk.subarray(position - offset, Math.min(chunk.byteLength, to - offset));
      out.set(piece, at);
      at += piece.byteLength;
      position += piece.byteLength;
      offset += chunk.byteLength;
    }
    return out;
  }

  dropBefore(offset) {
    while (this.chunks.length && this.start + this.chunks[0].byteLength <= offset) this.start += this.chunks.shift().byteLength;
  }
}

/** File offset and size of row ``row`` of a weight's joined matrix (batchgpu/export/weight_sources.py). */
function sourceRow(parts, interleave, row) {
  let part;
  let index = row;
  if (interleave) {
    part = parts[row % parts.length];
    index = Math.floor(row / parts.length);
  } else {
    for (part of parts) {
      if (index < part.rows) break;
      index -= part.rows;
    }
  }
  if (part.heads) { // llama.cpp's q/k permutation: file row h*n + 2b + a holds the model's row h*n + a*n/2 + b
    const perHead = part.rows / part.heads;
    const head = Math.floor(index / perHead);
    const within = index - head * perHead;
    const a = Math.floor(within / (perHead / 2));
    const b = within - a * (perHead / 2);
    index = head * perHead + 2 * b + a;
  }
  return [part.offset + index * part.row_bytes, part.row_bytes];
}

/** Repack GGUF blocks (``format``: block_bytes -> device_bytes, segments) into the device's layout. */
function repack(bytes, format) {
  if (!format) return bytes;
  const blocks = bytes.byteLength / format.block_bytes;
  const out = new Uint8Array(blocks * format.device_bytes);
  for (let b = 0; b < blocks; b++) {
    const from = b * format.block_bytes;
    const to = b * format.device_bytes;
    for (const [start, length, target] of format.segments) out.set(bytes.subarray(from + start, from + start + length), to + target);
  }
  return out;
}

/** A joined weight's bytes (rows of several tensors, or permuted rows) from the file bytes of its span. */
function assemble(source, span) {
  const { parts, interleave, first_row: first, rows, format } = source;
  const size = parts[0].row_bytes;
  const joined = new Uint8Array(rows * size);
  for (let r = 0; r < rows; r++) {
    const [offset] = sourceRow(parts, interleave, first + r);
    const from = offset - source.span[0];
    joined.set(span.subarray(from, from + size), r * size);
  }
  return repack(joined, format);
}

/** A weight buffer being written as the file arrives: one range of the file (a tensor, or consecutive rows of
 * one) goes in slabs of whole blocks as soon as each slab's bytes are in, so the page never holds the whole
 * tensor; any other weight (joined or permuted rows) is built once its whole span is in. */
class PendingWeight {
  constructor(index, source, slabBytes) {
    this.index = index;
    this.source = source;
    this.next = source.span[0]; // the first file byte not written yet
    this.inOneRange = source.parts.length === 1 && !source.parts[0].heads;
    const unit = source.format ? source.format.block_bytes : 4;
    this.slab = this.inOneRange ? Math.max(unit, Math.floor(slabBytes / unit) * unit) : source.span[1] - source.span[0];
  }

  /** Write what ``window`` now holds; true when the whole buffer is written. */
  advance(program, window) {
    const [start, end] = this.source.span;
    if (!this.inOneRange) {
      if (window.end < end) return false;
      program.write(this.index, assemble(this.source, window.slice(start, end)));
      this.next = end;
      return true;
    }
    const format = this.source.format;
    while (this.next < end && Math.min(this.next + this.slab, end) <= window.end) {
      const stop = Math.min(this.next + this.slab, end);
      const done = this.next - start;
      const at = format ? (done / format.block_bytes) * format.device_bytes : done;
      program.write(this.index, repack(window.slice(this.next, stop), format), at);
      this.next = stop;
    }
    return this.next >= end;
  }
}

/** Stream the GGUF file once (``source``: a ModelSource); each weight buffer is written as its bytes arrive
 * (``slabBytes`` at a time where it is one range of the file), and the bytes no pending buffer needs are let go. */
async function loadWeights(program, source, slabBytes) {
  let pending = program.manifest.buffers
    .map((entry, index) => (entry.source ? new PendingWeight(index, entry.source, slabBytes) : null))
    .filter(Boolean);
  const window = new ByteWindow();
  for await (const chunk of source.chunks()) {
    window.push(chunk);
    pending = pending.filter((weight) => weight.source.span[0] >= window.end || !weight.advance(program, window));
    window.dropBefore(pending.reduce((needed, weight) => Math.min(needed, weight.next), window.end));
  }
  if (window.end !== source.bytes) throw source.sizeError(window.end);
  return { file_bytes: window.end, window_peak_bytes: window.peak ?? 0, ...source.report };
}

// generating -----------------------------------------------------------------------------------------------

/** The prefill steps of a prompt of ``length`` tokens: ``chunk``-token steps, then the powers of two of the rest. */
export function promptChunks(length, chunk) {
  const sizes = new Array(Math.floor(length / chunk)).fill(chunk);
  const rest = length % chunk;
  for (let size = chunk >> 1; size >= 1; size >>= 1) if (rest & size) sizes.push(size);
  return sizes;
}

/** The length of the longest common prefix of the id arrays ``a`` and ``b``. */
export function commonPrefix(a, b) {
  const most = Math.min(a.length, b.length);
  let length = 0;
  while (length < most && a[length] === b[length]) length++;
  return length;
}

function checkOption(name, value, ok) {
  if (!ok) throw new Error(`batchgpu: ${name} out of range, got ${value}`);
}

// speculative decoding (prompt lookup): batchgpu/models/speculative.py's rules ------------------------------

/** Up to ``limit`` ids that followed the latest earlier occurrence of the last n ids of ``tokens`` (n from
 * ``maxNgram`` down to ``minNgram``; the first n that matches anywhere); none without a match. */
export function promptLookup(tokens, limit, minNgram, maxNgram) {
  const length = tokens.length;
  for (let n = Math.min(maxNgram, length - 1); n >= minNgram; n--) {
    const tail = length - n;
    for (let start = length - 1 - n; start >= 0; start--) { // every n-gram but the tail, the latest first
      let k = 0;
      while (k < n && tokens[start + k] === tokens[tail + k]) k++;
      if (k === n) return tokens.slice(start + n, start + n + Math.max(limit, 0));
    }
  }
  return [];
}

/** The ids a verify step gives: ``sampled[i]`` is what row ``i`` (the latest id, then each drafted one) chose;
 * drafted ids count while they equal what the row before chose, then one more id. */
export function accepted(draft, sampled) {
  let count = 0;
  while (count < draft.length && draft[count] === sampled[count]) count++;
  return Array.from(sampled.slice(0, count + 1), Number);
}

const NGRAM = { minNgram: 2, maxNgram: 4 }; // Speculative's min_ngram and max_ngram

/** ``generate``'s ``speculative`` option as {tokens, minNgram, maxNgram}, or null (off): true takes the export's
 * most (``most``: model.json's speculative_tokens) and n-grams of 4 down to 2 ids; throws naming what is wrong. */
export function speculativeSettings(option, most, temperature) {
  if (option === undefined || option === null || option === false) return null;
  const fail = (why) => {
    throw new Error(`batchgpu: speculative ${why}`);
  };
  if (!most) fail("decoding needs verify steps, and this export has none (it was exported with --speculative-tokens 0)");
  const given = option === true ? {} : option;
  if (typeof given !== "object" || Array.isArray(given)) fail(`must be true or {tokens, minNgram, maxNgram}, got ${JSON.stringify(option)}`);
  const unknown = Object.keys(given).filter((key) => !["tokens", "minNgram", "maxNgram"].includes(key));
  if (unknown.length) fail(`has no field ${unknown.join(", ")} (its fields: tokens, minNgram, maxNgram)`);
  const { tokens = most, minNgram = NGRAM.minNgram, maxNgram = NGRAM.maxNgram } = given;
  if (!(Number.isInteger(tokens) && tokens >= 1 && tokens <= most)) fail(`tokens must be an integer in [1, ${most}] (the export's verify steps), got ${JSON.stringify(tokens)}`);
  if (!(Number.isInteger(minNgram) && minNgram >= 1)) fail(`minNgram must be an integer >= 1, got ${JSON.stringify(minNgram)}`);
  if (!(Number.isInteger(maxNgram) && maxNgram >= minNgram)) fail(`maxNgram must be an integer >= minNgram (${minNgram}), got ${JSON.stringify(maxNgram)}`);
  if (temperature > 0) fail(`decoding is greedy only: it needs temperature 0, got temperature ${temperature}`);
  return { tokens, minNgram, maxNgram };
}

/** The bytes of the program's GPU buffers: weights, the KV cache, and the rest (the steps' own buffers). */
function bufferBytes(manifest) {
  const memory = { weights: 0, kv_cache: 0, other: 0 };
  for (const b of manifest.buffers) {
    const resident = b.kind === "resident" && b.name !== "token";
    const kind = !resident ? "other" : /^[kv]\d+$/.test(b.name) ? "kv_cache" : "weights";
    memory[kind] += b.size;
  }
  return memory;
}

export class ChatModel {
  #cachedIds = [];

  constructor(manifest, program, codec, adapter) {
    this.manifest = manifest;
    this.program = program;
    this.codec = codec;
    this.adapter = adapter;
    this.maxContext = manifest.model.max_context;
    this.stats = null;
    this.loading = null; // {file_bytes, window_peak_bytes (the most file bytes held at once), seconds, and
    // storage.js's report: loaded_from, network_bytes, storage_bytes, storage, stored, storage_message, ...}
    this.precision = null; // {shader_f16, self_test, cases}: which kernels run (precision.js)
    this.busy = false;
    this.memory = bufferBytes(manifest);
  }

  /** The ids whose keys and values the KV cache holds at positions 0, 1, ... (a copy). */
  get cachedIds() {
    return this.#cachedIds.slice();
  }

  /** The ids generated for ``prompt`` (token ids), one at a time: greedy at temperature 0, else drawn (top_k,
   * top_p, min_p) by a hash of (seed, the token's index), as batchgpu's ChatSteps.generate draws them. Ends
   * after ``maxTokens``, a stop id (default: the tokenizer's), at the model's context, or when ``signal``
   * aborts. Decode steps are submitted up to ``ahead`` steps before their token is read (each reads its input
   * token on the device), so the GPU does not wait for the page between steps. ``this.stats`` then holds the
   * timings and the prompt's ``cached_tokens`` and ``prefill_tokens``.
   *
   * With ``reuse`` (the default) the KV cache's rows for the longest common prefix of ``prompt`` with
   * ``this.cachedIds`` (the ids the cache holds: the last prompt and the tokens fed back after it) are kept and
   * only the rest of the prompt is prefilled, from its position on (at least its last token, whose logits give
   * the first id), as llama.cpp's server reuses a slot's cached prompt: a conversation's next turn computes only
   * its new tokens. A row's keys and values depend only on the ids up to it and its position, so the ids are
   * those of a run from position 0. ``reuse: false`` prefills the whole prompt.
   *
   * ``speculative`` (greedy only; true, or {tokens, minNgram, maxNgram}): speculative decoding by prompt lookup,
   * as batchgpu's Llama.generate(..., speculative=Speculative("ngram", K)) runs it: each step after the prompt
   * runs the latest id and up to ``tokens`` ids (default and most: the export's speculative_tokens) that followed
   * the latest earlier occurrence of the last ``maxNgram`` (4) down to ``minNgram`` (2) ids of the prompt and reply
   * (a verify step: every row's greedy id), and keeps the drafted ids those confirm, and one more; the KV cache's
   * rows after them are written again by the next step (and never kept for the next prompt). The ids are those
   * of a run without it, in fewer steps where drafts are accepted; ``stats.verify_steps`` counts the steps after
   * the prompt, ``stats.drafted`` and ``stats.accepted`` the drafted ids and those kept. With temperature > 0 it
   * is refused (the verify steps take greedy ids). */
  async *generate(prompt, { maxTokens = 128, temperature = 0, topK = 0, topP = 1, minP = 0, seed = 0, stop = null, signal = null, ahead = 1, reuse = true, speculative = null } = {}) {
    const { vocab } = this.manifest.model;
    const ids = Array.from(prompt, Number);
    if (ids.length < 1 || ids.length >= this.maxContext) throw new Error(`batchgpu: the prompt needs 1 to ${this.maxContext - 1} tokens, got ${ids.length}`);
    const bad = ids.find((id) => !Number.isInteger(id) || id < 0 || id >= vocab);
    if (bad !== undefined) throw new Error(`batchgpu: token id ${bad} is not in [0, ${vocab})`);
    checkOption("maxTokens", maxTokens, Number.isInteger(maxTokens) && maxTokens >= 1);
    checkOption("temperature", temperature, temperature >= 0);
    checkOption("topK", topK, Number.isInteger(topK) && topK >= 0);
    checkOption("topP", topP, topP > 0 && topP <= 1);
    checkOption("minP", minP, minP >= 0 && minP <= 1);
    checkOption("seed", seed, Number.isInteger(seed) && seed >= 0 && seed < 2 ** 32);
    checkOption("ahead", ahead, Number.isInteger(ahead) && ahead >= 0);
    checkOption("reuse", reuse, typeof reuse === "boolean");
    const lookup = speculativeSettings(speculative, this.manifest.model.speculative_tokens ?? 0, temperature);
    if (this.busy) throw new Error("batchgpu: the model is generating already (one sequence at a time: its KV cache is one); finish or stop that first");
    this.busy = true;
    try {
      yield* this.steps(ids, { maxTokens, temperature, topK, topP, minP, seed, stop, signal, ahead, reuse, lookup });
    } finally {
      this.busy = false;
    }
  }

  async *steps(ids, { maxTokens, temperature, topK, topP, minP, seed, stop, signal, ahead, reuse, lookup }) {
    const { chunk } = this.manifest.model;
    const stopIds = stop ?? this.codec?.stopIds ?? new Set();
    const sampling = Float32Array.of(temperature, topP, minP, 0);
    const top_k = Int32Array.of(topK);
    const keys = (index) => Uint32Array.of(seed, index);

    const started = performance.now();
    const cached = reuse ? Math.min(commonPrefix(ids, this.#cachedIds), ids.length - 1) : 0;
    this.#cachedIds = ids.slice(0, cached); // the rows from ``cached`` on are written again from here
    const known = ids.slice(); // the ids of positions 0, 1, ...: the prompt, then each token read
    let kept = cached; // the positions written by the steps whose outputs were read
    let failed = false;
    let pos = cached;
    const inFlight = []; // each submitted step's outputs (a promise) and the positions written once it is done
    const stats = { prompt_tokens: ids.length, cached_tokens: cached, prefill_tokens: ids.length - cached, generated: 0, prefill_ms: 0, decode_ms: 0, tokens_per_s: 0, verify_steps: 0, drafted: 0, accepted: 0 };
    this.stats = stats;
    let first = null;
    const tick = (generated) => { // the figures once ``generated`` tokens are read
      const now = performance.now();
      first ??= now;
      Object.assign(stats, { generated, prefill_ms: first - started, decode_ms: now - first });
      stats.tokens_per_s = generated > 1 && stats.decode_ms > 0 ? (1000 * (generated - 1)) / stats.decode_ms : 0;
    };
    try {
      const prefill = [];
      for (const size of promptChunks(ids.length - cached, chunk)) {
        const inputs = { ids: Int32Array.from(ids.slice(pos, pos + size)), sampling, top_k, keys: keys(0) };
        prefill.push(this.program.run(`prefill_${size}`, inputs, { pos }));
        pos += size;
      }
      inFlight.push({ outputs: Promise.all(prefill).then((outputs) => outputs.at(-1)), end: pos }); // the last chunk's token
      if (lookup) {
        // Speculative: each step is drafted from the ids read before it, so none runs ahead. A step writes the rows
        // of the latest id and the drafted ones from ``pos``; those of the ids it keeps count, the rest are written
        // again by the next step.
        let out = [(await inFlight.shift().outputs).next_id[0]];
        for (let generated = 0; ;) {
          known.push(...out);
          kept = pos; // the last id read has no row yet
          for (const token of out) {
            tick(++generated);
            yield token;
            if (stopIds.has(token) || signal?.aborted || generated === maxTokens) return;
          }
          if (pos >= this.maxContext) return; // the context is full
          const limit = Math.min(lookup.tokens, maxTokens - generated - 1, this.maxContext - pos - 1);
          const draft = limit > 0 ? promptLookup(known, limit, lookup.minNgram, lookup.maxNgram) : [];
          const rows = Int32Array.from([known.at(-1), ...draft]);
          const sampled = draft.length
            ? (await this.program.run(`verify_${rows.length}`, { ids: rows }, { pos })).next_ids
            : (await this.program.run("prefill_1", { ids: rows, sampling, top_k, keys: keys(generated) }, { pos })).next_id;
          out = accepted(draft, sampled);
          pos += out.length; // the latest id's row and the accepted drafted ids'
          stats.verify_steps += 1;
          stats.drafted += draft.length;
          stats.accepted += out.length - 1;
        }
      }
      let submitted = 1; // tokens whose step is submitted
      for (let index = 0; index < maxTokens; index++) {
        while (inFlight.length <= ahead && submitted < maxTokens && pos < this.maxContext) {
          inFlight.push({ outputs: this.program.run("decode", { sampling, top_k, keys: keys(submitted) }, { pos }), end: pos + 1 });
          submitted += 1;
          pos += 1;
        }
        if (!inFlight.length) return; // the context is full
        const step = inFlight.shift();
        const token = (await step.outputs).next_id[0];
        known.push(token);
        kept = step.end;
        tick(index + 1);
        yield token;
        if (stopIds.has(token) || signal?.aborted) return;
      }
    } catch (error) {
      failed = true;
      throw error;
    } finally {
      // Steps still in flight write rows past ``kept`` (a later prompt writes them again before any step reads
      // them); their tokens are dropped. After an error the cache's contents are not known: forget them.
      this.#cachedIds = failed ? [] : known.slice(0, kept);
      for (const pending of inFlight) pending.outputs.catch(() => {});
    }
  }

  /** Free the model's GPU buffers and its device. */
  destroy() {
    this.program.destroy();
    this.program.device.destroy();
  }
}

// The model file kept in the browser's storage, so that a page downloads it once: the origin private file system
// (OPFS, navigator.storage.getDirectory()), or the Cache API where OPFS is missing. The first load streams
// model.gguf into storage as the weights are built from it, checking its size and SHA-256 against model.json's;
// later loads read it from storage and fetch no byte of it. A download cut off resumes where it stopped with an
// HTTP Range request, in the same load (a few retries) or in the next one (from the bytes kept). Storage that
// is full (QuotaExceededError) or unavailable leaves the load streaming from the network, saying why.
//
//   const source = new ModelSource(url, { bytes, sha256, cache: "opfs", onProgress });
//   for await (const chunk of source.chunks()) ...      // the file's bytes from offset 0, in order
//   source.report   // { loaded_from: "network" | "cache" | "file", network_bytes, storage_bytes, storage, stored,
//                   //   storage_message, sha256_checked }
//   await forgetModel(url, { sha256, bytes })            // remove the stored copy (both stores)

import { sha256 as sha256Hasher } from "./vendor/noble-hashes/sha2.js";
import { fetchChunks } from "./io.js";

const FOLDER = "batchgpu-models"; // the OPFS folder, and the Cache API cache, holding models
export const PIECE_BYTES = 1 << 23; // the Cache API keeps a file as entries of this many bytes
const IN_NODE = typeof process !== "undefined" && process.versions?.node !== undefined;

/** A model file's key in storage: its SHA-256 (a new export of another file gets another key). */
function storeKey(url, { sha256, bytes }) {
  if (sha256) return sha256;
  let hash = 0;
  for (const c of String(url)) hash = (hash * 31 + c.codePointAt(0)) >>> 0;
  return `${bytes}-${hash.toString(16)}`;
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function isQuotaError(error) {
  return error?.name === "QuotaExceededError";
}

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

// stores ------------------------------------------------------------------------------------------------

/** The file in the origin private file system: ``<key>.gguf`` (its bytes, possibly a prefix of them) and
 * ``<key>.json`` (written once the whole file is in and its SHA-256 checked). Written through a sync access
 * handle in workers (each write lands in the file at once), else a writable stream closed at each pause. */
class OpfsStore {
  static async open(key) {
    const root = await navigator.storage.getDirectory();
    const folder = await root.getDirectoryHandle(FOLDER, { create: true });
    return new OpfsStore(folder, key);
  }

  constructor(folder, key) {
    this.kind = "opfs";
    this.folder = folder;
    this.key = key;
    this.writer = null;
    this.position = 0;
  }

  async handle(name, create = false) {
    try {
      return await this.folder.getFileHandle(name, { create });
    } catch (error) {
      if (error?.name === "NotFoundError") return null;
      throw error;
    }
  }

  /** ``{bytes, complete}``: the bytes kept from offset 0, and whether they are the whole checked file. */
  async stored() {
    const data = await this.handle(`${this.key}.gguf`);
    if (!data) return { bytes: 0, complete: false };
    const bytes = (await data.getFile()).size;
    const marker = await this.handle(`${this.key}.json`);
    const complete = marker ? JSON.parse(await (await marker.getFile()).text()).bytes === bytes : false;
    return { bytes, complete };
  }

  /** The kept bytes [from, to) as chunks. */
  async *read(from, to) {
    const file = await (await this.handle(`${this.key}.gguf`)).getFile();
    const reader = file.slice(from, to).stream().getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      yield value;
    }
  }

  /** Start writing at ``at`` (the bytes kept: what follows is dropped). */
  async open(at) {
    const data = await this.handle(`${this.key}.gguf`, true);
    if (typeof data.createSyncAccessHandle === "function" && typeof window === "undefined") {
      const access = await data.createSyncAccessHandle();
      access.truncate(at);
      this.writer = { sync: access };
    } else {
      const writable = await data.createWritable({ keepExistingData: true });
      await writable.truncate(at);
      await writable.seek(at);
      this.writer = { stream: writable };
    }
    this.position = at;
  }

  async write(chunk) {
    if (!this.writer) await this.open(this.position);
    if (this.writer.sync) {
      const written = this.writer.sync.write(chunk, { at: this.position });
      if (written !== chunk.byteLength) throw new DOMException(`wrote ${written} of ${chunk.byteLength} bytes`, "QuotaExceededError");
    } else {
      await this.writer.stream.write(chunk);
    }
    this.position += chunk.byteLength;
  }

  /** Keep what was written (a download interrupted: the next load resumes from here); a later write goes on
   * at the same position. */
  async pause() {
    const writer = this.writer;
    this.writer = null;
    if (writer?.sync) {
      writer.sync.flush();
      writer.sync.close();
    } else if (writer?.stream) {
      await writer.stream.close();
    }
  }

  /** The bytes a later load finds kept, were this one to stop now. */
  keptBytes() {
    return this.position;
  }

  async commit(sha256) {
    await this.pause();
    const marker = await this.handle(`${this.key}.json`, true);
    const writable = await marker.createWritable();
    await writable.write(JSON.stringify({ bytes: this.position, sha256 }));
    await writable.close();
  }

  async remove() {
    try {
      await this.pause();
    } catch {
      // a writer that cannot be closed: removing the entries below still frees them
    }
    for (const name of [`${this.key}.json`, `${this.key}.gguf`]) {
      try {
        await this.folder.removeEntry(name);
      } catch (error) {
        if (error?.name !== "NotFoundError") throw error;
      }
    }
  }
}

/** The file as Cache API entries of PIECE_BYTES each (keys under the model's URL), with a ``meta`` entry: the
 * whole pieces kept, and whether the file is complete and checked. A resumed download restarts at the first
 * piece not kept. */
class CacheStore {
  static async open(key, url) {
    return new CacheStore(await caches.open(FOLDER), key, url);
  }

  constructor(cache, key, url) {
    this.kind = "cache";
    this.cache = cache;
    this.prefix = new URL(`${FOLDER}/${key}/`, url);
    this.pieces = 0;
    this.pending = [];
    this.pendingBytes = 0;
    this.position = 0;
  }

  entry(name) {
    return new URL(String(name), this.prefix).href;
  }

  async meta() {
    const response = await this.cache.match(this.entry("meta"));
    return response ? response.json() : { pieces: 0, bytes: 0, complete: false };
  }

  async stored() {
    const meta = await this.meta();
    for (let i = 0; i < meta.pieces; i++) {
      if (!(await this.cache.match(this.entry(i), { ignoreVary: true }))) return { bytes: 0, complete: false }; // evicted
    }
    return { bytes: meta.bytes, complete: meta.complete };
  }

  async *read(from, to) {
    for (let i = Math.floor(from / PIECE_BYTES); i * PIECE_BYTES < to; i++) {
      const response = await this.cache.match(this.entry(i));
      if (!response) throw new Error(`batchgpu: the stored model lost its piece ${i} (the browser evicted it)`);
      const piece = new Uint8Array(await response.arrayBuffer());
      const start = Math.max(from - i * PIECE_BYTES, 0);
      yield piece.subarray(start, Math.min(piece.byteLength, to - i * PIECE_BYTES));
    }
  }

  async open(at) {
    if (at % PIECE_BYTES) throw new Error(`batchgpu: the Cache API store resumes at whole pieces, not at ${at}`);
    this.pieces = at / PIECE_BYTES;
    this.position = at;
    this.pending = [];
    this.pendingBytes = 0;
  }

  async write(chunk) {
    this.pending.push(chunk.slice());
    this.pendingBytes += chunk.byteLength;
    this.position += chunk.byteLength;
    while (this.pendingBytes >= PIECE_BYTES) await this.flushPiece(PIECE_BYTES);
  }

  async flushPiece(size) {
    const piece = new Uint8Array(size);
    let at = 0;
    while (at < size) {
      const head = this.pending[0];
      const take = Math.min(head.byteLength, size - at);
      piece.set(head.subarray(0, take), at);
      at += take;
      if (take === head.byteLength) this.pending.shift();
      else this.pending[0] = head.subarray(take);
    }
    this.pendingBytes -= size;
    await this.cache.put(this.entry(this.pieces), new Response(piece));
    this.pieces += 1;
    await this.putMeta(false);
  }

  async putMeta(complete) {
    const meta = { pieces: this.pieces, bytes: complete ? this.position : this.pieces * PIECE_BYTES, complete };
    await this.cache.put(this.entry("meta"), new Response(JSON.stringify(meta), { headers: { "content-type": "application/json" } }));
  }

  async pause() {
    // the whole pieces are kept already; the partial one stays in memory for this load's next write (the next
    // load resumes at the first piece not kept)
  }

  keptBytes() {
    return this.pieces * PIECE_BYTES;
  }

  async commit() {
    if (this.pendingBytes) await this.flushPiece(this.pendingBytes);
    await this.putMeta(true);
  }

  async remove() {
    for (const request of await this.cache.keys()) {
      if (request.url.startsWith(this.prefix.href)) await this.cache.delete(request);
    }
  }
}

function hasOpfs() {
  return typeof navigator !== "undefined" && typeof navigator.storage?.getDirectory === "function";
}

function hasCacheApi() {
  return typeof caches !== "undefined" && typeof caches.open === "function";
}

/** The store ``cache`` asks for ("opfs": OPFS, else the Cache API; "cache": the Cache API; "none"), or
 * ``{store: null, reason}``. */
export async function openStore(cache, url, key) {
  if (cache === "none" || cache === false || cache === null) return { store: null, reason: null };
  if (!["opfs", "cache"].includes(cache)) throw new Error(`batchgpu: cache must be "opfs", "cache" or "none", got ${cache}`);
  if (!/^https?:$/.test(new URL(url).protocol)) return { store: null, reason: `${new URL(url).protocol} URLs are read as they are, not stored` };
  const reasons = [];
  if (cache === "opfs") {
    if (hasOpfs()) {
      try {
        return { store: await OpfsStore.open(key), reason: null };
      } catch (error) {
        reasons.push(`the origin private file system failed: ${error.message}`);
      }
    } else {
      reasons.push("this browser has no origin private file system");
    }
  }
  if (hasCacheApi()) {
    try {
      return { store: await CacheStore.open(key, url), reason: null };
    } catch (error) {
      reasons.push(`the Cache API failed: ${error.message}`);
    }
  } else {
    reasons.push("this browser has no Cache API here");
  }
  return { store: null, reason: reasons.join("; ") };
}

/** Remove the stored copy of the model file at ``url`` (``{sha256, bytes}`` as model.json's ``weights``) from
 * both stores; resolves to the stores it was removed from. */
export async function forgetModel(url, weights) {
  const key = storeKey(url, weights);
  const removed = [];
  for (const cache of ["opfs", "cache"]) {
    if ((cache === "opfs" && !hasOpfs()) || (cache === "cache" && !hasCacheApi())) continue;
    const store = cache === "opfs" ? await OpfsStore.open(key) : await CacheStore.open(key, url);
    if ((await store.stored()).bytes) removed.push(cache);
    await store.remove();
  }
  return removed;
}

/** The bytes the origin may still store, or Infinity where the browser does not say. */
async function freeBytes() {
  try {
    const { quota, usage } = await navigator.storage.estimate();
    return quota === undefined ? Infinity : quota - (usage ?? 0);
  } catch {
    return Infinity;
  }
}

// the download -----------------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

/** Whether a download that failed with ``error`` may resume: network errors (fetch's TypeError, a body cut
 * off) and HTTP 5xx, 408 and 429; not a missing file or one of another size. */
function retryable(error) {
  if (error instanceof HttpError) return error.status >= 500 || error.status === 408 || error.status === 429;
  return error?.name === "TypeError" || error?.name === "NetworkError";
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** One load of the model file at ``url``: ``bytes`` long with SHA-256 ``sha256`` (hex; model.json's
 * ``weights``). ``cache``: where to keep it ("opfs", "cache", "none"); ``retries``: attempts to resume a
 * download cut off, each with a Range request from the bytes in (after 0.2 s, 0.4 s, ...); ``verify``: hash a
 * stored copy again on load (else its size and the mark written once it was checked are trusted);
 * ``onProgress({phase, done, total, network, storage})``. */
export class ModelSource {
  constructor(url, { bytes, sha256 = null, cache = "none", retries = 4, verify = false, onProgress = null }) {
    this.url = new URL(url);
    this.bytes = bytes;
    this.sha256 = sha256;
    this.cache = cache;
    this.retries = retries;
    this.verify = verify;
    this.onProgress = onProgress;
    this.report = {
      loaded_from: null, // "network" (some bytes over the network), "cache" (all from storage) or "file" (Node, disk)
      network_bytes: 0,
      storage_bytes: 0,
      storage: null, // "opfs" | "cache" | null: where the file is kept
      stored: false, // whether the whole checked file is in storage after this load
      storage_message: null, // why it is not stored, where it is not
      sha256_checked: false,
      resumed_at: [], // the offsets downloads resumed from
    };
  }

  progress() {
    const { network_bytes: network, storage_bytes: storage } = this.report;
    this.onProgress?.({ phase: "weights", done: network + storage, total: this.bytes, network, storage });
  }

  sizeError(actual) {
    return new Error(`batchgpu: ${this.url} is ${actual} bytes; the export was made from a file of ${this.bytes} bytes (export again)`);
  }

  /** The file's bytes from offset 0, in order, as they come from storage and then the network. */
  async *chunks() {
    if (IN_NODE && this.url.protocol === "file:") {
      yield* this.fromDisk();
      return;
    }
    const key = storeKey(this.url, this);
    let { store, reason } = await openStore(this.cache, this.url, key);
    this.report.storage_message = reason;
    let kept = store ? await store.stored().catch(() => ({ bytes: 0, complete: false })) : { bytes: 0, complete: false };
    if (kept.bytes > this.bytes || (kept.complete && kept.bytes !== this.bytes)) {
      await store.remove();
      kept = { bytes: 0, complete: false };
    }
    if (store && kept.complete) {
      this.report.loaded_from = "cache";
      this.report.storage = store.kind;
      this.report.stored = true;
      const hasher = this.verify && this.sha256 ? sha256Hasher.create() : null;
      yield* this.counted(store.read(0, this.bytes), "storage_bytes", hasher);
      if (this.report.storage_bytes !== this.bytes) throw this.sizeError(this.report.storage_bytes);
      if (hasher) await this.check(hasher, store);
      return;
    }
    this.report.loaded_from = "network";
    const hasher = this.sha256 ? sha256Hasher.create() : null;
    let offset = 0;
    if (store && kept.bytes) { // a download cut off in an earlier load: its bytes, then the rest
      try {
        yield* this.counted(store.read(0, kept.bytes), "storage_bytes", hasher);
      } catch (error) {
        throw await this.dropped(store, `reading the stored part failed (${error.message}); it was removed, reload to download the model again`);
      }
      offset = kept.bytes;
    }
    if (store) store = await this.startWriting(store, offset);
    this.report.storage = store?.kind ?? null;
    let failures = 0;
    while (offset < this.bytes) {
      try {
        const { response, skip } = await this.request(offset);
        const reader = response.body.getReader();
        let drop = skip; // a server that ignores Range sends the bytes we have again
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          let chunk = value;
          if (drop) {
            const cut = Math.min(drop, chunk.byteLength);
            drop -= cut;
            chunk = chunk.subarray(cut);
            if (!chunk.byteLength) continue;
          }
          if (offset + chunk.byteLength > this.bytes) throw this.sizeError(`more than ${this.bytes}`);
          hasher?.update(chunk);
          if (store) store = await this.store(store, chunk);
          offset += chunk.byteLength;
          this.report.network_bytes += chunk.byteLength;
          this.progress();
          yield chunk;
        }
        if (offset < this.bytes) throw new TypeError(`the download ended at byte ${offset} of ${this.bytes}`);
      } catch (error) {
        if (!retryable(error) || failures >= this.retries) {
          await store?.pause().catch(() => {}); // the bytes in stay for the next load to resume from
          if (error.status === 416) throw this.sizeError(`fewer than ${offset + 1}`);
          if (!retryable(error)) throw error;
          const kept = store?.keptBytes() ? `; the ${store.keptBytes()} bytes in are kept, so the next load resumes from there` : "";
          throw new Error(`batchgpu: downloading ${this.url} stopped at byte ${offset} of ${this.bytes} after ${failures + 1} attempt(s): ${error.message}${kept}`);
        }
        failures += 1;
        await store?.pause().catch(() => {});
        await sleep(200 * 2 ** (failures - 1));
      }
    }
    if (hasher) await this.check(hasher, store);
    if (store) {
      try {
        await store.commit(this.sha256);
        this.report.stored = true;
      } catch (error) {
        await this.dropStore(store, isQuotaError(error) ? `QuotaExceededError (the browser's storage for this site is full): ${error.message}` : `keeping it failed: ${error.message}`);
      }
    }
  }

  /** Chunks of ``source`` counted as ``field`` bytes (and hashed). */
  async *counted(source, field, hasher) {
    for await (const chunk of source) {
      hasher?.update(chunk);
      this.report[field] += chunk.byteLength;
      this.progress();
      yield chunk;
    }
  }

  async *fromDisk() {
    this.report.loaded_from = "file";
    const hasher = this.sha256 ? sha256Hasher.create() : null;
    let done = 0;
    for await (const chunk of fetchChunks(this.url)) {
      hasher?.update(chunk);
      done += chunk.byteLength;
      this.report.storage_bytes = done;
      this.progress();
      yield chunk;
    }
    if (done !== this.bytes) throw this.sizeError(done);
    if (hasher) await this.check(hasher, null);
  }

  /** The response for the bytes from ``offset`` on, and how many bytes before them it holds. */
  async request(offset) {
    const init = offset ? { headers: { Range: `bytes=${offset}-` } } : {};
    const response = await fetch(this.url, { ...init, cache: "no-store" });
    if (response.status === 416) throw new HttpError(`batchgpu: ${this.url} has no byte ${offset}`, 416);
    if (!response.ok) throw new HttpError(`batchgpu: fetching ${this.url} failed: HTTP ${response.status}`, response.status);
    let skip = 0;
    let size = null;
    if (response.status === 206) {
      const range = /bytes (\d+)-\d+\/(\d+|\*)/.exec(response.headers.get("content-range") ?? "");
      if (!range || Number(range[1]) !== offset) throw new HttpError(`batchgpu: ${this.url} answered another range (${response.headers.get("content-range")})`, 502);
      if (range[2] !== "*") size = Number(range[2]);
    } else {
      skip = offset;
      const length = response.headers.get("content-length");
      if (length !== null && !response.headers.get("content-encoding")) size = Number(length);
    }
    if (size !== null && size !== this.bytes) throw this.sizeError(size);
    if (offset) this.report.resumed_at.push(offset);
    return { response, skip };
  }

  /** ``store`` ready to write at ``at``, or null where it cannot be (said in the report). */
  async startWriting(store, at) {
    const free = await freeBytes();
    if (free < this.bytes - at) {
      return this.dropStore(store, `QuotaExceededError: the browser lets this site store ${mib(Math.max(free, 0))} more, the model needs ${mib(this.bytes - at)}`);
    }
    try {
      await store.open(at);
      return store;
    } catch (error) {
      return this.dropStore(store, isQuotaError(error) ? `QuotaExceededError: ${error.message}` : `opening it for writing failed: ${error.message}`);
    }
  }

  /** Write ``chunk``; on a full storage (QuotaExceededError) or any write error, drop the store and go on. */
  async store(store, chunk) {
    try {
      await store.write(chunk);
      return store;
    } catch (error) {
      const why = isQuotaError(error) ? `QuotaExceededError (the browser's storage for this site is full): ${error.message}` : `writing it failed: ${error.message}`;
      return this.dropStore(store, why);
    }
  }

  /** Stop storing: remove what was kept, note why. The load goes on from the network. */
  async dropStore(store, why) {
    try {
      await store.remove();
    } catch {
      // nothing more to do: the message says the model is not kept
    }
    this.report.storage = null;
    this.report.storage_message = `the model is not kept in browser storage (${why}); it is streamed from the network, and the next load downloads it again`;
    return null;
  }

  async dropped(store, why) {
    await store.remove().catch(() => {});
    return new Error(`batchgpu: the stored copy of ${this.url}: ${why}`);
  }

  async check(hasher, store) {
    const digest = hex(hasher.digest());
    if (digest !== this.sha256) {
      const kept = store ? "; the stored copy was removed, so the next load downloads it again" : "";
      await store?.remove().catch(() => {});
      throw new Error(`batchgpu: ${this.url} does not have the export's SHA-256 (expected ${this.sha256}, got ${digest})${kept}`);
    }
    this.report.sha256_checked = true;
  }
}

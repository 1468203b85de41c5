// Reading the app's files: fetch() for http(s) URLs (browsers, and Node for served folders); the file system
// for file: URLs under Node, where fetch() cannot read them.
//
//   import { fetchBytes, fetchJson, fetchText } from "./io.js";
//   const weights = await fetchBytes(new URL("model.gguf", base), (done, total) => bar(done / total));

const IN_NODE = typeof process !== "undefined" && process.versions?.node !== undefined;

function underNodeFromDisk(url) {
  return IN_NODE && new URL(url).protocol === "file:";
}

async function fromDisk(url) {
  const { readFile } = await import("node:fs/promises");
  const data = await readFile(new URL(url));
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

async function fetched(url, init) {
  const response = await fetch(url, init);
  if (!response.ok) throw new Error(`batchgpu: fetching ${url} failed: HTTP ${response.status}`);
  return response;
}

/** The bytes at ``url`` as a Uint8Array; ``onProgress(doneBytes, totalBytes)`` as they arrive (total 0 when
 * the server does not say). */
export async function fetchBytes(url, onProgress = null) {
  if (underNodeFromDisk(url)) {
    const data = await fromDisk(url);
    onProgress?.(data.byteLength, data.byteLength);
    return data;
  }
  const response = await fetched(url);
  const total = Number(response.headers.get("content-length") ?? 0);
  if (!onProgress || !response.body) return new Uint8Array(await response.arrayBuffer());
  const reader = response.body.getReader();
  const parts = [];
  let done = 0;
  for (;;) {
    const { value, done: finished } = await reader.read();
    if (finished) break;
    parts.push(value);
    done += value.byteLength;
    onProgress(done, total);
  }
  const out = new Uint8Array(done);
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.byteLength;
  }
  return out;
}

/** The text at ``url`` (UTF-8). */
export async function fetchText(url) {
  if (underNodeFromDisk(url)) return new TextDecoder().decode(await fromDisk(url));
  return (await fetched(url)).text();
}

/** The JSON value at ``url``. */
export async function fetchJson(url) {
  return JSON.parse(await fetchText(url));
}

/** The bytes at ``url`` as they arrive: an async iterator of Uint8Array chunks, ``onProgress(doneBytes,
 * totalBytes)`` after each. */
export async function* fetchChunks(url, onProgress = null) {
  let done = 0;
  if (underNodeFromDisk(url)) {
    const { createReadStream, statSync } = await import("node:fs");
    const total = statSync(new URL(url)).size;
    for await (const chunk of createReadStream(new URL(url), { highWaterMark: 1 << 22 })) {
      done += chunk.byteLength;
      onProgress?.(done, total);
      yield new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength);
    }
    return;
  }
  const response = await fetched(url);
  const total = Number(response.headers.get("content-length") ?? 0);
  const reader = response.body.getReader();
  for (;;) {
    const { value, done: finished } = await reader.read();
    if (finished) return;
    done += value.byteLength;
    onProgress?.(done, total);
    yield value;
  }
}

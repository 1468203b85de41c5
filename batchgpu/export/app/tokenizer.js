// The model's text codec in JavaScript: the same token ids and text as Python's batchgpu TextCodec
// (batchgpu/models/codec.py), from the two files batchgpu/export/text_assets.py writes:
//   tokenizer.json  the tokenizer as Hugging Face's JSON, run by the vendored @huggingface/tokenizers;
//   chat.json       chat template (rendered by the vendored @huggingface/jinja), BOS/EOS, stop ids.
// Where those packages differ from Python's tokenizers and jinja2, this module and chat_template.js do as
// Python does (see the comments at each workaround).
//
//   const codec = await loadCodec(base);            // base: URL of the folder (http(s):, or file: under Node)
//   codec.encode(text, { special: true })            // ids (special: with the BOS a SentencePiece model adds)
//   codec.encodeChat(messages, { trusted: false })   // ids of the chat prompt, the assistant's turn opened
//   codec.renderChat(messages)                       // the prompt text
//   codec.decode(ids)                                // text, control tokens left out
//   const stream = codec.stream();                   // stream.push(id) -> new text ("" while a character is
//                                                    // unfinished), stream.finish() -> the rest
//   codec.stopIds (a Set), codec.bosId, codec.eosId (number or null), codec.hasChatTemplate, codec.addsBos
// Bad input throws (TypeError or Error), with the message Python's codec gives where it can; the codec still
// works afterwards.

import { fetchJson } from "./io.js";
import { Template } from "./chat_template.js";
import { ByteFallbackDecoder, Tokenizer } from "./vendor/tokenizers.js";

const CHAT_FORMAT = 1; // chat.json's layout (text_assets.CHAT_FORMAT)
const REPLACEMENT = "\ufffd"; // what decoding makes of an incomplete UTF-8 sequence
// Unicode noncharacters around markers and placeholders, as batchgpu/models/control.py
const MARKER_START = "\ufdd0", MARKER_END = "\ufdd1", PLACEHOLDER_START = "\ufdd2", PLACEHOLDER_END = "\ufdd3";
// Python's tokenizers decodes without transformers' clean-up of spaces before punctuation
const OPTIONS = { clean_up_tokenization_spaces: false };

/** The codec of the app at ``base`` (a URL of the folder holding tokenizer.json and chat.json). */
export async function loadCodec(base) {
  const [json, chat] = await Promise.all([
    fetchJson(new URL("tokenizer.json", base)),
    fetchJson(new URL("chat.json", base)),
  ]);
  return new TextCodec(json, chat);
}

export class TextCodec {
  /** ``json``: tokenizer.json's object; ``chat``: chat.json's. */
  constructor(json, chat) {
    if (chat.format !== CHAT_FORMAT) {
      throw new Error(`batchgpu: chat.json has format ${chat.format}, this tokenizer.js reads ${CHAT_FORMAT}`);
    }
    this.json = json;
    this.tokenizer = pythonTokenizer(json);
    this.specialIds = new Set(json.added_tokens.filter((t) => t.special).map((t) => t.id));
    this.hasChatTemplate = Boolean(chat.chat_template);
    this.template = null; // the compiled template, or the error compiling it gave (raised by renderChat)
    try {
      this.template = this.hasChatTemplate ? new Template(chat.chat_template) : null;
    } catch (error) {
      this.template = new Error(`chat: the model's chat template does not compile: ${error.message}`);
    }
    this.bosToken = chat.bos_token;
    this.eosToken = chat.eos_token;
    this.bosId = chat.bos_id;
    this.eosId = chat.eos_id;
    this.addsBos = chat.add_bos;
    this.stopIds = new Set(chat.stop_ids);
    this.control = null; // ControlTokens, made at the first encodeChat
  }

  /** Token ids of ``text``, a control token wherever its text appears; ``special``: with the tokens the
   * tokenizer adds around a text (a SentencePiece model's BOS), as Python ``TextCodec.encode``. */
  encode(text, { special = true } = {}) {
    checkText(text, "prompt");
    return this.tokenizer.encode(text, { add_special_tokens: special }).ids;
  }

  /** Text of ``ids``, control tokens (and ids outside the vocabulary) left out, as Python ``decode``. */
  decode(ids) {
    const vocab = this.tokenizer.model.vocab;
    const kept = Array.from(ids, Number).filter((id) => !this.specialIds.has(id) && vocab[id] !== undefined);
    return kept.length ? this.tokenizer.decode(kept, { skip_special_tokens: false }) : "";
  }

  /** The prompt for ``messages`` through the model's chat template, the assistant's turn opened (Python
   * ``render_chat``; ``tools``: the template's ``tools`` variable). */
  renderChat(messages, { tools = null } = {}) {
    if (!this.template) throw new Error("chat: this model's files have no chat template; send a prompt instead");
    if (this.template instanceof Error) throw this.template;
    checkMessages(messages);
    try {
      return this.template.render({
        messages,
        tools,
        add_generation_prompt: true,
        bos_token: this.bosToken,
        eos_token: this.eosToken,
      });
    } catch (error) {
      throw new Error(`chat: the chat template refused the messages: ${error.message}`);
    }
  }

  /** Token ids of ``renderChat``'s prompt, control tokens only where the template wrote them (special-token
   * text inside a message is plain text), as Python ``encode_chat``; ``trusted``: the rendered prompt
   * encoded as one string (special-token text in messages is control too). */
  encodeChat(messages, { trusted = false, tools = null } = {}) {
    if (trusted) return this.encode(this.renderChat(messages, { tools }), { special: false });
    checkMessages(messages);
    this.control ??= new ControlTokens(this.json);
    return this.control.encode(messages, tools, (escaped, escapedTools) =>
      this.renderChat(escaped, { tools: escapedTools }),
    );
  }

  /** A TextStream of this codec. */
  stream() {
    return new TextStream(this);
  }
}

/** Incremental text of one generation, as Python batchgpu/llm/text.py's TextStream without stop strings:
 * ``push(id)`` returns the text that is now final (maybe ""), ``finish()`` the rest. Each token is decoded
 * with the ones since the last point where the text was whole; text is held back while it ends in an
 * unfinished UTF-8 character. The pieces together are ``decode`` of all the ids. */
export class TextStream {
  constructor(codec) {
    this.codec = codec;
    this.ids = [];
    this.prefix = 0; // the decoding window starts here ...
    this.read = 0; // ... and its text up to here was already returned
  }

  push(id) {
    this.ids.push(id);
    return this.advance(false);
  }

  finish() {
    return this.advance(true);
  }

  advance(final) {
    const known = this.codec.decode(this.ids.slice(this.prefix, this.read));
    const window = this.codec.decode(this.ids.slice(this.prefix));
    if (!final && (window.endsWith(REPLACEMENT) || window.length <= known.length)) return "";
    this.prefix = this.read;
    this.read = this.ids.length;
    return window.slice(known.length);
  }
}

/** Python's ByteFallback decoder (tokenizers' byte_fallback.rs): a run of byte tokens (``<0xE6>``) that is
 * not valid UTF-8 as a whole becomes one U+FFFD per byte, and a BOM is kept. The vendored one decodes the
 * run leniently instead (``<0xC3><0xA9><0xE6>``: "é�" where Python gives three U+FFFD, as a
 * generation cut inside a character shows) and drops a leading BOM. */
class PythonByteFallback extends ByteFallbackDecoder {
  decode_chain(tokens) {
    const strict = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });
    const out = [];
    let run = [];
    const flush = () => {
      if (!run.length) return;
      try {
        out.push(strict.decode(Uint8Array.from(run)));
      } catch {
        out.push(REPLACEMENT.repeat(run.length));
      }
      run = [];
    };
    for (const token of tokens) {
      if (/^<0x[0-9A-Fa-f]{2}>$/.test(token)) run.push(parseInt(token.slice(3, 5), 16));
      else {
        flush();
        out.push(token);
      }
    }
    flush();
    return out;
  }
}

/** A vendored Tokenizer of ``json`` with the two steps that differ from Python's ``tokenizers`` redone. */
function pythonTokenizer(json) {
  const tokenizer = new Tokenizer(json, OPTIONS);
  tokenizer.decoder = withPythonByteFallback(tokenizer.decoder);
  dropUnknownCharactersFirst(tokenizer.model);
  return tokenizer;
}

/** A BPE model with neither an unknown token nor byte fallback: Python's drops the characters its
 * vocabulary lacks (SmolLM2's has no token for 21 of the 256 bytes, 0x1D among them) before merging, so
 * the pieces around one merge (";\x1d\\" -> ";\\"); the vendored one merges first, then drops them
 * (";", "\\"). Here each pre-token loses those characters before the model sees it. */
function dropUnknownCharactersFirst(model) {
  const { unk_token: unknown, byte_fallback: fallback } = model.config;
  if (model.config.type !== "BPE" || unknown != null || fallback || model.config.continuing_subword_prefix) return;
  const encode = model.encode.bind(model);
  const known = (piece) => Array.from(piece).filter((c) => model.tokens_to_ids.has(c)).join("");
  model.encode = (pieces) => encode(pieces.map(known));
}

/** ``decoder`` with each ByteFallback step in it (alone or in a Sequence) the Python-faithful one. */
function withPythonByteFallback(decoder) {
  if (decoder instanceof ByteFallbackDecoder) return new PythonByteFallback(decoder.config);
  if (Array.isArray(decoder?.decoders)) decoder.decoders = decoder.decoders.map(withPythonByteFallback);
  return decoder;
}

/** The tokenizer's special added tokens and a copy of it that keeps them apart from message text, as
 * batchgpu/models/control.py: messages get each special token's text swapped for a placeholder before
 * rendering; in the rendered prompt each special text left (the template's) becomes a marker that the copy
 * knows as a non-special added token (with the special token's matching rules), the placeholders get their
 * text back, and the copy, which has no special tokens, encodes the string once; markers map back to the
 * special ids. */
class ControlTokens {
  constructor(json) {
    this.nonce = randomNonce();
    const special = json.added_tokens.filter((t) => t.special);
    this.texts = special.map((t) => t.content).sort((a, b) => b.length - a.length); // longest first
    this.pattern = this.texts.length ? new RegExp(this.texts.map(escapeRegExp).join("|"), "gu") : null;
    const byText = new Map(special.map((t) => [t.content, t]));
    let next = largestId(json) + 1;
    const markerTokens = [];
    this.markers = new Map();
    this.placeholders = new Map();
    this.ids = new Map(); // a marker's id in ``guarded`` -> the special token's id
    this.texts.forEach((text, k) => {
      const marker = `${MARKER_START}${this.nonce}:${k}${MARKER_END}`;
      markerTokens.push({ ...byText.get(text), id: next, content: marker, special: false });
      this.markers.set(text, marker);
      this.placeholders.set(text, `${PLACEHOLDER_START}${this.nonce}:${k}${PLACEHOLDER_END}`);
      this.ids.set(next++, byText.get(text).id);
    });
    const plain = json.added_tokens.filter((t) => !t.special);
    this.guarded = pythonTokenizer({ ...json, added_tokens: [...plain, ...markerTokens] });
  }

  /** Ids of ``render(escapedMessages, escapedTools)``'s prompt, control tokens from the template alone. */
  encode(messages, tools, render) {
    let rendered = render(this.escaped(messages), tools === null ? null : this.escaped(tools));
    if (this.pattern) rendered = rendered.replace(this.pattern, (text) => this.markers.get(text));
    for (const [text, placeholder] of this.placeholders) rendered = rendered.replaceAll(placeholder, text);
    if (rendered.includes(PLACEHOLDER_START + this.nonce)) {
      throw new Error("chat: the chat template cut a message's control-token text apart");
    }
    const ids = this.guarded.encode(rendered, { add_special_tokens: false }).ids;
    return ids.map((id) => this.ids.get(id) ?? id);
  }

  /** ``value`` with each special token's text in its strings swapped for a placeholder. */
  escaped(value) {
    if (typeof value === "string") {
      if (value.includes(this.nonce)) throw new Error("chat: a message holds a reserved sequence");
      return this.pattern ? value.replace(this.pattern, (text) => this.placeholders.get(text)) : value;
    }
    if (Array.isArray(value)) return value.map((item) => this.escaped(item));
    if (value !== null && typeof value === "object") {
      return Object.fromEntries(Object.entries(value).map(([key, item]) => [key, this.escaped(item)]));
    }
    return value;
  }
}

/** A random number as text (Web Crypto where there is one: Node 18 has it only under a flag). */
function randomNonce() {
  const random = new Uint32Array(3);
  if (globalThis.crypto?.getRandomValues) globalThis.crypto.getRandomValues(random);
  else random.forEach((_, i) => (random[i] = Math.floor(Math.random() * 2 ** 32)));
  return random.join("");
}

/** The largest token id of tokenizer.json (its model's vocabulary and its added tokens). */
function largestId(json) {
  const vocab = json.model.vocab ?? {};
  let largest = Array.isArray(vocab) ? vocab.length - 1 : -1; // a Unigram vocabulary: [piece, score] rows
  if (!Array.isArray(vocab)) for (const id of Object.values(vocab)) largest = Math.max(largest, id);
  for (const token of json.added_tokens) largest = Math.max(largest, token.id);
  return largest;
}

function escapeRegExp(text) {
  return text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
}

/** Text the tokenizer takes: a string of Unicode scalar values (no lone surrogate); the messages of
 * Python's checks (batchgpu/models/codec.py). */
function checkText(text, what) {
  if (typeof text !== "string") throw new TypeError(`${what} must be a str, got ${typeof text}`);
  const at = text.search(/\p{Surrogate}/u);
  if (at >= 0) {
    const unit = `'\\u${text.charCodeAt(at).toString(16)}'`;
    const character = Array.from(text.slice(0, at)).length;
    throw new TypeError(`${what} is not valid Unicode: a lone surrogate ${unit} at character ${character}`);
  }
}

function checkMessages(messages) {
  if (!Array.isArray(messages)) throw new TypeError("chat: messages must be an array");
  messages.forEach((message, i) => {
    if (message === null || typeof message !== "object" || typeof message.role !== "string") {
      throw new TypeError(`chat: messages[${i}] must be a mapping with a str 'role'`);
    }
    if (typeof message.content !== "string") throw new TypeError(`chat: messages[${i}]['content'] must be a str`);
    for (const [key, value] of Object.entries(message)) checkTexts(value, `messages[${i}].${key}`);
  });
}

function checkTexts(value, what) {
  if (typeof value === "string") checkText(value, what);
  else if (Array.isArray(value)) value.forEach((item, i) => checkTexts(item, `${what}[${i}]`));
  else if (value !== null && typeof value === "object") {
    for (const [key, item] of Object.entries(value)) checkTexts(item, `${what}.${key}`);
  }
}

// The model's text codec in JavaScript: the same token ids and text as Python's batchgpu TextCodec
// (batchgpu/models/codec.py), from the two files batchgpu/export/text_assets.py writes:
//   tokenizer.json  the tokenizer as Hugging Face's JSON, run by the vendored @huggingface/tokenizers;
//   chat.json       chat template (rendered by the vendored @huggingface/jinja), BOS/EOS, stop ids.
// Where those packages differ from Python's tokenizers and jinja2, this module does as Python does (see the
// comments at each workaround below).
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
import { Environment, Interpreter, Template } from "./vendor/jinja.js";
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

// @huggingface/jinja 0.5.11 drops what a loop iteration wrote before its {% break %} or {% continue %}
// ("{% for x in [1, 2] %}[{{ x }}]{% break %}{% endfor %}" renders "" where Python's jinja2 renders "[1]"):
// the control exception unwinds the blocks holding that text. Its Interpreter's two methods are wrapped
// here (once, for every Template): a block stopped by break or continue hands its text on with the
// exception, up to the loop body, which returns it as the iteration's output; after a break the loop's
// other iterations run no statements; and the loop's {% else %} runs where no iteration got to the end of
// the body (jinja2's rule, which the package kept by letting the exception reach the loop).
const LOOP_CONTROL = new Set(["BreakControl", "ContinueControl"]);
const runningLoops = new Map(); // a for loop's body -> a stack of its running loops' {completed, broken}

if (!Interpreter.prototype.batchgpuLoopText) {
  const { evaluateBlock, evaluateFor } = Interpreter.prototype;
  Interpreter.prototype.batchgpuLoopText = true;

  Interpreter.prototype.evaluateFor = function (node, environment) {
    const loop = { ran: false, completed: false, broken: false };
    if (!runningLoops.has(node.body)) runningLoops.set(node.body, []);
    const stack = runningLoops.get(node.body);
    stack.push(loop);
    try {
      const output = evaluateFor.call(this, node, environment);
      if (!loop.ran || loop.completed || !node.defaultBlock?.length) return output;
      const otherwise = evaluateBlock.call(this, node.defaultBlock, new Environment(environment));
      return new output.constructor(output.value + otherwise.value);
    } finally {
      stack.pop();
      if (!stack.length) runningLoops.delete(node.body);
    }
  };

  Interpreter.prototype.evaluateBlock = function (statements, environment) {
    const loop = runningLoops.get(statements)?.at(-1); // this block is a running loop's body
    const empty = evaluateBlock.call(this, [], environment); // a StringValue (a class the package keeps)
    if (loop?.broken) return empty;
    if (loop) loop.ran = true;
    let text = "";
    for (const statement of statements) {
      let value;
      try {
        value = this.evaluate(statement, environment);
      } catch (error) {
        if (!LOOP_CONTROL.has(error?.constructor?.name)) throw error;
        error.batchgpuText = text + (error.batchgpuText ?? "");
        if (!loop) throw error; // a block inside the loop's body ({% if %}): on to the body
        loop.broken = error.constructor.name === "BreakControl";
        return new empty.constructor(error.batchgpuText);
      }
      if (value.type !== "NullValue" && value.type !== "UndefinedValue") text += value.toString();
    }
    if (loop) loop.completed = true;
    return new empty.constructor(text);
  };
}

// @huggingface/jinja 0.5.11 runs str methods on message text with JavaScript's rules where Python's differ:
// strip, lstrip and rstrip ignore their argument (Qwen's ``content.lstrip('\n')`` strips spaces too) and,
// like ``| trim`` and ``split()``, take JavaScript's whitespace (U+FEFF is one, U+001C..U+001F and U+0085 are
// not; Python's str.isspace says the opposite), and ``| length`` counts UTF-16 code units (Python counts
// characters). Those builtins of its StringValue, and the trim filter, are Python's here (once, for every
// Template).
const PYTHON_SPACE = "\\t\\n\\v\\f\\r\\x1c-\\x20\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
const PYTHON_WORD = new RegExp(`[^${PYTHON_SPACE}]+`, "gu"); // a run of non-space (Python's split())

/** Python's ``text.strip(chars)`` (``start``, ``end``: which sides; ``chars`` null: whitespace). */
function pythonStrip(text, chars, start = true, end = true) {
  const space = new RegExp(`^[${PYTHON_SPACE}]$`, "u");
  const strips = chars == null ? (c) => space.test(c) : (c) => chars.includes(c);
  const characters = Array.from(text);
  let from = 0, to = characters.length;
  while (start && from < to && strips(characters[from])) from++;
  while (end && to > from && strips(characters[to - 1])) to--;
  return characters.slice(from, to).join("");
}

/** Python's ``text.split(None, maxsplit)``: runs of non-space, the last one the rest after ``maxsplit``. */
function pythonSplit(text, maxsplit) {
  const rest = pythonStrip(text, null, true, false);
  const parts = [];
  for (const { 0: word, index } of rest.matchAll(PYTHON_WORD)) {
    if (maxsplit >= 0 && parts.length >= maxsplit) return [...parts, rest.slice(index)];
    parts.push(word);
  }
  return parts;
}

if (!Interpreter.prototype.batchgpuPythonStrings) {
  Interpreter.prototype.batchgpuPythonStrings = true;
  const StringValue = Interpreter.prototype.evaluateBlock.call(null, [], null).constructor;
  const builtins = Object.getOwnPropertyDescriptor(StringValue.prototype, "builtins").get;
  const sample = builtins.call(new StringValue("a"));
  const [FunctionValue, IntegerValue] = [sample.get("strip").constructor, sample.get("length").constructor];
  const ArrayValue = sample.get("split").value([], null).constructor;
  const argument = (value) => (value === undefined || value.type === "NullValue" ? null : value.value);

  Object.defineProperty(StringValue.prototype, "builtins", {
    configurable: true,
    get() {
      const map = builtins.call(this);
      if (map.batchgpuPython) return map;
      map.batchgpuPython = true;
      const text = this.value;
      const strip = (start, end) =>
        new FunctionValue((args) => new StringValue(pythonStrip(text, argument(args[0]), start, end)));
      map.set("strip", strip(true, true)).set("lstrip", strip(true, false)).set("rstrip", strip(false, true));
      map.set("length", new IntegerValue(Array.from(text).length));
      const split = map.get("split");
      map.set(
        "split",
        new FunctionValue((args, environment) => {
          if (argument(args[0]) !== null) return split.value(args, environment);
          const parts = pythonSplit(text, argument(args[1]) ?? -1);
          return new ArrayValue(parts.map((part) => new StringValue(part)));
        }),
      );
      return map;
    },
  });

  const { applyFilter } = Interpreter.prototype;
  Interpreter.prototype.applyFilter = function (operand, filter, environment) {
    if (filter.type === "Identifier" && filter.value === "trim" && operand instanceof StringValue) {
      return new StringValue(pythonStrip(operand.value, null));
    }
    return applyFilter.call(this, operand, filter, environment);
  };
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

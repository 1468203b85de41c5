// Chat templates rendered as batchgpu's Python renders them (jinja2 as transformers sets it up:
// batchgpu/models/codec.py's _chat_environment), by the vendored @huggingface/jinja. That package already
// has what Python adds (raise_exception, strftime_now, tojson without HTML escapes, trim_blocks and
// lstrip_blocks, loop controls); where it renders differently from jinja2, its Interpreter is wrapped here,
// once, for every Template this module exports.
//
//   import { Template } from "./chat_template.js";
//   new Template(source).render({ messages, add_generation_prompt: true, bos_token, eos_token });

import { Environment, Interpreter, Template } from "./vendor/jinja.js";

export { Template };

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

// Runs an exported chat model under Node for tests/test_export_chat.py (batchgpu.export.node.run_node).
export async function generate(base, { prompts, tokenizer = false, slabBytes = undefined, ...options }) {
  const { loadModel } = await import(new URL("batchgpu.js", base));
  const { releaseGpu } = await import(new URL("node_gpu.js", base));
  const model = await loadModel(base, { tokenizer, slabBytes });
  const runs = [];
  try {
    for (const prompt of prompts) {
      const ids = typeof prompt === "string" ? model.codec.encodeChat([{ role: "user", content: prompt }]) : prompt;
      const token_ids = [];
      for await (const id of model.generate(ids, options)) token_ids.push(id);
      runs.push({ prompt_ids: Array.from(ids), token_ids, ...model.stats });
    }
  } finally {
    model.destroy();
    releaseGpu();
  }
  return { runs, adapter: model.adapter, loading: model.loading, memory: model.memory };
}

/** One conversation on one model, for the KV cache's reuse across turns: each turn runs ``ids`` with
 * ``options``; ``abortAfter``: its AbortController aborts after that many tokens; ``failAfter``: reading its
 * signal throws after that many tokens (an error inside the generation). Returns each turn's ids, stats, error
 * and the model's cachedIds after it. */
export async function converse(base, { turns }) {
  const { loadModel } = await import(new URL("batchgpu.js", base));
  const { releaseGpu } = await import(new URL("node_gpu.js", base));
  const model = await loadModel(base, { tokenizer: false });
  const runs = [];
  try {
    for (const { ids, options = {}, abortAfter = null, failAfter = null } of turns) {
      const token_ids = [];
      const controller = new AbortController();
      const failing = { get aborted() { if (token_ids.length >= failAfter) throw new Error("signal failed"); return false; } };
      const signal = failAfter !== null ? failing : controller.signal;
      let error = null;
      const started = performance.now();
      try {
        for await (const id of model.generate(ids, { ...options, signal })) {
          token_ids.push(id);
          if (token_ids.length === abortAfter) controller.abort();
        }
      } catch (caught) {
        error = String(caught.message);
      }
      const ms = performance.now() - started;
      runs.push({ token_ids, stats: { ...model.stats }, error, cached_ids: Array.from(model.cachedIds), ms });
    }
  } finally {
    model.destroy();
    releaseGpu();
  }
  return { runs };
}

/** The f16 self-test (precision.js) of the export at ``base`` with its ``steps`` only (Dawn here offers no
 * shader-f16: "f32" checks the f32 kernels against the export's values), once per file of expected values in
 * ``expected`` (null: the export's own). Returns selfTest's {passed, reason, cases} for each. */
export async function selfTest(base, { steps = ["f32"], expected = [null] }) {
  const { selfTest: run } = await import(new URL("precision.js", base));
  const { openDevice, requestAdapter } = await import(new URL("plan.js", base));
  const { fetchJson } = await import(new URL("io.js", base));
  const { getGpu, releaseGpu } = await import(new URL("node_gpu.js", base));
  const manifest = await fetchJson(new URL("model.json", base));
  const { adapter } = await requestAdapter(await getGpu());
  const test = manifest.self_test;
  const device = await openDevice(adapter, [{ ...test, features: steps.includes("f16") ? test.features : [] }]);
  try {
    const results = [];
    for (const file of expected) {
      const checked = file ? { ...test, expected: { ...test.expected, file } } : test;
      results.push(await run(device, checked, (name) => new URL(name, base), { steps }));
    }
    return results;
  } finally {
    device.destroy();
    releaseGpu();
  }
}

/** batchgpu.js's prompt lookup and acceptance rule on ``lookups`` ([ids, limit, minNgram, maxNgram]) and
 * ``verdicts`` ([draft, sampled]), for comparison with batchgpu/models/speculative.py; no GPU. */
export async function speculation(base, { lookups, verdicts }) {
  const { promptLookup, accepted } = await import(new URL("batchgpu.js", base));
  return { drafts: lookups.map((args) => promptLookup(...args)), kept: verdicts.map(([draft, sampled]) => accepted(draft, sampled)) };
}

/** An engine (engine.js's createEngine, on Node's thread: no Worker here) answering ``requests`` in turn: each
 * {body} through completions.create, or {ids, options} through engine.generate. Returns each one's {text} or
 * {token_ids}, with engine.stats and its error ([param, message], or null), and engine.info. */
export async function engineRequests(base, { requests }) {
  const { createEngine } = await import(new URL("engine.js", base));
  const { releaseGpu } = await import(new URL("node_gpu.js", base));
  const engine = await createEngine(base, { worker: false, cache: "none" });
  const results = [];
  try {
    for (const { body = null, ids = null, options = {} } of requests) {
      try {
        if (body) {
          const reply = await engine.completions.create(body);
          results.push({ text: reply.choices[0].text, stats: engine.stats, error: null });
        } else {
          const token_ids = [];
          for await (const id of engine.generate(ids, options)) token_ids.push(id);
          results.push({ token_ids, stats: engine.stats, error: null });
        }
      } catch (error) {
        results.push({ error: [error.param ?? null, String(error.message)] });
      }
    }
  } finally {
    await engine.unload();
    releaseGpu();
  }
  return { results, info: engine.info };
}

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

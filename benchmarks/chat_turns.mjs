// A chat conversation on an exported model under Node, for benchmarks/chat_turns.py: each turn's prompt is the
// whole conversation rendered by the chat template, run per mode ({reuse, speculative}) with the KV cache's reuse
// on or off and speculative decoding (up to ``speculative`` drafted ids a step) or not.
export async function converse(base, { messages, maxTokens, modes }) {
  const { loadModel } = await import(new URL("batchgpu.js", base));
  const { releaseGpu } = await import(new URL("node_gpu.js", base));
  const model = await loadModel(base);
  const conversations = [];
  try {
    for (const { reuse, speculative = null } of modes) {
      const history = [];
      const turns = [];
      for (const content of messages) {
        history.push({ role: "user", content });
        const ids = model.codec.encodeChat(history);
        const stream = model.codec.stream();
        const started = performance.now();
        const token_ids = [];
        let text = "";
        // each conversation starts from an empty cache, as on a page just loaded
        const options = { maxTokens, reuse: reuse && turns.length > 0, ...(speculative ? { speculative: { tokens: speculative } } : {}) };
        for await (const id of model.generate(ids, options)) {
          token_ids.push(id);
          text += stream.push(id);
        }
        text += stream.finish();
        const wall_ms = performance.now() - started;
        history.push({ role: "assistant", content: text });
        turns.push({ prompt_ids: Array.from(ids), token_ids, text, wall_ms, ...model.stats });
      }
      conversations.push({ reuse, speculative, turns });
    }
  } finally {
    model.destroy();
    releaseGpu();
  }
  return { conversations, adapter: model.adapter };
}

// Runs one function of an ES module under Node for batchgpu.export.node.run_node:
//
//   node node_main.mjs MODULE_URL FUNCTION BASE_URL ARGS_JSON
//
// imports MODULE_URL, awaits module[FUNCTION](BASE_URL, ARGS) and prints its result as one JSON line, the last
// of stdout, after anything the module printed; errors go to stderr with exit status 1. Exits as soon as the
// result is out: Dawn's GPU object keeps Node running otherwise.

// navigator.gpu, as browsers have it, is the GPU node_gpu.js gives (the npm package webgpu, as
// $BATCHGPU_WEBGPU names it), so code written for browsers runs as it is, and the export's own copy of
// node_gpu.js finds it there rather than creating a second one.

import { getGpu } from "./app/node_gpu.js";

const [moduleUrl, name, baseUrl, argsJson] = process.argv.slice(2);

async function provideNavigatorGpu() {
  const gpu = await getGpu();
  if (globalThis.navigator) Object.defineProperty(globalThis.navigator, "gpu", { value: gpu, configurable: true });
  else globalThis.navigator = { gpu };
}

function finish(code, line = null) {
  if (line === null) process.exit(code);
  process.stdout.write(`\n${line}\n`, () => process.exit(code)); // on a line of its own after the module's output
}

try {
  await provideNavigatorGpu();
  const module = await import(moduleUrl);
  if (typeof module[name] !== "function") {
    const functions = Object.keys(module).filter((key) => typeof module[key] === "function");
    throw new Error(`${moduleUrl} exports no function ${name} (its functions: ${functions.join(", ") || "none"})`);
  }
  const result = await module[name](baseUrl, JSON.parse(argsJson));
  finish(0, JSON.stringify(result ?? null));
} catch (error) {
  process.stderr.write(`${error?.stack ?? error}\n`, () => finish(1));
}

// Runs one function of an ES module under Node for batchgpu.export.node.run_node:
//
//   node node_main.mjs MODULE_URL FUNCTION BASE_URL ARGS_JSON
//
// imports MODULE_URL, awaits module[FUNCTION](BASE_URL, ARGS) and prints its result as one JSON line, the last
// of stdout, after anything the module printed; errors go to stderr with exit status 1. Exits as soon as the
// result is out: Dawn's GPU object keeps Node running otherwise.

const [moduleUrl, name, baseUrl, argsJson] = process.argv.slice(2);

function finish(code, line = null) {
  if (line === null) process.exit(code);
  process.stdout.write(`\n${line}\n`, () => process.exit(code)); // on a line of its own after the module's output
}

try {
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

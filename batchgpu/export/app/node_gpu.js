// The WebGPU entry point (a GPU object, what navigator.gpu is): navigator.gpu in browsers; under Node, the GPU
// of the npm package `webgpu` (Dawn's Node bindings), created once, with its GPUBufferUsage, GPUMapMode, ...
// put on globalThis as browsers have them.
//
//   import { getGpu, releaseGpu } from "./node_gpu.js";
//   const adapter = await (await getGpu()).requestAdapter();
//   ...
//   releaseGpu();   // under Node: lets the process exit (Dawn keeps it alive while its GPU object lives)
//
// Under Node the package is imported as $BATCHGPU_WEBGPU (a file: URL of its index.js, as Python's
// batchgpu.export.node sets it) or, without it, as "webgpu" from the node_modules folders above this file.
// Dawn's options (e.g. "backend=vulkan", "adapter=NAME", "enable-dawn-features=...") come from
// getGpu({ flags }) or $BATCHGPU_WEBGPU_FLAGS (a JSON array of strings).

const IN_NODE = typeof process !== "undefined" && process.versions?.node !== undefined;

let nodeGpu = null; // Promise of Dawn's GPU object, while held

/** navigator.gpu, or under Node the `webgpu` package's GPU object; throws saying why there is none. */
export async function getGpu({ flags = null } = {}) {
  if (globalThis.navigator?.gpu) return globalThis.navigator.gpu;
  if (!IN_NODE) throw new Error("batchgpu: WebGPU is not available (navigator.gpu is missing)");
  if (!nodeGpu) {
    nodeGpu = createNodeGpu(flags ?? envFlags());
    nodeGpu.catch(() => (nodeGpu = null));
  }
  return nodeGpu;
}

/** Drop the Node GPU object getGpu() created (a no-op in browsers), so the process can exit. */
export function releaseGpu() {
  nodeGpu = null;
}

function envFlags() {
  const text = process.env.BATCHGPU_WEBGPU_FLAGS;
  const flags = text ? JSON.parse(text) : [];
  if (!Array.isArray(flags) || flags.some((f) => typeof f !== "string")) {
    throw new Error(`batchgpu: $BATCHGPU_WEBGPU_FLAGS must be a JSON array of strings, got ${text}`);
  }
  return flags;
}

async function createNodeGpu(flags) {
  const specifier = process.env.BATCHGPU_WEBGPU || "webgpu";
  let webgpu;
  try {
    webgpu = await import(specifier);
  } catch (error) {
    throw new Error(
      `batchgpu: under Node, WebGPU comes from the npm package "webgpu" (npm install webgpu), which could not ` +
        `be imported as ${specifier}: ${error.message}`,
    );
  }
  for (const [name, value] of Object.entries(webgpu.globals)) {
    if (!(name in globalThis)) globalThis[name] = value;
  }
  return webgpu.create(flags);
}

/** The adapter requestAdapter() gives, described: { vendor, architecture, device, description,
 * isFallbackAdapter, features: [...], limits: {...} }, or null where there is none. Releases the GPU. */
export async function describeAdapter() {
  try {
    const adapter = await (await getGpu()).requestAdapter();
    if (!adapter) return null;
    const info = adapter.info ?? {};
    const limits = {};
    for (const name in adapter.limits) limits[name] = adapter.limits[name];
    return {
      vendor: info.vendor ?? "",
      architecture: info.architecture ?? "",
      device: info.device ?? "",
      description: info.description ?? "",
      isFallbackAdapter: info.isFallbackAdapter ?? null,
      features: [...adapter.features].sort(),
      limits,
    };
  } finally {
    releaseGpu();
  }
}

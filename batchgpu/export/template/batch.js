// A batchgpu batch exported for WebGPU: the same WGSL kernels, override constants, bind groups and
// single-submit command sequence as the Python wgpu executor, driven by manifest.json.
//
//   import { run, requestDevice } from "./batch.js";
//   const device = await requestDevice();                 // asks for the features and limits the batch needs
//   const outputs = await run(device, { x: new Float32Array(...) }, { pos: 3 });
//   outputs.y                                             // a Float32Array / Int32Array / Uint32Array
//
// Inputs and outputs go by the names of their Python tensors (batch.upload(data, name="x"),
// t.name = "y"); names() lists them.
//
// run(device, inputs, scalars) writes the given inputs (typed arrays, ArrayBuffers or plain arrays, by
// input name) and scalars (numbers, by name), encodes every dispatch in one compute pass plus the
// readback copies, submits once and resolves to the outputs. Inputs and scalars not given keep their
// current values (at first: the exported ones), like GpuCommandBatch.execute. float16 outputs come back
// as Float16Array where the browser has it, else as Uint16Array holding the raw half-precision bits.
//
// Under Node (>= 18) with the npm package `webgpu`, the same module runs from the folder on disk
// (file: URLs): io.js reads the files, node_gpu.js gives the GPU. check() runs the export's own check:
//
//   import { check } from "./batch.js";
//   const result = await check();                          // { status: "pass" | "fail", adapter, outputs }

import { fetchBytes, fetchJson, fetchText } from "./io.js";
import { getGpu, releaseGpu } from "./node_gpu.js";
import { checkOffers, initialBuffer, requiredLimits, setScalar, splitGroups, withErrors } from "./plan.js";

export { splitGroups };

const HERE = new URL(".", import.meta.url);


export const ARRAY_TYPES = {
  float32: Float32Array,
  int32: Int32Array,
  uint32: Uint32Array,
  float16: globalThis.Float16Array ?? Uint16Array,
};

const loaded = new Map(); // base URL -> Promise of the loaded program

async function fetchOk(url, as) {
  if (as === "json") return fetchJson(url);
  if (as === "text") return fetchText(url);
  const bytes = await fetchBytes(url); // an ArrayBuffer of exactly these bytes: typed arrays view it whole
  return bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength ? bytes.buffer : bytes.slice().buffer;
}

/** Fetch manifest.json, the WGSL, the parameters and the initial buffer contents (once per base URL). */
export function load(base = HERE) {
  const key = String(base);
  if (!loaded.has(key)) {
    const program = (async () => {
      const manifest = await fetchOk(new URL("manifest.json", base), "json");
      if (manifest.format !== "batchgpu-webgpu/1") throw new Error(`batchgpu: unknown export format ${manifest.format}`);
      const [shaders, data, params] = await Promise.all([
        Promise.all(manifest.shaders.map((s) => fetchOk(new URL(s.file, base), "text"))),
        Promise.all(manifest.buffers.map((b) => (b.file ? fetchOk(new URL(b.file, base)) : null))),
        manifest.params.size ? fetchOk(new URL(manifest.params.file, base)) : null,
      ]);
      return { base: key, manifest, shaders, data, params };
    })();
    loaded.set(key, program);
    program.catch(() => loaded.delete(key));
  }
  return loaded.get(key);
}

/** The outputs the exporting device computed for the exported inputs and scalars. */
export async function expectedOutputs(base = HERE) {
  const { manifest } = await load(base);
  const entries = await Promise.all(
    manifest.outputs.map(async (o) => [o.name, new ARRAY_TYPES[o.dtype](await fetchOk(new URL(o.expected, base)))]),
  );
  return Object.fromEntries(entries);
}

function checkAdapterOrDevice(what, thing, manifest) {
  checkOffers(what, thing, manifest, "this batch");
}

/** An adapter from navigator.gpu (under Node: the `webgpu` package's, see node_gpu.js). */
export async function requestAdapter() {
  const adapter = await (await getGpu()).requestAdapter();
  if (!adapter) throw new Error("batchgpu: navigator.gpu.requestAdapter() found no adapter");
  return adapter;
}

/** A device with the features and limits the batch needs, from `adapter` (default: navigator.gpu's). */
export async function requestDevice(adapter = null, base = HERE) {
  const { manifest } = await load(base);
  if (!adapter) adapter = await requestAdapter();
  checkAdapterOrDevice("adapter", adapter, manifest);
  return adapter.requestDevice({ requiredFeatures: manifest.features, requiredLimits: requiredLimits(manifest), label: `batchgpu ${manifest.batch}` });
}

async function build(device, program) {
  const { manifest } = program;
  checkAdapterOrDevice("device", device, manifest);
  return withErrors(device, "building the batch's buffers, pipelines and bind groups", async () => {
    const storageUsage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    const buffers = manifest.buffers.map((b, i) => initialBuffer(device, b, program.data[i], storageUsage));
    const uniformUsage = GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST;
    const params = program.params
      ? initialBuffer(device, { size: manifest.params.size, name: "params" }, program.params, uniformUsage)
      : null;
    const scalarBytes = new ArrayBuffer(manifest.scalar_bytes);
    const scalarView = new DataView(scalarBytes);
    const scalarValues = {};
    for (const s of manifest.scalars) {
      setScalar(scalarView, s, s.value);
      scalarValues[s.name] = s.value;
    }
    const scalarsBuffer = initialBuffer(device, { size: manifest.scalar_bytes, name: "scalars" }, scalarBytes, uniformUsage);

    const modules = manifest.shaders.map((s, i) => device.createShaderModule({ code: program.shaders[i], label: s.label }));
    const layouts = new Map();
    const explicitLayout = ({ storage, uniform }) => {
      const key = `${storage}:${uniform}`;
      if (!layouts.has(key)) {
        const entries = [];
        for (let i = 0; i < storage; i++) entries.push({ binding: i, visibility: GPUShaderStage.COMPUTE, buffer: { type: "storage" } });
        if (uniform) entries.push({ binding: storage, visibility: GPUShaderStage.COMPUTE, buffer: { type: "uniform" } });
        const group = device.createBindGroupLayout({ entries });
        layouts.set(key, device.createPipelineLayout({ bindGroupLayouts: [group] }));
      }
      return layouts.get(key);
    };
    const pipelines = await Promise.all(
      manifest.pipelines.map(async (p) => {
        try {
          return await device.createComputePipelineAsync({
            label: p.label,
            layout: p.layout === "auto" ? "auto" : explicitLayout(p.layout),
            compute: { module: modules[p.shader], entryPoint: p.entry, constants: p.constants },
          });
        } catch (error) {
          const info = await modules[p.shader].getCompilationInfo();
          const messages = info.messages.map((m) => `${m.type} ${m.lineNum}:${m.linePos} ${m.message}`).join("; ");
          throw new Error(`batchgpu: ${manifest.shaders[p.shader].label} (${p.label}) failed to compile: ${error.message} ${messages}`);
        }
      }),
    );

    const perDim = device.limits.maxComputeWorkgroupsPerDimension;
    const dispatches = manifest.dispatches.map((d) => {
      const pipeline = pipelines[d.pipeline];
      const entries = d.bindings.map((b) => {
        if (b.kind === "uniform") return { binding: b.binding, resource: { buffer: params, offset: b.offset, size: b.size } };
        if (b.kind === "scalars") return { binding: b.binding, resource: { buffer: scalarsBuffer, offset: 0, size: manifest.scalar_bytes } };
        return { binding: b.binding, resource: { buffer: buffers[b.buffer] } };
      });
      const bindGroup = device.createBindGroup({ label: d.label, layout: pipeline.getBindGroupLayout(0), entries });
      const grid = typeof d.groups === "number" ? splitGroups(d.groups, perDim) : d.groups;
      if (grid.some((g) => g > perDim)) throw new Error(`batchgpu: ${d.label}: grid ${grid} exceeds maxComputeWorkgroupsPerDimension ${perDim}`);
      return { pipeline, bindGroup, grid };
    });

    const copies = [];
    let total = 0;
    for (const o of manifest.outputs) {
      const size = manifest.buffers[o.buffer].size;
      copies.push({ output: o, source: buffers[o.buffer], offset: total, size });
      total += size;
    }
    const staging = total ? device.createBuffer({ size: total, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST, label: "staging" }) : null;
    return { device, manifest, buffers, scalarsBuffer, scalarBytes, scalarView, scalarValues, dispatches, copies, staging, total, queue: Promise.resolve() };
  });
}

function checkScalar(scalar, value) {
  if (typeof value !== "number" || (Number.isNaN(value) && scalar.dtype !== "f32")) {
    throw new Error(`batchgpu: scalar ${scalar.name} (${scalar.dtype}) needs a number, got ${value}`);
  }
  if (scalar.dtype === "f32") return;
  const [low, high] = scalar.dtype === "u32" ? [0, 2 ** 32 - 1] : [-(2 ** 31), 2 ** 31 - 1];
  if (!Number.isInteger(value) || value < low || value > high) {
    throw new Error(`batchgpu: scalar ${scalar.name} (${scalar.dtype}) needs an integer in [${low}, ${high}], got ${value}`);
  }
}

function inputBytes(input, value) {
  const Type = ARRAY_TYPES[input.dtype];
  let bytes;
  if (value instanceof ArrayBuffer) bytes = new Uint8Array(value);
  else if (ArrayBuffer.isView(value)) {
    if (!(value instanceof Type) && !(value instanceof Uint8Array)) {
      throw new Error(`batchgpu: input ${input.name} is ${input.dtype}; got a ${value.constructor.name}`);
    }
    bytes = new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  } else if (Array.isArray(value)) {
    bytes = new Uint8Array(Type.from(value).buffer);
  } else {
    throw new Error(`batchgpu: input ${input.name} must be a typed array, ArrayBuffer or array, got ${typeof value}`);
  }
  const count = input.shape.reduce((a, b) => a * b, 1);
  const expected = count * Type.BYTES_PER_ELEMENT;
  if (bytes.byteLength !== expected) {
    throw new Error(`batchgpu: input ${input.name} (shape [${input.shape}], ${input.dtype}) needs ${expected} bytes, got ${bytes.byteLength}`);
  }
  if (bytes.byteLength % 4) {
    const padded = new Uint8Array(bytes.byteLength + 4 - (bytes.byteLength % 4));
    padded.set(bytes);
    bytes = padded;
  }
  return bytes;
}

const prepared = new WeakMap(); // device -> Map(base URL -> Promise of built GPU objects)

/** Create the buffers, pipelines and bind groups on `device` (done once per device; run() calls it). */
export async function prepare(device, base = HERE) {
  const program = await load(base);
  if (!prepared.has(device)) prepared.set(device, new Map());
  const perDevice = prepared.get(device);
  if (!perDevice.has(program.base)) {
    const built = build(device, program);
    perDevice.set(program.base, built);
    built.catch(() => perDevice.delete(program.base));
  }
  return perDevice.get(program.base);
}

/** Run the batch once on `device`: write `inputs` and `scalars` (by name), one submit, resolve to the
 * outputs keyed by the names their tensors carry in Python (`t.name = "logits"` -> `outputs.logits`). */
export async function run(device, inputs = {}, scalars = {}, base = HERE) {
  const state = await prepare(device, base);
  const result = state.queue.then(() => runOnce(state, inputs, scalars));
  state.queue = result.catch(() => {}); // runs on one device are serialized: they share the staging buffer
  return result;
}

async function runOnce(state, inputs, scalars) {
  const { device, manifest } = state;
  // Maps and own properties: a name such as "constructor" or "__proto__" is an input like any other
  const byName = new Map(manifest.inputs.map((i) => [i.name, i]));
  for (const name of Object.keys(inputs)) {
    if (!byName.has(name)) throw new Error(`batchgpu: unknown input ${name} (this batch's inputs: ${[...byName.keys()].join(", ") || "none"})`);
  }
  const scalarByName = new Map(manifest.scalars.map((s) => [s.name, s]));
  for (const [name, value] of Object.entries(scalars)) {
    const scalar = scalarByName.get(name);
    if (!scalar) throw new Error(`batchgpu: unknown scalar ${name} (this batch's scalars: ${[...scalarByName.keys()].join(", ") || "none"})`);
    checkScalar(scalar, value);
  }
  const given = manifest.inputs.filter((i) => Object.hasOwn(inputs, i.name) && inputs[i.name] !== undefined);
  const writes = given.map((i) => [i, inputBytes(i, inputs[i.name])]);

  return withErrors(device, "running the batch", async () => {
    for (const [input, bytes] of writes) device.queue.writeBuffer(state.buffers[input.buffer], 0, bytes);
    for (const [name, value] of Object.entries(scalars)) {
      setScalar(state.scalarView, scalarByName.get(name), value);
      state.scalarValues[name] = value;
    }
    if (manifest.scalars.length) device.queue.writeBuffer(state.scalarsBuffer, 0, state.scalarBytes);
    const encoder = device.createCommandEncoder({ label: manifest.batch });
    if (state.dispatches.length) {
      const pass = encoder.beginComputePass();
      for (const { pipeline, bindGroup, grid } of state.dispatches) {
        pass.setPipeline(pipeline);
        pass.setBindGroup(0, bindGroup);
        pass.dispatchWorkgroups(grid[0], grid[1], grid[2]);
      }
      pass.end();
    }
    for (const c of state.copies) encoder.copyBufferToBuffer(c.source, 0, state.staging, c.offset, c.size);
    device.queue.submit([encoder.finish()]);
    const outputs = [];
    if (state.staging) {
      await state.staging.mapAsync(GPUMapMode.READ, 0, state.total);
      const mapped = state.staging.getMappedRange(0, state.total);
      for (const c of state.copies) {
        outputs.push([c.output.name, new ARRAY_TYPES[c.output.dtype](mapped.slice(c.offset, c.offset + c.output.bytes))]);
      }
      state.staging.unmap();
    }
    return Object.fromEntries(outputs); // by the tensors' names
  });
}

/** The names of the batch's inputs, scalars and outputs, as run() takes and returns them. */
export async function names(base = HERE) {
  const { manifest } = await load(base);
  return { inputs: manifest.inputs.map((i) => i.name), scalars: manifest.scalars.map((s) => s.name), outputs: manifest.outputs.map((o) => o.name) };
}

/** The exported inputs (typed arrays by name): what run() uses when given none. */
export async function exportedInputs(base = HERE) {
  const { manifest, data } = await load(base);
  return Object.fromEntries(manifest.inputs.map((i) => [i.name, new ARRAY_TYPES[i.dtype](data[i.buffer].slice(0))]));
}

/** The exported scalar values by name. */
export async function exportedScalars(base = HERE) {
  const { manifest } = await load(base);
  return Object.fromEntries(manifest.scalars.map((s) => [s.name, s.value]));
}

/** Free the GPU objects run() created on `device`. */
export async function release(device, base = HERE) {
  const perDevice = prepared.get(device);
  const program = await load(base);
  const state = await perDevice?.get(program.base);
  if (!state) return;
  perDevice.delete(program.base);
  await state.queue;
  for (const b of state.buffers) b.destroy();
  state.scalarsBuffer.destroy();
  state.staging?.destroy();
}

function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}
const numbers = (array, dtype) => (dtype === "float16" && array instanceof Uint16Array ? Array.from(array, halfToFloat) : array);

/** Compare one output (a manifest.outputs entry) with its expected values: every element within
 * atol + rtol * |expected| (NaN matches NaN; integers have zero tolerances, so they must be equal). */
export function compareOutput(output, actual, expected) {
  const a = numbers(actual, output.dtype), e = numbers(expected, output.dtype);
  let maxAbs = 0, maxExpected = 0, bad = 0, firstBad = -1;
  for (let i = 0; i < e.length; i++) {
    const x = Number(a[i]), y = Number(e[i]);
    if (Number.isNaN(x) && Number.isNaN(y)) continue;
    const diff = x === y ? 0 : Math.abs(x - y);
    if (!(diff <= output.atol + output.rtol * Math.abs(y))) { bad++; if (firstBad < 0) firstBad = i; }
    if (diff > maxAbs || Number.isNaN(diff)) maxAbs = Number.isNaN(diff) ? Infinity : diff;
    if (Number.isFinite(y)) maxExpected = Math.max(maxExpected, Math.abs(y));
  }
  const ok = a.length === e.length && bad === 0;
  return { name: output.name, shape: output.shape, dtype: output.dtype, ok, max_abs_error: maxAbs, max_expected: maxExpected, mismatches: bad, first_mismatch: firstBad };
}

/** The adapter's vendor, architecture, device and description (empty strings where it does not say). */
export function adapterInfo(adapter) {
  const info = adapter.info ?? {};
  return { vendor: info.vendor ?? "", architecture: info.architecture ?? "", device: info.device ?? "", description: info.description ?? "" };
}

/** The export's own check, as index.html runs it: one run on a new device with the exported inputs and
 * scalars, every output compared with expected/ (compareOutput). Resolves to { status: "pass" | "fail",
 * adapter, outputs: [per-output comparison] }; the device is destroyed and, under Node, the GPU released. */
export async function check(base = HERE) {
  const adapter = await requestAdapter();
  const device = await requestDevice(adapter, base);
  try {
    const { manifest } = await load(base);
    const outputs = await run(device, await exportedInputs(base), await exportedScalars(base), base);
    const expected = await expectedOutputs(base);
    const results = manifest.outputs.map((o) => compareOutput(o, outputs[o.name], expected[o.name]));
    return { status: results.every((r) => r.ok) ? "pass" : "fail", adapter: adapterInfo(adapter), outputs: results };
  } finally {
    await release(device, base);
    device.destroy();
    releaseGpu();
  }
}

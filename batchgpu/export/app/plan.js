// A batchgpu program on a WebGPU device: the buffers, pipelines and bind groups model.json describes, and its
// steps (each a recorded batch: one compute pass, one submit), run as the Python wgpu executor runs them.
//
//   const device = await requestDevice(manifest, navigator.gpu);
//   const program = await Program.create(device, manifest, { shaders, params, data });
//   program.write(buffer, bytes);                         // weights, as they arrive
//   const { next_id } = await program.run("decode", { sampling, top_k, keys }, { pos: 7 });  // submitted at once

// WebGPU's default limits: higher needs are requested from the adapter.
export const DEFAULT_LIMITS = {
  maxStorageBufferBindingSize: 134217728,
  maxBufferSize: 268435456,
  maxStorageBuffersPerShaderStage: 8,
  maxUniformBufferBindingSize: 65536,
  maxComputeWorkgroupStorageSize: 16384,
  maxComputeInvocationsPerWorkgroup: 256,
  maxComputeWorkgroupSizeX: 256,
  maxComputeWorkgroupSizeY: 256,
  maxComputeWorkgroupSizeZ: 64,
  maxComputeWorkgroupsPerDimension: 65535,
};

const ARRAY_TYPES = { float32: Float32Array, int32: Int32Array, uint32: Uint32Array };

/** Throw unless the adapter or device ``thing`` (``what``) offers the features and limits ``manifest`` names
 * (``subject``: what needs them, in the message). */
export function checkOffers(what, thing, manifest, subject = "the model") {
  const missing = manifest.features.filter((f) => !thing.features.has(f));
  if (missing.length) throw new Error(`batchgpu: ${subject} needs the WebGPU feature(s) ${missing.join(", ")}, which the ${what} lacks`);
  for (const [name, need] of Object.entries(manifest.limits)) {
    const have = thing.limits[name];
    if (have !== undefined && have < need) throw new Error(`batchgpu: ${subject} needs ${name} >= ${need}; the ${what} offers ${have}`);
  }
}

/** The limits of ``manifest`` above WebGPU's defaults: what requestDevice must ask for. */
export function requiredLimits(manifest) {
  const wanted = {};
  for (const [name, need] of Object.entries(manifest.limits)) {
    if (need > (DEFAULT_LIMITS[name] ?? Infinity)) wanted[name] = need;
  }
  return wanted;
}

/** The adapter of ``gpu`` (navigator.gpu) and its description. */
export async function requestAdapter(gpu) {
  if (!gpu) throw new Error("batchgpu: WebGPU is not available here (navigator.gpu is missing)");
  const adapter = await gpu.requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) throw new Error("batchgpu: WebGPU found no adapter (requestAdapter() gave null)");
  const info = adapter.info ?? {};
  const description = [info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(" ") || "unknown";
  return { adapter, description };
}

/** A device of ``adapter`` with the features and limits every plan of ``plans`` needs (each with ``features``
 * and ``limits``, as model.json has them); throws naming what the adapter lacks. */
export async function openDevice(adapter, plans, label = "batchgpu chat") {
  for (const plan of plans) checkOffers("adapter", adapter, plan);
  const features = [...new Set(plans.flatMap((plan) => plan.features))];
  const limits = {};
  for (const plan of plans) {
    for (const [name, need] of Object.entries(requiredLimits(plan))) limits[name] = Math.max(limits[name] ?? 0, need);
  }
  return adapter.requestDevice({ requiredFeatures: features, requiredLimits: limits, label });
}

/** A device with the features and limits ``manifest`` needs, and its adapter's description. */
export async function requestDevice(manifest, gpu) {
  const { adapter, description } = await requestAdapter(gpu);
  return { device: await openDevice(adapter, [manifest]), adapter: description };
}

/** A 1-D workgroup count over x and y, like batchgpu.limits.split_groups. */
export function splitGroups(groups, perDim) {
  if (groups <= perDim) return [Math.max(groups, 1), 1, 1];
  const y = Math.ceil(groups / perDim);
  const x = Math.ceil(groups / y);
  if (y > perDim) throw new Error(`batchgpu: ${groups} workgroups do not fit maxComputeWorkgroupsPerDimension ${perDim}`);
  return [x, y, 1];
}

/** Run ``body`` and throw the first validation or out-of-memory error WebGPU reports for it. */
export async function withErrors(device, what, body) {
  device.pushErrorScope("out-of-memory");
  device.pushErrorScope("validation");
  let result;
  try {
    result = await body();
  } finally {
    const validation = await device.popErrorScope();
    const memory = await device.popErrorScope();
    const error = validation ?? memory;
    if (error) throw new Error(`batchgpu: ${what} failed: ${error.message}`);
  }
  return result;
}

/** A buffer of ``entry.size`` bytes (label ``entry.name``) holding ``bytes`` from its start, or zeros (null). */
export function initialBuffer(device, entry, bytes, usage) {
  const buffer = device.createBuffer({ size: entry.size, usage, mappedAtCreation: bytes !== null, label: entry.name });
  if (bytes !== null) {
    new Uint8Array(buffer.getMappedRange()).set(new Uint8Array(bytes));
    buffer.unmap();
  }
  return buffer;
}

/** Write scalar ``scalar`` ({dtype: "f32" | "i32" | "u32", slot}) into the scalars' DataView. */
export function setScalar(view, scalar, value) {
  const offset = 4 * scalar.slot;
  if (scalar.dtype === "f32") view.setFloat32(offset, value, true);
  else if (scalar.dtype === "i32") view.setInt32(offset, value, true);
  else view.setUint32(offset, value, true);
}

function padded(bytes) {
  if (bytes.byteLength % 4 === 0) return bytes;
  const out = new Uint8Array(bytes.byteLength + 4 - (bytes.byteLength % 4));
  out.set(bytes);
  return out;
}

/** The pipelines (indices into ``manifest.pipelines``) the dispatches of ``steps`` (names) use. */
function usedPipelines(manifest, steps) {
  return new Set(steps.flatMap((name) => manifest.steps[name].dispatches.map((d) => d.pipeline)));
}

export class Program {
  /** Buffers (zeros, or their bytes from ``data``), pipelines and bind groups of ``steps`` (default: every step
   * of ``manifest``; the shader modules and pipelines other steps use alone are not built) on ``device``. */
  static async create(device, manifest, { shaders, params, data }, { steps = Object.keys(manifest.steps), what = "the model" } = {}) {
    checkOffers("device", device, manifest);
    return withErrors(device, `building ${what}'s buffers, pipelines and bind groups`, async () => {
      const program = new Program(device, manifest);
      program.buffers = manifest.buffers.map((b) => program.buffer(b, b.data ? data.subarray(b.data.offset, b.data.offset + b.data.bytes) : null));
      program.params = manifest.params.size ? program.uniform("params", params) : null;
      const pipelines = await program.pipelines(shaders, usedPipelines(manifest, steps));
      for (const name of steps) program.steps.set(name, program.step(name, manifest.steps[name], pipelines));
      return program;
    });
  }

  constructor(device, manifest) {
    this.device = device;
    this.manifest = manifest;
    this.steps = new Map();
  }

  buffer(entry, bytes) {
    return initialBuffer(this.device, entry, bytes, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST);
  }

  uniform(label, bytes) {
    return initialBuffer(this.device, { size: Math.max(bytes.byteLength, 16), name: label }, bytes, GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST);
  }

  /** The pipelines of ``manifest`` (those in ``used``, else null), compiled concurrently. */
  async pipelines(shaders, used) {
    const { device, manifest } = this;
    const needed = new Set([...used].map((i) => manifest.pipelines[i].shader));
    const modules = manifest.shaders.map((s, i) => (needed.has(i) ? device.createShaderModule({ code: shaders[i], label: s.label }) : null));
    return Promise.all(
      manifest.pipelines.map(async (p, index) => {
        if (!used.has(index)) return null;
        if (p.layout !== "auto") throw new Error(`batchgpu: pipeline ${p.label} has an explicit layout, which chat models do not use`);
        try {
          return await device.createComputePipelineAsync({ label: p.label, layout: "auto", compute: { module: modules[p.shader], entryPoint: p.entry, constants: p.constants } });
        } catch (error) {
          const info = await modules[p.shader].getCompilationInfo();
          const messages = info.messages.map((m) => `${m.type} ${m.lineNum}:${m.linePos} ${m.message}`).join("; ");
          throw new Error(`batchgpu: ${manifest.shaders[p.shader].label} (${p.label}) failed to compile: ${error.message} ${messages}`);
        }
      }),
    );
  }

  step(name, step, pipelines) {
    const { device, manifest } = this;
    const scalarBytes = new ArrayBuffer(manifest.scalar_bytes);
    const scalars = this.uniform(`${name} scalars`, new Uint8Array(scalarBytes));
    const perDim = device.limits.maxComputeWorkgroupsPerDimension;
    const dispatches = step.dispatches.map((d) => {
      const pipeline = pipelines[d.pipeline];
      const entries = d.bindings.map((b) => {
        if (b.kind === "uniform") return { binding: b.binding, resource: { buffer: this.params, offset: b.offset, size: b.size } };
        if (b.kind === "scalars") return { binding: b.binding, resource: { buffer: scalars, offset: 0, size: manifest.scalar_bytes } };
        return { binding: b.binding, resource: { buffer: this.buffers[b.buffer], offset: 0, size: b.size } };
      });
      const bindGroup = device.createBindGroup({ label: d.label, layout: pipeline.getBindGroupLayout(0), entries });
      const grid = typeof d.groups === "number" ? splitGroups(d.groups, perDim) : d.groups;
      return { pipeline, bindGroup, grid };
    });
    const outputs = Object.entries(step.outputs).map(([output, o]) => ({ name: output, ...o, size: manifest.buffers[o.buffer].size }));
    const total = outputs.reduce((sum, o) => sum + o.size, 0);
    // staging buffers: one per run in flight, kept for the next runs
    return { name, step, dispatches, scalars, scalarView: new DataView(scalarBytes), scalarBytes, outputs, total, staging: new Set(), free: [] };
  }

  /** Write ``bytes`` (a Uint8Array) into buffer ``index`` at byte ``offset`` (a multiple of 4). */
  write(index, bytes, offset = 0) {
    this.device.queue.writeBuffer(this.buffers[index], offset, padded(bytes));
  }

  /** Run step ``name`` once: write ``inputs`` (typed arrays by name) and ``scalars`` (numbers by name) and submit
   * now, in call order; resolves to its outputs by name (typed arrays) once the device is done. A caller may
   * submit further steps before awaiting one (a decode step reads its token on the device): each run copies its
   * outputs into a staging buffer of its own. */
  run(name, inputs = {}, scalars = {}) {
    const state = this.steps.get(name);
    if (!state) return Promise.reject(new Error(`batchgpu: the model has no step ${name}`));
    try {
      this.writeInputs(state, inputs, scalars);
    } catch (error) {
      return Promise.reject(error);
    }
    const staging = state.free.pop() ?? this.device.createBuffer({ size: state.total, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST, label: `${name} staging` });
    state.staging.add(staging);
    const encoder = this.device.createCommandEncoder({ label: name });
    const pass = encoder.beginComputePass({ label: name });
    for (const { pipeline, bindGroup, grid } of state.dispatches) {
      pass.setPipeline(pipeline);
      pass.setBindGroup(0, bindGroup);
      pass.dispatchWorkgroups(grid[0], grid[1], grid[2]);
    }
    pass.end();
    let offset = 0;
    for (const o of state.outputs) {
      encoder.copyBufferToBuffer(this.buffers[o.buffer], 0, staging, offset, o.size);
      offset += o.size;
    }
    this.device.queue.submit([encoder.finish()]);
    return this.read(state, staging);
  }

  writeInputs(state, inputs, scalars) {
    const { step } = state;
    for (const [input, value] of Object.entries(inputs)) {
      const entry = step.inputs[input];
      if (!entry) throw new Error(`batchgpu: step ${state.name} has no input ${input}`);
      const Type = ARRAY_TYPES[entry.dtype];
      const count = entry.shape.reduce((a, b) => a * b, 1);
      if (!(value instanceof Type) || value.length !== count) {
        throw new Error(`batchgpu: input ${input} of step ${state.name} needs a ${Type.name} of ${count}, got ${value?.constructor?.name} of ${value?.length}`);
      }
    }
    for (const [input, value] of Object.entries(inputs)) {
      const bytes = new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
      this.device.queue.writeBuffer(this.buffers[step.inputs[input].buffer], 0, padded(bytes));
    }
    for (const s of step.scalars) {
      if (s.name in scalars) setScalar(state.scalarView, s, scalars[s.name]);
    }
    if (step.scalars.length) this.device.queue.writeBuffer(state.scalars, 0, state.scalarBytes);
  }

  async read(state, staging) {
    try {
      await staging.mapAsync(GPUMapMode.READ, 0, state.total);
      const mapped = staging.getMappedRange(0, state.total);
      const outputs = {};
      let offset = 0;
      for (const o of state.outputs) {
        outputs[o.name] = new ARRAY_TYPES[o.dtype](mapped.slice(offset, offset + o.bytes));
        offset += o.size;
      }
      staging.unmap();
      state.free.push(staging);
      return outputs;
    } catch (error) {
      state.staging.delete(staging);
      staging.destroy();
      throw error;
    }
  }

  /** Free every buffer (the device stays). */
  destroy() {
    for (const b of this.buffers) b.destroy();
    this.params?.destroy();
    for (const s of this.steps.values()) {
      s.scalars.destroy();
      for (const staging of s.staging) staging.destroy();
    }
  }
}

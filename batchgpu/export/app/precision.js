// Choosing the model's kernels: the f16 variant (model.json's variants.f16: the KV cache stored as float16, and
// the decode kernels' products in f16: quantized matmuls, attention, norms) where the adapter offers WebGPU's
// shader-f16 and the variant passes a numeric self-test on this device; else the f32 kernels.
//
// The self-test (model.json's self_test, written by batchgpu/export/precision.py) runs each kernel the variant
// changes on a fixed input, in both forms: the f32 kernels must give the export's values (computed in Python,
// within tolerance.f32), and the f16 kernels the f32 kernels' values on this device (within tolerance.f16), every
// value finite. Some drivers offer shader-f16 and compute it wrongly; this is where that shows.
//
//   const choice = await choosePrecision(adapter, manifest, at, { f16: "auto" });
//   choice.plan          // the plan to build (manifest itself, or manifest with variants.f16 over it)
//   choice.device        // a device with what that plan (and the self-test) needs
//   choice.shader_f16, choice.self_test ("passed" | "failed: <why>" | "skipped: <why>"), choice.cases

import { fetchBytes, fetchText } from "./io.js";
import { Program, openDevice } from "./plan.js";

const ARRAY_TYPES = { float32: Float32Array, int32: Int32Array, uint32: Uint32Array };

/** The shader texts, params and data of ``plan``, read from the folder (``at(name)`` is a file's URL). */
export async function planFiles(plan, at) {
  const [shaders, params, data] = await Promise.all([
    Promise.all(plan.shaders.map((s) => fetchText(at(s.file)))),
    fetchBytes(at(plan.params.file)),
    fetchBytes(at(plan.data.file)),
  ]);
  return { shaders, params, data };
}

/** Whether every element of ``value`` is finite and within ``atol * max(1, max |reference|) + rtol * |reference|``
 * of ``reference`` (batchgpu/export/webgpu.py's check): ``{ok, error, at, allowed}``, the first element out of
 * tolerance, else the largest error. */
export function compare(value, reference, { rtol, atol }) {
  if (value.length !== reference.length) return { ok: false, error: Infinity, at: -1, allowed: 0 };
  let scale = 1;
  for (const r of reference) if (Number.isFinite(r)) scale = Math.max(scale, Math.abs(r));
  let worst = { ok: true, error: 0, at: -1, allowed: atol * scale };
  for (let i = 0; i < reference.length; i++) {
    const error = Math.abs(value[i] - reference[i]);
    const allowed = atol * scale + rtol * Math.abs(reference[i]);
    if (!(error <= allowed)) return { ok: false, error, at: i, allowed }; // NaN and inf fail here too
    if (error > worst.error) worst = { ok: true, error, at: i, allowed };
  }
  return worst;
}

/** Run ``test`` (model.json's self_test) on ``device``: ``steps`` "f32" (against the export's values) and
 * "f16" (against the f32 kernels' values here). Resolves to ``{passed, reason, cases: [{name, step,
 * max_error, allowed}]}``; never throws (a kernel that does not compile fails the test, saying so). */
export async function selfTest(device, test, at, { steps = ["f32", "f16"] } = {}) {
  const cases = [];
  let program = null;
  try {
    const [files, expected] = await Promise.all([planFiles(test, at), fetchBytes(at(test.expected.file))]);
    const plan = steps.includes("f16") ? test : { ...test, features: test.features.filter((f) => f !== "shader-f16") }; // f32 alone needs no f16
    program = await Program.create(device, plan, files, { steps, what: "the self-test" });
    const values = {};
    for (const step of steps) values[step] = await program.run(step);
    for (const name of test.cases) {
      const entry = test.expected.outputs[name];
      const wanted = new ARRAY_TYPES[entry.dtype](expected.slice(entry.offset, entry.offset + entry.bytes).buffer);
      for (const step of steps) {
        const reference = step === "f32" ? wanted : values.f32?.[name] ?? wanted;
        const outcome = compare(values[step][name], reference, test.tolerance[step]);
        cases.push({ name, step, max_error: outcome.error, allowed: outcome.allowed });
        if (!outcome.ok) {
          const against = step === "f32" ? "the export's values" : "the f32 kernels";
          const value = values[step][name][outcome.at];
          return { passed: false, reason: `${name}: the ${step} kernels give ${value} at element ${outcome.at}, ${against} ${reference[outcome.at]} (tolerance ${outcome.allowed.toExponential(2)})`, cases };
        }
      }
    }
    return { passed: true, reason: null, cases };
  } catch (error) {
    return { passed: false, reason: String(error?.message ?? error), cases };
  } finally {
    program?.destroy();
  }
}

/** The plan to run on ``adapter`` and a device for it. ``f16``: "auto" (the f16 variant where the adapter offers
 * shader-f16 and the self-test passes), true (the same, but a failed self-test throws), false (f32). */
export async function choosePrecision(adapter, manifest, at, { f16 = "auto", label = "batchgpu chat" } = {}) {
  const variant = manifest.variants?.f16;
  let skipped = null;
  if (f16 === false) skipped = "f16 is off (f16: false)";
  else if (!variant || !manifest.self_test) skipped = "the export has no f16 variant (exported with --no-f16)";
  else if (!adapter.features.has("shader-f16")) skipped = "the adapter does not offer shader-f16";
  if (skipped) {
    if (f16 === true) throw new Error(`batchgpu: f16 was asked for, but ${skipped}`);
    return { plan: manifest, device: await openDevice(adapter, [manifest], label), shader_f16: false, self_test: `skipped: ${skipped}`, cases: [] };
  }
  const plan = { ...manifest, ...variant };
  const device = await openDevice(adapter, [manifest, plan, manifest.self_test], label);
  const outcome = await selfTest(device, manifest.self_test, at);
  if (!outcome.passed && f16 === true) throw new Error(`batchgpu: the f16 self-test failed: ${outcome.reason}`);
  return {
    plan: outcome.passed ? plan : manifest,
    device,
    shader_f16: outcome.passed,
    self_test: outcome.passed ? "passed" : `failed: ${outcome.reason}`,
    cases: outcome.cases,
  };
}

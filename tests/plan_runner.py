"""An exported program (model.json's plan, its f16 variant, or the f16 self-test) run with wgpu-py the way the
page's plan.js runs it: its buffers (weights assembled from the GGUF file as the page builds them), its shader
files, pipelines and bind groups, one submit per step. The tests run the exported WGSL here on wgpu's adapter
(lavapipe offers shader-f16, which Chromium's SwiftShader and Dawn's do not) and compare it with numpy."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.export.weight_sources import assemble

ARRAY_DTYPES = {"float32": np.float32, "int32": np.int32, "uint32": np.uint32}


def kebab(name: str) -> str:
    """WebGPU's camelCase limit name as wgpu-py spells it (maxBufferSize -> max-buffer-size)."""
    return re.sub(r"(?<!^)([A-Z])", r"-\1", name).lower()


def adapter_features() -> set[str]:
    import wgpu

    return set(wgpu.gpu.request_adapter_sync(power_preference="high-performance").features)


class PlanRunner:
    """``plan`` (a program's JSON entry) of the export in ``folder``, on wgpu's adapter; ``gguf``: the model file's
    bytes (for weight buffers with a source); ``steps``: the steps to build (default all)."""

    def __init__(
        self, folder: Path, plan: Mapping[str, Any], *, gguf: bytes | None = None, steps: Sequence[str] | None = None
    ) -> None:
        import wgpu

        self.wgpu = wgpu
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        offered = {kebab(name): value for name, value in adapter.limits.items()}
        limits = {}
        for name, need in plan["limits"].items():
            key = kebab(name)
            if key in offered and need > 0:
                limits[key] = max(need, offered[key]) if "min-" in key else min(offered[key], max(need, 0))
        self.device = adapter.request_device_sync(required_features=list(plan["features"]), required_limits=limits)
        self.plan = plan
        self.steps_built = list(steps or plan["steps"])
        data = (folder / plan["data"]["file"]).read_bytes()
        params = (folder / plan["params"]["file"]).read_bytes()
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.buffers = []
        for entry in plan["buffers"]:
            buffer = self.device.create_buffer(size=entry["size"], usage=usage, label=entry["name"])
            initial = None
            if "data" in entry:
                initial = data[entry["data"]["offset"] : entry["data"]["offset"] + entry["data"]["bytes"]]
            elif "source" in entry:
                assert gguf is not None, f"buffer {entry['name']} is built from the GGUF file: pass its bytes"
                initial = assemble(memoryview(gguf), entry["source"])
            if initial:
                self.device.queue.write_buffer(buffer, 0, bytes(initial) + bytes(-len(initial) % 4))
            self.buffers.append(buffer)
        uniform = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
        self.params = self.device.create_buffer(size=max(len(params), 16), usage=uniform)
        if params:
            self.device.queue.write_buffer(self.params, 0, params)
        used = {d["pipeline"] for name in self.steps_built for d in plan["steps"][name]["dispatches"]}
        sources = {
            i: (folder / s["file"]).read_text()
            for i, s in enumerate(plan["shaders"])
            if any(plan["pipelines"][p]["shader"] == i for p in used)
        }
        modules = {
            i: self.device.create_shader_module(code=code, label=plan["shaders"][i]["label"])
            for i, code in sources.items()
        }
        self.pipelines = {}
        for index in used:
            spec = plan["pipelines"][index]
            compute = {"module": modules[spec["shader"]], "entry_point": spec["entry"], "constants": spec["constants"]}
            self.pipelines[index] = self.device.create_compute_pipeline(layout="auto", compute=compute)
        self.scalar_bytes = plan["scalar_bytes"]
        self.steps = {name: self._step(plan["steps"][name]) for name in self.steps_built}

    def _step(self, step: Mapping[str, Any]) -> dict[str, Any]:
        wgpu = self.wgpu
        scalars = self.device.create_buffer(
            size=self.scalar_bytes, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
        )
        per_dim = self.device.limits["max-compute-workgroups-per-dimension"]
        dispatches = []
        for d in step["dispatches"]:
            pipeline = self.pipelines[d["pipeline"]]
            entries = []
            for b in d["bindings"]:
                if b["kind"] == "uniform":
                    resource = {"buffer": self.params, "offset": b["offset"], "size": b["size"]}
                elif b["kind"] == "scalars":
                    resource = {"buffer": scalars, "offset": 0, "size": self.scalar_bytes}
                else:
                    resource = {"buffer": self.buffers[b["buffer"]], "offset": 0, "size": b["size"]}
                entries.append({"binding": b["binding"], "resource": resource})
            group = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
            groups = d["groups"]
            if isinstance(groups, int):  # split over x and y as plan.js's splitGroups does
                y = 1 if groups <= per_dim else math.ceil(groups / per_dim)
                groups = [math.ceil(groups / y), y, 1] if groups else [1, 1, 1]
            dispatches.append((pipeline, group, groups))
        return {"step": step, "dispatches": dispatches, "scalars": scalars}

    def run(
        self, name: str, inputs: Mapping[str, np.ndarray] | None = None, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        """Write ``inputs`` and ``scalars``, submit step ``name`` and read its outputs."""
        state = self.steps[name]
        step = state["step"]
        for key, value in (inputs or {}).items():
            entry = step["inputs"][key]
            array = np.ascontiguousarray(value, ARRAY_DTYPES[entry["dtype"]]).tobytes()
            self.device.queue.write_buffer(self.buffers[entry["buffer"]], 0, array + bytes(-len(array) % 4))
        if step["scalars"]:
            words = bytearray(self.scalar_bytes)
            for scalar in step["scalars"]:
                if scalar["name"] in (scalars or {}):
                    kind = {"f32": "<f", "i32": "<i", "u32": "<I"}[scalar["dtype"]]
                    struct.pack_into(kind, words, 4 * scalar["slot"], scalars[scalar["name"]])  # type: ignore[index]
            self.device.queue.write_buffer(state["scalars"], 0, bytes(words))
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for pipeline, group, (x, y, z) in state["dispatches"]:
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(x, y, z)
        compute.end()
        self.device.queue.submit([encoder.finish()])
        outputs = {}
        for key, entry in step["outputs"].items():
            raw = self.device.queue.read_buffer(
                self.buffers[entry["buffer"]], 0, self.plan["buffers"][entry["buffer"]]["size"]
            )
            outputs[key] = np.frombuffer(bytes(raw)[: entry["bytes"]], ARRAY_DTYPES[entry["dtype"]])
        return outputs

    def generate(self, prompt: Sequence[int], max_tokens: int, chunk: int) -> list[int]:
        """Greedy ids of the chat steps, as batchgpu.js's ChatModel.generate drives them."""
        from batchgpu.export.chat_steps import Sampling, chunks

        sampling = Sampling()
        pos, out = 0, None
        for size in chunks(len(prompt), chunk):
            feeds = {"ids": np.asarray(prompt[pos : pos + size], np.int32), **sampling.feeds(0)}
            out = self.run(f"prefill_{size}", feeds, {"pos": pos})
            pos += size
        ids = [int(out["next_id"][0])]  # type: ignore[index]
        while len(ids) < max_tokens:
            ids.append(int(self.run("decode", sampling.feeds(len(ids)), {"pos": pos})["next_id"][0]))
            pos += 1
        return ids

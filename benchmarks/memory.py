"""Device memory of a batch's own buffers with declared outputs (intermediates sharing buffers,
``batch.outputs``) beside one buffer per tensor (the baseline, ``batch.outputs()`` with nothing
declared), measured in one run, with the time of an execute + read of each.

    python benchmarks/memory.py [--device wgpu] [--tokens 8] [--json out.json]

Batches: the FFN example (8 layers, hidden 512, ffn 1536, 16 rows) and SmolLM2-135M's decode and
5-token prefill batches (quantized weights; skipped without the model). Resident weights and KV
caches are the same either way and are not counted.

Timed (ms columns): the median of ``--tokens`` executes + reads of each plan, after two untimed
warm-up runs of it (the first plans and compiles the pipelines, the second is the first run of a
planned batch; native executors capture their graph on it). Recording is not timed. The machine's
1-minute load average is printed before the table and, per batch, after its timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ffn_layer import make_weights, record_ffn
from machine_load import load_average

import batchgpu as bg

PROMPT = [504, 3575, 282, 4649, 314]


def measure(batch: bg.GpuCommandBatch, run: Callable[[], None], repeat: int) -> dict[str, float]:
    """Bytes and buffer count of the current plan, and the median ms of ``run`` (execute + read) after
    two untimed warm-up runs."""
    run()  # plans (and compiles the pipelines on the first plan)
    run()  # the first run of the plan (native executors capture their graph here)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    memory = batch.memory()
    return {"bytes": memory["planned"], "buffers": memory["buffers"], "ms": statistics.median(times)}


def compare(name: str, batch: bg.GpuCommandBatch, outputs: list[bg.Tensor], run: Callable[[], None], repeat: int):
    batch.outputs()
    unshared = measure(batch, run, repeat)
    batch.outputs(*outputs)
    shared = measure(batch, run, repeat)
    return {"batch": name, "unshared": unshared, "shared": shared, "load_average": load_average()}


def ffn_rows(dev: bg.Device, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    weights = [{k: dev.tensor(v) for k, v in layer.items()} for layer in make_weights(rng, 8, 512, 1536)]
    batch = bg.GpuCommandBatch(dev, name="ffn")
    x = batch.upload(rng.standard_normal((16, 512)).astype(np.float32))
    out = record_ffn(batch, x, weights)

    def run() -> None:
        batch.execute()
        batch.read(out)

    return compare("FFN 8x(512->1536->512), 16 rows", batch, [out], run, repeat)


def llama_rows(dev: bg.Device, tokens: int) -> list[dict]:
    try:
        from batchgpu.models.llama import Llama
    except ImportError as exc:
        print(f"SmolLM2 skipped: {exc}")
        return []
    try:
        model = Llama(dev, quantized=True, max_context=64)
    except Exception as exc:  # no model file / gguf
        print(f"SmolLM2 skipped: {exc}")
        return []
    rows = []
    prefill = model.record(len(PROMPT))
    decode = model.record(1)
    for name, step, ids in (("SmolLM2 decode step", decode, [7042]), ("SmolLM2 prefill, 5 tokens", prefill, PROMPT)):

        def run(step=step, ids=ids) -> None:
            step.batch.execute({step.ids: np.asarray(ids, np.int32)}, scalars={"pos": 8})
            step.batch.read(step.next_token)

        rows.append(compare(name, step.batch, [step.next_token, step.logits], run, tokens))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None)
    parser.add_argument("--tokens", type=int, default=8, help="timed executes per batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = bg.Device(args.device)
    load_before = load_average()
    rows = [ffn_rows(dev, args.tokens), *llama_rows(dev, args.tokens)]
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; device: {dev.name}")
    print(f"timed: median of {args.tokens} executes + reads per plan, after 2 untimed warm-up runs")
    print(f"load average (1 min) before: {load_before:.2f} on {os.cpu_count()} CPUs\n")
    print("| batch | unshared KiB | shared KiB | x less | buffers | ms unshared | ms shared | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        u, s = row["unshared"], row["shared"]
        print(
            f"| {row['batch']} | {u['bytes'] / 1024:.0f} | {s['bytes'] / 1024:.0f} | {u['bytes'] / s['bytes']:.1f} "
            f"| {u['buffers']} -> {s['buffers']} | {u['ms']:.1f} | {s['ms']:.1f} | {row['load_average']:.2f} |"
        )
    if args.json:
        payload = {"device": dev.name, "load_average_before": load_before, "rows": rows}
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()

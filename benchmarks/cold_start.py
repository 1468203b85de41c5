"""Cold start (issue 5): time from ``Device()`` to the first result of the FFN example, in fresh processes.

Run from a checkout: ``python benchmarks/cold_start.py [--repeat 5] [--json PATH]``.

Every sample is a new Python process running the FFN stack of ``examples/ffn_layer.py`` (defaults:
4 layers, 8 tokens, hidden 256, ffn 688): ``Device()``, upload the weights, record, ``execute()``,
``read``. Configurations, run interleaved round by round:

  no caches        ``BATCHGPU_FAST_IMPORT=0``, ``BATCHGPU_CACHE_DIR=off``, ``MESA_SHADER_CACHE_DISABLE=true``:
                   what the code before issue 5 did on a machine that never ran it.
  before, 2nd run  the same code path, but Mesa's own default shader cache warm (a fixed warm folder):
                   what the code before issue 5 got from the driver alone on a second run.
  first process    issue 5, with an empty ``BATCHGPU_CACHE_DIR`` (a new one per sample).
  second process   issue 5, with a ``BATCHGPU_CACHE_DIR`` warmed by one earlier process.

Cold start measures first runs on purpose. Per column, each a median over the samples:

  Device() to first result  from after the imports to the first result on the host: ``Device()``,
                            the weight uploads, recording, the first ``execute()`` and ``read``.
  CPU ms (all threads)      the process CPU time over the same window (lavapipe's threads included).
  Device() ms               ``bg.Device("wgpu")`` alone.
  execute ms                host time of the first ``execute()``: planning (buffers, bind groups),
                            pipeline creation (compile or cache load), encode and submit.
  first read ms             the first ``read``: waits for the first run's GPU work (and any
                            compile work the driver defers to it), copies back.
  import ms                 the child's imports (numpy, batchgpu, ffn_layer); interpreter start excluded.
  process ms                the parent's wall time of the whole child: interpreter start, imports, all
                            of the above, the steady-state runs below and exit.

Also reported: the steady-state execute + read of the same batch in the same process (the GPU work
itself, which no cache removes): the median of 3 timed runs after the first result and one more
untimed warm-up run (so no plan, compile or first run is in it), and the pipeline counters of
``dev.stats``. The machine's 1-minute load average before and after the samples is printed beside the
table and written into the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine_load import load_average

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import time
started = time.perf_counter()
import json, sys
import numpy as np
import batchgpu as bg
from batchgpu import coldstart
sys.path.insert(0, sys.argv[1])
from ffn_layer import make_weights, record_ffn
imported = time.perf_counter()

cpu_imported = time.process_time()
dev = bg.Device("wgpu")
device_ready = time.perf_counter()
rng = np.random.default_rng(0)
host_weights = make_weights(rng, 4, 256, 688)
weights = [{k: dev.tensor(w) for k, w in layer.items()} for layer in host_weights]
x_data = rng.standard_normal((8, 256)).astype(np.float32)
batch = bg.GpuCommandBatch(dev)
x = batch.upload(x_data)
y = record_ffn(batch, x, weights)
recorded = time.perf_counter()
batch.execute()
executed = time.perf_counter()
out = batch.read(y)
first_result = time.perf_counter()
cpu_first_result = time.process_time()
batch.execute({x: x_data * 2})  # warm-up: the first run with a fed input
batch.read(y)
steady_runs = []
for i in range(3):
    steady_started = time.perf_counter()
    batch.execute({x: x_data * (3 + i)})
    batch.read(y)
    steady_runs.append(time.perf_counter() - steady_started)
steady = sorted(steady_runs)[1]
print(json.dumps({
    "import_s": imported - started,
    "device_s": device_ready - imported,
    "weights_record_s": recorded - device_ready,
    "execute_s": executed - recorded,
    "read_s": first_result - executed,
    "to_first_result_s": first_result - imported,
    "cpu_to_first_result_s": cpu_first_result - cpu_imported,
    "steady_execute_read_s": steady,
    "stats": dev.stats.snapshot(),
    "coldstart": coldstart.stats,
    "device": dev.name,
}))
"""

CONFIGS = ("no caches", "before, 2nd run", "first process", "second process")


def run_child(env: dict[str, str]) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT / "examples")], env=env, capture_output=True, text=True, timeout=300
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BATCHGPU_CACHE_DIR", "BATCHGPU_FAST_IMPORT", "MESA_SHADER_CACHE_DIR", "MESA_SHADER_CACHE_DISABLE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="samples per configuration (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    began = time.perf_counter()
    samples: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="batchgpu-coldstart-") as tmp:
        work = Path(tmp)
        warm_mesa = work / "mesa-default"
        warm_cache = work / "warm"
        before = {**base_env(), "BATCHGPU_FAST_IMPORT": "0", "BATCHGPU_CACHE_DIR": "off"}
        run_child({**before, "MESA_SHADER_CACHE_DIR": str(warm_mesa)})  # warm the "before, 2nd run" driver cache
        run_child({**base_env(), "BATCHGPU_CACHE_DIR": str(warm_cache)})  # and the "second process" cache dir
        for round_index in range(max(1, args.repeat)):
            envs = {
                "no caches": {**before, "MESA_SHADER_CACHE_DISABLE": "true"},
                "before, 2nd run": {**before, "MESA_SHADER_CACHE_DIR": str(warm_mesa)},
                "first process": {**base_env(), "BATCHGPU_CACHE_DIR": str(work / f"empty{round_index}")},
                "second process": {**base_env(), "BATCHGPU_CACHE_DIR": str(warm_cache)},
            }
            for name in CONFIGS:
                samples[name].append(run_child(envs[name]))
    load_after = load_average()

    def median(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    device = samples["first process"][0]["device"]
    lines = [
        "cold_start: FFN example (4 layers, 8x256 tokens, ffn 688), fresh process per sample",
        f"date:   {date}",
        f"device: {device}",
        f"host:   {platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs",
        f"median of {max(1, args.repeat)} samples per configuration, configurations interleaved",
        f"load average (1 min): {load_before:.2f} before the samples, {load_after:.2f} after",
        "",
        "| configuration   | Device() to first result ms | CPU ms (all threads) | Device() ms | execute ms "
        "| first read ms | import ms | process ms | pipelines created / cache hits / misses |",
        "|-----------------|----------------------------:|---------------------:|------------:|-----------:"
        "|--------------:|----------:|-----------:|-----------------------------------------|",
    ]
    figures = {}
    for name in CONFIGS:
        stats = samples[name][-1]["stats"]
        row = {
            key: 1e3 * median(name, key)
            for key in (
                "to_first_result_s",
                "cpu_to_first_result_s",
                "device_s",
                "execute_s",
                "read_s",
                "import_s",
                "process_s",
            )
        }
        row["steady_execute_read_ms"] = 1e3 * median(name, "steady_execute_read_s")
        row["pipelines"] = [stats["pipelines_compiled"], stats["pipeline_cache_hits"], stats["pipeline_cache_misses"]]
        row["header_cache"] = samples[name][-1]["coldstart"]["header_cache"]
        figures[name] = row
        counts = " / ".join(map(str, row["pipelines"]))
        lines.append(
            f"| {name:<15} | {row['to_first_result_s']:>27.0f} | {row['cpu_to_first_result_s']:>20.0f} "
            f"| {row['device_s']:>11.0f} | {row['execute_s']:>10.0f} | {row['read_s']:>13.0f} "
            f"| {row['import_s']:>9.0f} | {row['process_s']:>10.0f} | {counts:<39} |"
        )
    steady = statistics.median(s["steady_execute_read_s"] for runs in samples.values() for s in runs)
    first, second, none = (figures[n]["to_first_result_s"] for n in ("first process", "second process", "no caches"))
    lines += [
        "",
        f"steady-state execute + read of the same batch (GPU work; after the first result and one more "
        f"untimed run, so no plan, compile or first run): {1e3 * steady:.0f} ms",
        f"second process / first process: {second / first:.2f}x; second process / no caches: {second / none:.2f}x; "
        f"first process / no caches: {first / none:.2f}x",
        "CPU ms: process CPU time (all threads, incl. lavapipe's) from after the imports to the first result;"
        " less sensitive than wall time to other load on the machine",
        f"total run time {time.perf_counter() - began:.0f} s",
    ]
    print("\n".join(lines))
    if args.json:
        payload = {
            "date": date,
            "device": device,
            "repeat": args.repeat,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "figures": figures,
            "samples": samples,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host overhead of batchgpu on a chain of many tiny elementwise ops, against raw wgpu-py (issue 2).

Run from a checkout: ``python benchmarks/batch_overhead.py [--ops 1000] [--repeat 15] [--json PATH]``.

Every figure is measured in one process on one ``bg.Device()``. The workload is a chain of ``--ops``
elementwise ops alternating ``y = y + a`` / ``y = y * m`` on a ``(--size,)`` float32 tensor, so each
op is one dispatch of one 256-wide workgroup: the GPU does almost nothing and what is measured is
the cost of getting work to it.

  (a)  library, one batch of all ops: ``execute()`` + ``read_sync(last)`` (steady state,
       after a warm-up execute), and ``execute()`` alone (host time of encode + submit; the GPU is
       drained by a read outside the timed region before anything else is timed). This batch's
       first record (the ``add``/``mul`` calls; built-in ops compile nothing at record) and first
       ``execute()`` (plan: buffers, bind groups and the two pipeline compiles) are timed once
       each, apart, in the rows labelled "first".
  (b)  library, one submit per op: ``--ops`` one-op batches recorded and planned once, each executed
       (one submit each), then ``read`` of the last. Batches cannot share tensors, so each op
       reads resident tensors (``Device.tensor``) instead of the previous op's output; the GPU work
       per op is the same.
  (c)  naive raw wgpu-py: per op create shader module + pipeline (no cache), buffers with the data,
       bind group, encode, submit and map the result back; the host array feeds the next op. Slow,
       so only ``--naive-ops`` ops are run and the time is scaled per op.
  (d)  raw wgpu-py floor: pipelines and bind groups made beforehand (the buffers + bind groups timed
       once, apart: the row labelled "once"), then one untimed warm-up run; timed is only the loop
       ``set_pipeline; set_bind_group; dispatch_workgroups`` over all ops inside one compute pass
       (host encoding), and separately the whole encode + submit + wait (map the last result);
       also the same dispatches with one encoder + submit each, then wait (the raw twin of (b)).
  rec  re-recording the chain into a fresh batch (host time of the ``add``/``mul`` calls, pipelines
       already cached), and the first ``execute()`` after it (host time of planning: buffers + bind
       groups, no compiles, plus encode + submit); one untimed warm-up round first.

Every figure is timed once per round with ``time.perf_counter``; the ``--repeat`` rounds run all
measurements interleaved (so a change of load on the machine hits all of them alike) and the table
shows medians. Warm-up (first records, plans, pipeline compiles, first runs) is outside every timed
window except the rows labelled "first" or "once", which time it on purpose. The machine's 1-minute
load average before and after the rounds is printed beside the table and written into the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import wgpu

try:
    import batchgpu as bg
except ImportError:  # running from a source checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import batchgpu as bg
from batchgpu.overhead import (  # the (a)-(c) workloads, shared with `batchgpu bench`
    ADD_VALUE,
    MUL_VALUE,
    RAW_WGSL,
    Bench,
    WrongResultError,
    check,
    is_add,
    load_average,
    numpy_chain,
    record_chain,
    setup_library_batch,
    setup_library_per_op,
    setup_naive,
    timed,
)

TARGET_NAIVE_OVER_BATCH = 10.0  # (c) / (a) should be at least this
TARGET_REEXEC_OVER_RAW = 2.0  # library re-execute per op / (d) per op should be at most this


# (a), (b), (c) are batchgpu.overhead's setup_library_batch, setup_library_per_op and setup_naive. Each
# setup_* builds its workload once, checks the result against numpy, warms up, and returns a Bench:
# figures measured once, and one_round() which times every figure of the bench once. main() runs the
# rounds of all benches interleaved, so a load change on the machine hits all of them alike.


# re-record ------------------------------------------------------------------------------------


def setup_rerecord(dev: bg.Device, x0: np.ndarray, ops: int) -> Bench:
    def one_round() -> dict[str, float]:
        batch, last, record = record_chain(dev, x0, ops)
        plan = timed(batch.execute)
        check("re-record", batch.read(last), numpy_chain(x0, ops))
        batch.release()
        return {"record_s": record, "plan_execute_s": plan}

    one_round()  # warm-up: the first fresh batch's allocations stay out of the timed rounds
    return Bench(one_round)


# (d) raw wgpu-py floor ------------------------------------------------------------------------


def setup_raw(device: Any, x0: np.ndarray, ops: int) -> Bench:
    usage = wgpu.BufferUsage
    n, nbytes = x0.size, x0.nbytes
    pipelines = []
    for symbol in "+*":
        module = device.create_shader_module(code=RAW_WGSL.replace("OP", symbol))
        pipelines.append(
            device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        )
    setup_started = time.perf_counter()  # buffers + bind groups: the raw twin of the library's plan
    chain = [device.create_buffer_with_data(data=x0, usage=usage.STORAGE)]
    chain += [device.create_buffer(size=nbytes, usage=usage.STORAGE | usage.COPY_SRC) for _ in range(ops)]
    add = device.create_buffer_with_data(data=np.full_like(x0, ADD_VALUE), usage=usage.STORAGE)
    mul = device.create_buffer_with_data(data=np.full_like(x0, MUL_VALUE), usage=usage.STORAGE)
    uniform = device.create_buffer_with_data(data=np.array([n, 0, 0, 0], np.uint32), usage=usage.UNIFORM)
    staging = device.create_buffer(size=nbytes, usage=usage.MAP_READ | usage.COPY_DST)
    work = []
    for i in range(ops):
        pipeline = pipelines[0 if is_add(i) else 1]
        bind_group = device.create_bind_group(
            layout=pipeline.get_bind_group_layout(0),
            entries=[
                {"binding": 0, "resource": {"buffer": chain[i]}},
                {"binding": 1, "resource": {"buffer": add if is_add(i) else mul}},
                {"binding": 2, "resource": {"buffer": chain[i + 1]}},
                {"binding": 3, "resource": {"buffer": uniform}},
            ],
        )
        work.append((pipeline, bind_group))
    setup = time.perf_counter() - setup_started
    groups = -(-n // 256)
    timings: dict[str, float] = {}

    def run() -> np.ndarray:
        """One encode + submit + wait; notes the dispatch-loop time and the host time up to submit."""
        started = time.perf_counter()
        encoder = device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        loop_started = time.perf_counter()
        for pipeline, bind_group in work:
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, bind_group)
            compute.dispatch_workgroups(groups, 1, 1)
        timings["loop_s"] = time.perf_counter() - loop_started
        compute.end()
        encoder.copy_buffer_to_buffer(chain[-1], 0, staging, 0, nbytes)
        device.queue.submit([encoder.finish()])
        timings["encode_submit_s"] = time.perf_counter() - started
        staging.map_sync("READ")
        result = np.frombuffer(staging.read_mapped(), np.float32).copy()
        staging.unmap()
        return result

    def run_per_op() -> np.ndarray:
        """The same dispatches, one encoder and one submit each (compare with (b)); then wait."""
        for pipeline, bind_group in work:
            encoder = device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, bind_group)
            compute.dispatch_workgroups(groups, 1, 1)
            compute.end()
            device.queue.submit([encoder.finish()])
        encoder = device.create_command_encoder()
        encoder.copy_buffer_to_buffer(chain[-1], 0, staging, 0, nbytes)
        device.queue.submit([encoder.finish()])
        staging.map_sync("READ")
        result = np.frombuffer(staging.read_mapped(), np.float32).copy()
        staging.unmap()
        return result

    check("(d)", run(), numpy_chain(x0, ops))  # warm-up
    check("(d) per op", run_per_op(), numpy_chain(x0, ops))

    def one_round() -> dict[str, float]:
        full = timed(run)
        return {**timings, "encode_submit_wait_s": full, "submit_per_op_wait_s": timed(run_per_op)}

    return Bench(one_round, once={"setup_s": setup})


# report ---------------------------------------------------------------------------------------


def us_per_op(seconds: float, ops: int) -> float:
    return 1e6 * seconds / ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1000, help="ops in the chain (default 1000)")
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds; each figure shows the median")
    parser.add_argument("--size", type=int, default=256, help="elements of the float32 tensor (default 256)")
    parser.add_argument("--naive-ops", type=int, default=50, help="ops run for (c), scaled per op (default 50)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    ops, repeat = args.ops, max(1, args.repeat)
    naive_ops = min(args.naive_ops, ops)

    began = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    dev = bg.Device()
    raw_device = dev.executor.device
    x0 = np.random.default_rng(0).standard_normal(args.size).astype(np.float32)

    benches = {  # (a) and (d) run back to back in each round: their ratio is the one most sensitive to load
        "a": setup_library_batch(dev, x0, ops),
        "d": setup_raw(raw_device, x0, ops),
        "b": setup_library_per_op(dev, x0, ops),
        "c": setup_naive(raw_device, x0, naive_ops),
        "rerecord": setup_rerecord(dev, x0, ops),
    }
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in benches}
    load_before = load_average()
    for _ in range(repeat):
        for name, bench in benches.items():
            gc.collect()
            for key, value in bench.one_round().items():
                samples[name].setdefault(key, []).append(value)
    load_after = load_average()
    medians = {
        name: {**benches[name].once, **{key: statistics.median(values) for key, values in figures.items()}}
        for name, figures in samples.items()
    }
    for bench in benches.values():
        bench.close()
    a, b, c, d, rec = (medians[name] for name in ("a", "b", "c", "d", "rerecord"))

    per_op = {
        "a_execute_read": us_per_op(a["execute_read_s"], ops),
        "a_execute": us_per_op(a["execute_s"], ops),
        "b_execute_read": us_per_op(b["execute_read_s"], ops),
        "b_execute": us_per_op(b["execute_s"], ops),
        "c_naive": us_per_op(c["total_s"], naive_ops),
        "d_loop": us_per_op(d["loop_s"], ops),
        "d_encode_submit": us_per_op(d["encode_submit_s"], ops),
        "d_encode_submit_wait": us_per_op(d["encode_submit_wait_s"], ops),
        "d_submit_per_op_wait": us_per_op(d["submit_per_op_wait_s"], ops),
        "d_setup": us_per_op(d["setup_s"], ops),
        "rerecord": us_per_op(rec["record_s"], ops),
        "rerecord_plan": us_per_op(rec["plan_execute_s"], ops),
        "reexecute": us_per_op(a["execute_s"], ops),
        "first_record": us_per_op(a["first_record_s"], ops),
        "first_execute_with_compile": us_per_op(a["first_execute_s"], ops),
    }
    ratios = {
        "naive_over_batch": per_op["c_naive"] / per_op["a_execute_read"],
        "reexecute_over_raw_loop": per_op["reexecute"] / per_op["d_loop"],
        "reexecute_over_raw_encode_submit": per_op["reexecute"] / per_op["d_encode_submit"],
        "rerecord_over_raw_loop": per_op["rerecord"] / per_op["d_loop"],
        "batch_over_raw_full": per_op["a_execute_read"] / per_op["d_encode_submit_wait"],
        "per_op_submit_over_batch": per_op["b_execute_read"] / per_op["a_execute_read"],
        "plan_over_raw_setup": per_op["rerecord_plan"] / per_op["d_setup"],
        "per_op_submit_lib_over_raw": per_op["b_execute_read"] / per_op["d_submit_per_op_wait"],
    }
    targets = {
        "naive_over_batch >= 10": ratios["naive_over_batch"] >= TARGET_NAIVE_OVER_BATCH,
        "reexecute_over_raw_loop <= 2": ratios["reexecute_over_raw_loop"] <= TARGET_REEXEC_OVER_RAW,
    }

    rows = [
        ("(a) library, 1 batch: execute() + read_sync(last)", a["execute_read_s"], ops, per_op["a_execute_read"]),
        ("(a) library, 1 batch: execute() alone (host) = re-execute", a["execute_s"], ops, per_op["a_execute"]),
        ("(b) library, 1 submit/op: execute() x N + read last", b["execute_read_s"], ops, per_op["b_execute_read"]),
        ("(b) library, 1 submit/op: execute() x N alone (host)", b["execute_s"], ops, per_op["b_execute"]),
        ("(c) naive raw wgpu: compile+alloc+submit+map per op", c["total_s"], naive_ops, per_op["c_naive"]),
        ("(d) raw wgpu: set_pipeline/bind_group/dispatch loop", d["loop_s"], ops, per_op["d_loop"]),
        ("(d) raw wgpu: encode + submit (host)", d["encode_submit_s"], ops, per_op["d_encode_submit"]),
        (
            "(d) raw wgpu: encode + submit + wait (map last)",
            d["encode_submit_wait_s"],
            ops,
            per_op["d_encode_submit_wait"],
        ),
        (
            "(d) raw wgpu: 1 encoder+submit per dispatch, + wait",
            d["submit_per_op_wait_s"],
            ops,
            per_op["d_submit_per_op_wait"],
        ),
        ("library re-record (add/mul calls, fresh batch)", rec["record_s"], ops, per_op["rerecord"]),
        ("library first execute after record (plan)", rec["plan_execute_s"], ops, per_op["rerecord_plan"]),
        ("(d) raw wgpu: create buffers + bind groups (once)", d["setup_s"], ops, per_op["d_setup"]),
        ("library first record (add/mul calls, no compiles)", a["first_record_s"], ops, per_op["first_record"]),
        (
            "library first execute (plan + 2 pipeline compiles, host)",
            a["first_execute_s"],
            ops,
            per_op["first_execute_with_compile"],
        ),
    ]
    lines = [
        f"batch_overhead: chain of {ops} alternating add/mul on ({args.size},) float32",
        f"date:   {date}",
        f"device: {dev.name}",
        f"host:   {platform.python_implementation()} {platform.python_version()}, wgpu {wgpu.__version__}, "
        f"numpy {np.__version__}, {os.cpu_count()} CPUs",
        f"median of {repeat} interleaved rounds after warm-up; (c) ran {naive_ops} ops per round and is scaled "
        "per op; rows labelled first/once are single timings of the warm-up itself",
        f"load average (1 min): {load_before:.2f} before the rounds, {load_after:.2f} after, on {os.cpu_count()} CPUs",
        "",
        f"| {'measurement':<58} | {'median ms':>10} | {'ops':>5} | {'us/op':>9} |",
        f"|{'-' * 60}|{'-' * 11}:|{'-' * 6}:|{'-' * 10}:|",
    ]
    lines += [f"| {name:<58} | {1e3 * s:>10.2f} | {n:>5} | {u:>9.2f} |" for name, s, n, u in rows]
    lines += [
        "",
        f"(c)/(a)           naive per op / batched execute+read per op  : {ratios['naive_over_batch']:7.2f}x"
        f"  (target >= {TARGET_NAIVE_OVER_BATCH:g}x: {'met' if targets['naive_over_batch >= 10'] else 'NOT met'})",
        f"re-execute/(d)    library execute() / raw dispatch loop       : {ratios['reexecute_over_raw_loop']:7.2f}x"
        f"  (target <= {TARGET_REEXEC_OVER_RAW:g}x: {'met' if targets['reexecute_over_raw_loop <= 2'] else 'NOT met'})",
        f"re-execute/(d)    library execute() / raw encode+submit       : "
        f"{ratios['reexecute_over_raw_encode_submit']:7.2f}x",
        f"re-record/(d)     record per op / raw dispatch loop per op    : {ratios['rerecord_over_raw_loop']:7.2f}x",
        f"(a)/(d)           batched execute+read / raw enc+submit+wait  : {ratios['batch_over_raw_full']:7.2f}x",
        f"(b)/(a)           one submit per op / one batch, execute+read : {ratios['per_op_submit_over_batch']:7.2f}x",
        f"plan/(d) setup    library plan / raw buffers + bind groups    : {ratios['plan_over_raw_setup']:7.2f}x",
        f"(b)/(d) per op    library / raw, one submit per op, + wait    : {ratios['per_op_submit_lib_over_raw']:7.2f}x",
        f"total run time {time.perf_counter() - began:.1f} s",
    ]
    print("\n".join(lines))

    if args.json:
        figures = {
            "benchmark": "batch_overhead",
            "date": date,
            "device": dev.name,
            "python": platform.python_version(),
            "wgpu": wgpu.__version__,
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "ops": ops,
            "size": args.size,
            "repeat": repeat,
            "naive_ops": naive_ops,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "seconds_median": medians,
            "seconds_samples": samples,
            "us_per_op": per_op,
            "ratios": ratios,
            "targets_met": targets,
        }
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except WrongResultError as exc:  # a workload that computes the wrong thing is not timed
        raise SystemExit(str(exc)) from None

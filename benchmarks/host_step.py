"""Host time of the engine's decode steps: the CPU time the engine's driver thread spends per step outside
the device's work, at ``--sequences`` concurrent greedy requests (end-of-sequence ignored), on this checkout
and, with ``--baseline-tree PATH``, on another checkout of batchgpu in the same run (each round runs both
trees in fresh subprocesses, alternating, so load changes hit both alike; the ratio is of the medians).

    python benchmarks/host_step.py [--device reference,wgpu] [--sequences 16] [--tokens 48] [--rounds 3]
    git archive cd1570b | tar -x -C /tmp/base    # an older commit's tree
    python benchmarks/host_step.py --baseline-tree /tmp/base

Method: the driver (``Engine``'s asyncio task) and the requests' consumers run on one thread, the event
loop's. Over the window in which every request decodes (from the moment the last request has its first
token to the moment the first one ends: decode steps only, all ``--sequences`` rows busy), the benchmark
takes that thread's CPU time (``time.thread_time``) and subtracts the device's work done on it: with the
numpy reference executor the device runs inside the executor's ``run`` (its ops, and copying the feeds
into its arrays), timed the same way; with wgpu the device (lavapipe's threads, or a GPU) runs
elsewhere, and waiting for it costs the thread no CPU time. What is left is the host's work per step:
scheduling, packing the feeds, the batch's execute (feed validation, and for wgpu the uploads, encoding
and submit), reading the tokens back, the scheduler's update, detokenization and stop checks, and handing
each piece to its request's consumer. Divided by the window's decode steps: host µs per step; by the
sequences too: per sequence. CPU time, not wall time: a core taken by another process costs the thread
nothing, so the figure does not swing with the shared machine's load (the wall-time ms per step is
printed beside it).

Within it, on the reference device, the engine's own part (:data:`ENGINE_WORK`: planning, packing and
submitting, reading back and handing the pieces over, timed the same way): the rest is the requests'
consumers waking to take their pieces (asyncio's task switches, the request's generator) and the event
loop's bookkeeping.

The host time uses only public, long-standing API (``Engine.generate``, ``Engine.steps``,
``Device.executor``), so the script runs against older checkouts too (the tree is whatever ``batchgpu``
imports, ``PYTHONPATH``); the engine's own part needs the parts :data:`ENGINE_WORK` names ("-" where a tree
lacks them). ``--model``: a GGUF file or model directory instead of the engine's default model.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average

DEVICE_WORK = {"reference": "run"}
"""Per executor kind, the executor method in which the device's work runs on the calling thread (and whose
reads return at once, without waiting: the engine's part below is measured on these kinds only)."""

ENGINE_WORK = (("scheduler", "schedule"), ("runner", "run"), ("driver", "complete"))
"""The engine's own work per step (attribute of the engine, method): planning the step, packing and
submitting it (the device's work inside it subtracted), reading its tokens back and handing each to its
request (the scheduler's update, detokenization, stop checks, the pieces put on the requests' queues)."""


class Clock:
    """CPU time of the calling thread inside methods patched on their instances (:meth:`time`)."""

    def __init__(self) -> None:
        self.spent = 0.0

    def time(self, owner: Any, method: str) -> None:
        inner = getattr(owner, method)
        if inspect.iscoroutinefunction(inner):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.thread_time()
                try:
                    return await inner(*args, **kwargs)
                finally:
                    self.spent += time.thread_time() - started

            setattr(owner, method, timed_async)
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += time.thread_time() - started

        setattr(owner, method, timed)


def device_clock(executor: Any, kind: str) -> Clock:
    """CPU time of the calling thread inside the executor's device work (see :data:`DEVICE_WORK`)."""
    clock = Clock()
    if kind in DEVICE_WORK:
        clock.time(executor, DEVICE_WORK[kind])
    return clock


def engine_clock(engine: Any, kind: str) -> Clock | None:
    """CPU time of the calling thread in the engine's own work (:data:`ENGINE_WORK`, the device's in it
    included); None on a kind whose reads wait (the consumers would run inside) or on an older engine
    without these parts."""
    owners = [getattr(engine, name, None) for name, _ in ENGINE_WORK]
    if kind not in DEVICE_WORK or any(owner is None for owner in owners):
        return None
    clock = Clock()
    for owner, (_, method) in zip(owners, ENGINE_WORK):
        clock.time(owner, method)
    return clock


class Window:
    """The window in which every request decodes: opened when the last one has its first token, closed
    when the first one ends; CPU time (less the device's; and the engine's own part where measured), wall
    time and decode steps inside it."""

    def __init__(self, engine: Any, device: Clock, own: Clock | None, sequences: int) -> None:
        self.engine, self.device, self.own, self.waiting = engine, device, own, sequences
        self.start: tuple[float, float, float, float, int] | None = None
        self.end: tuple[float, float, float, float, int] | None = None

    def mark(self) -> tuple[float, float, float, float, int]:
        own = self.own.spent if self.own is not None else 0.0
        return time.thread_time(), self.device.spent, own, time.perf_counter(), self.engine.steps["decode"]

    def first_token(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.start = self.mark()

    def finished(self) -> None:
        if self.end is None and self.start is not None:
            self.end = self.mark()

    def per_step(self) -> dict[str, float | None]:
        assert self.start is not None and self.end is not None
        thread, device, own, wall, steps = (end - start for start, end in zip(self.start, self.end))
        return {
            "steps": steps,
            "host_s": thread - device,
            "engine_s": own - device if self.own is not None else None,
            "wall_s": wall,
        }


CORE_CLOCKS: dict[str, Clock | None] = {}
"""In an engine's core process: the clocks :func:`install_clocks` put there."""


def install_clocks(engine: Any, kind: str) -> None:
    """In the core process (:meth:`EngineProcess.call`): the device's and the engine's clocks on its engine."""
    CORE_CLOCKS["device"] = device_clock(engine.device.executor, kind)
    CORE_CLOCKS["own"] = engine_clock(engine, kind)


def core_mark(engine: Any) -> tuple[float, float, float, float, int]:
    """In the core process: :meth:`Window.mark` of its step loop's thread."""
    device, own = CORE_CLOCKS["device"], CORE_CLOCKS["own"]
    assert device is not None
    spent = own.spent if own is not None else 0.0
    return time.thread_time(), device.spent, spent, time.perf_counter(), engine.steps["decode"]


class CoreWindow(Window):
    """The window of an engine whose core runs in a process of its own (``EngineProcess``): its marks are
    the core's step loop thread's, read there (each a message, answered between two steps)."""

    def __init__(self, engine: Any, sequences: int, kind: str) -> None:
        super().__init__(engine, Clock(), Clock() if kind in DEVICE_WORK else None, sequences)
        self.marks: list[asyncio.Task[Any]] = []

    def first_token(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.marks.append(asyncio.ensure_future(self.engine.call(core_mark)))

    def finished(self) -> None:
        if len(self.marks) == 1:
            self.marks.append(asyncio.ensure_future(self.engine.call(core_mark)))

    async def read(self) -> None:
        self.start, self.end = await asyncio.gather(*self.marks)


async def request(engine: Any, prompt: str, tokens: int, window: Window) -> None:
    from batchgpu.llm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    first = True
    async for piece in engine.generate(prompt, params):
        if first:
            first = False
            window.first_token()
        if piece.finish_reason is not None:
            window.finished()


async def crowd(engine: Any, window: Window, sequences: int, tokens: int) -> None:
    await asyncio.gather(*(request(engine, f"Once upon a time ({i})", tokens, window) for i in range(sequences)))
    if isinstance(window, CoreWindow):
        await window.read()


def measure(
    kind: str, sequences: int, tokens: int, repeats: int, model: str | None = None, core_process: bool = False
) -> dict[str, Any]:
    """In this process: the engine of whatever ``batchgpu`` imports (on ``model``; None: the default model),
    warmed up, then ``repeats`` crowds; ``core_process``: the engine's core in a process of its own, its
    step loop's thread measured there."""
    import batchgpu as bg

    blocks = sequences * -(-(16 + tokens) // 16)
    settings = {"max_batch": sequences, "max_context": 256, "kv_blocks": blocks}
    if core_process:
        from batchgpu.llm.engine_process import EngineProcess
        from batchgpu.llm.options import EngineOptions

        engine = EngineProcess(EngineOptions(model=str(model) if model else None, device=kind, **settings))
        asyncio.run(engine.call(install_clocks, kind))
        device_name = asyncio.run(engine.call(device_of))

        def window() -> Window:
            return CoreWindow(engine, sequences, kind)
    else:
        from batchgpu.llm import Engine

        device = bg.Device(kind)
        engine, device_name = Engine(model, device=device, **settings), device.name
        clock, own = device_clock(device.executor, kind), engine_clock(engine, kind)

        def window() -> Window:
            return Window(engine, clock, own, sequences)

    asyncio.run(crowd(engine, window(), sequences, 4))  # records and plans every step
    runs = []
    for _ in range(repeats):
        measured = window()
        asyncio.run(crowd(engine, measured, sequences, tokens))
        runs.append(measured.per_step())
    if core_process:
        engine.close()
    steps = sum(r["steps"] for r in runs)
    host_us = 1e6 * sum(r["host_s"] for r in runs) / steps
    engine_us = 1e6 * sum(r["engine_s"] for r in runs) / steps if runs[0]["engine_s"] is not None else None
    return {
        "tree": str(Path(bg.__file__).resolve().parents[1]),
        "device": device_name,
        "kind": kind,
        "sequences": sequences,
        "steps": steps,
        "host_us_per_step": host_us,
        "host_us_per_sequence": host_us / sequences,
        "engine_us_per_step": engine_us,
        "wall_ms_per_step": 1e3 * sum(r["wall_s"] for r in runs) / steps,
    }


def device_of(engine: Any) -> str:
    """In the core process: its device's name."""
    return engine.device.name


def run_tree(tree: Path, kind: str, args: argparse.Namespace, core_process: bool = False) -> dict[str, Any]:
    """:func:`measure` in a fresh subprocess importing ``batchgpu`` from ``tree``."""
    command = [sys.executable, __file__, "--measure", "--device", kind, "--sequences", str(args.sequences)]
    command += ["--engine-process"] if core_process else []
    command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    command += ["--model", str(args.model.resolve())] if args.model else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="reference,wgpu", help="comma-separated device kinds")
    parser.add_argument("--sequences", type=int, default=16, help="concurrent requests (decode rows)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="crowds per subprocess")
    parser.add_argument("--rounds", type=int, default=3, help="subprocesses per tree (alternating trees)")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout's root, measured in the same run")
    parser.add_argument("--model", type=Path, help="a GGUF file or model directory (default: the engine's)")
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="this checkout's engine with its core in a process of its own (the core's thread measured); "
        "--baseline-tree may then be this checkout, in one process",
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one tree, in this process
    args = parser.parse_args()
    if args.measure:
        print(
            json.dumps(measure(args.device, args.sequences, args.tokens, args.repeats, args.model, args.engine_process))
        )
        return
    this = Path(__file__).resolve().parents[1]
    trees = {"this": this, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; load (1 min) {load_average():.2f}")
    report = []
    for kind in args.device.split(","):
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name in reversed(list(trees)):  # the baseline first in each round
                results[name].append(run_tree(trees[name], kind, args, args.engine_process and name == "this"))
        print(
            f"\n{results['this'][0]['device']} ({kind}), {args.sequences} sequences decoding; load {load_average():.2f}"
        )
        print("| tree | host µs per step | host µs per sequence | engine's own µs per step | wall ms per step | runs |")
        print("|---|---:|---:|---:|---:|---:|")
        medians = {}
        for name, runs in results.items():
            host = statistics.median(r["host_us_per_step"] for r in runs)
            wall = statistics.median(r["wall_ms_per_step"] for r in runs)
            own = [r["engine_us_per_step"] for r in runs if r.get("engine_us_per_step") is not None]
            engine = f"{statistics.median(own):.0f}" if own else "-"
            medians[name] = host
            print(
                f"| {name} ({runs[0]['tree']}) | {host:.0f} | {host / args.sequences:.1f} | {engine} | {wall:.1f} | "
                f"{len(runs)} |"
            )
        if "baseline" in medians:
            print(f"host time per step, baseline / this: {medians['baseline'] / medians['this']:.2f}x")
        report.append({"kind": kind, "results": results})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Decode and prefill at real model sizes (issue 30): synthetic GGUF checkpoints in real models' shapes
(random weights, :mod:`batchgpu.models.synth`) written into a temporary folder, each file once and deleted
when its rows are done, and per (preset, format, executor):

- load: seconds of ``Llama(device, file)`` and the host's peak resident memory while it loads (Linux's
  VmHWM, reset through ``/proc/self/clear_refs`` before the load; the mapped file's pages count);
- batch 1: ``Llama.generate`` ms/token (the single-sequence path with the library's defaults: steps
  submitted ahead of the reads, CUDA graph replay on the native executors), the median step after the
  first 3 tokens, median of ``--rounds`` rounds;
- batch 16: the ``Engine`` (the public API for batches; the batched step is internal) serving 16 greedy
  requests at once, ms per step: per request the time from its 3rd to its last token over the steps
  between, the median over requests. Request 0 has batch 1's prompt, so its ids must be batch 1's;
- prefill tokens/s of a ``--prompt``-token prompt (``Llama.prefill`` and the read of its next token);
- the floor: the weight bytes one decode step reads (every matrix; of the embedding one row where the
  output head is a matrix of its own) over the device's copy bandwidth, measured in this run (bytes read
  plus written per second of a large device-to-device copy: torch's ``copy_`` timed with CUDA events where
  torch has CUDA, else batchgpu's ``copy`` op timed by its profile), and each decode time over it;
- one decode step's GPU time per kernel (``batchgpu.profiling``: every launch timed), the 10 slowest.

Untimed first: one short generation per decoder and engine (recording, compiles, graph capture) and one
prefill. The floor leaves out the KV cache's reads (at these short contexts under 1% of an 8B step's bytes
at batch 1, about 2% at batch 16 in q4_0).

torch, where it has CUDA: a plain-torch float16 Llama on a static KV cache, its decode step replayed as a
CUDA graph (benchmarks/torch_llama.py), from the same file's dequantized weights: once per preset, beside
its first format on the first executor, batch 1 and prefill rounds alternating with batchgpu's; its
"load s" is building it (dequantizing on the host, a thread per CPU, and the upload).

    python benchmarks/real_sizes.py [--preset P,...] [--format F,...] [--device cuda,wgpu] [--json out.json]
    python benchmarks/real_sizes.py --preset qwen2.5-0.5b --format q4_0 --device wgpu --tokens 4 --prompt 32 --rounds 1

Default (no --preset, no --format): llama-3.1-8b in q4_0, q4_k and q8_0, qwen2.5-7b in q4_k, then
llama-3.1-8b in f16 (last: its 16 GB file costs the most, and ``--budget`` drops rows from the end), on every
GPU executor ``python -m batchgpu info`` finds. --preset or --format alone: crossed with q4_0 or
llama-3.1-8b. While one file is measured, the next is written by a background process (--no-write-ahead:
not). A row an executor refuses (LimitError: lavapipe's 128 MiB storage binding refuses the embedding of
most files) says "refused: <message>"; a row that fails says "failed: <error>" and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import WARM_TOKENS, steady_steps
from hf_checkpoint import peak_rss
from machine_load import load_average
from native import first_line, fmt, kernel_table, per_kernel, profiled_step, table, try_torch

import batchgpu as bg
from batchgpu import check
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.llama import GGUFWeights, Llama
from batchgpu.models.synth import FILE_TYPES, PRESETS, tensor_plans, write_synthetic

DEFAULT_RUNS = (
    ("llama-3.1-8b", "q4_0"),
    ("llama-3.1-8b", "q4_k"),
    ("llama-3.1-8b", "q8_0"),
    ("qwen2.5-7b", "q4_k"),
    ("llama-3.1-8b", "f16"),
)
"""Issue 30's list, the costliest file last."""
BATCH = 16
TOP_KERNELS = 10
DISK_MARGIN = 2 << 30  # free bytes left beside a file written ahead
MIB = 1 << 20

Run = tuple[str, str]  # (preset, format)


# the files ----------------------------------------------------------------------------------------


def file_bytes(run: Run) -> int:
    """The tensor bytes of a run's synthetic file (its size less the metadata)."""
    return sum(plan.nbytes for plan in tensor_plans(PRESETS[run[0]], run[1]))


class Files:
    """The runs' synthetic files in ``folder``: each written once, the next one by a background
    ``python -m batchgpu synth`` while the current one is measured (where the disk has room for both)."""

    def __init__(self, folder: Path, seed: int, write_ahead: bool) -> None:
        self.folder, self.seed, self.write_ahead = folder, seed, write_ahead
        self.writing: dict[Run, subprocess.Popen] = {}
        self.logs: dict[Run, Path] = {}

    def path(self, run: Run) -> Path:
        return self.folder / f"{run[0]}-{run[1]}.gguf"

    def start(self, run: Run) -> None:
        """Write ``run``'s file in the background, if asked to and the disk has room."""
        if not self.write_ahead or run in self.writing or self.path(run).exists():
            return
        if shutil.disk_usage(self.folder).free < file_bytes(run) + DISK_MARGIN:
            return  # written when needed, after the current file is gone
        command = [sys.executable, "-m", "batchgpu", "synth", "--preset", run[0], "--format", run[1]]
        command += ["--out", str(self.path(run)), "--seed", str(self.seed)]
        self.logs[run] = self.folder / f"{run[0]}-{run[1]}.log"
        with self.logs[run].open("w") as log:  # the child keeps its own handle
            self.writing[run] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                 env=check.child_environment(), stdin=subprocess.DEVNULL)  # fmt: skip

    def ready(self, run: Run) -> tuple[Path, float]:
        """``run``'s file, awaited from the background or written now, and the seconds waited for it."""
        started, path = time.perf_counter(), self.path(run)
        process = self.writing.pop(run, None)
        if process is not None:
            if process.wait() != 0:
                raise RuntimeError(f"synth {run[0]} {run[1]} failed: {self.logs[run].read_text()[-500:]}")
        elif not path.exists():
            write_synthetic(path, *run, seed=self.seed, show=False)
        return path, time.perf_counter() - started

    def discard(self, run: Run) -> None:
        self.path(run).unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the background writers this object started; the folder is the caller's to delete."""
        for process in self.writing.values():
            process.kill()
            process.wait()
        self.writing.clear()


# what is measured ---------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux); False where that cannot be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def copy_size(device: bg.Device, mib: int) -> int:
    """float32 elements of a copy of at most ``mib`` MiB that the device can bind."""
    limits = device.limits
    return min(mib * MIB, limits.max_storage_buffer_binding_size, limits.max_buffer_size) // 4


def batchgpu_copy_bandwidth(device: bg.Device, mib: int, repeat: int = 5) -> float:
    """Bytes read plus written per second by batchgpu's ``copy`` of a resident float32 tensor: the GPU time
    of its dispatch from the profile (host time of numpy's copy on the reference executor), the median of
    ``repeat`` after one untimed."""
    count = copy_size(device, mib)
    source = device.tensor(np.arange(count, dtype=np.float32))
    batch = bg.GpuCommandBatch(device, name="copy_bandwidth")
    first = batch.slice(batch.copy(source), (slice(0, 1),))  # read one element, not the copy
    times = []
    for _ in range(repeat + 1):
        batch.execute(profile=True)
        batch.read(first)
        row = next(r for r in batch.profile().rows if r.op == "copy")
        times.append((row.gpu_us if row.gpu_us is not None else row.host_us or math.nan) * 1e-6)
    batch.release()
    return 2 * 4 * count / statistics.median(times[1:])


def torch_copy_bandwidth(torch: Any, mib: int, repeat: int = 5) -> float:
    """Bytes read plus written per second by a device-to-device ``copy_`` of ``mib`` MiB (CUDA events)."""
    source = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat + 2):
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del source, target
    torch.cuda.empty_cache()
    return 2 * mib * MIB / statistics.median(times[2:])


def step_bytes(model: Llama) -> int:
    """Device bytes one decode step reads of the weights: all of them, except the embedding's other rows
    where the output head is a matrix of its own."""
    total = sum(t.nbytes for t in model.params.values())
    embedding = model.params["token_embd.weight"]
    if "output.weight" in model.params:
        total -= embedding.nbytes - embedding.nbytes // embedding.shape[0]
    return total


class Contestant(Protocol):
    """A batch-1 decoder of one file: its untimed first run; greedy ids and the median step after the first
    tokens; prefill seconds."""

    def warm(self, prompt: Sequence[int]) -> Any: ...

    def decode(self, prompt: Sequence[int], tokens: int) -> tuple[list[int], float] | None: ...

    def prefill(self, ids: Sequence[int]) -> float | None: ...


class BatchgpuSingle:
    """batchgpu's ``Llama``: ``generate`` with the library's defaults; ``prefill`` and its next token read."""

    def __init__(self, model: Llama) -> None:
        self.model = model

    def warm(self, prompt: Sequence[int]) -> None:
        self.decode(prompt, WARM_TOKENS + 1)  # recording, compiles, a native graph's capture

    def decode(self, prompt: Sequence[int], tokens: int) -> tuple[list[int], float]:
        ids, steps = steady_steps(self.model.generate(prompt, tokens))
        return ids, statistics.median(steps)

    def prefill(self, ids: Sequence[int]) -> float:
        started = time.perf_counter()
        step = self.model.prefill(ids)
        step.batch.read(step.next_token)
        return time.perf_counter() - started


class TorchStatic:
    """torch_llama's ``StaticDecoder`` in float16, its decode step a CUDA graph once captured."""

    def __init__(self, torch: Any, path: Path, context: int) -> None:
        from torch_llama import StaticDecoder

        self.torch = torch
        self.decoder = StaticDecoder(torch, GGUFWeights(path), "cuda", context, dtype=torch.float16)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.decoder.w.values())
        if "output.weight" in self.decoder.w:
            embedding = self.decoder.w["token_embd.weight"]
            self.weight_bytes -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()

    def warm(self, prompt: Sequence[int]) -> None:
        self.decode(prompt, WARM_TOKENS + 1)
        self.decoder.capture()

    def decode(self, prompt: Sequence[int], tokens: int) -> tuple[list[int], float]:
        ids, times = self.decoder.generate(prompt, tokens)  # times[i]: token i + 1
        return ids, statistics.median(times[WARM_TOKENS - 1 :])

    def prefill(self, ids: Sequence[int]) -> float:
        started = time.perf_counter()
        self.decoder.prefill(ids)
        return time.perf_counter() - started


class Guarded:
    """A rival whose errors are noted in its own row (then it gives None), not the batchgpu row's."""

    def __init__(self, contestant: Contestant, row: Row) -> None:
        self.contestant, self.row = contestant, row

    def call(self, stage: str, work: Callable[[], Any]) -> Any:
        return None if self.row.stopped else self.row.guard(stage, work)

    def warm(self, prompt: Sequence[int]) -> Any:
        return self.call("warm-up", lambda: self.contestant.warm(prompt))

    def decode(self, prompt: Sequence[int], tokens: int) -> tuple[list[int], float] | None:
        return self.call("decode", lambda: self.contestant.decode(prompt, tokens))

    def prefill(self, ids: Sequence[int]) -> float | None:
        return self.call("prefill", lambda: self.contestant.prefill(ids))


def alternate(contestants: dict[str, Contestant], rounds: int, measure: Callable[[Contestant], Any]) -> dict:
    """``measure`` of each contestant, round after round in turn: {name: [result per round]}."""
    results: dict[str, list[Any]] = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, contestant in contestants.items():
            results[name].append(measure(contestant))
    return results


async def request(engine: Engine, prompt: Sequence[int], tokens: int) -> tuple[list[int], list[float]]:
    """A greedy request's ids and the arrival time of each."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids: list[int] = []
    stamps: list[float] = []
    async for piece in engine.generate(list(prompt), params):
        ids += piece.token_ids
        stamps += [time.perf_counter()] * len(piece.token_ids)
    return ids, stamps


async def engine_round(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[list[int], float]:
    """All requests at once: request 0's ids and the seconds per step (per request, its 3rd to last token
    over the steps between; the median over requests)."""
    results = await asyncio.gather(*(request(engine, prompt, tokens) for prompt in prompts))
    steps = tokens - WARM_TOKENS
    per_step = [(stamps[-1] - stamps[WARM_TOKENS - 1]) / steps for _, stamps in results]
    return results[0][0], statistics.median(per_step)


# one row ------------------------------------------------------------------------------------------


class Row(dict):
    """One (preset, format, executor) row's figures, and what refused or failed (then its figures stop)."""

    def guard(self, stage: str, work: Callable[[], Any]) -> Any:
        """``work()``, or None with the refusal (LimitError) or failure noted under ``stage``."""
        try:
            return work()
        except bg.LimitError as exc:
            self.setdefault("refused", []).append(f"{stage}: {first_line(exc)}")
        except Exception as exc:  # reported, and the next row runs
            traceback.print_exc()
            self.setdefault("failed", []).append(f"{stage}: {type(exc).__name__}: {first_line(exc)}")
        return None

    @property
    def stopped(self) -> bool:
        return bool(self.get("refused") or self.get("failed"))


def single_context(args: argparse.Namespace) -> int:
    """The batch-1 decoders' context: the prefill prompt or the decode, and room for the profiled step."""
    return max(args.prompt, args.decode_prompt + args.tokens) + 8


def measure_single(row: Row, device: bg.Device, path: Path, args: argparse.Namespace, prompts: dict,
                   rivals: dict[str, Contestant]) -> dict[str, Any]:  # fmt: skip
    """Load, batch-1 decode, the profiled step and prefill on ``device``, alternating with ``rivals``;
    returns the rivals' figures."""
    context = single_context(args)
    reset = reset_peak_rss()
    before, started = current_rss(), time.perf_counter()
    model = Llama(device, path, max_context=context, progress=lambda names: names)
    row.update(load_s=time.perf_counter() - started, rss_before=before, peak_rss=peak_rss(), peak_since_load=reset)
    row.update(weight_bytes=sum(t.nbytes for t in model.params.values()), step_bytes=step_bytes(model))
    contestants: dict[str, Contestant] = {"batchgpu": BatchgpuSingle(model), **rivals}
    decode_prompt, prefill_prompt = prompts["decode"], prompts["prefill"]
    for contestant in contestants.values():  # untimed: recording, compiles, graph capture
        contestant.warm(decode_prompt)
    decoded = alternate(contestants, args.rounds, lambda c: c.decode(decode_prompt, args.tokens))
    profile = profiled_step(model, decoded["batchgpu"][-1][0][-1])
    row.update(kernels=per_kernel(profile), launches=len(profile.rows), kernel_timing=profile.gpu_timing,
               profile_note=profile.message)  # fmt: skip
    for contestant in contestants.values():  # untimed: recording, compiles (a native graph's capture: round 1)
        contestant.prefill(prefill_prompt)
    prefilled = alternate(contestants, args.rounds, lambda c: c.prefill(prefill_prompt))
    figures = {
        name: {
            "b1_ids": decoded[name][0][0],
            "b1_ms": 1e3 * statistics.median(s for _, s in decoded[name]),
            "b1_rounds_ms": [1e3 * s for _, s in decoded[name]],
            "prefill_tokens_per_s": len(prefill_prompt) / statistics.median(prefilled[name]),
            "prefill_rounds_s": prefilled[name],
        }
        for name in contestants
        if None not in decoded[name] + prefilled[name]  # a rival that failed: noted in its row
    }
    row.update(figures.pop("batchgpu"))
    del model, contestants
    gc.collect()
    return figures


def measure_engine(row: Row, device: bg.Device, path: Path, args: argparse.Namespace, prompts: dict) -> None:
    """16 concurrent greedy requests through the Engine, request 0 with batch 1's prompt."""
    context = args.decode_prompt + args.tokens + 8
    blocks = BATCH * -(-context // 16)
    started = time.perf_counter()
    engine = Engine(path, device, max_batch=BATCH, max_context=context, kv_blocks=blocks)
    row["engine_load_s"] = time.perf_counter() - started
    batch = prompts["batch"]
    asyncio.run(engine_round(engine, batch, WARM_TOKENS + 1))  # untimed: recording, compiles, capture
    rounds = [asyncio.run(engine_round(engine, batch, args.tokens)) for _ in range(args.rounds)]
    row.update(b16_ids=rounds[0][0], b16_ms=1e3 * statistics.median(s for _, s in rounds),
               b16_rounds_ms=[1e3 * s for _, s in rounds], b16_steps=dict(engine.decode_sizes))  # fmt: skip
    del engine
    gc.collect()


def make_prompts(args: argparse.Namespace) -> dict[str, Any]:
    """Random byte-token prompts (ids below 256: the synthetic vocabulary's bytes): batch 1's decode prompt,
    the engine's 16 (the first of them batch 1's), the prefill prompt."""
    rng = np.random.default_rng(args.seed)
    batch = [rng.integers(0, 256, args.decode_prompt).tolist() for _ in range(BATCH)]
    return {"decode": batch[0], "batch": batch, "prefill": rng.integers(0, 256, args.prompt).tolist()}


# the table ----------------------------------------------------------------------------------------

HEADER = ["preset", "format", "executor", "device", "load s", "peak RSS MB", "RSS growth MB", "MB/step", "floor ms",
          "batch 1 ms/token", "x floor", "batch 16 ms/step", "batch 16 tokens/s", "x floor", "prefill tokens/s",
          "batch 1 ids = batch 16 request 0"]  # fmt: skip


def cells(row: dict[str, Any]) -> list[str]:
    """The row's table cells: figures, or what refused or failed in the first figure's place."""
    head = [row["preset"], row["format"], row["executor"], row.get("device", "-")]
    floor = row.get("floor_ms")
    b1, b16 = row.get("b1_ms"), row.get("b16_ms")
    figures = [
        fmt(row.get("load_s")), fmt(row["peak_rss"] / MIB, 0) if "peak_rss" in row else "-",
        fmt((row["peak_rss"] - row["rss_before"]) / MIB, 0) if "peak_rss" in row else "-",
        fmt(row["step_bytes"] / MIB, 0) if "step_bytes" in row else "-", fmt(floor, 3),
        fmt(b1, 3), fmt(b1 / floor) if b1 and floor else "-",
        fmt(b16, 3), fmt(BATCH * 1e3 / b16, 1) if b16 else "-", fmt(b16 / floor) if b16 and floor else "-",
        fmt(row.get("prefill_tokens_per_s"), 1), row.get("ids_equal", "-"),
    ]  # fmt: skip
    status = "; ".join(
        f"{kind}: {text}" for kind in ("refused", "failed", "not run") for text in row.get(kind.replace(" ", "_"), [])
    )
    if status:  # in the place of the first figure missing
        figures[next((i for i, value in enumerate(figures) if value == "-"), len(figures) - 1)] = status
    return head + figures


def summary(rows: list[dict[str, Any]]) -> str:
    return table(HEADER, [cells(row) for row in rows])


def row_details(row: dict[str, Any]) -> str:
    """The row, its kernel table and its ids, as printed once it is done."""
    lines = [f"\n## {row['preset']} {row['format']} on {row['executor']} ({row.get('device', '-')})", summary([row])]
    if row.get("kernels"):
        unit = "GPU us" if row.get("kernel_timing") else "host us"
        note = f" ({row['profile_note']})" if row.get("profile_note") else ""
        lines.append(f"\none decode step: {row['launches']} launches; the {TOP_KERNELS} slowest kernels{note}")
        lines.append(kernel_table(row["kernels"], TOP_KERNELS, unit))
    for key in ("b1_ids", "b16_ids"):
        if key in row:
            lines.append(f"{key}: {row[key]}")
    return "\n".join(lines)


# the run ------------------------------------------------------------------------------------------


def planned_runs(presets: str | None, formats: str | None) -> list[Run]:
    if presets is None and formats is None:
        return list(DEFAULT_RUNS)
    names = (presets or "llama-3.1-8b").split(",")
    kinds = (formats or "q4_0").split(",")
    return [(name, kind) for name in names for kind in kinds]


def default_kinds() -> list[str]:
    """The GPU executors ``python -m batchgpu info`` finds, the native ones first."""
    return sorted(check.gpu_executors(check.machine_info()), key=lambda kind: kind not in check.NATIVE_EXECUTORS)


def bandwidths(devices: dict[str, bg.Device], torch: Any, mib: int) -> dict[str, dict[str, Any]]:
    """Per executor: the copy bandwidth its floor uses (torch's where torch has CUDA) and how it was measured."""
    measured = {}
    shared = torch_copy_bandwidth(torch, mib) if torch is not None else None
    for kind, device in devices.items():
        own = batchgpu_copy_bandwidth(device, mib)
        if shared is not None:
            measured[kind] = {"bytes_per_s": shared, "how": f"torch copy_ of {mib} MiB, CUDA events",
                              "batchgpu_copy": own}  # fmt: skip
        else:
            size = copy_size(device, mib) * 4 / MIB
            measured[kind] = {"bytes_per_s": own, "how": f"batchgpu copy of {size:.0f} MiB, profiled"}
    return measured


def measure_row(files: Files, run: Run, kind: str, device: bg.Device, args: argparse.Namespace,
                prompts: dict, bandwidth: float, torch: Any) -> list[Row]:  # fmt: skip
    """The row of ``run`` on ``kind`` (and the torch row beside it where ``torch`` is given)."""
    row = Row(preset=run[0], format=run[1], executor=kind, device=device.name)
    written = row.guard("synth", lambda: files.ready(run))
    if written is None:
        return [row]
    path, waited = written
    row.update(file_bytes=path.stat().st_size, file_wait_s=waited)
    rivals: dict[str, Contestant] = {}
    rows = [row]
    if torch is not None:
        twin = Row(preset=run[0], format=f"f16 of {run[1]}", executor="torch", device=torch.cuda.get_device_name())
        started = time.perf_counter()
        rival = twin.guard("build", lambda: TorchStatic(torch, path, single_context(args)))
        if rival is not None:
            twin.update(load_s=time.perf_counter() - started, step_bytes=rival.weight_bytes)
            rivals["torch"] = Guarded(rival, twin)
        del rival  # the torch model lives in rivals until this row is done
        rows.append(twin)
    figures = row.guard("batch 1", lambda: measure_single(row, device, path, args, prompts, rivals))
    if not row.stopped:
        row.guard("batch 16", lambda: measure_engine(row, device, path, args, prompts))
    if "b1_ids" in row and "b16_ids" in row:
        row["ids_equal"] = "yes" if row["b1_ids"] == row["b16_ids"] else "NO"
    for twin in rows[1:]:
        if figures and "torch" in figures:
            twin.update(figures["torch"])
            twin["ids_equal"] = f"= batchgpu's: {'yes' if twin['b1_ids'] == row.get('b1_ids') else 'no'}"
        elif not twin.stopped:
            twin["failed"] = ["not measured: the batchgpu row beside it stopped"]
    rivals.clear()
    if torch is not None:
        gc.collect()
        torch.cuda.empty_cache()
    for each in rows:
        if each.get("step_bytes"):
            each["floor_ms"] = 1e3 * each["step_bytes"] / bandwidth
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", help=f"comma-separated presets ({', '.join(PRESETS)})")
    parser.add_argument("--format", help=f"comma-separated formats ({', '.join(FILE_TYPES)})")
    parser.add_argument("--device", help="comma-separated executors (default: every GPU executor found)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per decode (the first 3 untimed)")
    parser.add_argument("--decode-prompt", type=int, default=8, help="prompt tokens before the decode")
    parser.add_argument("--prompt", type=int, default=512, help="tokens of the prefill prompt")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per figure (median)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="MiB of the bandwidth copy (or the most bound)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no row is started")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", help="folder for the files (default: a temporary one, deleted)")
    parser.add_argument("--write-ahead", action=argparse.BooleanOptionalAction, default=True,
                        help="write the next file in the background while one is measured")  # fmt: skip
    parser.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                        help="the torch rows where torch has CUDA")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    for preset, fmt_name in planned_runs(args.preset, args.format):
        if preset not in PRESETS:
            parser.error(f"preset {preset!r} is not known; presets: {', '.join(PRESETS)}")
        if fmt_name not in FILE_TYPES:
            parser.error(f"format {fmt_name!r} is not known; formats: {', '.join(FILE_TYPES)}")
    if args.tokens <= WARM_TOKENS:
        parser.error(f"--tokens must be more than {WARM_TOKENS}: the first {WARM_TOKENS} tokens are warm-up")
    if min(args.prompt, args.decode_prompt, args.rounds, args.copy_mib) < 1:
        parser.error("--prompt, --decode-prompt, --rounds and --copy-mib must be at least 1")
    return args


def run(args: argparse.Namespace, folder: Path, say: Callable[[str], Any] = print) -> dict[str, Any]:
    """Every row of ``args`` with the files in ``folder``; the report (also written to --json as it grows)."""
    started = time.perf_counter()
    kinds = args.device.split(",") if args.device else default_kinds()
    if not kinds:
        raise SystemExit("no GPU executor found: name one with --device (reference, or wgpu on lavapipe)")
    torch, reason = try_torch() if args.torch else (None, "--no-torch")
    devices = {kind: bg.Device(kind) for kind in kinds}
    measured = bandwidths(devices, torch, args.copy_mib)
    runs, prompts = planned_runs(args.preset, args.format), make_prompts(args)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "bandwidth": measured,
        "torch": torch.__version__ if torch is not None else f"no torch rows: {reason}",
        "rows": [],
    }
    say(f"# real sizes: {report['date']}; {report['host']}; load average {load_average():.2f}")
    say(
        f"decode: {args.tokens} tokens after a {args.decode_prompt}-token prompt (the first {WARM_TOKENS} untimed), "
        f"batch 1 and {BATCH} requests; prefill: {args.prompt} tokens; medians of {args.rounds} rounds"
    )
    for kind, figures in measured.items():
        extra = f" (batchgpu copy: {figures['batchgpu_copy'] / 1e9:.1f} GB/s)" if "batchgpu_copy" in figures else ""
        say(f"copy bandwidth for {kind}'s floor: {figures['bytes_per_s'] / 1e9:.1f} GB/s, {figures['how']}{extra}")
    say(report["torch"] if torch is None else f"torch {torch.__version__} beside the first format of each preset")
    files = Files(folder, args.seed, args.write_ahead)
    torch_presets = set()
    try:
        for index, run_ in enumerate(runs):
            for kind in kinds:
                if time.perf_counter() - started > args.budget:
                    row = Row(preset=run_[0], format=run_[1], executor=kind, device=devices[kind].name)
                    row["not_run"] = [f"--budget {args.budget:.0f} s spent"]
                    rows = [row]
                else:
                    rival = torch if torch is not None and run_[0] not in torch_presets else None
                    torch_presets.add(run_[0])
                    if index + 1 < len(runs):
                        files.start(runs[index + 1])
                    bandwidth = measured[kind]["bytes_per_s"]
                    rows = measure_row(files, run_, kind, devices[kind], args, prompts, bandwidth, rival)
                for row in rows:
                    row["load_average"] = load_average()
                    say(row_details(row))
                report["rows"] += rows
                if args.json:
                    Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
            files.discard(run_)
    finally:
        files.close()
    report["wall_s"] = time.perf_counter() - started
    say(f"\n## all rows ({report['date']}, {report['wall_s']:.0f} s)\n")
    say(summary(report["rows"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        report = run(args, Path(args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="batchgpu-real-sizes-") as folder:
            report = run(args, Path(folder))
    return 1 if any(row.get("failed") for row in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())

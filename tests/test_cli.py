"""``python -m batchgpu info | bench | profile``, run as subprocesses like a user would; and the
progress helper."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from itertools import pairwise, takewhile

import pytest

import batchgpu
from batchgpu import cli
from batchgpu import progress as progress_module
from batchgpu.progress import progress

from .test_cache import ROOT, python_env


def batchgpu_cli(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchgpu", *args],
        env=python_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_info_lists_adapters_default_and_native_status():
    """The text lists every adapter ``info --json`` reports (whatever the machine has: lavapipe here, a
    GPU elsewhere) with its backend, type and limits, and marks the default one."""
    done, listed = batchgpu_cli("info"), batchgpu_cli("info", "--json")
    assert done.returncode == 0 and listed.returncode == 0, done.stderr + listed.stderr
    out, report = done.stdout, json.loads(listed.stdout)
    assert report["adapters"], report["reason"]
    for adapter in report["adapters"]:
        mark = "   <- default: bg.Device()" if adapter["index"] == report["default"] else ""
        assert f"[{adapter['index']}] {adapter['summary']}{mark}\n" in out
        assert f"backend {adapter['backend']}, type {adapter['type']}, vendor " in out
        assert all(feature in out for feature in adapter["features"])
    assert out.count("<- default: bg.Device()") == 1 and "max-buffer-size=" in out
    assert "CUDA:" in out and "HIP:" in out and "bg.Device('cuda')" in out
    assert "cache dir:" in out


def test_info_json_reports_why_cuda_is_missing():
    done = batchgpu_cli("-v", "info", "--json", "-v")  # -v before and after the command: logs go to stderr
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    adapters = report["adapters"]
    assert adapters and report["default"] in [a["index"] for a in adapters]
    default = adapters[report["default"]]
    assert default["backend"] != "OpenGL"  # native APIs before OpenGL
    assert set(default["limits"]) >= {"max-buffer-size", "max-compute-workgroups-per-dimension"}
    for name in ("cuda", "hip"):
        entry = report["native"][name]
        assert isinstance(entry["available"], bool)
        if not entry["available"]:
            assert entry["reason"]  # the loader's error text, e.g. "libcuda.so.1: cannot open shared object file"


def test_info_without_wgpu_says_why():
    done = batchgpu_cli("info", WGPU_LIB_PATH=str(ROOT / "no-such-libwgpu.so"))
    assert done.returncode == 0, done.stderr
    assert "wgpu: no adapter: wgpu unavailable" in done.stdout
    assert "no-such-libwgpu.so" in done.stdout
    assert "CUDA:" in done.stdout


def test_bench_quick_prints_tables_and_writes_a_png(tmp_path):
    plot, figures = tmp_path / "bench.png", tmp_path / "bench.json"
    done = batchgpu_cli("bench", "--quick", "--plot", str(plot), "--json", str(figures))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "| ops | batched ms | per-op submit ms | naive ms* | naive/batched |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(figures.read_text())
    if report["decode"] is not None:  # benchmarks/decode.py with the llm extra and the model installed
        assert "| decode" in out and report["decode"] and all(v > 0 for v in report["decode"].values())
    else:
        assert "decode benchmark" in out  # and why it is missing
    sweep = report["sweep"]
    assert [row["ops"] for row in sweep] == [10, 50]
    assert all(row["batched_ms"] > 0 and row["per_op_submit_ms"] > 0 and row["naive_ms"] > 0 for row in sweep)


BENCH_WITHOUT_BENCHMARKS = """
import sys
from pathlib import Path

from batchgpu import cli

cli.BENCHMARKS = Path(sys.argv[1])  # as in an installed wheel: no benchmarks/ folder beside the package
raise SystemExit(cli.main(sys.argv[2:]))
"""


def test_bench_without_the_benchmarks_folder_runs_the_sweep_and_says_what_is_missing(tmp_path):
    missing, figures = tmp_path / "benchmarks", tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-c", BENCH_WITHOUT_BENCHMARKS, str(missing), "bench", "--quick", "--plot", "",
         "--json", str(figures)],
        env=python_env(), capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "| ops | batched ms | per-op submit ms | naive ms* | naive/batched |" in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if "decode benchmark" in line]
    assert "benchmarks/ folder of a source checkout" in line and str(missing) in line
    assert "overhead sweep above runs from the installed package" in line
    report = json.loads(figures.read_text())
    assert [row["ops"] for row in report["sweep"]] == [10, 50] and report["decode"] is None


def test_bench_plot_labels_decode_bars_without_overlap():
    pytest.importorskip("matplotlib")
    sweep = [{"ops": n, "batched_ms": 0.1 * n, "per_op_submit_ms": 0.3 * n, "naive_ms": 3.0 * n} for n in (10, 100)]
    decode = {"numpy fp32": 3.21, "batchgpu fp32": 41.7, "batchgpu Q4_1/Q8_0": 58.3, "batchgpu fp16 KV cache": 50.0}
    fig = cli.bench_figure(sweep, decode, "some device", "2026-01-02 03:04")
    try:
        fig.canvas.draw()
        bars = fig.axes[1]
        assert "2026-01-02" in bars.get_title()
        renderer = fig.canvas.get_renderer()
        ticks = [t for t in bars.get_xticklabels() if t.get_text()]
        assert [t.get_text().replace("\n", " ") for t in ticks] == list(decode)
        boxes = sorted((t.get_window_extent(renderer) for t in ticks), key=lambda box: box.x0)
        assert all(right.x0 - left.x1 >= 4 for left, right in pairwise(boxes)), boxes  # pixels between labels
        values = [t.get_text() for t in bars.texts]
        assert values == ["3.2", "41.7", "58.3", "50.0"]
        top = bars.get_window_extent(renderer).y1
        assert all(t.get_window_extent(renderer).y1 <= top for t in bars.texts)  # inside the axes, above the bars
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_help_is_plain_text_and_version_is_printed(capsys):
    for command in ([], ["info"], ["bench"], ["profile"], ["serve"]):
        with pytest.raises(SystemExit) as exited:
            cli.main([*command, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: ") and "``" not in out, out
        assert "-v, --verbose" in out
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"batchgpu {batchgpu.__version__}\n"


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["info"], None),
        (["-v", "info"], logging.INFO),
        (["info", "-v"], logging.INFO),
        (["info", "--verbose"], logging.INFO),
        (["-vv", "info"], logging.DEBUG),
        (["info", "-vv"], logging.DEBUG),
        (["-v", "info", "-v"], logging.DEBUG),
        (["profile", "-v", "script.py", "-v"], logging.INFO),  # the -v after the script is the script's
    ],
)
def test_verbose_before_and_after_the_command_add_up(argv, level):
    args = cli.build_parser().parse_args(argv)
    assert cli.log_level(args) == level
    if argv[0] == "profile":
        assert args.args == ["-v"]


def test_profile_runs_a_script_and_prints_its_batches(tmp_path):
    trace = tmp_path / "ffn.json"
    done = batchgpu_cli(
        "profile", "--trace", str(trace), "examples/ffn_layer.py", "--layers", "1", "--hidden", "64", "--ffn", "96",
        "--repeat", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "max relative error" in out  # the script itself ran, with its arguments
    assert "profile of batch 'batch0'" in out
    table = [line for line in out.splitlines() if line.startswith("| ") and "x" in line and "." in line]
    assert [line.split("|")[2].strip() for line in table] == ["fused(matmul+silu)", "matmul", "mul", "matmul", "add"]
    assert "GPU total" in out
    events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e["ph"] == "X" and e["tid"] == 2 and e["name"] != "compute pass"]
    assert [e["name"] for e in gpu] == ["fused(matmul+silu)", "matmul", "mul", "matmul", "add"]


def test_profile_top_prints_a_per_kernel_summary():
    done = batchgpu_cli(
        "profile", "--top", "2", "examples/ffn_layer.py", "--layers", "2", "--hidden", "64", "--ffn", "96",
        "--repeat", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "(8 more dispatches not shown)" in lines  # --top 2 of 10 dispatches
    at = next(i for i, line in enumerate(lines) if line.startswith("per-kernel summary of batch 'batch0': "))
    assert "10 launches" in lines[at]
    table = takewhile(lambda line: line.startswith("|"), lines[at + 1 :])
    header, _rule, *rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table]
    assert header == ["kernel", "ops", "launches", "GPU us", "us/launch", "share"]
    launches = {family: sum(int(row[2]) for row in rows if row[0].startswith(family)) for family in ("matmul", "elem")}
    assert launches == {"matmul": 6, "elem": 4}  # 3 matmul (one fused with silu), a mul and an add per layer
    assert any(row[1] == "fused(matmul+silu), matmul" for row in rows)  # the ops each kernel ran for
    totals = [float(row[3]) for row in rows]
    assert totals == sorted(totals, reverse=True)
    assert sum(float(row[5].rstrip("%")) for row in rows) == pytest.approx(100, abs=0.5)


def test_profile_of_a_missing_script_fails_cleanly():
    done = batchgpu_cli("profile", "no/such/script.py")
    assert done.returncode == 2 and done.stderr == (
        "batchgpu profile: script must be a readable file, got 'no/such/script.py' (no such file or directory)\n"
    )


def test_progress_is_plain_iteration_without_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv(progress_module.ENV_PROGRESS, raising=False)
    assert not progress_module.enabled()  # pytest captures stderr: not a TTY
    assert list(progress(range(5), "loading", total=5)) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().err == ""


def test_progress_bar_when_forced(capsys, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setenv(progress_module.ENV_PROGRESS, "1")
    assert list(progress(iter(range(3)), "dequantizing", total=3)) == [0, 1, 2]
    assert "dequantizing" in capsys.readouterr().err
    monkeypatch.setenv(progress_module.ENV_PROGRESS, "0")
    assert not progress_module.enabled()


@pytest.mark.parametrize(("flag", "value"), [("--kv-blocks", "0"), ("--block-size", "0"), ("--kv-blocks", "-3")])
def test_serve_refuses_a_kv_pool_without_blocks_before_loading_a_model(flag, value):
    done = batchgpu_cli("serve", flag, value, "--model", "no-such-model.gguf", timeout=60)
    assert done.returncode == 2 and f"serve: {flag} must be at least 1, got {value}" in done.stderr, done.stderr

"""``python -m batchgpu info | bench | profile``, run as subprocesses like a user would; and the
progress helper."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    done = batchgpu_cli("info")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "<- default: bg.Device()" in out
    assert "backend Vulkan" in out and "type CPU" in out  # lavapipe
    assert "timestamp-query" in out and "max-buffer-size=" in out
    assert "CUDA:" in out and "HIP:" in out and "bg.Device('cuda')" in out
    assert "cache dir:" in out


def test_info_json_reports_why_cuda_is_missing():
    done = batchgpu_cli("info", "--json")
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


def test_profile_of_a_missing_script_fails_cleanly():
    done = batchgpu_cli("profile", "no/such/script.py")
    assert done.returncode == 2 and "no such script" in done.stderr


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

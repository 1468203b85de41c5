"""benchmarks/host_step.py's measure on tiny-llama (synthetic) on the reference executor, with the engine in
this process and with its core in a process of its own (the core's step loop thread measured there): the
window holds decode steps, and the engine's own part is within the host time, which is positive."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from batchgpu.models.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("host-step") / "tiny.gguf", "tiny-llama", "q8_0", show=False).path


@pytest.mark.parametrize("core_process", [False, True], ids=["one process", "core process"])
def test_the_host_time_per_step_adds_up(model, core_process: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    module = importlib.import_module("host_step")  # by its name: the core process imports its clocks from it
    figures = module.measure("reference", 4, 16, 1, str(model), core_process)
    assert figures["steps"] > 0 and figures["sequences"] == 4
    host, own = figures["host_us_per_step"], figures["engine_us_per_step"]
    assert math.isfinite(host) and 0 < own <= host

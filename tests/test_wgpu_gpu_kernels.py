"""wgpu's GPU-shaped kernels (``Launch.gpu``: a 32-invocation group per output for decode GEMVs), which
GPU adapters run, checked on lavapipe by forcing them with ``BATCHGPU_GPU_KERNELS=1``.

A CPU adapter normally runs the lavapipe-shaped entries (tests/test_ops.py etc. cover those); here
the matmul tests of the executor-neutral suites and the SmolLM2 greedy ids run again on a device
created with the GPU forms on.
"""

from __future__ import annotations

import os

import pytest

import batchgpu as bg

from .conftest import check_smollm2_greedy_ids, collect_device_tests


@pytest.fixture(scope="module")
def gpu() -> bg.Device:
    pytest.importorskip("wgpu", reason="wgpu-py is not installed here")
    previous = os.environ.get("BATCHGPU_GPU_KERNELS")
    os.environ["BATCHGPU_GPU_KERNELS"] = "1"
    try:
        device = bg.Device("wgpu", poison=True)
    finally:
        if previous is None:
            del os.environ["BATCHGPU_GPU_KERNELS"]
        else:
            os.environ["BATCHGPU_GPU_KERNELS"] = previous
    assert device.executor.gpu_kernels
    return device


@pytest.fixture
def dev(gpu) -> bg.Device:
    return gpu


collect_device_tests(globals(), select=lambda name: "matmul" in name or "linear" in name)


def test_cpu_adapters_run_the_cpu_forms_by_default(monkeypatch):
    pytest.importorskip("wgpu", reason="wgpu-py is not installed here")
    monkeypatch.delenv("BATCHGPU_GPU_KERNELS", raising=False)
    device = bg.Device("wgpu")
    assert device.executor.gpu_kernels == (device.executor.describe()["adapter_type"] != "CPU")


@pytest.mark.model
def test_smollm2_greedy_ids_quantized(gpu):
    """Quantized only: fp32's GEMV (matmul_gemv_t) is covered by the matmul tests above, and the model
    through it takes a minute on lavapipe."""
    check_smollm2_greedy_ids(gpu, quantized=True)

"""The executor-neutral suites (test_ops.py, test_llm_ops.py, the custom kernels with CUDA sources of
test_custom_kernels.py) and the SmolLM2 greedy ids on the native executors ("cuda", "hip").

Each test that takes the ``gpu`` or ``dev`` fixture is collected here again with it bound to a native
device (poisoned outputs). Without the vendor's driver or a device every test skips, the reason naming
what is missing (e.g. "libcuda.so.1 not found: no NVIDIA driver on this machine").
"""

from __future__ import annotations

import pytest

import batchgpu as bg

from .conftest import check_smollm2_greedy_ids, collect_device_tests, native_device_or_skip


@pytest.fixture(params=["cuda", "hip"])
def gpu(request) -> bg.Device:
    return native_device_or_skip(request.param)


@pytest.fixture
def dev(gpu) -> bg.Device:
    return gpu


collect_device_tests(globals())


@pytest.mark.model
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "quantized"])
def test_smollm2_greedy_ids(gpu, quantized):
    check_smollm2_greedy_ids(gpu, quantized)

"""The op suites of test_ops.py and test_llm_ops.py on the native executors ("cuda", "hip").

Each test that takes the ``gpu`` fixture is collected here again with ``gpu`` bound to a native device
(poisoned outputs). Without the vendor's driver or a device every test skips, the reason naming what
is missing (e.g. "libcuda.so.1 not found: no NVIDIA driver on this machine").
"""

from __future__ import annotations

import inspect

import pytest

import batchgpu as bg

from . import test_llm_ops, test_ops
from .conftest import native_device_or_skip

WGPU_ONLY = {"test_kv_cache_decode_with_position_scalar"}  # compares results keyed by "wgpu"


@pytest.fixture(params=["cuda", "hip"])
def gpu(request) -> bg.Device:
    return native_device_or_skip(request.param)


for _module in (test_ops, test_llm_ops):
    for _name, _function in vars(_module).items():
        if _name.startswith("test_") and _name not in WGPU_ONLY and "gpu" in inspect.signature(_function).parameters:
            globals()[_name] = _function

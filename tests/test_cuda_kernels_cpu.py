"""The op suites of test_ops.py and test_llm_ops.py run on the CUDA kernel sources compiled for the
CPU (tests/cuda_cpu.py): what the native executors' kernels compute, checked against numpy without a
GPU. The driver side of the native executors is not involved (tests/test_native_ops.py covers it on a
GPU)."""

from __future__ import annotations

import inspect

import pytest

import batchgpu as bg
from batchgpu.models import llama

from . import cuda_cpu, test_llm_ops, test_ops

WGPU_ONLY = {"test_kv_cache_decode_with_position_scalar"}  # compares results keyed by "wgpu"
TOO_BIG = {"test_op_above_one_dispatch_limit"}  # 2^25 elements: the small grid covers splitting


@pytest.fixture(scope="session")
def gpu(request, tmp_path_factory) -> bg.Device:
    if cuda_cpu.compiler() is None:
        pytest.skip("no C++ compiler (apt-get install g++) to build the CUDA kernels for the CPU")
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    root = cache.mkdir("cuda-cpu-kernels") if cache is not None else tmp_path_factory.mktemp("cuda-cpu-kernels")
    return cuda_cpu.device(cuda_cpu.Kernels(root))


for _module in (test_ops, test_llm_ops):
    for _name, _function in vars(_module).items():
        skipped = _name in WGPU_ONLY | TOO_BIG
        if _name.startswith("test_") and not skipped and "gpu" in inspect.signature(_function).parameters:
            globals()[_name] = _function


@pytest.mark.model
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "quantized"])
def test_smollm2_greedy_ids_on_the_cuda_kernels(gpu, quantized):
    """The whole SmolLM2-135M decode (prefill, 12 greedy tokens, KV cache, GQA attention, Q4_1/Q8_0
    matmuls) on the CUDA kernels gives the same ids as wgpu and the reference."""
    from . import test_smollm2

    model = llama.Llama(gpu, quantized=quantized, max_context=64)
    assert list(model.generate(test_smollm2.PROMPT, len(test_smollm2.GREEDY))) == test_smollm2.GREEDY

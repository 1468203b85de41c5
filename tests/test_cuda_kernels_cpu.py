"""The executor-neutral suites (test_ops.py, test_llm_ops.py, the custom kernels with CUDA sources of
test_custom_kernels.py) and the SmolLM2 greedy ids, run on the CUDA kernel sources compiled for the CPU
(tests/cuda_cpu.py): what the native executors' kernels compute, checked against numpy without a GPU.
The driver side of the native executors is not involved (tests/test_native_ops.py covers it on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg

from . import cuda_cpu
from .conftest import check_smollm2_greedy_ids, collect_device_tests, random_array

TOO_BIG = frozenset({"test_op_above_one_dispatch_limit"})  # 2^25 elements: the small grid covers splitting


@pytest.fixture(scope="session")
def gpu(request, tmp_path_factory) -> bg.Device:
    if cuda_cpu.compiler() is None:
        pytest.skip("no C++ compiler (apt-get install g++) to build the CUDA kernels for the CPU")
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    root = cache.mkdir("cuda-cpu-kernels") if cache is not None else tmp_path_factory.mktemp("cuda-cpu-kernels")
    return cuda_cpu.device(cuda_cpu.Kernels(root))


@pytest.fixture
def dev(gpu) -> bg.Device:
    return gpu


# Tests named *past_loop_cap* run sizes past llvmpipe's per-invocation loop cap (millions of elements):
# too slow for coroutine threads; their chunked paths run here at small sizes (the small_bounds fixture).
collect_device_tests(globals(), skip=TOO_BIG, select=lambda name: "past_loop_cap" not in name)


@pytest.mark.model
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "quantized"])
def test_smollm2_greedy_ids_on_the_cuda_kernels(gpu, quantized):
    """The whole SmolLM2-135M decode (prefill, greedy tokens, KV cache, GQA attention, Q4_1/Q8_0
    matmuls) on the CUDA kernels gives the same ids as wgpu and the reference. The first 5 of the 12
    ids: every GEMV thread is a coroutine here (warp sums), ~0.4 µs each, 6.5M per token."""
    check_smollm2_greedy_ids(gpu, quantized, tokens=5)


def test_tiny_bert_on_the_cuda_kernels(gpu, tmp_path):
    """A tiny random BERT (batched attention with a padding mask, LayerNorm, erf GELU, pooling and
    normalization; two groups, one padded) on the CUDA kernels is within tests/test_encoder.py's tolerance
    of its float64 forward."""
    from . import test_encoder  # skips this test where the safetensors package is missing

    rng = np.random.default_rng(11)
    directory = test_encoder.write_bert(tmp_path / "bert", rng, hidden=12, heads=4, ffn=29, layers=2)
    ids = [rng.integers(0, 41, n).tolist() for n in (1, 9, 23)]
    vectors = test_encoder.Encoder(gpu, directory, max_batch=2).embed(ids)
    expected = test_encoder.forward64(directory, ids)
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=test_encoder.TOLERANCE)


def test_tiny_gemma3_on_the_cuda_kernels(gpu, tmp_path):
    """A tiny random Gemma 3 (sliding-window layers with their own RoPE base, q/k norms, post-norms, GeGLU) on
    the CUDA kernels: prefill logits within 1e-5 x max|logit| of its float64 forward, greedy ids equal."""
    from . import test_gemma3  # skips this test where the gguf package is missing

    weights = test_gemma3.random_gemma3(test_gemma3.TINY, 30)
    test_gemma3.write_gemma3(tmp_path / "gemma3.gguf", weights)
    model = test_gemma3.Llama(gpu, tmp_path / "gemma3.gguf", quantized=False, max_context=16)
    prompt = test_gemma3.PROMPT
    expected = test_gemma3.gemma3_float64_logits(test_gemma3.TINY, weights, prompt)
    step = model.prefill(prompt)
    np.testing.assert_allclose(step.batch.read(step.logits)[0], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(model.generate(prompt, 3)) == test_gemma3.greedy(test_gemma3.TINY, weights, prompt, 3)


@pytest.mark.parametrize("qtype,k", [("q8_0", 96), ("q4_k", 256)])
def test_quantized_matmul_cpu_form_on_the_cuda_kernels(gpu, qtype, k):
    """The CUDA twin of the quantized matmul's CPU form (matmul_q8_0 / matmul_blocks: 8 output features
    of 4 rows of x per thread, which the native executors leave for the warp form) computes every row of
    the grid the lowering gives it: row counts around multiples of 4, bias, the swiglu epilogue."""
    from .test_llm_ops import QUANT_ROW_COUNTS, _quantized_weights, swiglu_of_pairs

    cpu_form = cuda_cpu.device(gpu.executor.kernels)
    cpu_form.executor.form = lambda launch: launch  # the launch as lowered, not its native form
    (w,), truth = _quantized_weights([cpu_form], qtype, 38, k, seed=k + 2)
    rng = np.random.default_rng(64)
    bias = random_array(rng, (38,), np.float32)
    for m in QUANT_ROW_COUNTS:
        x = random_array(rng, (m, k), np.float32)
        product = x.astype(np.float64) @ truth.T
        with np.errstate(over="ignore"):
            cases = (({"bias": True}, product + bias), ({"epilogue": "swiglu"}, swiglu_of_pairs(product)))
        for options, expected in cases:
            batch = bg.GpuCommandBatch(cpu_form)
            extra = dict(bias=batch.upload(bias)) if options.get("bias") else options
            y = batch.matmul(batch.upload(x), w, transpose_b=True, **extra)
            batch.execute()
            np.testing.assert_allclose(batch.read(y), expected, rtol=2e-4, atol=2e-5 * np.abs(expected).max())

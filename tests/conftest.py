"""Shared fixtures: one real wgpu device (lavapipe on CPU machines), the numpy reference device, and a headless
Chromium per module for the browser tests."""

from __future__ import annotations

import os

# One BLAS thread per test process, set before numpy loads (xdist workers and the servers the tests start inherit
# it): the suite runs a process per core, and OpenBLAS's own threads, busy-waiting on cores the other
# workers use, made numpy-heavy tests (the reference executor's matmuls) up to 10x slower on 2 cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import asyncio
import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.export.browser import Chromium, find_chromium

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str, name: str) -> ModuleType:
    """A script of the checkout (``benchmarks/soak.py``, ``examples/x.py``) as module ``name``, loaded once per
    process (registered in ``sys.modules``, as dataclasses in it need)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


TOLERANCES = {
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-6),
    np.dtype(np.float16): dict(rtol=2e-3, atol=2e-3),
    np.dtype(np.int32): dict(rtol=0, atol=0),
    np.dtype(np.uint32): dict(rtol=0, atol=0),
}


@pytest.fixture(scope="session")
def gpu() -> bg.Device:
    """The real default wgpu device, with poisoned output buffers so unwritten elements fail."""
    pytest.importorskip("wgpu", reason="wgpu-py is not installed here (a GPU image running the native suites only)")
    return bg.Device("wgpu", poison=True)


@pytest.fixture(scope="session")
def ref() -> bg.Device:
    return bg.Device("reference")


@pytest.fixture(scope="session")
def smollm2_codec():
    """SmolLM2-135M's TextCodec, read from its GGUF file (skips where gguf, tokenizers or the model file
    is missing)."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from batchgpu.models.codec import TextCodec
    from batchgpu.models.llama import GGUFWeights, smollm2_path

    try:
        path = smollm2_path()
    except Exception as exc:
        pytest.skip(str(exc))
    return TextCodec.from_gguf(GGUFWeights(path).file)


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the kernels' per-invocation work bounds (batchgpu/ops/bounds.py) so that the chunked
    paths (row pieces with partial results, split-K, attention over blocks of rows) run at small sizes
    on every executor; record the batch inside the test, after this fixture ran."""
    from batchgpu.ops import bounds

    monkeypatch.setattr(bounds, "LOOP_BUDGET", 256)
    monkeypatch.setattr(bounds, "ROW_CHUNK", 300)  # not a multiple of the 256-invocation workgroup
    monkeypatch.setattr(bounds, "COLUMN_LIMIT", 7)
    monkeypatch.setattr(bounds, "MATMUL_K_CHUNK", 32)
    monkeypatch.setattr(bounds, "QUANT_BLOCK_CHUNK", 2)


_native_devices: dict[str, bg.Device | str] = {}


def native_device_or_skip(kind: str) -> bg.Device:
    """The process's one ``Device(kind, poison=True)`` for ``"cuda"``/``"hip"``, or a skip whose reason
    names what is missing (no driver library, no GPU)."""
    from batchgpu.errors import DeviceError, UnsupportedError

    if kind not in _native_devices:
        try:
            _native_devices[kind] = bg.Device(kind, poison=True)
        except (UnsupportedError, DeviceError) as exc:
            _native_devices[kind] = f"{kind}: {exc}"
    device = _native_devices[kind]
    if isinstance(device, str):
        pytest.skip(device)
    return device


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype, domain: str = "any") -> np.ndarray:
    """Random non-zero test data; ``positive`` keeps log/sqrt inputs in their domain."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        data = rng.uniform(0.1, 3.0, shape) if domain == "positive" else rng.standard_normal(shape) * 2
    elif dtype.kind == "u":
        data = rng.integers(1, 1000, shape)
    else:
        data = rng.integers(-1000, 1000, shape)
        data[data == 0] = 7
    return np.asarray(data).astype(dtype)


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype=None, scale: float = 1.0) -> None:
    """Compare with the per-dtype tolerance (``scale`` widens float tolerances for long sums)."""
    dtype = np.dtype(dtype or expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64), rtol=tol["rtol"] * scale, atol=tol["atol"] * scale
    )


class TickCounter:
    """How many times another asyncio task got to run (``ticks``) while the block ran."""

    ticks = 0


@contextlib.asynccontextmanager
async def counting_event_loop_ticks() -> AsyncIterator[TickCounter]:
    counter = TickCounter()
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            counter.ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        yield counter
    finally:
        done.set()
        await task


# The executor-neutral suites, collected again by the CUDA/HIP modules (tests/test_native_ops.py and
# tests/test_cuda_kernels_cpu.py) with ``gpu``/``dev`` bound to their device.
DEVICE_SUITES = (
    "test_ops",
    "test_llm_ops",
    "test_custom_kernels",
    "test_sampling",
    "test_paged",
    "test_fusion",
    "test_block_formats",
    "test_numpy_style",
    "test_jit",
    "test_async_reads",
)
WGPU_ONLY = {
    "test_kv_cache_decode_with_position_scalar",  # compares results keyed by "wgpu"
    "test_reexecute_and_second_batch_compile_nothing",  # counts wgpu pipelines
    "test_wgsl_compile_error",
    "test_launch_over_device_limit",  # wgpu limits
    "test_bad_launch_arguments",
    "test_reference_executor_needs_reference_fn",
}


def collect_device_tests(
    namespace: dict, skip: frozenset[str] = frozenset(), select: Callable[[str], bool] = lambda name: True
) -> None:
    """Copy every test of ``DEVICE_SUITES`` that takes ``gpu`` or ``dev`` (and whose name ``select``
    accepts) into ``namespace`` (a test module's globals), with the suites' own fixtures, so the
    module's ``gpu``/``dev`` fixture runs them."""
    import importlib
    import inspect

    for suite in DEVICE_SUITES:
        module = importlib.import_module(f"{__package__}.{suite}")
        for name, value in vars(module).items():
            if name.startswith("test_") and name not in WGPU_ONLY | skip and callable(value) and select(name):
                if {"gpu", "dev"} & set(inspect.signature(value).parameters):
                    namespace[name] = value
            elif name == "rng":  # test_custom_kernels' per-test generator fixture
                namespace.setdefault(name, value)


def check_smollm2_greedy_ids(device: bg.Device, quantized: bool, tokens: int | None = None) -> None:
    """SmolLM2-135M prefill + greedy tokens on ``device`` (all 12, or the first ``tokens``) give the ids
    wgpu and the reference give."""
    from batchgpu.models import llama

    from . import test_smollm2  # skips the caller when the model or gguf is missing

    expected = test_smollm2.GREEDY[:tokens]
    model = llama.Llama(device, quantized=quantized, max_context=64)
    assert list(model.generate(test_smollm2.PROMPT, len(expected))) == expected


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    """One headless Chromium for the module's browser tests."""
    if find_chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium): the browser tests need it")
    with Chromium() as chromium:
        yield chromium

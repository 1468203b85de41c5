"""The f16 variant of an exported chat model (model.json's ``variants.f16``) and the self-test that decides, on
each device, whether it runs (model.json's ``self_test``; the page's ``precision.js``).

The variant is the same steps (:class:`~batchgpu.export.chat_steps.ChatSteps`) with the KV cache stored as
float16 (half its bytes: attention reads half as much) and every launch of a half-capable kernel family in its
half form (:meth:`~batchgpu.kernels.Launch.for_half`, one WGSL source specialized by the alias ``H = f16``):
quantized matmuls dequantize weights to f16 and take their products four at a time in f16, attention its q.k and
p.v products, norms their scaling by the weight; every sum over a row stays f32. It needs WebGPU's ``shader-f16``.

The self-test runs each kernel the variant changes on fixed inputs, in both forms: a matmul per block format the
model's matmuls use (and its SwiGLU epilogue where the model joins gate and up), RoPE with the KV write into the
f16 cache followed by attention of one group of query heads over the model's head size (over a cache split into
blocks where the model's context is), an RMS norm and an add-and-RMS-norm of the model's width. The page accepts
the variant when the f32 kernels give the values computed here (``SELF_TEST_TOLERANCE["f32"]``), and the f16
kernels those of the f32 kernels on the same device (``SELF_TEST_TOLERANCE["f16"]``), every value finite.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batch import GpuCommandBatch
from ..device import Device
from ..models.decoder import attention_settings
from ..models.llama import LlamaConfig
from ..models.row_pieces import Weight, project
from ..ops.attention import split_rows
from ..quant import FORMATS
from ..quantize import quantize
from ..tensor import Storage, Tensor
from .program import Program, ProgramStep, build_program

SELF_TEST_TOLERANCE = {"f32": {"rtol": 1e-3, "atol": 1e-3}, "f16": {"rtol": 1e-2, "atol": 1e-2}}
"""Each value ``v`` of a form against its reference ``r`` (the f32 kernels: the values computed in Python; the f16
kernels: the f32 kernels' on the same device) passes when ``|v - r| <= atol * max(1, max |r|) + rtol * |r|``. f16
keeps 11 significant bits (a relative step of 2^-11 = 4.9e-4): a product of two rounded f16 values errs by up to
~1.5e-3 of its size, and sums of such products stay well inside 1e-2 of the output's largest value; the f32
bound is the export check's (WGSL's latitude for exp and sin/cos)."""

SELF_TEST_SEED = 41
MATMUL_ROWS = 37
"""Output features of each self-test matmul: not a multiple of the kernels' 8 rows per invocation (the SwiGLU
one takes 38: whole pairs)."""
MATMUL_K = 512
"""The self-test matmuls' inner size: two 256-weight super-blocks of the K-quants, 16 blocks of the others."""
CACHE_ROWS = 257
"""Cache rows of the self-test's attention where the model's context takes one pass; past that, one block of
rows and this many more (the split path: partials and their combination), so its data stays small."""
INPUT_SCALE = 4.0
"""The self-test's activations are standard normal times this: values past 10 in magnitude, as hidden states
reach, so that an f16 product or sum that overflows or loses its range shows."""


@dataclass(frozen=True)
class SelfTestShapes:
    """What the self-test runs, from the model: the block formats of its matmul weights (``swiglu``: those of its
    joined gate/up weights), its width, its query heads per kv head, its head size and the attention cache's rows
    (split into blocks where the model's context is)."""

    qtypes: tuple[str, ...]
    swiglu: tuple[str, ...]
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    cache_rows: int
    rope: Mapping[str, Any]
    attention: Mapping[str, Any]
    eps: float


def self_test_shapes(config: LlamaConfig, weights: Mapping[str, Weight], max_context: int) -> SelfTestShapes:
    """The shapes of ``config``'s model with ``weights`` (uploaded) and a KV cache of ``max_context`` rows."""
    tied = "output.weight" not in weights  # else the token embedding is only gathered from
    used = {name: weight for name, weight in weights.items() if tied or name != "token_embd.weight"}

    def qtypes(names: Mapping[str, Weight]) -> tuple[str, ...]:
        found = set()
        for weight in names.values():
            for piece in getattr(weight, "pieces", (weight,)):
                qtype = getattr(piece, "qtype", None)
                if qtype in FORMATS:
                    found.add(qtype)
        return tuple(sorted(found))

    joined = {name: w for name, w in used.items() if name.endswith("ffn_gate_up.weight")}
    block = split_rows(config.head_dim)  # cache rows one attention workgroup takes
    return SelfTestShapes(
        qtypes=qtypes(used),
        swiglu=qtypes(joined),
        hidden=config.hidden,
        heads=config.heads // config.kv_heads,  # one kv head and its group: every head computes alike
        kv_heads=1,
        head_dim=config.head_dim,
        cache_rows=min(max_context, CACHE_ROWS) if max_context <= block else block + CACHE_ROWS,
        rope=config.rope(0),
        attention=attention_settings(config, 0),
        eps=config.eps,
    )


def _matmul_shape(device: Device, qtype: str, rows: int) -> tuple[int, int]:
    """(rows, k) of a self-test weight: ``rows`` by ``MATMUL_K``, fewer of both where a smaller storage binding
    limit (an export's ``limits``) asks for it (rows stay even: SwiGLU pairs)."""
    fmt = FORMATS[qtype]
    limit = device.limits.max_storage_buffer_binding_size
    k = MATMUL_K
    while k > 256 and rows * (k // fmt.weights) * fmt.device_bytes > limit:
        k //= 2
    fit = limit // ((k // fmt.weights) * fmt.device_bytes)
    return (rows if rows <= fit else max(2, fit - fit % 2)), k


def _quantized(device: Device, rng: np.random.Generator, qtype: str, rows: int, k: int) -> Tensor:
    values = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    return device.quantized(quantize(values, qtype), qtype, (rows, k), name=f"w_{qtype}")


def record_self_test(device: Device, shapes: SelfTestShapes, kv_dtype: Any) -> ProgramStep:
    """The self-test's batch on ``device`` with its KV cache in ``kv_dtype``: the same fixed inputs whatever the
    dtype (the cache's values are float16 numbers, so both caches hold them exactly); its outputs by name."""
    rng = np.random.default_rng(SELF_TEST_SEED)
    batch = GpuCommandBatch(device, name=f"self_test_{np.dtype(kv_dtype).name}")
    outputs: dict[str, Tensor] = {}

    def activations(shape: tuple[int, ...], name: str) -> Tensor:
        return batch.upload((rng.standard_normal(shape) * INPUT_SCALE).astype(np.float32), name=name)

    for qtype in shapes.qtypes:
        rows, k = _matmul_shape(device, qtype, MATMUL_ROWS)
        x = activations((1, k), f"x_{qtype}")
        outputs[f"matmul {qtype}"] = project(batch, x, _quantized(device, rng, qtype, rows, k))
    for qtype in shapes.swiglu:
        rows, k = _matmul_shape(device, qtype, MATMUL_ROWS + 1)
        x = activations((1, k), f"x_swiglu_{qtype}")
        outputs[f"swiglu {qtype}"] = project(batch, x, _quantized(device, rng, qtype, rows, k), epilogue="swiglu")
    rows, width = shapes.cache_rows, shapes.heads + 2 * shapes.kv_heads
    cache = rng.standard_normal((rows, shapes.kv_heads, shapes.head_dim)).astype(np.float16)
    keys = batch.upload(cache.astype(kv_dtype), name="keys")
    values = batch.upload(np.flip(cache, axis=0).astype(kv_dtype), name="values")
    qkv = batch.upload(rng.standard_normal((1, width, shapes.head_dim)).astype(np.float32), name="qkv")
    q = batch.rope_kv_write(qkv, keys, values, rows - 1, **shapes.rope)  # the last row, then all rows attended
    outputs["attention"] = batch.attention(q, keys, values, rows - 1, **shapes.attention)
    x, residual = activations((1, shapes.hidden), "x_norm"), activations((1, shapes.hidden), "residual")
    w = batch.upload((1 + 0.1 * rng.standard_normal(shapes.hidden)).astype(np.float32), name="w_norm")
    outputs["rms_norm"] = batch.rms_norm(x, w, shapes.eps)
    outputs["add_rms_norm"] = batch.add_rms_norm(x, residual, w, shapes.eps)[0]
    for name, tensor in outputs.items():
        tensor.name = name
    batch.outputs(*outputs.values())
    return ProgramStep(batch, {}, outputs)


def self_test_program(
    device: Device,
    shapes: SelfTestShapes,
    read_resident: Callable[[Storage], np.ndarray],
    *,
    gpu_kernels: bool,
    offered: set[str],
) -> tuple[Program, bytes]:
    """The self-test program (steps ``f32`` and ``f16``, the latter in half forms with a float16 cache) and the
    expected values of its outputs (the f32 step run on ``device``, float32 bytes in ``test.cases`` order)."""
    steps = {"f32": record_self_test(device, shapes, np.float32), "f16": record_self_test(device, shapes, np.float16)}
    steps["f16"].half = True
    reference = steps["f32"]
    reference.batch.execute()  # type: ignore[attr-defined]
    expected = bytearray()
    outputs: dict[str, Any] = {}
    for name, tensor in reference.outputs.items():
        value = np.ascontiguousarray(reference.batch.read(tensor), np.float32)  # type: ignore[attr-defined]
        outputs[name] = {"offset": len(expected), "bytes": value.nbytes, "dtype": "float32"}
        expected += value.tobytes()
    program = build_program(steps, device.limits, read_resident, gpu_kernels=gpu_kernels, offered=offered)
    program.entry["cases"] = list(reference.outputs)
    program.entry["expected"] = {"file": "self_test/expected.bin", "outputs": outputs}
    program.entry["tolerance"] = SELF_TEST_TOLERANCE
    return program, bytes(expected)

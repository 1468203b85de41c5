"""Row normalizations: rms_norm, add_rms_norm (residual add fused into the norm) and layer_norm."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import FLOAT32
from ..errors import ShapeError
from ..kernels import Launch, wgsl_aliases
from ..tensor import Storage, Tensor
from . import bounds
from .interface import NORM
from .spec import Node, OpSpec, check_dtype, same_dtype

Shape = tuple[int, ...]


def _check_vector(op: str, x: Tensor, vector: Tensor, argument: str) -> None:
    if vector.shape != (x.shape[-1],):
        raise ShapeError(
            f"{op}: {argument} {vector.describe()} must have shape ({x.shape[-1]},) to match the last dim of "
            f"x {x.describe()}"
        )


def _infer_for(op: str, vectors: tuple[str, ...], outputs: int):
    def infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> Any:
        names = ("x", "residual", *vectors) if op == "add_rms_norm" else ("x", *vectors)
        dtype = same_dtype(op, inputs, names)
        x = inputs[0]
        check_dtype(op, "float", x)
        if x.ndim == 0:
            raise ShapeError(f"{op}: x {x.describe()} needs at least one dim")
        if op == "add_rms_norm" and inputs[1].shape != x.shape:
            raise ShapeError(f"{op}: residual {inputs[1].describe()} must have x's shape {x.shape}")
        for tensor, name in zip(inputs[len(names) - len(vectors) :], vectors):
            _check_vector(op, x, tensor, name)
        if not float(params["eps"]) > 0:
            raise ShapeError(f"{op}: eps must be > 0, got {params['eps']!r}")
        return [(x.shape, dtype)] * outputs if outputs > 1 else (x.shape, dtype)

    return infer


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def _layer(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + np.float32(eps)) * w + b


Buffers = dict[str, Tensor | Storage]


def _norm_passes(
    node: Node, op: str, *, whole: Buffers, partials: Buffers, chunks: Buffers, statistics: int
) -> list[Launch]:
    """``op`` over the rows of ``x``: ``{op}_rows`` (bindings ``whole``) while rows fit in one chunk; longer
    rows in two passes over pieces of ``bounds.ROW_CHUNK`` elements: ``{op}_partials`` (bindings
    ``partials``) writes ``statistics`` floats per piece to scratch, ``{op}_chunks`` (bindings ``chunks``)
    combines a row's and writes its piece."""
    x = node.inputs[0]
    d = x.shape[-1]
    rows = x.size // d
    chunk = bounds.ROW_CHUNK
    if d <= chunk:
        return [_launch(node, f"{op}_rows", whole, d, rows)]
    pieces = rows * math.ceil(d / chunk)
    scratch = node.new_scratch(pieces * statistics * FLOAT32.itemsize, FLOAT32)
    return [
        _launch(node, f"{op}_partials", {**partials, "partials": scratch}, chunk, pieces),
        _launch(node, f"{op}_chunks", {**chunks, "partials": scratch}, chunk, pieces),
    ]


def _launch(node: Node, entry: str, buffers: Buffers, chunk: int, groups: int) -> Launch:
    x = node.inputs[0]
    return NORM.launch(
        label=node.spec.name,
        entry=entry,
        types=wgsl_aliases(A=x.dtype),
        groups=groups,
        params=dict(rows=x.size // x.shape[-1], d=x.shape[-1], eps=float(node.params["eps"]), chunk=chunk),
        buffers=buffers,
        workgroup_bytes=NORM.value("WG") * 4,
    )


def _rms_lower(node: Node) -> list[Launch]:
    x, w = node.inputs
    normed: Buffers = dict(x=x, w=w, out=node.output)
    return _norm_passes(node, "rms_norm", whole=normed, partials=dict(x=x), chunks=normed, statistics=1)


def _add_rms_lower(node: Node) -> list[Launch]:
    x, residual, w = node.inputs
    normed, summed = node.outputs
    h: Buffers = dict(x=x, extra=residual)  # x + residual, recomputed in each pass
    out: Buffers = {**h, "w": w, "out": normed}
    return _norm_passes(
        node,
        "add_rms_norm",
        whole={**out, "summed": summed},
        partials={**h, "summed": summed},
        chunks=out,
        statistics=1,
    )


def _layer_lower(node: Node) -> list[Launch]:
    x, w, b = node.inputs
    normed: Buffers = dict(x=x, w=w, extra=b, out=node.output)
    return _norm_passes(node, "layer_norm", whole=normed, partials=dict(x=x), chunks=normed, statistics=2)


RMS_NORM = OpSpec(
    name="rms_norm",
    infer=_infer_for("rms_norm", ("w",), 1),
    reference=lambda arrays, params: _rms(arrays[0], arrays[1], params["eps"]),
    lower=_rms_lower,
    dtypes="float",
    doc="x / sqrt(mean(x**2, -1) + eps) * w",
)

ADD_RMS_NORM = OpSpec(
    name="add_rms_norm",
    infer=_infer_for("add_rms_norm", ("w",), 2),
    reference=lambda arrays, params: (_rms(arrays[0] + arrays[1], arrays[2], params["eps"]), arrays[0] + arrays[1]),
    lower=_add_rms_lower,
    dtypes="float",
    doc="h = x + residual; returns (rms_norm(h, w, eps), h) from one kernel",
)

LAYER_NORM = OpSpec(
    name="layer_norm",
    infer=_infer_for("layer_norm", ("w", "b"), 1),
    reference=lambda arrays, params: _layer(arrays[0], arrays[1], arrays[2], params["eps"]),
    lower=_layer_lower,
    dtypes="float",
    doc="(x - mean) / sqrt(var + eps) * w + b over the last dim",
)

SPECS: list[OpSpec] = [RMS_NORM, ADD_RMS_NORM, LAYER_NORM]

"""Elementwise ops: unary math, broadcasting binary ops, cast and copy. One WGSL template,
``elementwise.wgsl``, specialized per op by its expression and per dtype by type aliases."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..dtypes import UINT32, as_dtype
from ..errors import ShapeError
from ..kernels import Launch, pack_params, wgsl_aliases
from ..tensor import Tensor
from .common import broadcast_strides, check_rank, collapse, groups_for, reads, uniform, writes
from .spec import Node, OpSpec, check_dtype, same_dtype

GELU_C = 0.7978845608028654  # sqrt(2 / pi)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x**3)))


_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def _gelu(x: np.ndarray) -> np.ndarray:
    """x * Phi(x) (torch's default ``gelu``) in float64, Phi(x) = erfc(-x / sqrt(2)) / 2 (no cancellation
    for negative x, unlike 1 + erf), rounded to the input's float dtype."""
    wide = x.astype(np.float64)
    return (0.5 * wide * _erfc(-wide / math.sqrt(2.0))).astype(x.dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


# name: (WGSL expression of x in the compute type C, numpy reference, dtype class, input domain, doc).
# NaN propagates like numpy's: max_nan/min_nan/is_nan (shaders/wgsl/lib/nan.wgsl) test its bit pattern
# on float data (WGSL's max/min/clamp may drop NaN, and x != x may fold to false).
UNARY: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], str, str, str]] = {
    "neg": ("-x", np.negative, "signed", "any", "-x"),
    "abs": ("abs(x)", np.abs, "all", "any", "|x|"),
    "exp": ("exp(x)", np.exp, "float", "any", "e**x"),
    "log": ("log(x)", np.log, "float", "positive", "natural log"),
    "sqrt": ("sqrt(x)", np.sqrt, "float", "positive", "square root"),
    "rsqrt": ("inverseSqrt(x)", lambda x: 1.0 / np.sqrt(x), "float", "positive", "1 / sqrt(x)"),
    "tanh": ("select(tanh(clamp(x, -15.0, 15.0)), x, is_nan(x))", np.tanh, "float", "any", "hyperbolic tangent"),
    "sigmoid": ("1.0 / (1.0 + exp(-x))", _sigmoid, "float", "any", "1 / (1 + e**-x)"),
    "relu": ("max_nan(x, C(0))", lambda x: np.maximum(x, 0).astype(x.dtype), "all", "any", "max(x, 0)"),
    "gelu": ("gelu_erf(x)", _gelu, "float", "any", "GELU, exact: x * Phi(x) with erf (torch's default)"),
    "gelu_tanh": (
        f"0.5 * x * (1.0 + tanh(clamp({GELU_C} * (x + 0.044715 * x * x * x), -15.0, 15.0)))",
        _gelu_tanh,
        "float",
        "any",
        "GELU, tanh approximation (torch's approximate='tanh')",
    ),
    "silu": ("x / (1.0 + exp(-x))", lambda x: x * _sigmoid(x), "float", "any", "x * sigmoid(x)"),
    "copy": ("x", np.copy, "all", "any", "a copy in a new buffer"),
}

# name: (WGSL expression of x and y, numpy reference, dtype class, doc)
BINARY: dict[str, tuple[str, Callable[[np.ndarray, np.ndarray], np.ndarray], str, str]] = {
    "add": ("x + y", np.add, "all", "a + b"),
    "sub": ("x - y", np.subtract, "all", "a - b"),
    "mul": ("x * y", np.multiply, "all", "a * b"),
    "div": ("x / y", np.divide, "float", "a / b (floats only)"),
    "maximum": ("max_nan(x, y)", np.maximum, "all", "elementwise max (NaN if either is, as numpy)"),
    "minimum": ("min_nan(x, y)", np.minimum, "all", "elementwise min (NaN if either is, as numpy)"),
    "silu_mul": ("x / (1.0 + exp(-x)) * y", lambda a, b: a * _sigmoid(a) * b, "float", "silu(a) * b (SwiGLU), fused"),
}

CONTIGUOUS, SCALAR, STRIDED = 0, 1, 2


def _unary_launch(node: Node, expression: str, in_dtype: np.dtype) -> list[Launch]:
    x, out = node.inputs[0], node.output
    params = pack_params((out.size, 0, 0, 0), "IIII", (), (), ())
    return [
        Launch(
            label=node.spec.name,
            family="elementwise",
            entry="unary",
            types=wgsl_aliases(A=in_dtype, B=in_dtype, O=out.dtype),
            snippets=(("UNARY", expression),),
            constants=(("IS_FLOAT", in_dtype.kind == "f"),),
            groups=groups_for(out.size),
            bindings=(reads(0, x), writes(2, out.storage), uniform(3, params)),
            params=params,
        )
    ]


def _unary_spec(name: str) -> OpSpec:
    expression, fn, dtypes, domain, doc = UNARY[name]

    def infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
        (x,) = inputs
        check_dtype(name, dtypes, x)
        if name == "neg" and x.dtype == UINT32:
            check_dtype(name, "signed", x)
        return x.shape, x.dtype

    def reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
        with np.errstate(over="ignore"):
            return fn(arrays[0])

    return OpSpec(
        name=name,
        infer=infer,
        reference=reference,
        lower=lambda node: _unary_launch(node, expression, node.inputs[0].dtype),
        dtypes=dtypes,
        domain=domain,
        doc=doc,
    )


def _mode(tensor: Tensor, out_shape: tuple[int, ...]) -> int:
    if tensor.shape == out_shape:
        return CONTIGUOUS
    return SCALAR if tensor.size == 1 else STRIDED


def _binary_launch(node: Node, expression: str) -> list[Launch]:
    a, b = node.inputs
    out = node.output
    modes = (_mode(a, out.shape), _mode(b, out.shape))
    if STRIDED in modes:
        shape, (a_strides, b_strides) = collapse(
            out.shape, broadcast_strides(a.shape, out.shape), broadcast_strides(b.shape, out.shape)
        )
    else:  # every input is read at the output index or is a scalar: no index math in the kernel
        shape, a_strides, b_strides = (), (), ()
    params = pack_params((out.size, len(shape), 0, 0), "IIII", shape, a_strides, b_strides)
    return [
        Launch(
            label=node.spec.name,
            family="elementwise",
            entry="binary",
            types=wgsl_aliases(A=a.dtype, B=b.dtype, O=out.dtype),
            snippets=(("BINARY", expression),),
            constants=(("A_MODE", modes[0]), ("B_MODE", modes[1]), ("IS_FLOAT", a.dtype.kind == "f")),
            groups=groups_for(out.size),
            bindings=(reads(0, a), reads(1, b), writes(2, out.storage), uniform(3, params)),
            params=params,
        )
    ]


def _binary_spec(name: str) -> OpSpec:
    expression, fn, dtypes, doc = BINARY[name]

    def infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
        a, b = inputs
        dtype = same_dtype(name, inputs, ("a", "b"))
        check_dtype(name, dtypes, a, "a")
        if a.shape == b.shape:
            return a.shape, dtype
        check_rank(name, a)
        check_rank(name, b)
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ShapeError(
                f"{name}: cannot broadcast a {a.describe()} with b {b.describe()}: shapes {a.shape} and {b.shape}"
            ) from None
        return tuple(shape), dtype

    def reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(arrays[0], arrays[1])

    return OpSpec(
        name=name,
        infer=infer,
        reference=reference,
        lower=lambda node: _binary_launch(node, expression),
        dtypes=dtypes,
        doc=doc,
    )


def _cast_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    return inputs[0].shape, as_dtype(params["dtype"], what="cast")


CAST = OpSpec(
    name="cast",
    infer=_cast_infer,
    reference=lambda arrays, params: arrays[0].astype(np.dtype(params["dtype"])),
    lower=lambda node: _unary_launch(node, "x", node.inputs[0].dtype),
    doc="convert to another dtype (float to int truncates toward zero)",
)

SPECS: list[OpSpec] = [_unary_spec(n) for n in UNARY] + [_binary_spec(n) for n in BINARY] + [CAST]

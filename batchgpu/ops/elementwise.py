"""Elementwise ops: unary math, broadcasting binary ops, cast and copy. One kernel family,
``elementwise.wgsl`` / ``elementwise.cu``, specialized per op by its expression (:data:`EXPRESSIONS`, looked
up by op name in each language) and per dtype by type aliases."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..dtypes import UINT32, as_dtype
from ..errors import ShapeError
from ..kernels import Launch, wgsl_aliases
from ..tensor import Tensor
from .common import broadcast_strides, check_rank, collapse, groups_for
from .interface import CONTIGUOUS, ELEMENTWISE, SCALAR, STRIDED
from .spec import Domain, DtypeClass, InferFn, Node, OpSpec, check_dtype, same_dtype

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


_erf_scalar = np.vectorize(math.erf, otypes=[np.float64])


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64, rounded to the input's float dtype."""
    return _erf_scalar(x.astype(np.float64)).astype(x.dtype)


def _mask(compare: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """A numpy comparison as the uint32 0/1 mask the kernels store."""
    return lambda a, b: compare(a, b).astype(np.uint32)


@dataclass(frozen=True)
class Expression:
    """One elementwise op: its expression of ``x`` (unary) or ``x, y`` (binary) in the compute type
    ``C``, in WGSL and, where the text differs, in CUDA (``shaders/cuda/prelude.cuh`` gives the
    ``bg_*`` helpers); the numpy reference; the dtype class it accepts; the inputs its tests draw
    (``positive`` for log and friends); and the doc of its batch method."""

    arity: Literal[1, 2]
    wgsl: str
    reference: Callable[..., np.ndarray]
    dtypes: DtypeClass
    doc: str
    cuda: str = ""
    domain: Domain = "any"
    mask: bool = False  # a comparison: the result is a uint32 0/1 mask whatever the inputs' dtype

    def text(self, language: Literal["wgsl", "cuda"]) -> str:
        """The expression in ``language``."""
        return (self.cuda or self.wgsl) if language == "cuda" else self.wgsl


# NaN propagates like numpy's: max_nan/min_nan/is_nan (shaders/wgsl/lib/nan.wgsl; bg_max_nan... in the
# CUDA prelude) test its bit pattern on float data (WGSL's max/min/clamp may drop NaN, and x != x may
# fold to false). CUDA float literals carry an f: unsuffixed ones would compute in double.
EXPRESSIONS: dict[str, Expression] = {
    "neg": Expression(1, "-x", np.negative, "signed", "-x"),
    "abs": Expression(1, "abs(x)", np.abs, "all", "|x|", cuda="bg_abs(x)"),
    "exp": Expression(1, "exp(x)", np.exp, "float", "e**x", cuda="expf(x)"),
    "log": Expression(1, "log(x)", np.log, "float", "natural log", cuda="logf(x)", domain="positive"),
    "sqrt": Expression(1, "sqrt(x)", np.sqrt, "float", "square root", cuda="sqrtf(x)", domain="positive"),
    "rsqrt": Expression(
        1, "inverseSqrt(x)", lambda x: 1.0 / np.sqrt(x), "float", "1 / sqrt(x)", cuda="rsqrtf(x)", domain="positive"
    ),
    "tanh": Expression(
        1,
        "select(tanh(clamp(x, -15.0, 15.0)), x, is_nan(x))",
        np.tanh,
        "float",
        "hyperbolic tangent",
        cuda="bg_is_nan(x) ? x : tanhf(bg_clamp(x, -15.0f, 15.0f))",
    ),
    "sigmoid": Expression(
        1, "1.0 / (1.0 + exp(-x))", _sigmoid, "float", "1 / (1 + e**-x)", cuda="1.0f / (1.0f + expf(-x))"
    ),
    "relu": Expression(
        1,
        "max_nan(x, C(0))",
        lambda x: np.maximum(x, 0).astype(x.dtype),
        "all",
        "max(x, 0)",
        cuda="bg_max_nan(x, (C)0)",
    ),
    "gelu": Expression(
        1, "gelu_erf(x)", _gelu, "float", "GELU, exact: x * Phi(x) with erf (torch's default)", cuda="bg_gelu_erf(x)"
    ),
    "gelu_tanh": Expression(
        1,
        f"0.5 * x * (1.0 + tanh(clamp({GELU_C} * (x + 0.044715 * x * x * x), -15.0, 15.0)))",
        _gelu_tanh,
        "float",
        "GELU, tanh approximation (torch's approximate='tanh')",
        cuda=f"0.5f * x * (1.0f + tanhf(bg_clamp({GELU_C}f * (x + 0.044715f * x * x * x), -15.0f, 15.0f)))",
    ),
    "silu": Expression(
        1, "x / (1.0 + exp(-x))", lambda x: x * _sigmoid(x), "float", "x * sigmoid(x)", cuda="x / (1.0f + expf(-x))"
    ),
    "copy": Expression(1, "x", np.copy, "all", "a copy in a new buffer"),
    "add": Expression(2, "x + y", np.add, "all", "a + b"),
    "sub": Expression(2, "x - y", np.subtract, "all", "a - b"),
    "mul": Expression(2, "x * y", np.multiply, "all", "a * b"),
    "div": Expression(2, "x / y", np.divide, "float", "a / b (floats only)"),
    "maximum": Expression(
        2, "max_nan(x, y)", np.maximum, "all", "elementwise max (NaN if either is, as numpy)", cuda="bg_max_nan(x, y)"
    ),
    "minimum": Expression(
        2, "min_nan(x, y)", np.minimum, "all", "elementwise min (NaN if either is, as numpy)", cuda="bg_min_nan(x, y)"
    ),
    "pow": Expression(
        2, "pow_real(x, y)", np.power, "float", "a ** b (floats; negative bases need integer b)", cuda="powf(x, y)"
    ),
    "sin": Expression(1, "sin(reduce_turns(x))", np.sin, "float", "sine", cuda="sinf(x)"),
    "cos": Expression(1, "cos(reduce_turns(x))", np.cos, "float", "cosine", cuda="cosf(x)"),
    "floor": Expression(1, "floor(x)", np.floor, "float", "largest integer <= x", cuda="floorf(x)"),
    "ceil": Expression(1, "ceil(x)", np.ceil, "float", "smallest integer >= x", cuda="ceilf(x)"),
    "round": Expression(
        1, "round(x)", np.round, "float", "nearest integer, halves to even (numpy's round)", cuda="rintf(x)"
    ),
    "erf": Expression(1, "erf_f32(x)", _erf, "float", "the error function", cuda="erff(x)"),
    **{
        op: Expression(
            2, f"select(C(0), C(1), {test})", _mask(reference), "all", doc, cuda=f"(({cuda}) ? (C)1 : (C)0)", mask=True
        )
        for op, (test, cuda, reference, doc) in {
            "greater": ("x > y", "x > y", np.greater, "a > b as a uint32 0/1 mask"),
            "greater_equal": ("x >= y", "x >= y", np.greater_equal, "a >= b as a uint32 0/1 mask"),
            "less": ("x < y", "x < y", np.less, "a < b as a uint32 0/1 mask"),
            "less_equal": ("x <= y", "x <= y", np.less_equal, "a <= b as a uint32 0/1 mask"),
            "equal": (
                "x == y && !is_nan(x) && !is_nan(y)",
                "x == y && !bg_is_nan(x) && !bg_is_nan(y)",
                np.equal,
                "a == b as a uint32 0/1 mask",
            ),
            "not_equal": (
                "x != y || is_nan(x) || is_nan(y)",
                "x != y || bg_is_nan(x) || bg_is_nan(y)",
                np.not_equal,
                "a != b as a uint32 0/1 mask",
            ),
        }.items()
    },
    "silu_mul": Expression(
        2,
        "x / (1.0 + exp(-x)) * y",
        lambda a, b: a * _sigmoid(a) * b,
        "float",
        "silu(a) * b (SwiGLU), fused",
        cuda="x / (1.0f + expf(-x)) * y",
    ),
}
"""The op-expression table: every elementwise op by name. A new op is a row here plus its batch method;
``elementwise.wgsl``/``.cu`` take the expression by op name (``Launch.snippets``)."""


def unary_launch(x: Tensor, out: Tensor, op: str, *, label: str) -> Launch:
    """Elementwise op ``op`` of ``x`` into ``out`` (same size; ``out``'s dtype: a cast with ``copy``)."""
    return ELEMENTWISE.launch(
        label=label,
        entry="unary",
        types=wgsl_aliases(A=x.dtype, B=x.dtype, O=out.dtype),
        snippets=(("UNARY", op),),
        constants=(("IS_FLOAT", x.dtype.kind == "f"),),
        groups=groups_for(out.size),
        params=dict(n=out.size, ndim=0, shape=(), a_strides=(), b_strides=(), b_base=0),
        buffers=dict(a=x, out=out),
    )


def _unary_launch(node: Node, op: str) -> list[Launch]:
    return [unary_launch(node.inputs[0], node.output, op, label=node.spec.name)]


def _unary_infer(name: str, dtypes: DtypeClass) -> InferFn:
    def infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
        (x,) = inputs
        check_dtype(name, dtypes, x)
        if name == "neg" and x.dtype == UINT32:
            check_dtype(name, "signed", x)
        return x.shape, x.dtype

    return infer


def read_mode(tensor: Tensor, out_shape: tuple[int, ...]) -> int:
    """How an elementwise kernel reads ``tensor`` for an output of ``out_shape``: at the output index
    (CONTIGUOUS), as a broadcast scalar (SCALAR) or through broadcast strides (STRIDED)."""
    if tensor.shape == out_shape:
        return CONTIGUOUS
    return SCALAR if tensor.size == 1 else STRIDED


def _binary_launch(node: Node, op: str) -> list[Launch]:
    a, b = node.inputs
    out = node.output
    modes = (read_mode(a, out.shape), read_mode(b, out.shape))
    if STRIDED in modes:
        shape, (a_strides, b_strides) = collapse(
            out.shape, broadcast_strides(a.shape, out.shape), broadcast_strides(b.shape, out.shape)
        )
    else:  # every input is read at the output index or is a scalar: no index math in the kernel
        shape, a_strides, b_strides = (), (), ()
    return [
        ELEMENTWISE.launch(
            label=node.spec.name,
            entry="binary",
            types=wgsl_aliases(A=a.dtype, B=b.dtype, O=out.dtype),
            snippets=(("BINARY", op),),
            constants=(("A_MODE", modes[0]), ("B_MODE", modes[1]), ("IS_FLOAT", a.dtype.kind == "f")),
            groups=groups_for(out.size),
            params=dict(n=out.size, ndim=len(shape), shape=shape, a_strides=a_strides, b_strides=b_strides, b_base=0),
            buffers=dict(a=a, b=b, out=out),
        )
    ]


def _binary_infer(name: str, dtypes: DtypeClass) -> InferFn:
    def infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
        a, b = inputs
        dtype = same_dtype(name, inputs, ("a", "b"))
        check_dtype(name, dtypes, a, "a")
        if EXPRESSIONS[name].mask:
            dtype = UINT32
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

    return infer


def _spec(name: str, row: Expression) -> OpSpec:
    """The op spec of an elementwise op from its row of the op-expression table."""
    fn = row.reference
    if row.arity == 1:

        def reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
            with np.errstate(over="ignore", invalid="ignore"):
                return np.asarray(fn(arrays[0]))

        infer, lower = _unary_infer(name, row.dtypes), (lambda node: _unary_launch(node, name))
    else:

        def reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                return np.asarray(fn(arrays[0], arrays[1]))

        infer, lower = _binary_infer(name, row.dtypes), (lambda node: _binary_launch(node, name))
    return OpSpec(
        name=name,
        infer=infer,
        reference=reference,
        lower=lower,
        dtypes=row.dtypes,
        domain=row.domain,
        doc=row.doc,
    )


def _cast_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    return inputs[0].shape, as_dtype(params["dtype"], what="cast")


def _cast_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    """numpy's astype, except from float to an integer type (undefined in numpy past the type's range and
    for NaN): toward zero, saturating at the type's bounds, NaN to 0, as the kernels convert."""
    x, dtype = arrays[0], np.dtype(params["dtype"])
    if x.dtype.kind != "f" or dtype.kind not in "iu":
        return x.astype(dtype)
    info = np.iinfo(dtype)
    wide = x.astype(np.float64)
    return np.clip(np.where(np.isnan(wide), 0.0, wide), info.min, info.max).astype(dtype)


CAST = OpSpec(
    name="cast",
    infer=_cast_infer,
    reference=_cast_reference,
    # copy's expression (x): the conversion is the kernel's own, from A through C to O (float to an integer
    # type: lib/convert.wgsl, the CUDA prelude's CVT)
    lower=lambda node: _unary_launch(node, "copy"),
    doc="convert to another dtype (float to int truncates toward zero, saturates at the int type's bounds, "
    "NaN gives 0)",
)


def _swiglu_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    check_dtype("swiglu", "float", x)
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ShapeError(f"swiglu: the last axis of x {x.describe()} must have an even length (gate, then up)")
    return (*x.shape[:-1], x.shape[-1] // 2), x.dtype


def _swiglu_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    x = arrays[0]
    half = x.shape[-1] // 2
    with np.errstate(over="ignore"):
        return EXPRESSIONS["silu_mul"].reference(x[..., :half], x[..., half:])


def swiglu_launch(x: Tensor, out: Tensor, *, interleaved: bool = False) -> Launch:
    """silu_mul's binary kernel with both operands read through strides from ``x`` (..., 2n) into ``out``
    (..., n): gate [row, j] and up [row, n + j] (b_base = n), or with ``interleaved`` gate [row, 2j] and
    up [row, 2j + 1] (b_base = 1)."""
    rows, half = out.size // out.shape[-1], out.shape[-1]
    strides = (2 * half, 2) if interleaved else (2 * half, 1)
    return ELEMENTWISE.launch(
        label="swiglu",
        entry="binary",
        types=wgsl_aliases(A=x.dtype, B=x.dtype, O=out.dtype),
        snippets=(("BINARY", "silu_mul"),),
        constants=(("A_MODE", STRIDED), ("B_MODE", STRIDED), ("IS_FLOAT", True)),
        groups=groups_for(out.size),
        params=dict(
            n=out.size,
            ndim=2,
            shape=(rows, half),
            a_strides=strides,
            b_strides=strides,
            b_base=1 if interleaved else half,
        ),
        buffers=dict(a=x, b=x, out=out),
    )


def _swiglu_lower(node: Node) -> list[Launch]:
    return [swiglu_launch(node.inputs[0], node.output)]


SWIGLU = OpSpec(
    name="swiglu",
    infer=_swiglu_infer,
    reference=_swiglu_reference,
    lower=_swiglu_lower,
    dtypes="float",
    doc="silu(x[..., :n]) * x[..., n:] for x (..., 2n): silu_mul of a fused gate/up projection",
)

SPECS: list[OpSpec] = [_spec(name, row) for name, row in EXPRESSIONS.items()] + [CAST, SWIGLU]

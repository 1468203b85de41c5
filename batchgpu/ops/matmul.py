"""matmul: 2-D and batched (numpy broadcasting over batch dims), optional transposes, 1-D operands
promoted like numpy. Lowered to one tiled kernel: 64x64 output tiles, 16-deep k tiles staged in
workgroup memory, 4x4 outputs per invocation. With a quantized ``b`` (QuantTensor, rows of GGUF
blocks) it lowers to ``qmatmul.wgsl``: one invocation per 8 output features and 4 rows of ``a``,
each block dequantized once in registers for the 4 rows.

Split-K: an invocation accumulates at most ``bounds.MATMUL_K_CHUNK`` values of K (quantized b:
``bounds.QUANT_BLOCK_CHUNK`` blocks). Longer K is cut into ``splits`` ranges: the kernel (every form of
it) writes split s's partial products to slice s of a (batch, splits, m * n) scratch in the compute dtype,
split 0 adding the bias, and a sum over the splits axis (the sum op's own lowering) writes the output."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..dtypes import compute_dtype
from ..errors import ArgumentError, ShapeError
from ..kernels import Launch, wgsl_aliases
from ..quant import BLOCK, kernel_entry
from ..tensor import QuantTensor, Tensor
from . import bounds, reduce
from .common import broadcast_strides
from .elementwise import EXPRESSIONS, swiglu_launch, unary_launch
from .interface import MATMUL as FAMILY
from .interface import QMATMUL
from .spec import Node, OpSpec, same_dtype

# The kernels' shapes, declared with their interfaces (batchgpu/ops/interface.py).
TILE = FAMILY.value("TILE")
TILE_K = FAMILY.value("TK")
WORKGROUP = (FAMILY.value("TILE_WG"), FAMILY.value("TILE_WG"), 1)
MAX_BATCH_DIMS = 8
SKINNY_ROWS = FAMILY.value("SKINNY_ROWS")
SKINNY_WORKGROUP = FAMILY.value("SKINNY_WG")
SKINNY_COLUMNS = FAMILY.value("SKINNY_COLUMNS")  # output columns per invocation in matmul_skinny
QUANT_WORKGROUP = QMATMUL.value("WG")
QUANT_ROWS = QMATMUL.value("ROWS")  # output features per invocation in qmatmul.wgsl
QUANT_X_ROWS = QMATMUL.value("XROWS")  # rows of x per invocation in qmatmul.wgsl (one dequantization)
BIG_TILE = FAMILY.value("BIG")  # the native executors' large-matmul tile (matmul_128, matmul_mma_f16)
BIG_TILE_K = FAMILY.value("BIG_K")  # k per shared tile step of matmul_128 (4-byte accumulators)
MMA_ROW_HALVES = FAMILY.value("MMA_PAD")  # a float16 tile row of matmul_mma_f16: 32 k values + 8 halves of padding
BIG_TILE_MIN_BLOCKS = 128  # 128 x 128 tiles needed before a non-float16 matmul uses them
WARP = FAMILY.value("WARP")  # lanes per output in the GPU-form GEMV kernels (*_warp, matmul_gemv_t)
WARPS_PER_BLOCK = FAMILY.value("WARPS")


def _operand_dims(a: Tensor, b: Tensor, params: dict[str, Any]) -> tuple[int, int, int, int]:
    """M, K (from a) and K, N (from b) after transposes and 1-D promotion."""
    a_rows, a_cols = (1, a.shape[0]) if a.ndim == 1 else a.shape[-2:]
    b_rows, b_cols = (b.shape[0], 1) if b.ndim == 1 else b.shape[-2:]
    if params.get("transpose_a") and a.ndim > 1:
        a_rows, a_cols = a_cols, a_rows
    if params.get("transpose_b") and b.ndim > 1:
        b_rows, b_cols = b_cols, b_rows
    return a_rows, a_cols, b_rows, b_cols


def _batch_shapes(a: Tensor, b: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (a.shape[:-2] if a.ndim > 2 else ()), (b.shape[:-2] if b.ndim > 2 else ())


EPILOGUES = ("swiglu",)
"""``matmul(..., epilogue=)``: "swiglu" turns each output row's (gate, up) column pairs (2i, 2i + 1) into
silu(gate) * up, halving the last dim; fused into the store of unsplit quantized GEMVs, a second
elementwise pass otherwise."""


def _infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    shape, dtype = _infer_product(inputs, params)
    _check_activation(params.get("activation"), dtype, params.get("epilogue"))
    epilogue = params.get("epilogue")
    if epilogue is None:
        return shape, dtype
    if epilogue not in EPILOGUES:
        raise ArgumentError(f"matmul: epilogue must be one of {EPILOGUES} or None, got {epilogue!r}")
    if len(inputs) == 3:
        raise ArgumentError("matmul: epilogue='swiglu' takes no bias")
    if not shape or shape[-1] % 2 or dtype.kind != "f":
        raise ShapeError(
            f"matmul: epilogue='swiglu' needs a float product with an even last dim (gate, up pairs), got "
            f"shape {shape} {dtype.name}"
        )
    return (*shape[:-1], shape[-1] // 2), dtype


def activations(dtype: np.dtype) -> list[str]:
    """The unary ops of the op-expression table ``matmul(..., activation=)`` takes for ``dtype``."""
    classes = {"all": True, "float": dtype.kind == "f", "signed": dtype.kind in "fi"}
    return [op for op, row in EXPRESSIONS.items() if row.arity == 1 and op != "copy" and classes[row.dtypes]]


def is_activation(node: Node, product: Tensor) -> bool:
    """Whether ``node`` is a unary op ``matmul(..., activation=)`` takes, of ``product`` at its shape."""
    return (
        len(node.inputs) == 1
        and node.inputs[0].storage is product.storage
        and node.inputs[0].shape == product.shape
        and node.spec.name in activations(product.dtype)
    )


def _check_activation(activation: Any, dtype: np.dtype, epilogue: Any) -> None:
    if activation is None:
        return
    if activation not in activations(dtype):
        raise ArgumentError(
            f"matmul: activation must be one of {activations(dtype)} for a {dtype.name} product, got {activation!r}"
        )
    if epilogue is not None:
        raise ArgumentError("matmul: activation and epilogue='swiglu' do not combine")


def fold_epilogue(node: Node, out: Tensor, *, bias: Tensor | None = None, activation: str | None = None) -> Node | None:
    """``node`` (a matmul without bias, epilogue or activation) with ``bias`` and / or ``activation`` in its
    store, writing ``out``, named after the ops it took in; None where the kernel cannot take them in
    one launch (split-K, an operand quantized where a bias may not be)."""
    params = node.params
    if node.spec.name != "matmul" or len(node.inputs) != 2 or len(node.launches) != 1 or node.scratch:
        return None
    if params.get("epilogue") is not None or params.get("activation") is not None:
        return None
    inputs = node.inputs if bias is None else (*node.inputs, bias)
    folded_params = dict(params) if activation is None else dict(params, activation=activation)
    taken = [op for op, used in (("add", bias is not None), (activation, activation is not None)) if used]
    spec = replace(MATMUL, name="fused(" + "+".join(["matmul", *taken]) + ")")  # type: ignore[list-item]
    try:
        _check_activation(activation, out.dtype, None)
        if _infer(inputs, folded_params) != (out.shape, out.dtype):
            return None
    except (ArgumentError, ShapeError):
        return None
    folded = Node(spec, inputs, folded_params, (out,))
    folded.launches = _lower(folded)
    return folded if len(folded.launches) == 1 and not folded.scratch else None


def _infer_product(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    a, b = inputs[:2]
    dtype = same_dtype("matmul", inputs, ("a", "b", "bias"))
    if isinstance(b, QuantTensor):
        return _infer_quantized(inputs, params)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: operands must have at least 1 dim, got a {a.describe()} and b {b.describe()}")
    m, k, k2, n = _operand_dims(a, b, params)
    if k != k2:
        raise ShapeError(
            f"matmul: inner dims differ: a {a.describe()} gives K={k}, b {b.describe()} gives K={k2}"
            f" (transpose_a={bool(params.get('transpose_a'))}, transpose_b={bool(params.get('transpose_b'))})"
        )
    a_batch, b_batch = _batch_shapes(a, b)
    try:
        batch = tuple(np.broadcast_shapes(a_batch, b_batch))
    except ValueError:
        raise ShapeError(
            f"matmul: batch dims {a_batch} of a {a.describe()} and {b_batch} of b {b.describe()} do not broadcast"
        ) from None
    if len(batch) > MAX_BATCH_DIMS:
        raise ShapeError(f"matmul: at most {MAX_BATCH_DIMS} batch dims are supported, got {len(batch)}")
    shape = batch + ((m,) if a.ndim > 1 else ()) + ((n,) if b.ndim > 1 else ())
    if len(inputs) == 3 and inputs[2].shape != (n,):
        raise ShapeError(f"matmul: bias {inputs[2].describe()} must have shape ({n},), one value per output column")
    return shape, dtype


def _split_k(k: int, chunk: int, step: int = 1) -> tuple[int, int]:
    """(chunk, splits) of split-K over ``k``: ``splits`` ranges of ``chunk`` (a multiple of ``step``, the
    kernel's k tile, so no tile straddles two ranges); one range of all of ``k`` when it fits one chunk."""
    chunk = math.ceil(chunk / step) * step
    return min(k, chunk), max(1, math.ceil(k / chunk))


def _split_output(node: Node, splits: int, batch: int) -> Tensor:
    """What the matmul kernel writes: the output itself, or with split-K a (batch, splits, m * n) scratch of
    partial products in the compute dtype (float16 sums in float32, integers wrap as the output does)."""
    out = node.output
    if splits == 1:
        return out
    dtype = compute_dtype(out.dtype)
    shape = (batch, splits, out.size // batch)
    storage = node.new_scratch(math.prod(shape) * dtype.itemsize, dtype)
    return Tensor(shape, dtype, storage, device=out.device, batch=out.batch, name=f"{node.spec.name}.partials")


SUM = next(spec for spec in reduce.SPECS if spec.name == "sum")


def _sum_splits(node: Node, partials: Tensor) -> list[Launch]:
    """Split-K's second pass: the partials' sum over the splits axis into the output, lowered as the sum op
    lowers it (one thread per output walking the splits; a splits axis longer than bounds.COLUMN_LIMIT is
    permuted into rows first, rows longer than bounds.ROW_CHUNK go through partial sums). Nothing without
    split-K."""
    out = node.output
    if partials is out:
        return []
    batch, _, size = partials.shape
    total = Tensor((batch, size), out.dtype, out.storage, device=out.device, batch=out.batch, name=out.name)
    sum_node = Node(SUM, (partials,), {"axis": 1}, (total,))
    launches = SUM.lower(sum_node)
    node.scratch += sum_node.scratch
    for launch in launches:
        launch.label = node.spec.name  # profiles and limit errors name the matmul
    return launches


def _warp_per_output(launch: Launch, entry: str, outputs: int, rows: int, sums_per_invocation: int) -> Launch:
    """The GPU form of a GEMV launch (CUDA/HIP, and wgpu on GPU adapters): a 32-lane warp per output
    of each of ``rows`` rows (with split-K: rows of every split, split after split), as a linear block
    count the executor splits over the grid; its workgroup memory holds ``sums_per_invocation`` 4-byte
    partial sums per invocation (WGSL sums lanes there; CUDA shuffles, but the checks take the larger)."""
    invocations = WARP * WARPS_PER_BLOCK
    return replace(
        launch,
        entry=entry,
        groups=math.ceil(outputs / WARPS_PER_BLOCK) * rows,
        workgroup_size=(invocations, 1, 1),
        workgroup_bytes=4 * sums_per_invocation * invocations,
    )


def _big_tile(launch: Launch, dtype: np.dtype, m: int, n: int, batch: int, splits: int) -> Launch | None:
    """The native form of a tiled matmul: float16 on tensor cores (``matmul_mma_f16``, a 128 x 128
    tile; HIP runs it as ``matmul_128``), other dtypes the 128 x 128 tile once there are enough tiles
    to fill a large GPU; else the WGSL-shaped 64 x 64 tile (None). ``matmul_mma_f16`` ignores split-K
    (it runs all of K; inline PTX that only real NVIDIA GPUs run, so a split path in it would go
    untested): with splits, float16 takes the split-aware tiles like the other dtypes."""
    half = dtype == np.float16 and splits == 1
    big_tiles = math.ceil(m / BIG_TILE) * math.ceil(n / BIG_TILE) * batch * splits
    if not half and big_tiles < BIG_TILE_MIN_BLOCKS:
        return None
    return replace(
        launch,
        entry="matmul_mma_f16" if half else "matmul_128",
        groups=(math.ceil(n / BIG_TILE), math.ceil(m / BIG_TILE) * splits, batch),
        workgroup_size=(FAMILY.value("BIG_WG"), 1, 1),
        workgroup_bytes=2 * BIG_TILE * (MMA_ROW_HALVES * 2 if half else BIG_TILE_K * 4),
    )


def _skinny_launch(
    node: Node, params: dict[str, Any], m: int, n: int, bias: Tensor, b_transposed: bool, target: Tensor, splits: int
) -> Launch:
    """Few rows of a (decode): one invocation per 8 output columns of one row (and split), no tiles to
    fill. With b stored (N, K), GPUs (native executors, wgpu on GPU adapters) run a warp per output column
    over all m rows instead."""
    a, b = node.inputs[:2]
    launch = FAMILY.launch(
        label="matmul",
        entry="matmul_skinny",
        types=wgsl_aliases(A=a.dtype, O=target.dtype),
        groups=(math.ceil(n / (SKINNY_WORKGROUP * SKINNY_COLUMNS)), m, splits),
        constants=(("HAS_BIAS", len(node.inputs) == 3),),
        params=params,
        buffers=dict(a=a, b=b, out=target, bias=bias),
        workgroup_size=(SKINNY_WORKGROUP, 1, 1),
    )
    if b_transposed:
        launch.native = launch.gpu = _warp_per_output(launch, "matmul_gemv_t", n, splits, SKINNY_ROWS)
    return launch


def _lower_with_epilogue(node: Node) -> list[Launch]:
    """The swiglu epilogue in the GEMV's store (quantized weights, one split), else the product into a
    scratch tensor and silu_mul's kernel over its interleaved (gate, up) pairs."""
    w = node.inputs[1]
    plain = dict(node.params, epilogue=None)
    if isinstance(w, QuantTensor) and _quant_split_k(w)[1] == 1:
        (launch,) = _lower_quantized(Node(node.spec, node.inputs, plain, node.outputs))  # one split: no sum
        return [_in_every_form(launch, constants=(*launch.constants, ("SWIGLU", True)))]
    out = node.output
    product, launches = _product_in_scratch(node, plain, (*out.shape[:-1], 2 * out.shape[-1]))
    return [*launches, swiglu_launch(product, out, interleaved=True)]


def _product_in_scratch(node: Node, params: dict[str, Any], shape: tuple[int, ...]) -> tuple[Tensor, list[Launch]]:
    """The launches of the matmul with ``params`` into a new scratch tensor of ``shape`` (the product an
    elementwise pass then reads), and that tensor."""
    out = node.output
    storage = node.new_scratch(math.prod(shape) * out.dtype.itemsize, out.dtype)
    product = Tensor(shape, out.dtype, storage, device=out.device, batch=out.batch, name=f"{node.spec.name}.product")
    inner = Node(node.spec, node.inputs, params, (product,))
    launches = _lower(inner)
    node.scratch += inner.scratch
    node.constants += inner.constants
    return product, launches


def _lower_with_activation(node: Node, activation: str) -> list[Launch]:
    """The activation in the kernel's store where one launch writes the output (one split), else the
    product into a scratch tensor and the op's elementwise kernel from there."""
    plain = dict(node.params, activation=None)
    launches = _lower(Node(node.spec, node.inputs, plain, node.outputs))
    if len(launches) == 1:
        return [_with_activation(launches[0], activation, node.output.dtype)]
    product, launches = _product_in_scratch(node, plain, node.output.shape)
    return [*launches, unary_launch(product, node.output, activation, label=node.spec.name)]


def _with_activation(launch: Launch, activation: str, dtype: np.dtype) -> Launch:
    """``launch`` (and its native / GPU forms) storing activation(value)."""
    return _in_every_form(
        launch,
        snippets=(*launch.snippets, ("ACTIVATION", activation)),
        constants=(*launch.constants, ("IS_FLOAT", dtype.kind == "f")),
    )


def _in_every_form(launch: Launch, **fields: Any) -> Launch:
    """``launch`` with ``fields`` replaced, in its native and GPU forms too (the same specialization)."""
    changed = replace(launch, **fields)
    changed.native = replace(launch.native, **fields) if launch.native is not None else None
    changed.gpu = replace(launch.gpu, **fields) if launch.gpu is not None else None
    return changed


def _quant_split_k(w: QuantTensor) -> tuple[int, int]:
    """(blocks per split, splits) of a quantized GEMV over ``w``'s rows of blocks."""
    return _split_k(w.shape[1] // BLOCK, bounds.QUANT_BLOCK_CHUNK)


def _infer_quantized(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    a, w = inputs[:2]
    rows, k = w.shape
    if not params.get("transpose_b") or params.get("transpose_a"):
        raise ShapeError(
            f"matmul: quantized b {w.describe()} holds (out_features, K) rows of blocks: use "
            f"matmul(a, b, transpose_b=True) without transpose_a"
        )
    if a.ndim == 0 or a.shape[-1] != k:
        raise ShapeError(f"matmul: a {a.describe()} must end in K={k} to multiply quantized b {w.describe()}")
    if len(inputs) == 3 and inputs[2].shape != (rows,):
        raise ShapeError(f"matmul: bias {inputs[2].describe()} must have shape ({rows},)")
    return (*a.shape[:-1], rows), a.dtype


def _lower_quantized(node: Node) -> list[Launch]:
    x, w = node.inputs[:2]
    bias = node.inputs[2] if len(node.inputs) == 3 else x
    rows, k = w.shape
    m = x.size // k
    block_chunk, splits = _quant_split_k(w)
    target = _split_output(node, splits, 1)
    entry, snippets = kernel_entry("matmul", w.qtype)
    launch = QMATMUL.launch(
        label="matmul",
        entry=entry,
        snippets=snippets,
        types=wgsl_aliases(A=x.dtype, O=target.dtype),
        groups=(math.ceil(rows / (QUANT_WORKGROUP * QUANT_ROWS)), math.ceil(m / QUANT_X_ROWS), splits),
        constants=(("HAS_BIAS", len(node.inputs) == 3),),
        params=dict(m=m, n=rows, k=k, blocks=k // BLOCK, block_chunk=block_chunk, splits=splits),
        buffers=dict(x=x, w=w, out=target, bias=bias),
    )
    row_groups = math.ceil(m / QUANT_X_ROWS)  # each weight word read once for XROWS rows of x
    launch.native = launch.gpu = _warp_per_output(launch, f"{entry}_warp", rows, row_groups * splits, 1)
    return [launch, *_sum_splits(node, target)]


def _reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    product = _reference_product(arrays, params)
    if params.get("activation") is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            return EXPRESSIONS[params["activation"]].reference(product)
    if params.get("epilogue") is None:
        return product
    with np.errstate(over="ignore"):
        return EXPRESSIONS["silu_mul"].reference(product[..., 0::2], product[..., 1::2])


def _reference_product(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    a, b = arrays[:2]
    if params.get("transpose_a") and a.ndim > 1:
        a = np.swapaxes(a, -1, -2)
    if params.get("transpose_b") and b.ndim > 1:
        b = np.swapaxes(b, -1, -2)
    out = np.matmul(a, b)
    return out + arrays[2] if len(arrays) == 3 else out


def _lower(node: Node) -> list[Launch]:
    activation = node.params.get("activation")
    if activation is not None:
        return _lower_with_activation(node, activation)
    if node.params.get("epilogue") is not None:
        return _lower_with_epilogue(node)
    if isinstance(node.inputs[1], QuantTensor):
        return _lower_quantized(node)
    a, b = node.inputs[:2]
    bias = node.inputs[2] if len(node.inputs) == 3 else a  # without bias, a stands in for the unread binding
    m, k, _, n = _operand_dims(a, b, node.params)
    a_cols = a.shape[-1]
    b_cols = b.shape[-1] if b.ndim > 1 else 1
    a_sm, a_sk = (1, a_cols) if node.params.get("transpose_a") and a.ndim > 1 else (a_cols, 1)
    b_sk, b_sn = (1, b_cols) if node.params.get("transpose_b") and b.ndim > 1 else (b_cols, 1)
    a_batch, b_batch = _batch_shapes(a, b)
    batch = tuple(np.broadcast_shapes(a_batch, b_batch))
    a_matrix = a.size // max(math.prod(a_batch), 1)
    b_matrix = b.size // max(math.prod(b_batch), 1)
    a_strides = tuple(s * a_matrix for s in broadcast_strides(a_batch, batch)) if batch else ()
    b_strides = tuple(s * b_matrix for s in broadcast_strides(b_batch, batch)) if batch else ()
    batch_count = max(math.prod(batch), 1)
    k_chunk, splits = _split_k(k, bounds.MATMUL_K_CHUNK, TILE_K)
    target = _split_output(node, splits, batch_count)
    params = dict(
        m=m,
        n=n,
        k=k,
        batch_ndim=len(batch),
        strides=(a_sm, a_sk, b_sk, b_sn),
        split_k=(k_chunk, splits),
        batch_shape=batch,
        a_batch_strides=a_strides,
        b_batch_strides=b_strides,
    )
    if not batch and m <= SKINNY_ROWS:
        skinny = _skinny_launch(node, params, m, n, bias, b_sk == 1, target, splits)
        return [skinny, *_sum_splits(node, target)]
    # Split-K folds the splits into grid y (m tiles x splits): a's m x K elements fit one binding, so that
    # stays far below the per-dimension limit (at most 8192 with 128 MiB bindings); batch x splits in z
    # would not.
    groups = (math.ceil(n / TILE), math.ceil(m / TILE) * splits, batch_count)
    launch = FAMILY.launch(
        label="matmul",
        entry="matmul",
        types=wgsl_aliases(A=a.dtype, O=target.dtype),
        groups=groups,
        constants=(("HAS_BIAS", len(node.inputs) == 3),),
        params=params,
        buffers=dict(a=a, b=b, out=target, bias=bias),
        workgroup_size=WORKGROUP,
        workgroup_bytes=2 * TILE * TILE_K * 4,
    )
    launch.native = _big_tile(launch, a.dtype, m, n, batch_count, splits)
    return [launch, *_sum_splits(node, target)]


MATMUL = OpSpec(
    name="matmul",
    infer=_infer,
    reference=_reference,
    lower=_lower,
    doc="a @ b (+ bias), 2-D or batched with broadcast batch dims; transpose_a / transpose_b",
    quantized=(1,),  # b may be quantized weights (QuantTensor), dequantized in registers
)

SPECS: list[OpSpec] = [MATMUL]

"""GpuCommandBatch: record ops once, execute many times with one submit, read back asynchronously."""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import arguments
from .device import Device
from .dtypes import FLOATS, as_dtype, host_copy
from .errors import ArgumentError, BatchError, DeviceMismatchError, DTypeError, LimitError, ShapeError
from .fusion import enabled_by_environment
from .kernels import Kernel
from .limits import check_launch
from .ops import OPS, Node, OpSpec
from .ops.elementwise import EXPRESSIONS
from .profiling import Profile
from .promotion import has_float_scalar, promote_types, scalar_value
from .recording import Recording
from .runtime import BatchRuntime, BatchView, Submission, default_device, warn_deprecated
from .scalars import MAX_SCALARS, SCALAR_FORMATS, Scalar, check_value
from .tensor import QuantTensor, Storage, StorageKind, Tensor, as_shape

Number = int | float | np.number
Operand = Tensor | Number


def _unary(op: str) -> Callable[..., Tensor]:
    def record(self: GpuCommandBatch, x: Tensor, *, name: str = "") -> Tensor:
        return self._named(self._record(op, (x,)), name)

    record.__name__ = record.__qualname__ = op
    record.__doc__ = f"Record ``{op}(x)``: {OPS[op].doc}, elementwise."
    return record


def _binary(op: str) -> Callable[..., Tensor]:
    def record(self: GpuCommandBatch, a: Operand, b: Operand, *, name: str = "") -> Tensor:
        return self._named(self._record(op, (a, b)), name)

    record.__name__ = record.__qualname__ = op
    record.__doc__ = (
        f"Record ``{op}(a, b)``: {OPS[op].doc}, broadcasting like numpy; either may be a Python scalar; mixed "
        "dtypes promote (batchgpu.promotion)."
    )
    return record


class GpuCommandBatch:
    """A recorded command graph on one device.

    Record ops (each returns a :class:`Tensor` handle), then ``execute()``: one command encoder, one
    queue submit (readback copies included), returning once submitted. ``read``/``read_async`` return
    numpy arrays. Re-execute with new inputs via ``execute({x: array})``: nothing is re-recorded and
    no pipeline is recompiled.

    Each chain of elementwise ops runs as one generated kernel (:mod:`batchgpu.fusion`) and intermediates
    share buffers (:mod:`batchgpu.memory`), except the tensors the plan keeps readable: the declared
    outputs (:meth:`outputs`); else, in a batch that computes from its own inputs and constants alone,
    those no op consumes and those read so far (reading another plans anew, see :meth:`read`); else all.
    ``fusion=False`` (or ``BATCHGPU_FUSION=off``) runs every op as recorded, for debugging.
    """

    _names = itertools.count()

    def __init__(self, device: Device | None = None, *, name: str = "", fusion: bool = True) -> None:
        if device is not None and not isinstance(device, Device):
            raise ArgumentError(
                f"GpuCommandBatch: device must be a batchgpu.Device (e.g. bg.Device({device!r})) or None for "
                f"the default device, got {type(device).__name__}"
            )
        self.device = device if device is not None else default_device()
        self.name = arguments.text("GpuCommandBatch", "name", name) or f"batch{next(self._names)}"
        self.fusion = arguments.flag("GpuCommandBatch", "fusion", fusion) and enabled_by_environment()
        self._runtime = BatchRuntime(self, self.device, fusion=self.fusion)  # executes and reads back

    def __repr__(self) -> str:
        return f"GpuCommandBatch({self.name!r}, {len(self._recording.nodes)} ops, {self.device!r})"

    def __len__(self) -> int:
        return len(self._recording.nodes)

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The recorded ops, in order."""
        return tuple(self._recording.nodes)

    @property
    def released(self) -> bool:
        """Whether ``release()`` was called."""
        return self._runtime.released

    @property
    def _recording(self) -> Recording:
        """What this batch recorded, kept by its runtime."""
        return self._runtime.recording

    def view(self) -> BatchView:
        """A read-only view of what was recorded and executed (for the export, profiling and tools)."""
        return self._runtime.view()

    # inputs ----------------------------------------------------------------------------------

    def upload(self, data: Any, dtype: Any = None, *, name: str = "") -> Tensor:
        """A batch input holding ``data``; uploaded by ``execute()``, replaceable via ``execute({x: new})``.

        float64/int64 data is refused unless ``dtype`` asks for a cast."""
        self._check_open("upload")
        arguments.text("upload", "name", name)
        array = host_copy(data, dtype, what=f"upload {name}".strip())  # later edits of data don't leak in
        self.device.check_storable(f"upload {name}".strip(), array.shape, array.dtype)
        tensor = self._new_tensor(array.shape, array.dtype, "input", name or f"input{self._recording.count}", array)
        self._runtime.uploads.append(tensor)
        return tensor

    def empty(self, shape: Sequence[int] | int, dtype: Any = np.float32, *, name: str = "") -> Tensor:
        """An uninitialized tensor for custom kernels to write into."""
        self._check_open("empty")
        arguments.text("empty", "name", name)
        shape = as_shape(shape, what=f"empty {name}".strip())
        resolved = as_dtype(dtype, what="empty")
        self.device.check_storable(f"empty {name}".strip(), shape, resolved)
        return self._new_tensor(shape, resolved, "output", name or f"empty{self._recording.count}")

    def scalar(self, name: str, dtype: Any = "u32", value: int | float = 0) -> Scalar:
        """A per-execute value (``"u32"``, ``"i32"`` or ``"f32"``, or the numpy dtypes uint32, int32,
        float32) that ops such as ``rope`` and ``attention`` read; set it with
        ``execute(scalars={name: value})``."""
        self._check_open("scalar")
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"scalar: name must be a non-empty str, got {name!r}")
        scalars = self._recording.scalars
        if name in scalars:
            raise BatchError(f"scalar: batch {self.name!r} already declares a scalar named {name!r}")
        kind = _scalar_kind(name, dtype)
        if len(scalars) >= MAX_SCALARS:
            raise LimitError(f"scalar {name!r}: a batch holds at most {MAX_SCALARS} scalars")
        declared = Scalar(name, kind, len(scalars), self)
        self._recording.scalar_values[name] = check_value(declared, value)
        scalars[name] = declared
        self._changed()  # the plan sizes its scalar uniform by the declared scalars
        return declared

    def _new_tensor(
        self, shape: tuple[int, ...], dtype: np.dtype, kind: StorageKind, name: str, data: np.ndarray | None = None
    ) -> Tensor:
        storage = Storage(math.prod(shape) * dtype.itemsize, kind, dtype)
        self._recording.own(storage, data)
        self._changed()
        return Tensor(shape, dtype, storage, device=self.device, batch=self, name=name)

    def _changed(self) -> None:
        """The recording grew: the next execute plans anew, and the default readback may differ."""
        self._runtime.recording_changed()

    # ops -------------------------------------------------------------------------------------

    neg = _unary("neg")
    abs = _unary("abs")
    exp = _unary("exp")
    log = _unary("log")
    sqrt = _unary("sqrt")
    rsqrt = _unary("rsqrt")
    tanh = _unary("tanh")
    sigmoid = _unary("sigmoid")
    relu = _unary("relu")
    silu = _unary("silu")
    gelu_tanh = _unary("gelu_tanh")
    copy = _unary("copy")
    add = _binary("add")
    sub = _binary("sub")
    mul = _binary("mul")
    div = _binary("div")
    maximum = _binary("maximum")
    minimum = _binary("minimum")

    silu_mul = _binary("silu_mul")
    sin = _unary("sin")
    cos = _unary("cos")
    floor = _unary("floor")
    ceil = _unary("ceil")
    round = _unary("round")
    erf = _unary("erf")
    pow = _binary("pow")
    greater = _binary("greater")
    greater_equal = _binary("greater_equal")
    less = _binary("less")
    less_equal = _binary("less_equal")
    equal = _binary("equal")
    not_equal = _binary("not_equal")

    def gelu(self, x: Tensor, approximate: str = "none", *, name: str = "") -> Tensor:
        """GELU with ``torch.nn.functional.gelu``'s signature: ``"none"`` (default) is the exact
        ``x * Phi(x)`` (erf), ``"tanh"`` the tanh approximation."""
        ops = {"none": "gelu", "tanh": "gelu_tanh"}
        if not isinstance(approximate, str) or approximate not in ops:
            raise ArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return self._named(self._record(ops[approximate], (x,)), name)

    def matmul(
        self,
        a: Tensor,
        b: Tensor,
        *,
        transpose_a: bool = False,
        transpose_b: bool = False,
        bias: Tensor | None = None,
        epilogue: str | None = None,
        activation: str | None = None,
        name: str = "",
    ) -> Tensor:
        """``a @ b (+ bias)`` (2-D, batched with broadcast batch dims, 1-D promoted like numpy); the
        transposes swap the last two dims of an operand without a copy; ``bias`` (one value per output
        column) is added in the same kernel. ``epilogue="swiglu"``: the output's column pairs (2i, 2i + 1)
        become ``silu(y[..., 2i]) * y[..., 2i + 1]`` (a gate/up projection with interleaved rows), in the
        GEMV's store for quantized weights. ``activation``: a unary elementwise op (``"relu"``, ``"gelu"``,
        ``"silu"``, ...) applied to ``a @ b + bias`` in the kernel's store (a second pass under split-K);
        a batch with declared outputs folds ``relu(matmul(...) + b)`` into this by itself."""
        operands = (a, b) if bias is None else (a, b, bias)
        flags = {
            name: arguments.flag("matmul", name, value)
            for name, value in (("transpose_a", transpose_a), ("transpose_b", transpose_b))
        }
        extra = {key: value for key, value in (("epilogue", epilogue), ("activation", activation)) if value is not None}
        return self._named(self._record("matmul", operands, **flags, **extra), name)

    def sum(
        self, x: Tensor, axis: int | Sequence[int] | None = None, *, keepdims: bool = False, name: str = ""
    ) -> Tensor:
        """Sum over ``axis`` (int, tuple, or None for all); integer sums wrap like int32."""
        return self._named(
            self._record("sum", (x,), axis=axis, keepdims=arguments.flag("sum", "keepdims", keepdims)), name
        )

    def mean(
        self, x: Tensor, axis: int | Sequence[int] | None = None, *, keepdims: bool = False, name: str = ""
    ) -> Tensor:
        """Mean over ``axis`` (floats only)."""
        return self._named(
            self._record("mean", (x,), axis=axis, keepdims=arguments.flag("mean", "keepdims", keepdims)), name
        )

    def max(
        self, x: Tensor, axis: int | Sequence[int] | None = None, *, keepdims: bool = False, name: str = ""
    ) -> Tensor:
        """Maximum over ``axis``."""
        return self._named(
            self._record("max", (x,), axis=axis, keepdims=arguments.flag("max", "keepdims", keepdims)), name
        )

    def softmax(self, x: Tensor, axis: int = -1, *, name: str = "") -> Tensor:
        """Numerically stable softmax along ``axis``."""
        return self._named(self._record("softmax", (x,), axis=axis), name)

    def reshape(self, x: Tensor, *shape: int | Sequence[int], name: str = "") -> Tensor:
        """Same data, new shape (one dim may be -1): a free view, no copy."""
        flat = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return self._named(self._record("reshape", (x,), shape=flat), name)

    def permute(self, x: Tensor, axes: Sequence[int], *, name: str = "") -> Tensor:
        """Reorder axes (``numpy.transpose(x, axes)``), materialized in a new buffer."""
        return self._named(self._record("permute", (x,), axes=_sequence("permute", "axes", axes)), name)

    def transpose(self, x: Tensor, axes: Sequence[int] | None = None, *, name: str = "") -> Tensor:
        """Reverse the axes, or permute them by ``axes``."""
        return self._named(
            self._record("permute", (x,), axes=None if axes is None else _sequence("transpose", "axes", axes)), name
        )

    def slice(self, x: Tensor, key: Any, *, name: str = "") -> Tensor:
        """``x[key]`` with ints, slices (any step), Ellipsis and None (a new axis of length 1, as numpy's
        ``x[:, None]``); also available as ``x[key]``."""
        keys = key if isinstance(key, tuple) else (key,)
        if not any(k is None for k in keys):
            return self._named(self._record("slice", (x,), key=key), name)
        kept = tuple(k for k in keys if k is not None)
        whole = all(k is Ellipsis or (isinstance(k, slice) and k == slice(None)) for k in kept)
        sliced = x if whole else self._record("slice", (x,), key=kept)  # validates the key's other entries
        shape = np.broadcast_to(np.empty((), np.int8), x.shape)[key].shape  # numpy's reading of the key
        return self.reshape(sliced, shape, name=name)

    def clip(self, x: Tensor, lo: Operand | None = None, hi: Operand | None = None, *, name: str = "") -> Tensor:
        """``numpy.clip``: ``minimum(maximum(x, lo), hi)`` (either bound may be None; NaN stays NaN)."""
        if lo is None and hi is None:
            raise ArgumentError("clip: give lo, hi or both")
        low = x if lo is None else self.maximum(x, lo)
        return self._named(low if hi is None else self.minimum(low, hi), name)

    def where(self, cond: Tensor, a: Operand, b: Operand, *, name: str = "") -> Tensor:
        """``numpy.where(cond, a, b)``: ``a`` where ``cond`` is non-zero (a comparison's mask, or any dtype;
        NaN counts as true), else ``b``; all three broadcast; ``a`` and ``b`` (either may be a Python
        scalar) promote to one dtype (batchgpu.promotion)."""
        if not isinstance(cond, Tensor):
            raise ArgumentError(f"where: cond must be a Tensor, got {type(cond).__name__}")
        values = [v for v in (a, b) if isinstance(v, Tensor)]
        if not values:
            raise ArgumentError("where: a or b must be a Tensor (a where of two scalars is a constant)")
        a, b = (v if isinstance(v, Tensor) else _number_operand("where", k, v) for k, v in (("a", a), ("b", b)))
        target = promote_types("where", [v.dtype for v in values], python_float=has_float_scalar((a, b)))
        stand_ins = [_retyped(v, target) if isinstance(v, Tensor) else _constant_stand_in(target) for v in (a, b)]
        OPS["where"].infer((cond, *stand_ins), {})  # refuse bad shapes before recording casts or constants
        a, b = (self._as_dtype(v, target) for v in (a, b))
        return self._named(self._record("where", (cond, a, b)), name)

    def _as_dtype(self, value: Operand, dtype: np.dtype) -> Tensor:
        """A tensor operand cast to ``dtype`` (if it differs), or a Python scalar as a 0-d constant."""
        if isinstance(value, Tensor):
            return value if value.dtype == dtype else self.cast(value, dtype)
        return self.full((), value, dtype)

    # constants -------------------------------------------------------------------------------------

    def full(self, shape: Sequence[int] | int, value: int | float, dtype: Any = None, *, name: str = "") -> Tensor:
        """A constant tensor of ``value`` (recorded into the batch, uploaded once; dtype: float32 for a
        float value, int32 for an int, as torch's defaults)."""
        self._check_open("full")
        shape = as_shape(shape, what="full")
        array = host_copy(np.full(shape, value), dtype, what="full") if dtype is not None else None
        if array is None:
            array = np.full(shape, value, np.float32 if isinstance(scalar_value(value), float) else np.int32)
        self.device.check_storable("full", array.shape, array.dtype)
        return self._new_tensor(array.shape, array.dtype, "const", name or f"const{self._recording.count}", array)

    def zeros(self, shape: Sequence[int] | int, dtype: Any = np.float32, *, name: str = "") -> Tensor:
        """A constant tensor of zeros (float32 unless ``dtype``)."""
        return self.full(shape, 0, dtype, name=name)

    def ones(self, shape: Sequence[int] | int, dtype: Any = np.float32, *, name: str = "") -> Tensor:
        """A constant tensor of ones (float32 unless ``dtype``)."""
        return self.full(shape, 1, dtype, name=name)

    def arange(
        self, start: int | float, stop: int | float | None = None, step: int | float = 1, dtype: Any = None
    ) -> Tensor:
        """A constant ``numpy.arange`` (int32 for int arguments, float32 if any is a float, unless ``dtype``)."""
        self._check_open("arange")
        values = np.arange(start, stop, step) if stop is not None else np.arange(start)
        default = np.float32 if values.dtype.kind == "f" else np.int32
        array = host_copy(values, dtype or default, what="arange")
        if array.size == 0:
            raise ShapeError(f"arange: ({start}, {stop}, {step}) has no elements")
        self.device.check_storable("arange", array.shape, array.dtype)
        return self._new_tensor(array.shape, array.dtype, "const", f"arange{self._recording.count}", array)

    def concat(self, tensors: Sequence[Tensor], axis: int = 0, *, name: str = "") -> Tensor:
        """Join tensors along ``axis`` (``numpy.concatenate``)."""
        return self._named(self._record("concat", _sequence("concat", "tensors", tensors), axis=axis), name)

    def cast(self, x: Tensor, dtype: Any, *, name: str = "") -> Tensor:
        """Convert to ``dtype`` (float to int truncates toward zero, saturates at the int type's bounds and
        gives 0 for NaN, on every executor)."""
        return self._named(self._record("cast", (x,), dtype=as_dtype(dtype, what="cast")), name)

    def swiglu(self, x: Tensor, *, name: str = "") -> Tensor:
        """``silu(x[..., :n]) * x[..., n:]`` for ``x`` (..., 2n): ``silu_mul`` of a fused gate/up projection
        (its halves read in place, no copies)."""
        return self._named(self._record("swiglu", (x,)), name)

    def rms_norm(self, x: Tensor, w: Tensor, eps: float = 1e-5, *, name: str = "") -> Tensor:
        """``x / sqrt(mean(x**2, -1) + eps) * w`` per row, one workgroup reduction per row."""
        return self._named(self._record("rms_norm", (x, w), eps=arguments.real("rms_norm", "eps", eps)), name)

    def add_rms_norm(self, x: Tensor, residual: Tensor, w: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
        """The residual add fused into the norm: returns ``(rms_norm(x + residual, w, eps), x + residual)``."""
        return self._record("add_rms_norm", (x, residual, w), eps=arguments.real("add_rms_norm", "eps", eps))

    def layer_norm(self, x: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5, *, name: str = "") -> Tensor:
        """``(x - mean) / sqrt(var + eps) * w + b`` over the last dim."""
        return self._named(self._record("layer_norm", (x, w, b), eps=arguments.real("layer_norm", "eps", eps)), name)

    def rope(
        self,
        x: Tensor,
        pos: Scalar | int | Tensor,
        theta: float = 10000.0,
        *,
        factors: Sequence[float] | None = None,
        name: str = "",
    ) -> Tensor:
        """Rotary embedding, rotate-half convention (Llama in transformers), of ``x`` shaped
        (tokens, heads, head_dim); token t sits at position ``pos + t``, or at ``pos[t]`` when ``pos`` is
        an int32 Tensor of shape (tokens,) (any order and repeats; negative values rotate backwards).
        Pair i turns at ``theta ** (-2i / head_dim) / factors[i]`` (``factors``: head_dim / 2 numbers > 0,
        Llama 3's or linear RoPE scaling; None: all 1)."""
        rope = dict(theta=arguments.real("rope", "theta", theta))
        if factors is not None:
            rope["factors"] = arguments.positive_reals("rope", "factors", factors)
        if isinstance(pos, Tensor):
            return self._named(self._record("rope", (x, pos), pos=None, **rope), name)
        return self._named(self._record("rope", (x,), pos=self._own_scalar("rope", pos), **rope), name)

    def kv_write(self, cache: Tensor, new: Tensor, pos: Scalar | int) -> Tensor:
        """Write ``new`` (tokens, kv_heads, head_dim) into ``cache`` rows ``pos .. pos + tokens`` in
        place; returns ``cache``. Executes check the position fits the cache."""
        self._record("kv_write", (cache, new), pos=self._own_scalar("kv_write", pos))
        return cache

    def rope_kv_write(
        self,
        qkv: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        pos: Scalar | int | Tensor,
        theta: float = 10000.0,
        *,
        rows: Tensor | None = None,
        factors: Sequence[float] | None = None,
    ) -> Tensor:
        """``rope`` (with its ``factors``) and ``kv_write`` of a fused q/k/v projection in one kernel: ``qkv``
        is (tokens, heads + 2 * kv_heads, head_dim), the q heads, then the k heads, then the v heads
        (kv_heads: the caches').
        Token t sits at position ``pos + t`` and its rope(k) and v go to the caches' row ``pos + t``; with
        ``pos`` an int32 Tensor (tokens,) of positions, ``rows`` (int32, (tokens,)) gives each token's cache
        row instead (negative: skipped, as ``scatter_rows``: a paged pool). Returns rope(q), (tokens,
        heads, head_dim) in qkv's dtype; the caches may be float32 or float16 whatever qkv's dtype. The
        numbers equal ``rope``, ``rope`` + ``kv_write`` / ``scatter_rows`` and ``kv_write`` of the parts."""
        rope = dict(theta=arguments.real("rope_kv_write", "theta", theta))
        if factors is not None:
            rope["factors"] = arguments.positive_reals("rope_kv_write", "factors", factors)
        if isinstance(pos, Tensor):
            if not isinstance(rows, Tensor):
                raise ArgumentError("rope_kv_write: with a positions Tensor, rows (each token's cache row) is needed")
            return self._record("rope_kv_write", (qkv, k_cache, v_cache, pos, rows), pos=None, **rope)
        if rows is not None:
            raise ArgumentError("rope_kv_write: rows goes with a positions Tensor, not a scalar or int position")
        position = self._own_scalar("rope_kv_write", pos)
        return self._record("rope_kv_write", (qkv, k_cache, v_cache), pos=position, **rope)

    def attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        pos: Scalar | int,
        *,
        causal: bool = True,
        scale: float | None = None,
        window: int = 0,
        name: str = "",
    ) -> Tensor:
        """Attention of ``q`` (tokens, heads, head_dim) over cache rows ``[0, pos + tokens)``; query t
        sees rows up to ``pos + t`` when causal. Grouped-query: heads a multiple of the cache's kv heads.
        ``window`` (sliding-window attention, causal only): query t sees only the ``window`` rows up to
        ``pos + t`` (0: all)."""
        pos = self._own_scalar("attention", pos)
        causal = arguments.flag("attention", "causal", causal)
        scale = None if scale is None else arguments.real("attention", "scale", scale)
        record = self._record("attention", (q, k_cache, v_cache), pos=pos, causal=causal, scale=scale, window=window)
        return self._named(record, name)

    def embedding(self, ids: Tensor, table: Tensor, *, name: str = "") -> Tensor:
        """Rows of ``table`` picked by int32 ``ids`` (any shape); out-of-range ids give zero rows."""
        return self._named(self._record("embedding", (ids, table)), name)

    def argmax(self, x: Tensor, axis: int = -1, *, name: str = "") -> Tensor:
        """int32 index of the first maximum along ``axis`` (greedy sampling)."""
        return self._named(self._record("argmax", (x,), axis=axis), name)

    def _own_scalar(self, op: str, value: Any) -> Any:
        if isinstance(value, Scalar) and value.batch is not self:
            raise DeviceMismatchError(f"{op}: scalar {value.name!r} belongs to batch {value.batch.name!r}")
        return value

    def launch(
        self,
        kernel: Kernel,
        grid: int | Sequence[int],
        buffers: Sequence[Tensor] = (),
        scalars: Sequence[Number] = (),
    ) -> None:
        """Run a custom :class:`Kernel` over ``grid`` workgroups. ``buffers`` are bound read_write at
        bindings 0..n-1 and written in place; ``scalars`` form one uniform struct at binding n."""
        self._record("launch", _sequence("launch", "buffers", buffers), kernel=kernel, grid=grid, scalars=scalars)

    def penalize(self, logits: Tensor, seen: Tensor, generated: Tensor, penalties: Tensor, *, name: str = "") -> Tensor:
        """New (S, V) logits: where ``seen > 0`` the row's repetition penalty r (``l / r`` for ``l > 0``,
        else ``l * r``), then ``l -= presence * (generated > 0) + frequency * generated``. ``seen``,
        ``generated``: (S, V) int32 counts (prompt + output, output only); ``penalties``: (S, 3) float32
        rows of (repetition, presence, frequency)."""
        return self._named(self._record("penalize", (logits, seen, generated, penalties)), name)

    def sample(
        self,
        logits: Tensor,
        params: Tensor,
        top_k: Tensor,
        keys: Tensor,
        allowed: Tensor | None = None,
        *,
        name: str = "",
    ) -> Tensor:
        """One int32 token id per row of (S, V) logits, drawn on the device. ``params``: (S, 4) float32
        rows of (temperature, top_p, min_p, masked); ``top_k``: (S,) int32 (<= 0 or >= V: off); ``keys``:
        (S, 2) uint32 rows of (seed, counter). Temperature <= 0 is greedy (``argmax``'s rule); otherwise a
        draw from softmax(logits / temperature) restricted to top_k (ties included), top_p and min_p
        (Gumbel-max with a counter-based hash: the same keys draw the same id).

        ``allowed``: an optional (S, ceil(V / 32)) uint32 allowed-token bitmask (token t allowed iff bit
        ``t & 31`` of word ``t >> 5`` is set; a grammar engine's int32 mask viewed as uint32). Rows with
        ``params[i, 3] != 0`` then see -inf at every token it leaves out, before every step (greedy, min_p,
        top_k, top_p, the draw); their greedy id is the first allowed maximum, and a row whose mask allows no
        token gives id -1 (treat it as an error). Other rows never read the mask. Without ``allowed``,
        ``params[:, 3]`` is ignored and the launch is the plain one."""
        inputs = (logits, params, top_k, keys) if allowed is None else (logits, params, top_k, keys, allowed)
        return self._named(self._record("sample", inputs), name)

    def logprobs(self, logits: Tensor, targets: Tensor, top_n: Tensor, *, name: str = "") -> Tensor:
        """Log-probabilities of (S, V) logits as they are (no temperature, penalty or truncation: the
        model's distribution), per row a (41,) float32 row: the logprob of ``targets[i]`` (int32 (S,); NaN
        outside [0, V)), then the ``top_n[i]`` (int32 (S,), at most 20) ids with the largest logits in
        ``argmax``'s order (as floats, exact), then their logprobs. Rows with ``top_n < 0`` are not computed;
        entries not computed are NaN with id -1, and a row whose maximum is not finite gives NaN logprobs.
        Read back only these rows, never the logits: ``batchgpu.ops.sampling.logprobs_reference`` says it
        in numpy."""
        return self._named(self._record("logprobs", (logits, targets, top_n)), name)

    def count_tokens(self, counts: Tensor, slots: Tensor, ids: Tensor, reset: Tensor | None = None) -> Tensor:
        """Update (S, V) int32 ``counts`` in place: rows with ``reset != 0`` are zeroed first (without
        ``reset``, none is), then each ``counts[slots[i], ids[i]]`` gains 1 (duplicates add up; a slot outside
        [0, S) or an id outside [0, V) is skipped); returns ``counts``."""
        self._record("count_tokens", (counts, slots, ids) if reset is None else (counts, slots, ids, reset))
        return counts

    def scatter_rows(self, table: Tensor, rows: Tensor, values: Tensor) -> Tensor:
        """``table[rows[i]] = values[i]`` in place for each i with ``0 <= rows[i] < table.shape[0]``; other
        entries (-1 for an idle slot) are skipped; returns ``table``. ``table`` (R, ...) and ``values`` (N, ...)
        share the trailing shape and dtype, ``rows`` is int32 (N,). With duplicate targets it is unspecified
        which of their values lands. A resident table keeps its rows for every batch that uses it."""
        for name, value in (("table", table), ("rows", rows), ("values", values)):
            if not isinstance(value, Tensor):
                raise ArgumentError(f"scatter_rows: {name} must be a Tensor, got {type(value).__name__}")
        self._record("scatter_rows", (table, rows, values))
        return table

    def paged_attention(
        self,
        q: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        block_tables: Tensor,
        seq: Tensor,
        lengths: Tensor,
        *,
        block_size: int,
        scale: float | None = None,
        window: int = 0,
    ) -> Tensor:
        """Attention over a paged KV cache (vLLM's PagedAttention), (N, heads, head_dim) in q's dtype. Row n
        of ``q`` (N, heads, head_dim) attends, grouped-query like ``attention``, over positions
        ``[0, lengths[n])`` of sequence ``seq[n]``; position p is row ``block_tables[s, p // block_size] *
        block_size + p % block_size`` of ``k_pool``/``v_pool`` (P, kv_heads, head_dim), float32 or float16
        (computed in f32). Causality is in the lengths (a prefill row at position t: t + 1). A row with no
        positions (length <= 0, or ``seq[n]`` outside the table's rows) gives zeros; lengths past
        ``max_blocks * block_size`` are clamped to it; a position whose block lies outside the pool is left
        out (a row left with none gives zeros). ``scale`` defaults to 1/sqrt(head_dim). ``window``
        (sliding-window attention): row n sees only positions ``[lengths[n] - window, lengths[n])`` (0: all)."""
        if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)):
            raise ArgumentError(f"paged_attention: block_size must be an int >= 1, got {block_size!r}")
        scale = None if scale is None else arguments.real("paged_attention", "scale", scale)
        inputs = (q, k_pool, v_pool, block_tables, seq, lengths)
        for name, value in zip(("q", "k_pool", "v_pool", "block_tables", "seq", "lengths"), inputs):
            if not isinstance(value, Tensor):
                raise ArgumentError(f"paged_attention: {name} must be a Tensor, got {type(value).__name__}")
        return self._record("paged_attention", inputs, block_size=int(block_size), scale=scale, window=window)

    # recording core --------------------------------------------------------------------------

    def _record(self, op: str, operands: Sequence[Any], **params: Any) -> Any:
        """Validate, infer, lower and check one op against the device; commit only if all pass."""
        started = time.perf_counter()
        self._check_open(op)
        spec = OPS[op]
        if spec.prepare is not None:
            params = spec.prepare(params)
        constants: list[tuple[Storage, np.ndarray]] = []
        target = _promotion(op, operands)
        inputs = tuple(self._operand(spec, i, value, operands, constants, target) for i, value in enumerate(operands))
        _check_quantized_operands(spec, inputs)
        if target is not None and any(t.dtype != target for t in inputs):
            spec.infer(tuple(_retyped(t, target) for t in inputs), params)  # refuse before recording the casts
            cast: dict[int, Tensor] = {}
            for t in inputs:
                if t.dtype != target and id(t) not in cast:
                    cast[id(t)] = self._record("cast", (t,), dtype=target)
            inputs = tuple(cast.get(id(t), t) for t in inputs)
        inferred = spec.infer(inputs, params)
        outputs = tuple(
            self._output(op, spec.view, inputs, shape, dtype, i)
            for i, (shape, dtype) in enumerate(inferred if isinstance(inferred, list) else [inferred])
            if shape is not None
        )
        node = Node(spec, inputs, params, outputs)
        if spec.lower is not None:
            node.launches = spec.lower(node)
        for launch in node.launches:
            check_launch(launch, self.device.limits, self.device.name)
            if launch.kernel is not None:
                self.device.executor.prepare(launch)
        self._recording.add(node, constants)
        self._changed()
        self._recording.record_spans.append((started, time.perf_counter()))
        if len(outputs) > 1:
            return outputs
        return outputs[0] if outputs else None

    def _named(self, tensor: Tensor, name: str) -> Tensor:
        """``tensor`` under the user's ``name`` (ops' ``name=``: profiles, errors, exports), if one is given."""
        if arguments.text("name", "name", name):
            tensor.name = name
        return tensor

    def _output(
        self, op: str, view: bool, inputs: Sequence[Tensor], shape: tuple[int, ...], dtype: np.dtype, index: int
    ) -> Tensor:
        self.device.check_storable(op, shape, dtype)
        storage = inputs[0].storage if view else Storage(math.prod(shape) * dtype.itemsize, "output", dtype)
        suffix = f".{index}" if index else ""
        name = f"{op}{self._recording.count}{suffix}"
        return Tensor(shape, dtype, storage, device=self.device, batch=self, name=name)

    def _operand(
        self,
        spec: OpSpec,
        index: int,
        value: Any,
        operands: Sequence[Any],
        constants: list[tuple[Storage, np.ndarray]],
        target: np.dtype | None = None,
    ) -> Tensor:
        """``value`` as an input tensor of the op: a member tensor, or a scalar (a Python number, a numpy
        scalar or 0-d array) as a constant of the partner tensor's dtype (of ``target``, the promoted
        dtype, where given)."""
        op = spec.name
        argument = spec.operand_name(index, len(operands))
        if isinstance(value, Tensor):
            self._check_member(op, argument, value)
            return value
        if not spec.literal_operands:  # e.g. buffers written in place: a number would silently be a constant
            raise ArgumentError(f"{op}: {argument} must be a Tensor, got {type(value).__name__}")
        number = _number_operand(op, argument, value)
        partner = next((o for o in operands if isinstance(o, Tensor)), None)
        if partner is None:
            raise ArgumentError(f"{op}: at least one operand must be a Tensor")
        array = _scalar_array(op, argument, number, partner, target or partner.dtype)
        storage = Storage(array.nbytes, "const", array.dtype)
        constants.append((storage, array))
        return Tensor((), array.dtype, storage, device=self.device, batch=self, name=f"scalar {number!r}")

    def _check_member(self, op: str, argument: str, tensor: Tensor) -> None:
        self._runtime.check_member(op, argument, tensor)

    def _check_open(self, op: str) -> None:
        self._runtime.check_open(op)

    # execution and readback (batchgpu/runtime.py) --------------------------------------------

    def execute(
        self,
        feeds: Mapping[Tensor | str, Any] | Iterable[tuple[Tensor | str, Any]] | None = None,
        *,
        scalars: Mapping[str, int | float] | Iterable[tuple[str, int | float]] | None = None,
        profile: bool = False,
    ) -> Submission:
        """Upload new inputs and scalar values, encode every op and the readback copies, submit once;
        returns without waiting for the GPU. Inputs and scalars keep their values until changed; feeds are
        keyed by input tensor or by its name (``{"x": array}``).
        ``profile=True`` also times every dispatch (see :meth:`profile`). The returned
        :class:`Submission` reads this execute's outputs even after later executes (submit ahead, read
        behind)."""
        return self._runtime.execute(feeds, scalars=scalars, profile=profile)

    def execute_async(
        self,
        feeds: Mapping[Tensor | str, Any] | Iterable[tuple[Tensor | str, Any]] | None = None,
        *,
        scalars: Mapping[str, int | float] | Iterable[tuple[str, int | float]] | None = None,
        profile: bool = False,
    ) -> Coroutine[Any, Any, Submission]:
        """``execute()`` for asyncio code: submits when called, in call order with every other execute and
        read of the batch (like ``execute``); the coroutine it returns gives the :class:`Submission`."""
        return self._runtime.execute_async(feeds, scalars=scalars, profile=profile)

    def profile(self) -> Profile:
        """Timing of the latest ``execute(profile=True)``: per dispatch the op, kernel, shapes, workgroups,
        GPU µs (wgpu timestamp queries) or host µs (reference executor) and share of the total, plus
        host spans. ``print()`` it for a table. Waits for the GPU."""
        return self._runtime.profile()

    def save_trace(self, path: Any) -> Any:
        """Write the latest profiled execute as a Chrome trace-event JSON file (Perfetto, chrome://tracing):
        one track for host recording/encoding, one for the GPU ops. Returns the path."""
        return self.profile().save_trace(path)

    def outputs(self, *tensors: Tensor) -> None:
        """Declare the batch tensors read after ``execute`` (and the only ones copied back); every other
        intermediate may then run fused into the op that reads it or share device memory with
        intermediates whose lifetimes do not overlap (see :mod:`batchgpu.memory`), and reading one raises
        BatchError. Inputs stay readable. Call again to change the declaration; with no tensors, the
        default again (the tensors no op consumes and those read: see :meth:`read`)."""
        self._runtime.outputs(*tensors)

    def memory(self) -> dict[str, int]:
        """Bytes of the batch's own device buffers in the current plan (``planned``, in ``buffers``
        buffers), beside what they would take with a buffer per tensor (``unshared``); 0 before the
        first execute."""
        return self._runtime.memory()

    def read_async(self, tensor: Tensor) -> Coroutine[Any, Any, np.ndarray]:
        """:meth:`read` for asyncio code. The read is requested when called: it returns the value after
        the latest execute submitted before this call, whatever is submitted (or released) before the
        coroutine is awaited or completes; awaiting waits for the device without blocking the event loop
        (resident tensors and their views are copied at the call)."""
        return self._runtime.read_async(tensor)

    def read(self, tensor: Tensor) -> np.ndarray:
        """The tensor's value after the latest execute, as a numpy array (blocks until the device is done;
        :meth:`read_async` in asyncio code). Without declared outputs, an intermediate that execute fused
        away or stored in a shared buffer is computed again: the batch plans anew keeping it and runs the
        latest execute again (BatchError when the batch recorded more since: the next execute keeps it)."""
        return self._runtime.read(tensor)

    def read_sync(self, tensor: Tensor) -> np.ndarray:
        """Deprecated name of :meth:`read` (kept for one release)."""
        warn_deprecated("GpuCommandBatch.read_sync", "read")
        return self.read(tensor)

    def export_webgpu(
        self,
        out_dir: str | Path,
        feeds: Mapping[Tensor, Any] | None = None,
        scalars: Mapping[str, int | float] | None = None,
        *,
        features: Sequence[str] = (),
        outputs: Sequence[Tensor] | None = None,
        tolerance: tuple[float, float] | None = None,
        gpu_kernels: bool = True,
    ) -> Path:
        """Write this batch as a standalone WebGPU program (``index.html``, ``batch.js``, the same WGSL,
        inputs, weights and expected outputs) into ``out_dir``; executes the batch once with ``feeds``
        and ``scalars`` to record the expected outputs. See :func:`batchgpu.export.export_webgpu`."""
        from .export.webgpu import export_webgpu

        if not isinstance(out_dir, (str, os.PathLike)):
            raise ArgumentError(f"export_webgpu: out_dir must be a path, got {type(out_dir).__name__}")
        return export_webgpu(
            self,
            out_dir,
            feeds,
            scalars,
            features=features,
            outputs=outputs,
            tolerance=tolerance,
            gpu_kernels=gpu_kernels,
        )

    def release(self) -> None:
        """Free the batch's device buffers now; the batch can no longer be used. Reads requested before
        (pending ``read_async`` coroutines, awaited or not) still complete with their values, from the
        staging buffers they hold; any later read raises BatchError."""
        self._runtime.release()


def _check_quantized_operands(spec: OpSpec, inputs: Sequence[Tensor]) -> None:
    """Packed quantized blocks may only reach the operand positions whose kernels dequantize them."""
    for index, tensor in enumerate(inputs):
        if isinstance(tensor, QuantTensor) and index not in spec.quantized:
            readers = ", ".join(f"{s.name} (input {list(s.quantized)})" for s in OPS.values() if s.quantized)
            raise DTypeError(
                f"{spec.name}: input {index} {tensor.describe()} holds packed {tensor.qtype} blocks, which "
                f"{spec.name} cannot read; quantized weights go to: {readers}. Read the float32 values with "
                f"Device.read(w) and upload them to use them elsewhere"
            )


def _scalar_kind(name: str, dtype: Any) -> str:
    """The scalar format name (``"u32"``, ``"i32"``, ``"f32"``) of a dtype given by short or numpy name."""
    if isinstance(dtype, str) and dtype in SCALAR_FORMATS:
        return dtype
    try:
        resolved = as_dtype(dtype, what=f"scalar {name!r}")
    except DTypeError:
        resolved = None
    kinds: dict[np.dtype | None, str] = {
        np.dtype(np.uint32): "u32",
        np.dtype(np.int32): "i32",
        np.dtype(np.float32): "f32",
    }
    kind = kinds.get(resolved)
    if kind is None:
        raise DTypeError(f"scalar {name!r}: dtype {dtype!r} is not one of {', '.join(SCALAR_FORMATS)}")
    return kind


def _sequence(op: str, argument: str, value: Any) -> tuple:
    """``value`` (a list or tuple) as a tuple, or ArgumentError naming the op and argument."""
    if not isinstance(value, (list, tuple)):
        raise ArgumentError(f"{op}: {argument} must be a list or tuple, got {type(value).__name__} {value!r:.60}")
    return tuple(value)


def _promotion(op: str, operands: Sequence[Any]) -> np.dtype | None:
    """The dtype an elementwise op's operands are cast to (:mod:`batchgpu.promotion`), None for other ops
    and for operands without a tensor (refused later)."""
    if op not in EXPRESSIONS:
        return None
    tensors = [o for o in operands if isinstance(o, Tensor)]
    if not tensors:
        return None
    python_float = has_float_scalar(operands)
    floats_only = EXPRESSIONS[op].dtypes == "float"
    return promote_types(op, [t.dtype for t in tensors], python_float=python_float, floats_only=floats_only)


def _number_operand(op: str, argument: str, value: Any) -> int | float:
    """A scalar operand (:func:`batchgpu.promotion.scalar_value`) as its Python number; arrays with
    dimensions, bools, complex numbers and other values raise ``ArgumentError``."""
    number = scalar_value(value)
    if number is not None:
        return number
    if isinstance(value, (list, tuple)) or (hasattr(value, "__array__") and np.ndim(value) > 0):
        raise ArgumentError(
            f"{op}: {argument} is a {type(value).__name__} of shape {np.shape(value)}, not a Tensor; upload it "
            f"first: batch.upload(array) (a batch input) or Device.tensor(array) (resident weights)"
        )
    dtype = f" of dtype {value.dtype}" if isinstance(value, (np.ndarray, np.generic)) else ""
    raise ArgumentError(
        f"{op}: {argument} must be a Tensor or a number (int, float, a numpy integer or floating scalar), got "
        f"{type(value).__name__}{dtype} {value!r:.40}"
    )


def _constant_stand_in(dtype: np.dtype) -> Tensor:
    """A 0-d stand-in for a Python scalar operand, to validate an op's shapes before recording anything."""
    storage = Storage(dtype.itemsize, "const", dtype)
    return Tensor((), dtype, storage, device=None, name="scalar")  # type: ignore[arg-type]


def _retyped(tensor: Tensor, dtype: np.dtype) -> Tensor:
    """A stand-in for ``tensor`` cast to ``dtype``, to validate an op before recording the cast."""
    return Tensor(tensor.shape, dtype, tensor.storage, device=tensor.device, batch=tensor.batch, name=tensor.name)


def _scalar_array(op: str, argument: str, value: Number, partner: Tensor, dtype: np.dtype) -> np.ndarray:
    """A Python scalar as a 0-d array of ``dtype`` (the partner tensor's, or the promoted one), refusing
    lossy conversions."""
    if dtype not in FLOATS and not float(value).is_integer():
        raise DTypeError(
            f"{op}: {argument} = {value!r} cannot be represented in {dtype.name}, the dtype of "
            f"{partner.describe()}; cast the tensor first"
        )
    if dtype not in FLOATS:
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            raise DTypeError(
                f"{op}: {argument} = {value!r} is out of range for {dtype.name}, the dtype of {partner.describe()}"
            )
    return np.asarray(value, dtype=dtype)

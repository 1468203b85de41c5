"""Kernels and launches: what a recorded op asks an executor to run, in executor-neutral terms."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from .dtypes import WGSL_COMPUTE_TYPE, WGSL_TYPE
from .errors import ArgumentError, BatchError

if TYPE_CHECKING:
    from .tensor import Storage

MAX_DIMS = 8
"""Tensors handed to the built-in strided kernels have at most this many dimensions."""

DEFAULT_WORKGROUP = 256
"""Invocations per workgroup of the built-in 1-D kernels (the WebGPU minimum for this limit)."""

HALF_ALIAS = "H"
"""The type alias of a half-capable family's products: ``f32``, or ``f16`` in a launch's :meth:`Launch.for_half`
form (a source also gets the const ``HALF``: whether it is f16)."""


class Kernel:
    """A user kernel: WGSL source, optionally CUDA source too, with an entry point.

    Buffers passed to ``batch.launch`` are bound in order at ``@group(0) @binding(i)`` as
    ``var<storage, read_write>``; scalars, if any, as one ``var<uniform>`` struct of 4-byte fields at
    ``@binding(len(buffers))``. ``reference`` is an optional numpy function ``f(*arrays, *scalars)``
    that updates the arrays in place; the reference executor runs it.

    ``cuda`` is the same kernel in CUDA C++ for the native ``"cuda"``/``"hip"`` devices: an
    ``extern "C" __global__`` function named ``cuda_entry`` (default: ``entry``; C++ forbids a
    kernel named ``main``, WGSL's usual entry) taking one pointer per buffer, in order, then (with
    scalars) a struct of the 4-byte scalar fields by value; the block size is the WGSL
    ``workgroup_size``. ``shaders/cuda/prelude.cuh`` is prepended (``bg_half``, ``CVT``, ``WG``).
    """

    def __init__(
        self,
        wgsl: str,
        entry: str = "main",
        *,
        name: str | None = None,
        reference: Callable[..., None] | None = None,
        workgroup_size: tuple[int, ...] | None = None,
        cuda: str | None = None,
        cuda_entry: str | None = None,
    ) -> None:
        if not isinstance(wgsl, str) or not isinstance(entry, str) or not isinstance(cuda, (str, type(None))):
            raise ArgumentError(
                f"Kernel: wgsl and entry must be str (cuda str or None), got {type(wgsl).__name__}, "
                f"{type(entry).__name__}, {type(cuda).__name__}"
            )
        self.wgsl = wgsl
        self.cuda = cuda
        self.entry = entry
        self.cuda_entry = cuda_entry or entry
        if cuda is not None and self.cuda_entry == "main":
            raise BatchError(
                f"Kernel {name or entry!r}: a CUDA kernel cannot be named 'main' (C++ reserves it); name the "
                f"CUDA function differently and pass cuda_entry='<its name>'"
            )
        self.name = name or entry
        self.reference = reference
        parsed = parse_workgroup_size(wgsl, entry)
        if workgroup_size is not None:
            given = _pad3(as_sizes(workgroup_size, f"Kernel {self.name!r}: workgroup_size"))
            if parsed is not None and _pad3(parsed) != given:
                raise ArgumentError(
                    f"Kernel {self.name!r}: workgroup_size={tuple(workgroup_size)} contradicts the source's "
                    f"@workgroup_size of {entry!r}, {_pad3(parsed)}"
                )
            parsed = given
        elif parsed is None and find_workgroup_size(wgsl, entry) is not None:
            raise ArgumentError(
                f"Kernel {self.name!r}: cannot read the @workgroup_size({find_workgroup_size(wgsl, entry)}) of "
                f"{entry!r} (only literals and override/const names with literal values are read); pass "
                f"workgroup_size=(x, y, z): limits are checked and native devices launch blocks of that size"
            )
        self.workgroup_size: tuple[int, int, int] | None = _pad3(parsed) if parsed else None
        self.workgroup_bytes = parse_workgroup_bytes(wgsl)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, entry={self.entry!r})"


def _pad3(size: Sequence[int]) -> tuple[int, int, int]:
    padded = tuple(size) + (1,) * (3 - len(size))
    return (int(padded[0]), int(padded[1]), int(padded[2]))


_WORKGROUP_SIZE = r"@workgroup_size\(\s*([^)]*)\)"
_ENTRY = r"(?:@\w+(?:\([^)]*\))?\s*)*fn\s+{entry}\s*\("
_NAMED_VALUE = re.compile(r"\b(?:override|const)\s+(\w+)\s*(?::\s*\w+\s*)?=\s*(\d+)[ui]?\s*;")


def find_workgroup_size(source: str, entry: str) -> str | None:
    """The text inside ``entry``'s ``@workgroup_size(...)``, or None when the entry is not found."""
    pattern = _WORKGROUP_SIZE + r"\s*" + _ENTRY.format(entry=re.escape(entry))
    match = re.search(pattern, source)
    return match.group(1) if match else None


def parse_workgroup_size(source: str, entry: str) -> tuple[int, ...] | None:
    """``entry``'s ``@workgroup_size``: literals, or override/const names declared with a literal value
    (the value a pipeline gets when no constant is passed); None when the entry is missing or a size is
    an expression."""
    text = find_workgroup_size(source, entry)
    if text is None:
        return None
    named = dict(_NAMED_VALUE.findall(source))
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        value = named.get(part, part).rstrip("ui")
        if not value.isdigit():
            return None
        sizes.append(int(value))
    return tuple(sizes)


def as_sizes(sizes: Sequence[int] | int, what: str) -> tuple[int, ...]:
    """1 to 3 positive ints (an int is one size)."""
    dims = (sizes,) if isinstance(sizes, int) else tuple(sizes) if isinstance(sizes, (tuple, list)) else ()
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ArgumentError(f"{what} must be 1 to 3 positive ints, got {sizes!r}")
    return dims


_SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2}
_WORKGROUP_ARRAY = re.compile(
    r"var\s*<\s*workgroup\s*>\s*\w+\s*:\s*array\s*<\s*(?:vec([234])\s*<\s*)?(f32|i32|u32|f16)\s*>?\s*,\s*(\w+?)[ui]?\s*>"
)


def parse_workgroup_bytes(source: str) -> int:
    """Bytes of workgroup memory declared as arrays of scalars or vectors sized by a literal or by an
    override/const name with a literal value."""
    named = dict(_NAMED_VALUE.findall(source))
    total = 0
    for lanes, scalar, count in _WORKGROUP_ARRAY.findall(source):
        width = int(lanes or 1)
        stride = _SCALAR_BYTES[scalar] * (4 if width == 3 else width)
        value = named.get(count, count)
        total += stride * int(value) if value.isdigit() else 0
    return total


BindingKind = Literal["read", "write", "uniform", "scalars"]
"""A binding's kind: a storage the kernel reads (``var<storage, read>``) or writes (``read_write``), the
launch's ``Params`` (``uniform``, the launch's ``params`` bytes) or the per-execute ``scalars`` buffer."""


@dataclass(frozen=True, slots=True)
class Binding:
    """One buffer bound to a launch: a storage (whole), the launch's uniform parameters or the scalars."""

    slot: int
    kind: BindingKind
    storage: Storage | None = None
    nbytes: int = 0


@dataclass(slots=True)
class Launch:
    """One kernel dispatch, described without executor objects.

    Built-in kernels name a shader ``family`` (``shaders/wgsl/<family>.wgsl``, its interface declared in
    ``batchgpu/ops/interface.py``) rendered with type aliases and ``snippets``: (placeholder, op name)
    pairs, each placeholder filled with that op's expression from the op-expression table
    (``batchgpu/ops/elementwise.py``) in the shader's language; custom kernels carry their ``kernel``.
    ``groups`` is a 1-D workgroup count (split over x/y by the executor when over the per-dimension
    limit) or an explicit grid.
    ``native`` and ``gpu`` optionally name differently shaped launches of the same op for the CUDA/HIP
    executors and for wgpu on GPU adapters; executors pick theirs with :meth:`Executor.form`.
    """

    label: str
    entry: str
    groups: int | tuple[int, int, int]
    bindings: tuple[Binding, ...]
    params: bytes = b""
    family: str = ""
    types: tuple[tuple[str, str], ...] = ()
    snippets: tuple[tuple[str, str], ...] = ()
    constants: tuple[tuple[str, float], ...] = ()
    kernel: Kernel | None = None
    workgroup_size: tuple[int, int, int] = (DEFAULT_WORKGROUP, 1, 1)
    workgroup_bytes: int = 0
    native: Launch | None = None
    """What the native executors (CUDA, HIP) launch instead, where a GPU wants another kernel shape
    than the WGSL one (same bindings and params; e.g. a warp per output row for decode GEMVs)."""
    gpu: Launch | None = None
    """What wgpu launches instead on a GPU adapter (not a CPU one such as lavapipe): a GPU-shaped
    entry of the same WGSL family, same bindings and params."""

    def for_native(self) -> Launch:
        """The launch a native executor runs: :attr:`native` where set, else this one."""
        return self.native or self

    def for_gpu(self) -> Launch:
        """The launch wgpu runs on a GPU adapter: :attr:`gpu` where set, else this one."""
        return self.gpu or self

    def for_half(self) -> Launch:
        """This launch's half form: the same kernel with its product type ``H`` f16 (``enable f16``; WebGPU's
        ``shader-f16``) where its family declares one (:attr:`~batchgpu.ops.interface.Family.half`: quantized
        matmuls, attention, norms), else this one. What the form computes in f16 is written in each family's
        source under ``if HALF``."""
        if (HALF_ALIAS, "f32") not in self.types:
            return self
        types = tuple((alias, "f16" if alias == HALF_ALIAS else wgsl) for alias, wgsl in self.types)
        return replace(self, types=types, native=None, gpu=None)

    def describe(self) -> str:
        name = self.kernel.name if self.kernel else f"{self.family}.{self.entry}"
        return f"kernel {name}, workgroup {self.workgroup_size}, groups {self.groups}"


def wgsl_aliases(**dtypes: np.dtype) -> tuple[tuple[str, str], ...]:
    """Type aliases for a WGSL template: each name maps to a storage type; ``C`` is the compute type
    of the first dtype (float16 computes in f32)."""
    aliases = [(alias, WGSL_TYPE[dtype]) for alias, dtype in dtypes.items()]
    first = next(iter(dtypes.values()))
    aliases.append(("C", WGSL_COMPUTE_TYPE[first]))
    return tuple(aliases)

"""CUDA C++ sources of the built-in kernels (``shaders/cuda/<family>.cu``), specialized per launch.

A :class:`~batchgpu.kernels.Launch` names a shader family, WGSL type aliases, op snippets and override
constants. For the native executors each of those becomes a ``#define`` in front of the family's source
(after ``prelude.cuh``): one module per specialization, its ``extern "C"`` kernels named like the WGSL
entry points. Op expressions are not translated from WGSL text: the op-expression table
(``batchgpu/ops/elementwise.py``) gives each op's CUDA expression by op name.

Kernel arguments follow the WGSL binding slots, both declared once in ``batchgpu/ops/interface.py``
(``BG_ARGS``): slot ``i`` is argument ``i``; a storage binding is a device pointer (NULL where the launch
binds nothing), the ``uniform`` slot is the ``Params`` struct passed by value (the launch's ``params``
bytes, the same layout as the WGSL struct) and the ``scalars`` slot is a pointer to the per-execute
scalar buffer (64 x 4 bytes).
"""

from __future__ import annotations

import functools

from .dtypes import CUDA_TYPE
from .errors import UnsupportedError
from .kernels import Launch
from .ops.interface import FAMILIES as _FAMILIES
from .ops.interface import cuda_literal
from .shaders import DEFAULT_FORMAT, FORMAT_SNIPPET, STATEMENT_SNIPPETS, format_source, shader_root, snippet
from .shaders import family_source as _family_source

_FORMAT_LINE = "//!format\n"
"""Where a family's CUDA source takes the block format's code (qmatmul, gather)."""

FAMILIES = tuple(_FAMILIES)
"""The built-in kernel families (``shaders/cuda/<family>.cu``)."""

"""Kernel arguments of each family (derived from its declared bindings; :func:`argument_count` is the API)."""

RUNTIME_CONSTANTS: dict[str, frozenset[str]] = {
    name: frozenset(c.name for c in family.constants if c.runtime) for name, family in _FAMILIES.items()
}
"""Override constants the CUDA kernels take at launch (dynamic shared memory), not as #defines."""


@functools.cache
def prelude() -> str:
    return (shader_root() / "cuda" / "prelude.cuh").read_text()


def family_source(family: str) -> str:
    """``shaders/cuda/<family>.cu`` with its declared interface (Params, BG_ARGS, constants) in place."""
    return _family_source("cuda", family)


def defines(launch: Launch) -> list[str]:
    """The lines specializing ``launch.family`` after the prelude: types, op expressions, constants."""
    lines = []
    types = dict(launch.types)
    for alias, wgsl_type in launch.types:
        lines.append(f"typedef {CUDA_TYPE[wgsl_type]} {alias};")
    for alias in ("A", "B", "O", "C"):
        if alias not in types:  # families declare every alias; fill unused ones with float
            lines.append(f"typedef float {alias};")
    for name, value in launch.snippets:
        if name == FORMAT_SNIPPET:
            continue  # rendered at the family source's //!format line
        if name in STATEMENT_SNIPPETS.get(launch.family, ()):
            lines.append(f"#define {launch.family.upper()}_{name} {snippet(name, value, 'cuda')}")
        else:
            lines.append(f"#define {name}_EXPR ({snippet(name, value, 'cuda')})")
    skip = RUNTIME_CONSTANTS.get(launch.family, frozenset())
    lines += [f"#define {name} {cuda_literal(value)}" for name, value in launch.constants if name not in skip]
    return lines


def render(launch: Launch) -> tuple[str, str]:
    """(source, display name) of the module ``launch`` runs, for NVRTC or hipRTC."""
    if launch.kernel is not None:
        cuda = getattr(launch.kernel, "cuda", None)
        if not cuda:
            raise UnsupportedError(
                f"{launch.label}: kernel {launch.kernel.name!r} has no CUDA source; create it with "
                f"Kernel(wgsl=..., cuda=...) to run it on a native device"
            )
        return f"#define WG {launch.workgroup_size[0]}\n{prelude()}\n{cuda}", f"{launch.kernel.name}.cu"
    specialization = "\n".join(defines(launch))
    block_format = dict(launch.snippets).get(FORMAT_SNIPPET, DEFAULT_FORMAT)
    source = family_source(launch.family).replace(_FORMAT_LINE, format_source(block_format, "cuda"))
    return f"#define WG {launch.workgroup_size[0]}\n{prelude()}\n{specialization}\n{source}", f"{launch.family}.cu"


def entry_name(launch: Launch) -> str:
    """The CUDA function ``launch`` calls: the family kernel's entry, or a custom kernel's ``cuda_entry``."""
    return launch.kernel.cuda_entry if launch.kernel is not None else launch.entry


def argument_count(launch: Launch) -> int:
    """Arguments of the kernel ``launch`` calls: a custom kernel's bindings, a family's declared bindings."""
    if launch.kernel is not None:
        return len(launch.bindings)
    return len(_FAMILIES[launch.family].bindings)


def dynamic_shared_bytes(launch: Launch) -> int:
    """Bytes of dynamic shared memory the CUDA kernel of ``launch`` needs."""
    if launch.family == "attention" and launch.entry in ("attention", "attention_partial"):  # scores, query row
        constants = dict(launch.constants)
        return 4 * (int(constants["SMAX"]) + int(constants["HEAD_DIM"]))
    return 0
